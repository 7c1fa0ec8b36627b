"""Baselines dmuon is measured against."""

from dmuon.baselines.gather import GatherThenCompute

__all__ = ["GatherThenCompute"]
