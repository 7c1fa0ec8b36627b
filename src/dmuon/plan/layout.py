"""Layout rules: how FSDP2 lays a matrix's rows over the shard positions (``Shard(0)``, torch.chunk's
rule), and which mesh dmuon's replicate level puts a parameter's gradient and momentum on."""

from __future__ import annotations

import functools


def shard_rows(m: int, shard: int) -> list[int]:
    """Rows of an ``m``-row matrix on each of ``shard`` columns, by ``torch.chunk``'s rule.

    FSDP2's ``Shard(0)`` gives every column ``ceil(m / shard)`` rows until the
    rows run out, so trailing columns may hold fewer rows, or none.
    """
    return list(_shard_rows(m, shard))


@functools.lru_cache(maxsize=4096)
def _shard_rows(m: int, shard: int) -> tuple[int, ...]:
    # Cached: the cost model asks for the same few (rows, shard) pairs hundreds of thousands of times per plan.
    if shard < 1:
        raise ValueError(f"shard must be >= 1, got {shard}")
    if m < 0:
        raise ValueError(f"rows must be >= 0, got {m}")
    chunk = -(-m // shard)
    return tuple(max(0, min(m, (s + 1) * chunk) - s * chunk) for s in range(shard))


def position(rank: int, shard: int) -> tuple[int, int]:
    """A plan rank's position in its mesh, ``(replica, shard position)``: plan ranks are ``r * shard + s``."""
    return divmod(rank, shard)


def hsdp_meshes(hsdp_mesh) -> tuple:
    """``hsdp_mesh`` as a tuple: one ``(replicate, shard[, ...])`` DeviceMesh, or several views of one root
    that share their replicate dim (expert parallelism: the dense parameters' ``(replicate, fsdp)`` and the
    experts' ``(replicate, efsdp, ep)``)."""
    return tuple(hsdp_mesh) if isinstance(hsdp_mesh, (tuple, list)) else (hsdp_mesh,)


def replicated_mesh(hsdp_mesh, param):
    """The mesh made of ``hsdp_mesh``'s replicate dim and ``param``'s dims (by name), from the one of the
    ``hsdp_mesh`` views (:func:`hsdp_meshes`) whose other dims hold ``param``'s: where dmuon's replicate
    level puts ``param``'s gradient and momentum (native HSDP's layout for it).

    Raises:
        ValueError: No view holds the parameter's dims (``prepare`` checks every parameter first).
    """
    dims = tuple(param.device_mesh.mesh_dim_names or ())
    for mesh in hsdp_meshes(hsdp_mesh):
        names = tuple(mesh.mesh_dim_names)
        if dims and set(dims) <= set(names[1:]):
            wanted = (names[0], *dims)
            return mesh if wanted == names else mesh[wanted]
    raise ValueError(f"no hsdp_mesh holds the dims {dims} of a parameter's mesh {param.device_mesh}")
