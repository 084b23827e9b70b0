"""Benchmarks: measurements of spikehound against its quality bars (design brief section 7), not tests."""
