"""The Ray cluster, for every stage that runs on it: the session, where actors go (placement and the resource
checks), how a node's cores are shared, and model work run with an expert actor's resources."""
