"""``fp4_formats``: the error of each FP4 variant, and guided vs RTN train-rollout agreement.

For each input distribution the pipeline quantizes a tensor with every format option and reports
the relative error ``||Q(x) - x|| / ||x||`` and storage bits per element. It then perturbs the
tensor slightly (a stand-in for the rollout and trainer computing the same activation through
different kernels) and compares the trainer's codes with the rollout's under vanilla RTN fake
quant and under TRACE's guided rounding: the code match rate and
``D_act = ||Q_train(x_t) - Q_rollout(x_r)|| / ||Q_rollout(x_r)||`` (TRACE.md section 7).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from experiments.registry import register
from trace_jax import fp4
from trace_jax.config import ConfigError

Distribution = Literal["normal", "student_t", "outliers", "activations"]

VARIANTS = {
    "nvfp4": dict(fmt="nvfp4"),
    "nvfp4/row": dict(fmt="nvfp4", global_scale="row"),
    "nvfp4/4over6": dict(fmt="nvfp4", scale_rule="four_over_six"),
    "nvfp4/2d": dict(fmt="nvfp4", block_2d=True),
    "mxfp4": dict(fmt="mxfp4"),
}


@dataclasses.dataclass(frozen=True)
class FP4FormatsConfig:
    """Attributes:
    seed: PRNG seed.
    rows, cols: tensor shape (cols is the quantized axis; a multiple of 32; rows of 16).
    distributions: input distributions to report.
    perturbation: relative std of the rollout-vs-trainer input difference.
    plot: write ``error_histograms.png`` to the run directory.
    """

    seed: int = 0
    rows: int = 256
    cols: int = 1024
    distributions: tuple[Distribution, ...] = ("normal", "student_t", "outliers", "activations")
    perturbation: float = 1e-3
    plot: bool = True

    def __post_init__(self):
        if self.cols % 32 or self.cols <= 0:
            raise ConfigError(f"cols: {self.cols} is not a positive multiple of 32")
        if self.rows % 16 or self.rows <= 0:
            raise ConfigError(f"rows: {self.rows} is not a positive multiple of 16")
        if not self.perturbation >= 0:
            raise ConfigError(f"perturbation: {self.perturbation} must be >= 0")


def sample(dist: str, key: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """Test inputs: Gaussian, heavy-tailed, Gaussian with outlier channels, SwiGLU-like outputs."""
    k1, k2 = jax.random.split(key)
    if dist == "normal":
        return jax.random.normal(k1, shape)
    if dist == "student_t":
        return jax.random.t(k1, 3.0, shape)
    if dist == "outliers":
        channels = jax.random.bernoulli(k2, 0.01, (shape[1],))
        return jax.random.normal(k1, shape) * jnp.where(channels, 30.0, 1.0)
    gate, up = jax.random.normal(k1, (2, *shape))
    return jax.nn.silu(gate * 2) * up * jnp.exp(jax.random.normal(k2, (shape[0], 1)))


def _rel(a, b) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@register("fp4_formats", FP4FormatsConfig, "FP4 format error table and guided-vs-RTN agreement")
def run(cfg: FP4FormatsConfig, run_dir: Path) -> dict:
    key = jax.random.key(cfg.seed)
    shape = (cfg.rows, cfg.cols)
    errors, agreement, hist = {}, {}, {}
    for i, dist in enumerate(cfg.distributions):
        kx, kn = jax.random.split(jax.random.fold_in(key, i))
        x = sample(dist, kx, shape)
        for name, kw in VARIANTS.items():
            qt = fp4.quantize(x, **kw)
            x_hat = fp4.dequantize(qt)
            errors[f"{dist}/{name}"] = {
                "rel_error": _rel(x_hat, x),
                "bits_per_element": 8 * qt.nbytes / qt.size,
            }
            if name in ("nvfp4/row", "mxfp4"):
                hist[f"{dist}/{name}"] = np.asarray(x_hat - x).ravel()
        # Rollout and trainer see the same activation up to a small kernel-level difference.
        x_t = x + cfg.perturbation * jnp.std(x) * jax.random.normal(kn, shape)
        for fmt, kw in (("nvfp4", dict(global_scale="row")), ("mxfp4", {})):
            rollout = fp4.quantize(x, fmt, **kw)
            q_r = fp4.dequantize(rollout)
            rtn = fp4.quantize(x_t, fmt, **kw)
            guided = fp4.guided_quantize(x_t, fp4.rollout_guidance(rollout))
            agreement[f"{dist}/{fmt}"] = {
                "rtn_code_match": _match(rtn, rollout),
                "guided_code_match": _match(guided, rollout),
                "rtn_d_act": _rel(fp4.dequantize(rtn), q_r),
                "guided_d_act": _rel(fp4.dequantize(guided), q_r),
            }
    _print_tables(errors, agreement)
    if cfg.plot:
        _plot(hist, run_dir / "error_histograms.png")
    return {"errors": errors, "agreement": agreement}


def _match(a: fp4.QTensor, b: fp4.QTensor) -> float:
    """Fraction of elements with the same E2M1 value (+0 and -0 count as equal)."""
    return float(jnp.mean(fp4.code_values(a) == fp4.code_values(b)))


def _print_tables(errors: dict, agreement: dict) -> None:
    print(f"{'distribution/variant':34s} {'rel. error':>10s} {'bits/elem':>9s}")
    for k, v in errors.items():
        print(f"{k:34s} {v['rel_error']:10.4f} {v['bits_per_element']:9.3f}")
    print()
    print(
        f"{'distribution/format':28s} {'code match RTN':>14s} {'guided':>8s} "
        f"{'D_act RTN':>10s} {'guided':>8s}"
    )
    for k, v in agreement.items():
        print(
            f"{k:28s} {v['rtn_code_match']:14.5f} {v['guided_code_match']:8.5f} "
            f"{v['rtn_d_act']:10.2e} {v['guided_d_act']:8.2e}"
        )


def _plot(hist: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dists = sorted({k.split("/")[0] for k in hist})
    fig, axes = plt.subplots(1, len(dists), figsize=(4 * len(dists), 3), squeeze=False)
    for ax, dist in zip(axes[0], dists, strict=True):
        for fmt in ("nvfp4/row", "mxfp4"):
            err = hist[f"{dist}/{fmt}"]
            lim = np.percentile(np.abs(err), 99.5)
            ax.hist(err, bins=101, range=(-lim, lim), histtype="step", label=fmt, log=True)
        ax.set_title(dist)
        ax.set_xlabel("Q(x) - x")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")
