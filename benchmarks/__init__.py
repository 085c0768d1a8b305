"""Benchmarks: reproducible measurements, not tests."""
