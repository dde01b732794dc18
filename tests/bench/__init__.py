"""The benchmarks and `squeeze eval`, run small on the CPU."""
