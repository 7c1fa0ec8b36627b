"""Test utilities: spawning gloo ranks, odd-shaped models, single-process references."""

from dmuon.testing.spawn import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]
