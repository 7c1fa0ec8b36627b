"""The optimizer front door and its per-matrix update rules."""

from dmuon.optim.dion2 import Dion2
from dmuon.optim.dmuon import DMuon
from dmuon.optim.muonh import MuonH
from dmuon.optim.normuon import NorMuon
from dmuon.optim.settings import AdamWConfig

__all__ = ["AdamWConfig", "DMuon", "Dion2", "MuonH", "NorMuon"]
