"""The experiment registry: a name -> (config dataclass, pure pipeline ``run(cfg, run_dir)``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

Pipeline = Callable[[Any, Path], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Experiment:
    name: str
    config_cls: type
    run: Pipeline
    description: str


EXPERIMENTS: dict[str, Experiment] = {}


def register(name: str, config_cls: type, description: str):
    """Decorator: register ``fn(cfg, run_dir) -> results`` under ``name``."""

    def wrap(fn: Pipeline) -> Pipeline:
        if name in EXPERIMENTS:
            raise ValueError(f"experiment {name!r} is registered twice")
        EXPERIMENTS[name] = Experiment(name, config_cls, fn, description)
        return fn

    return wrap


def get_experiment(name: str) -> Experiment:
    import experiments.pipelines  # noqa: F401  (registers the pipelines)

    if name not in EXPERIMENTS:
        raise KeyError(f"unknown experiment {name!r}; registered: {', '.join(sorted(EXPERIMENTS))}")
    return EXPERIMENTS[name]
