"""Importing this package registers every pipeline."""

from experiments.pipelines import fp4_formats, rl, trace_mismatch  # noqa: F401
