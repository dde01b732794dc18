"""The store: SQLite and blobs, documents and their loaders, fuzzed inputs."""
