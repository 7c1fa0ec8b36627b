"""Communication: dmuon's process groups, its shard-to-owner exchanges and their byte counters."""

from dmuon.comm.exchange import ShardExchange
from dmuon.comm.pending import Pending
from dmuon.comm.stats import CommStats
from dmuon.comm.topology import Topology, from_mesh, single_process

__all__ = ["CommStats", "Pending", "ShardExchange", "Topology", "from_mesh", "single_process"]
