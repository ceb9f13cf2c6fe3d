"""Tests of the benchmark scripts under benchmarks/ and what they report."""
