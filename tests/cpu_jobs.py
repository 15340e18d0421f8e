"""The environment of a test's child process that runs JAX on host CPU devices."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """This process's environment for a child on the CPU backend that imports the repository:
    ``devices`` host CPU devices (XLA's default, one, when None), ``extra`` variables added.

    Without the persistent compilation cache: multi-device CPU programs loaded from it can
    deadlock in their collectives (XLA:CPU, jax 0.11.2: reproduced on a second run over one
    cache directory). A deserialized program does not meet its peers: with
    ``jax_share_binary_between_hosts`` (process 0 compiles, the others load its program) the
    job's first cross-process sum timed out in the Gloo context's key exchange."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **extra)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if devices is not None:
        flags = (
            f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
        )
        env["XLA_FLAGS"] = flags.strip()
    return env
