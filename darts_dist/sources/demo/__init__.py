"""The demo's own sources: its three tasks, the experts fine-tuned on them, and tiny random models for tests.

Only `sources.references` imports this package: nothing that serves or evaluates a model needs it."""
