"""Reinforcement learning with TRACE: losses, importance corrections, mismatch metrics, the loop."""
