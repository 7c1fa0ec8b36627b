"""Communication: packed reduce-to-owner and gather-from-owner collectives."""

from dmuon.comm.exchange import Exchanger, PendingGather, PendingReduce
from dmuon.comm.stats import CommStats
from dmuon.comm.topology import Topology, from_mesh, single_process

__all__ = ["CommStats", "Exchanger", "PendingGather", "PendingReduce", "Topology", "from_mesh", "single_process"]
