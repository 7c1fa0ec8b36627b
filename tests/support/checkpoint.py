"""Save on one cluster, resume on another, through torch's own checkpoint API (run inside spawned ranks).

Nothing here is dmuon-specific: the calls are the ones a training script makes
for FSDP2 + AdamW (``get_model_state_dict``/``get_optimizer_state_dict``,
``dcp.save``/``dcp.load``, ``set_model_state_dict``/``set_optimizer_state_dict``),
with the default (strict) options. DMuon's state lives beside the parameter
shards as DTensors, so DCP reshards it like AdamW's.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)

from support.cases import full_params, sharded_oddnet
from support.models import lm_loss

GLOBAL_BATCH = 12  # divides by 1, 2, 3 and 4 ranks


def global_batch(step: int, vocab: int = 50, seq: int = 7):
    """The whole batch of ``step`` (the single-process reference trains on it)."""
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _local(step: int, rank: int, world_size: int):
    """This rank's slice of the global batch (every rank of the world gets a distinct slice)."""
    tokens, targets = global_batch(step)
    per = GLOBAL_BATCH // world_size
    return tokens[rank * per : (rank + 1) * per], targets[rank * per : (rank + 1) * per]


def _train(model, opt, rank, world_size, steps):
    for step in steps:
        lm_loss(model, _local(step, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()


def save(model, opt, path: str) -> None:
    """What a user writes to save FSDP2 + any torch optimizer."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=path)


def load(model, opt, path: str) -> None:
    """What a user writes to resume (default options: strict)."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def _full_model_state(model) -> dict[str, torch.Tensor]:
    """The full, CPU model state dict (a collective; rank 0 gets the tensors, as torch documents)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().clone() for k, v in state.items()}


def save_after(rank: int, world_size: int, path: str, steps: int, zero: int, mesh_shape=None,
               hsdp: str = "fsdp2") -> dict | None:
    """Trains ``steps`` steps, saves a DCP checkpoint at ``path``.

    Returns (rank 0): the full CPU model state dict taken after the save, the
    live full parameters, for the plain-model check, and Muon's momenta by
    name from torch's full optimizer state dict.
    """
    model, _, opt = sharded_oddnet(world_size, zero=zero, mesh_shape=mesh_shape, hsdp=hsdp)
    _train(model, opt, rank, world_size, range(steps))
    save(model, opt, path)
    state = _full_model_state(model)
    params = full_params(model)
    optim = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # With cpu_offload only rank 0 gets the tensors, as torch documents.
    momenta = {k: v["momentum_buffer"].clone() for k, v in optim.get("state", {}).items() if "momentum_buffer" in v}
    return {"state": state, "params": params, "momenta": momenta} if rank == 0 else None


def resume_and_train(rank: int, world_size: int, path: str, start: int, steps: int, zero: int,
                     mesh_shape=None, hsdp: str = "fsdp2") -> dict | None:
    """Builds a fresh model on this cluster, resumes from ``path`` and trains ``steps`` more steps.

    Returns (rank 0): every parameter's full value.
    """
    model, _, opt = sharded_oddnet(world_size, zero=zero, mesh_shape=mesh_shape, hsdp=hsdp)
    load(model, opt, path)
    _train(model, opt, rank, world_size, range(start, start + steps))
    params = full_params(model)
    return params if rank == 0 else None


def save_then_resume_elsewhere(rank: int, world_size: int, directory: str, saved_at: int, more: int,
                               saved_layout: tuple, layouts: list[tuple]) -> list | None:
    """One process group: train and save under ``saved_layout`` (``(mesh_shape, hsdp)``), then for each
    of ``layouts`` a fresh model resumes and trains ``more`` steps. Returns (rank 0) each resumed
    run's full parameters."""
    path = f"{directory}/saved"
    save_after(rank, world_size, path, saved_at, 3, *saved_layout)
    out = [resume_and_train(rank, world_size, path, saved_at, more, 3, *layout) for layout in layouts]
    return out if rank == 0 else None


def resume_matches_continuing(rank: int, world_size: int, path: str, saved_at: int, more: int,
                              frozen: tuple[str, ...]) -> dict | None:
    """bf16 mixed precision with frozen parameters: save, then both continue and resume.

    One model trains ``saved_at`` steps, saves, and trains ``more`` steps on;
    a fresh model resumes from the checkpoint and trains the same ``more`` steps.

    Returns (rank 0): both runs' full parameters, the frozen parameters'
    initial values and which parameters had optimizer state after the load.
    """
    kw = dict(zero=3, bf16=True, frozen=frozen)
    model, _, opt = sharded_oddnet(world_size, **kw)
    initial = full_params(model)
    _train(model, opt, rank, world_size, range(saved_at))
    save(model, opt, path)
    _train(model, opt, rank, world_size, range(saved_at, saved_at + more))
    continued = full_params(model)
    del model, opt

    model, _, opt = sharded_oddnet(world_size, **kw)
    load(model, opt, path)
    with_state = sorted(n for n, p in model.named_parameters() if opt.state.get(p))
    _train(model, opt, rank, world_size, range(saved_at, saved_at + more))
    resumed = full_params(model)
    if rank != 0:
        return None
    return {"continued": continued, "resumed": resumed, "initial": initial, "with_state": with_state}


def on_4_ranks(rank: int, world_size: int, directory: str, saved_at: int, more: int,
               frozen: tuple[str, ...]) -> dict | None:
    """The 4-rank work of the checkpoint tests in one process group (one spawn costs more than the work).

    ``save_after`` (fp32, ZeRO-3) into ``directory/fp32``, then
    ``resume_matches_continuing`` (bf16, ``frozen``) in ``directory/bf16``.
    """
    saved = save_after(rank, world_size, f"{directory}/fp32", saved_at, 3)
    bf16 = resume_matches_continuing(rank, world_size, f"{directory}/bf16", saved_at, more, frozen)
    return {"saved": saved, "bf16": bf16} if rank == 0 else None


# --- The combined API with an async save, resumed under another balancer --------------------------

def async_save_then_resume(rank: int, world_size: int, path: str, saved_at: int, more: int) -> dict | None:
    """``get_state_dict`` + ``dcp.async_save`` (greedy owners), then a fresh model with round-robin
    owners resumes through ``get_state_dict``/``dcp.load``/``set_state_dict``.

    The saving run waits on the future before its next step, as torch documents.
    Returns (rank 0): the resumed run's full parameters after ``more`` steps, and the
    memory figures of the load (see :func:`_checkpoint_bytes`).
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, _, opt = sharded_oddnet(world_size, zero=3)
    _train(model, opt, rank, world_size, range(saved_at))
    model_sd, optim_sd = get_state_dict(model, opt)
    future = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    future.result()
    _train(model, opt, rank, world_size, range(saved_at, saved_at + 1))  # the next step, after the wait
    del model, opt, model_sd, optim_sd

    resumed, _, opt = _round_robin_oddnet(world_size)
    load_bytes = _load_combined(resumed, opt, path)
    _train(resumed, opt, rank, world_size, range(saved_at, saved_at + more))
    params = full_params(resumed)
    return {"params": params if rank == 0 else None, "load_bytes": load_bytes}


def _round_robin_oddnet(world_size: int):
    import dmuon
    from support.cases import make_mesh, shard_oddnet
    from support.models import OddNet

    mesh = make_mesh(world_size)
    torch.manual_seed(0)
    model = OddNet()
    shard_oddnet(model, mesh, zero=3)
    plan = dmuon.prepare(model, balancer="round_robin", ns=dmuon.NSConfig(method="standard", dtype=torch.float32))
    opt = dmuon.DMuon(model, plan, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3))
    return model, plan, opt


def _load_combined(model, opt, path: str) -> dict:
    """What a user writes to resume with the combined API; returns the bytes measured right after dcp.load."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    measured = _checkpoint_bytes(model, opt, (model_sd, optim_sd))
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return measured


# --- Memory of a save and a load ------------------------------------------------------------------

def _tensors_in(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)


def _checkpoint_bytes(model, opt, state) -> dict:
    """This rank's live training-state bytes, and the bytes of ``state``'s tensors that are not
    aliases of them (unique storages, deduplicated by data_ptr)."""
    from dmuon.bench.memory import live_state_bytes, state_tensors, storages

    live = storages(list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
                    + list(state_tensors(opt)))
    extra = {k: v for k, v in storages(_tensors_in(state)).items() if k not in live}
    return {"live": live_state_bytes(model, opt)["total"], "extra": sum(extra.values())}


def save_measuring_memory(rank: int, world_size: int, path: str, steps: int) -> dict:
    """Trains ``steps`` steps (ZeRO-3, fp32) and saves as :func:`save` does, measuring this rank's bytes:
    the training peak (after the last backward) and right after get_*_state_dict + dcp.save."""
    from dmuon.bench.memory import live_state_bytes

    model, _, opt = sharded_oddnet(world_size, zero=3)
    peak = 0
    for step in range(steps):
        lm_loss(model, _local(step, rank, world_size)).backward()
        peak = max(peak, live_state_bytes(model, opt)["total"])
        opt.step()
        opt.zero_grad()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=path)
    return {"train_peak": peak, "save": _checkpoint_bytes(model, opt, state)}


def on_4_ranks_more(rank: int, world_size: int, directory: str, saved_at: int, more: int,
                    frozen: tuple[str, ...]) -> dict | None:
    """:func:`on_4_ranks`, then the async/combined-API round trip and the save memory figures."""
    out = on_4_ranks(rank, world_size, directory, saved_at, more, frozen)
    memory = save_measuring_memory(rank, world_size, f"{directory}/memory", saved_at + 1)
    resumed = async_save_then_resume(rank, world_size, f"{directory}/async", saved_at, more)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, {"memory": memory,
                                      "load_bytes": resumed["load_bytes"]})
    if rank != 0:
        return None
    return out | {"async": resumed["params"], "memory": gathered}


# --- Portability: a single-process torch.optim.Muon + AdamW on a plain OddNet ---------------------

class PlainMuonAdamW:
    """``torch.optim.Muon`` on the matrices (conv kernels through 2-D views sharing their storage,
    as :func:`support.reference.reference_training` does) + ``torch.optim.AdamW`` on the rest,
    with DMuon's hyperparameters of :func:`sharded_oddnet`."""

    def __init__(self, model) -> None:
        from dmuon.plan.selection import select_matrices
        from support.cases import MUON_KW
        from torch import nn

        self.model = model
        matrices = select_matrices(model)
        ids = {id(p) for _, p in matrices}
        self.views = {n: (p, nn.Parameter(p.data.view(p.shape[0], -1)) if p.ndim > 2 else p) for n, p in matrices}
        self.muon = torch.optim.Muon([v for _, v in self.views.values()], **MUON_KW)
        self.adam_params = {n: p for n, p in model.named_parameters() if id(p) not in ids}
        self.adamw = torch.optim.AdamW(list(self.adam_params.values()), lr=3e-3, weight_decay=0.01)

    def train(self, steps) -> None:
        from support.reference import ns_precision

        for step in steps:
            lm_loss(self.model, global_batch(step)).backward()
            for p, v in self.views.values():
                if v is not p:
                    v.grad = p.grad.view(v.shape)
            with ns_precision(torch.float32):
                self.muon.step()
            self.adamw.step()
            for p, v in self.views.values():
                v.grad = None
            self.model.zero_grad(set_to_none=True)

    def load_full_state(self, full: dict) -> None:
        """Maps an FQN-keyed full optimizer state dict (``get_optimizer_state_dict(...,
        full_state_dict=True)``) into the two optimizers, by parameter name."""
        for name, state in full["state"].items():
            if name in self.views:
                p, v = self.views[name]
                self.muon.state[v] = {"momentum_buffer": state["momentum_buffer"].clone().view(v.shape)}
            else:
                p = self.adam_params[name]
                self.adamw.state[p] = {
                    "step": torch.tensor(float(state["step"])),
                    "exp_avg": state["exp_avg"].clone(), "exp_avg_sq": state["exp_avg_sq"].clone(),
                }

    def full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """FQN -> state (Muon's momentum in the parameter's own shape), copies."""
        out = {}
        for name, (p, v) in self.views.items():
            if v in self.muon.state:
                out[name] = {"momentum_buffer": self.muon.state[v]["momentum_buffer"].detach().clone().view(p.shape)}
        for name, p in self.adam_params.items():
            if p in self.adamw.state:
                out[name] = {k: t.detach().clone() for k, t in self.adamw.state[p].items()}
        return out


def _full_options(**kw):
    return StateDictOptions(full_state_dict=True, **kw)


def _sharded_model(world_size: int, **oddnet_kw):
    import dmuon
    from support.cases import make_mesh, shard_oddnet
    from support.models import OddNet

    mesh = make_mesh(world_size)
    torch.manual_seed(0)
    model = OddNet(**oddnet_kw)
    shard_oddnet(model, mesh, zero=3)
    return model, dmuon.DMuon(model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3),
                              ns=dmuon.NSConfig(method="standard", dtype=torch.float32))


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    return obj


def _error_of(fn) -> str | None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return f"{type(exc).__name__}: {exc}"
    return None


def on_3_ranks(rank: int, world_size: int, directory: str, saved_at: int, more: int,
               plain: dict) -> dict:
    """The 3-rank work (meant for :func:`support.spawn.run_with_crashes`).

    * ``export``: trains ``saved_at`` steps; rank 0's full CPU model and optimizer state
      dicts; then ``more`` steps on (the parameters).
    * ``import``: a fresh model starts from ``plain`` (a single-process full model state dict
      and FQN-keyed Muon + AdamW state) through ``set_*_state_dict(full_state_dict=True)``
      and trains ``more`` steps (the parameters).
    * ``bad``: what ``dcp.load`` raised on this rank for checkpoints of OddNet(blocks=2)
      and OddNet(dim=40) loaded into OddNet().
    """
    # Spawn arguments arrive as shared-memory tensors (one storage for every rank), and the
    # optimizer would keep and update them in place (AdamW's step): each rank takes its own copy.
    plain = _clone(plain)
    out = {}
    model, opt = _sharded_model(world_size)
    _train(model, opt, rank, world_size, range(saved_at))
    model_sd = get_model_state_dict(model, options=_full_options(cpu_offload=True))
    optim_sd = get_optimizer_state_dict(model, opt, options=_full_options(cpu_offload=True))
    if rank == 0:
        out["export_state"] = {"model": _clone(model_sd), "optim": _clone(optim_sd)}
    del model_sd, optim_sd
    _train(model, opt, rank, world_size, range(saved_at, saved_at + more))
    out["export"] = full_params(model)
    del model, opt

    model, opt = _sharded_model(world_size)
    set_model_state_dict(model, plain["model"], options=_full_options())
    template = get_optimizer_state_dict(model, opt, options=_full_options())
    set_optimizer_state_dict(model, opt, {"state": plain["state"], "param_groups": template["param_groups"]},
                             options=_full_options())
    _train(model, opt, rank, world_size, range(saved_at, saved_at + more))
    out["import"] = full_params(model)
    del model, opt

    bad = {}
    for label, kw in [("blocks=2", dict(blocks=2)), ("dim=40", dict(dim=40))]:
        other, other_opt = _sharded_model(world_size, **kw)
        _train(other, other_opt, rank, world_size, range(1))
        save(other, other_opt, f"{directory}/{label}")
        del other, other_opt
        model, opt = _sharded_model(world_size)
        bad[label] = _error_of(functools.partial(load, model, opt, f"{directory}/{label}"))
        del model, opt
    out["bad"] = bad
    return out if rank == 0 else {"bad": bad}
