"""float8 training as torchtitan runs it, for tests/frameworks/test_float8.py: torchao's ``convert_to_float8_training``
with ``enable_fsdp_float8_all_gather=True`` before ``fully_shard`` (each weight cast to float8 in FSDP2's
all-gather), and ``precompute_float8_dynamic_scale_for_fsdp(model)`` after each ``step()``; and its one-process
reference. torchao is imported inside the functions: the test module skips before calling them without it.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import dmuon
from support.cases import MUON_KW, full_params, make_mesh
from support.reference import reference_training

D, OUT = 32, 16
"""Widths (float8's matmuls need multiples of 16)."""
HIDDEN = (64, 48)
"""Each block's hidden width. Distinct, so no NS batch holds matrices of two blocks: ``"in_step"`` then
batches NS as ``"next_forward"`` does (per unit), and the two runs are the same bits (batched and single BLAS
calls may differ in float32: `dmuon.ortho.newton_schulz`)."""
STEPS = 3
BATCH = 8
"""Rows of each rank's batch."""
ADAMW_KW = dict(lr=3e-3, weight_decay=0.01)
PRECOMPUTE = ("none", "after step", "step post-hook", "after step, flushed on rank 0")
"""When ``precompute_float8_dynamic_scale_for_fsdp(model)`` runs: never (the all-gather computes each scale),
after ``step()`` by hand or as the optimizer's step post-hook (torchtitan's two ways), or after ``step()`` with
rank 0 then flushing the held updates (as a state dict read on rank 0 does) before the next forward."""


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        # An fp32 norm beside the float8 weights, as in torchtitan's blocks: FSDP2 then gathers the unit as
        # bytes (gloo has no float8 all-gather; a unit of float8 weights alone cannot be gathered on CPU).
        self.norm = nn.RMSNorm(D)
        self.up = nn.Linear(D, hidden, bias=False)
        self.down = nn.Linear(hidden, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Float8Net(nn.Module):
    """Linears only, every one converted: ``inp`` and the blocks' on Muon, ``head`` on AdamW (its name)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D, bias=False)
        self.layers = nn.ModuleList([Block(h) for h in HIDDEN])
        self.norm = nn.RMSNorm(D)
        self.head = nn.Linear(D, OUT, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def float8_net() -> Float8Net:
    """:class:`Float8Net` (seed 0), every Linear torchao's ``Float8Linear`` with the float8 all-gather."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = Float8Net()
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    return model


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, OUT, generator=g)


def loss_fn(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = data
    return ((model(inputs) - targets) ** 2).mean()


def reference(world: int) -> dict:
    """One process: the float8 model, torch.optim.Muon (fp32 NS) + AdamW, each step on every rank's batch,
    each batch its own forward: float8 casts activations and their gradients with one scale per tensor, so a
    forward over the joined batch would cast with other scales than the ranks' (the mean of the ranks' losses
    is the global batch's loss). As :func:`train` reports it."""
    model = float8_net()
    batches = [[batch(step, r) for r in range(world)] for step in range(STEPS)]

    def mean_loss(m, parts):
        return sum(loss_fn(m, p) for p in parts) / len(parts)

    params, losses = reference_training(model, batches, mean_loss, muon_kwargs=MUON_KW, adamw_kwargs=ADAMW_KW,
                                        ns_dtype=torch.float32)
    with torch.no_grad():
        out = sum(model(batch(STEPS, r)[0]).abs().sum().item() for r in range(world)) / world
    return {"params": params, "losses": losses, "out": out}


def train(rank: int, world: int, mode: str, precompute: str, mesh_shape: tuple[int, int] | None = None,
          hsdp: str = "fsdp2", refresh: bool = True) -> dict:
    """:class:`Float8Net` under FSDP2 (1-D, or on ``mesh_shape`` FSDP2's HSDP (``hsdp="fsdp2"``) or dmuon's
    replicate level (``"dmuon"``)) and DMuon with ``apply_updates=mode``, ``STEPS`` steps on rank ``rank``'s
    batches, ``precompute`` (:data:`PRECOMPUTE`) after each; then one forward (the last step's updates,
    applied and gathered) and a flush. Every parameter's full value (rank 0), the losses and the output of
    that forward (every rank's mean), and whether the last all-gathers cast with a precomputed scale.
    ``refresh=False``: without dmuon's recomputation of the scales at the next forward's applies (what the
    tests check would otherwise go wrong)."""
    if not refresh:
        from dmuon.runtime.next_forward import NextForwardUpdates

        with mock.patch.object(NextForwardUpdates, "_refresh_float8_scales", lambda self, blocks: None):
            return train(rank, world, mode, precompute, mesh_shape, hsdp)
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    from dmuon.util.float8 import float8_linears, has_precomputed_scale

    assert precompute in PRECOMPUTE, precompute
    mesh = make_mesh(world, mesh_shape)
    model = float8_net()
    replicate_level = mesh_shape is not None and hsdp == "dmuon"
    shard_mesh = mesh["shard"] if replicate_level else mesh
    for layer in model.layers:
        fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    plan = dmuon.prepare(model, hsdp_mesh=mesh if replicate_level else None, ns=dmuon.NSConfig(dtype=torch.float32))
    opt = dmuon.DMuon(model, plan, **MUON_KW, adamw=dmuon.AdamWConfig(**ADAMW_KW),
                      execution=dmuon.ExecutionConfig(apply_updates=mode))
    if precompute == "step post-hook":
        opt.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
    losses = []
    for step in range(STEPS):
        loss = loss_fn(model, batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if precompute.startswith("after step"):
            precompute_float8_dynamic_scale_for_fsdp(model)
        if precompute == "after step, flushed on rank 0" and rank == 0:
            opt.flush_updates()
        losses.append(_mean(loss.detach()))
    with torch.no_grad():  # the next forward: the last step's updates reach it
        out = _mean(model(batch(STEPS, rank)[0]).detach().abs().sum())
    model.reshard()  # the root stays gathered after a forward; its parameters are read sharded below
    opt.flush_updates()
    linears = float8_linears(model)
    assert len(linears) == 2 + 2 * len(HIDDEN), "every Linear is a Float8Linear with the float8 all-gather"
    params = full_params(model)
    return {"params": params if rank == 0 else None, "losses": losses, "out": out,
            "precomputed": all(has_precomputed_scale(m) for m in linears.values())}


def _mean(value: torch.Tensor) -> float:
    total = value.float().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()
