"""Experiments: the registry of named pipelines, the entry point and the benchmark scripts."""
