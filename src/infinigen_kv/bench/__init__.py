"""Benchmarks: task generators, the speed harness and (later) the accuracy harness."""
