"""Kernel and end-to-end benchmarks that write JSON results to bench/results/."""
