"""Benchmarks behind `nonstop bench …`: each prints a table and writes JSON with date, hardware and versions."""
