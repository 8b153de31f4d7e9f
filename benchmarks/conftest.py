"""Shared fixtures for the benchmarks (run: pytest benchmarks/ --benchmark-only)."""
