"""The shard runtime: dmuon's collectives, issued from FSDP2's backward hooks and from ``step()``."""

from dmuon.runtime.runtime import Launch, ShardRuntime

__all__ = ["Launch", "ShardRuntime"]
