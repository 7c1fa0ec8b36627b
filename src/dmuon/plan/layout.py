"""Layout rules: how FSDP2 lays a matrix's rows over the shard positions (``Shard(0)``, torch.chunk's
rule), and which mesh dmuon's replicate level puts a parameter's gradient and momentum on."""

from __future__ import annotations


def shard_rows(m: int, shard: int) -> list[int]:
    """Rows of an ``m``-row matrix on each of ``shard`` columns, by ``torch.chunk``'s rule.

    FSDP2's ``Shard(0)`` gives every column ``ceil(m / shard)`` rows until the
    rows run out, so trailing columns may hold fewer rows, or none.
    """
    if shard < 1:
        raise ValueError(f"shard must be >= 1, got {shard}")
    if m < 0:
        raise ValueError(f"rows must be >= 0, got {m}")
    chunk = -(-m // shard)
    return [max(0, min(m, (s + 1) * chunk) - s * chunk) for s in range(shard)]


def replicated_mesh(hsdp_mesh, param):
    """The sub-mesh of ``hsdp_mesh`` made of its replicate dim and ``param``'s dims (by name): where
    dmuon's replicate level puts ``param``'s gradient and momentum (native HSDP's layout for it)."""
    names = (hsdp_mesh.mesh_dim_names[0], *param.device_mesh.mesh_dim_names)
    return hsdp_mesh if names == tuple(hsdp_mesh.mesh_dim_names) else hsdp_mesh[names]
