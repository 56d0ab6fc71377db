"""Benchmarks: accuracy, peak memory and time of ggnchunk against the alternatives."""
