"""Benchmarks: runnable modules that print one JSON document (see `squeeze bench --help`)."""
