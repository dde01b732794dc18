"""The serving layer: the Engine over its store, background jobs, the artifact writer."""
