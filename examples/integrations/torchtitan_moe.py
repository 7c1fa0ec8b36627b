"""torchtitan's own MoE model (deepseek_v3 ``debugmodel``) with expert parallelism, stepped by dmuon::

    torchrun --nproc-per-node 4 examples/integrations/torchtitan_moe.py

(or ``python examples/integrations/torchtitan_moe.py``, which starts 4 local gloo ranks itself). Needs the
``integrations`` extra (``pip install -e ".[integrations]"``: torchtitan 0.3.0 and triton).

What torchtitan's ``Trainer`` does up to its first step, without the ``Trainer`` (it calls
``torch.cuda.set_device``): the model from torchtitan's ``model_registry`` (8 routed experts ``(8, 256, 256)``
x 3 per MoE layer, 5 MoE layers after one dense one, MLA attention, a shared expert), torchtitan's
``ParallelDims`` with ``ep=2`` on 4 ranks (dense parameters ``fully_shard``-ed over ``fsdp = 4``, experts
split ``Shard(0)`` over ``ep = 2`` then ``fully_shard``-ed over ``efsdp = 2``) applied by the model's own
``parallelize_fn``, torchtitan's loss (a sum over the rank's tokens / the global token count), its
``clip_grad_norm_(..., ep_enabled=True)`` (the norm over both meshes), and its optimizer container, which
builds one ``DMuon`` (the subclass of ``torchtitan_container.py`` that knows ``"DMuon"``) with torchtitan's
auxiliary-loss-free load balancing hook registered on it, as the ``Trainer`` registers it. Each routed
expert ``(m, n)`` is one Muon matrix, orthogonalized once in the cluster by its owner.

On a machine without CUDA it runs on CPU with gloo; what that takes from torchtitan 0.3.0 (unmodified):

* ``torchtitan.distributed.parallel_dims.device_type = "cpu"`` before ``build_mesh()``: on a CPU-only
  machine it still says ``"cuda"`` and no config selects the device;
* SDPA (``ScaledDotProductAttention``, causal, no mask) as every layer's inner attention: FlexAttention
  has no backward on CPU and varlen is CUDA's. The batches here are plain causal sequences (no document
  boundaries), for which SDPA's causal mask is the block-causal one;
* ``set_force_sum_reduction_for_comms(True)`` on every FSDP module: torchtitan switches FSDP's
  gradient division off (the loss is already divided by the global token count), so FSDP2 reduces with
  ``PREMUL_SUM``, which gloo refuses; summing instead is the same reduction. NCCL needs nothing.

On CPU the weights come from one unsharded init (:func:`init_from_full_model`: torch's DTensor init on a
CPU mesh repeats one shard). FSDP keeps fp32 parameters for the forward (``mixed_precision_param=
"float32"``; torchtitan's default is bf16), so the run can be checked against one process
(tests/frameworks/test_integrations.py); the routed experts' grouped GEMMs run in bf16 whatever it is (torchtitan's
``GroupedExperts`` casts to bf16). The CUDA path (NCCL, torchtitan's own init) has not been run yet.
"""

from __future__ import annotations

import os
import sys
import tempfile
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dmuon  # noqa: E402
from tiny import launch  # noqa: E402
from torchtitan_container import container_class  # noqa: E402

FLAVOR, EP, WORLD = "debugmodel", 2, 4
STEPS, LOCAL_BATCH, SEQ, MAX_NORM = 3, 2, 32, 1.0
GROUP = {"lr": 0.02, "adamw_lr": 3e-3, "weight_decay": 0.1, "adamw_weight_decay": 0.01}
"""The container's DMuon param-group keys (Muon's lr and weight decay; AdamW's as ``adamw_*``)."""


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def model_spec(ep: int, training):
    """torchtitan's deepseek_v3 ``FLAVOR`` spec, its model config set for ``ep`` and ``training`` (SDPA
    attention) as the Trainer's ``update_from_config`` sets it; and the ``ParallelismConfig``."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import model_registry

    spec = model_registry(FLAVOR)
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    # "partial_dtensor": DTensor for the model-parallel dims only. The default, "spmd_types", fails inside
    # fully_shard on torch 2.13 ("all parameters must be DTensors on the full SPMD mesh").
    parallelism = ParallelismConfig(expert_parallel_degree=ep, spmd_backend="partial_dtensor")
    # update_from_config reads .parallelism and .training; the rest of a Trainer.Config is not needed.
    spec.model.update_from_config(config=types.SimpleNamespace(parallelism=parallelism, training=training))
    return spec, parallelism


def training_config(mixed_precision_param: str = "float32"):
    from torchtitan.config import TrainingConfig

    return TrainingConfig(local_batch_size=LOCAL_BATCH, seq_len=SEQ, max_norm=MAX_NORM,
                          mixed_precision_param=mixed_precision_param)


def build_model(world_size: int, device: str):
    """torchtitan's model, sharded by its own ``parallelize_fn`` with ``ep=EP``: ``(model, spec, dims)``."""
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    training = training_config()
    spec, parallelism = model_spec(EP, training)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)  # as the Trainer does, before building meshes
    tt_parallel_dims.device_type = device
    dims = ParallelDims.from_config(parallelism, world_size)
    dims.build_mesh()
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(model, parallel_dims=dims, training=training, parallelism=parallelism,
                                compile_config=CompileConfig(), ac_config=None,
                                dump_folder=tempfile.gettempdir())
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    if device == "cpu":
        init_from_full_model(model, spec)
    model.train()
    if dist.get_backend() == "gloo":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model, spec, dims


def init_from_full_model(model, spec, seed: int = 0) -> None:
    """Sets every parameter of the sharded ``model`` to its shard of one unsharded model initialized by
    torchtitan's ``init_weights`` from ``seed`` (the same on every rank).

    On a CPU mesh, DTensor has no random-number offsets per shard (torch warns "DTensor random operators
    may not have complete support on cpu device mesh"): torchtitan's init gives every rank the same local
    values, so a sharded weight is its first shard repeated. The router's rows then come in equal groups
    (experts 0, 2, 4, 6 score the same on every token) and so do the experts: ties in top-k routing and
    copies of one expert. CUDA meshes draw each shard from its own offset and need none of this."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(seed)
    with torch.device("meta"):
        full = spec.model.build()
    full.to_empty(device="cpu")
    with torch.no_grad():
        full.init_weights(buffer_device=None)
        values = dict(full.named_parameters())
        for name, p in model.named_parameters():
            p.to_local().copy_(distribute_tensor(values[name], p.device_mesh, p.placements).to_local())


def batch(step: int, rank: int, world_size: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``(inputs, labels)`` of ``step``: its rows of one global batch of random tokens (a
    new one each step: the losses printed show the run, not learning; put torchtitan's dataloader here)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (world_size * LOCAL_BATCH, SEQ + 1), generator=g)
    mine = tokens[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]
    return mine[:, :-1], mine[:, 1:]


def full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter's full value by name, on CPU (a collective for the DTensors)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for n, p in model.named_parameters()}


def train(rank: int, world_size: int, steps: int = STEPS, ns: dmuon.NSConfig | None = None) -> dict:
    """Builds, shards and trains torchtitan's model for ``steps`` steps with DMuon (``ns``: its
    Newton-Schulz settings; None: DMuon's default). Returns the initial and final full parameters, the
    global loss and gradient norm of each step, and the Muon matrices this rank orthogonalized in the last."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import ParamGroupConfig
    from torchtitan.distributed.utils import clip_grad_norm_

    device = device_type()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    model, spec, dims = build_model(world_size, device)
    initial = full_state(model)
    config = container_class().Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="DMuon", optimizer_kwargs=dict(GROUP))],
        optimizer_factory_kwargs_by_name={"DMuon": {"ns": ns}} if ns is not None else {})
    optimizers = config.build(model_parts=[model])
    # torchtitan's expert-bias update for load balancing (global token counts per expert), run before
    # each optimizer step, as the Trainer registers it.
    spec.post_optimizer_build_fn(optimizers, [model], dims)
    loss_fn = CrossEntropyLoss.Config().build()
    losses, norms = [], []
    for step in range(steps):
        inputs, labels = (t.to(device) for t in batch(step, rank, world_size, spec.model.vocab_size))
        global_tokens = torch.tensor(labels.numel() * world_size, device=device)
        loss, _ = loss_fn(model(inputs), labels, global_tokens)  # this rank's token sum / global tokens
        loss.backward()
        norm = clip_grad_norm_([p for p in model.parameters()], MAX_NORM, ep_enabled=True)
        optimizers.step()
        optimizers.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)  # the global batch's mean loss
        losses.append(loss.item())
        norms.append(float(norm))
    opt = optimizers.optimizers[0]
    opt.flush_updates()
    return {"initial": initial, "params": full_state(model), "losses": losses, "norms": norms,
            "orthogonalized": opt.last_step_stats()["orthogonalized"]}


if __name__ == "__main__":
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    result = launch(train, world_size=WORLD)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("losses", [round(v, 4) for v in result["losses"]],
              "grad norms", [round(v, 4) for v in result["norms"]])
