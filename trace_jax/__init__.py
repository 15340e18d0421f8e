"""trace-jax: FP4 reinforcement learning of Mixture-of-Experts language models with TRACE."""

__version__ = "0.1.0"
