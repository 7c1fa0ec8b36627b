"""Communication: packed reduce-to-owner and gather-from-owner collectives."""

from dmuon.comm.exchange import Exchanger, PendingGather
from dmuon.comm.stats import CommStats

__all__ = ["CommStats", "Exchanger", "PendingGather"]
