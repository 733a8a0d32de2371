"""Sources: model folders and data files, resolved from a config's references and checked before any work."""
