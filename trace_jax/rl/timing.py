"""Seconds per phase of an RL step (``rollout/decode_s``, ``train/optimizer_s``, ...)."""

from __future__ import annotations

import contextlib
import time

import jax


class PhaseTimer:
    """Adds wall seconds per phase to ``totals``: device calls waited for until their results
    are ready (a host timer around an asynchronous dispatch would time the dispatch only), and
    host-side blocks (``part``)."""

    def __init__(self, totals: dict[str, float] | None = None):
        self.totals = {} if totals is None else totals

    def _add(self, phase: str, seconds: float) -> None:
        self.totals[phase] = self.totals.get(phase, 0.0) + seconds

    def __call__(self, phase: str, fn, *args):
        """``fn(*args)``, timed until its outputs are ready."""
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        self._add(phase, time.perf_counter() - t0)
        return out

    @contextlib.contextmanager
    def part(self, phase: str):
        t0 = time.perf_counter()
        yield
        self._add(phase, time.perf_counter() - t0)
