"""The optimizer front door and its per-matrix update rules."""

from dmuon.optim.dmuon import DMuon
from dmuon.optim.normuon import NorMuon

__all__ = ["DMuon", "NorMuon"]
