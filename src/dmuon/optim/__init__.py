"""The optimizer front door and its per-matrix update rules."""

from dmuon.optim.dmuon import DMuon

__all__ = ["DMuon"]
