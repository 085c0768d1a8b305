"""Small real workloads for the demo, the multi-rank tests and the benchmarks."""
