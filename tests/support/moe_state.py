"""The MoE layout's state across a run (issue #62 item 5): DCP checkpoints that resume on another ``ep`` and
world size, non-finite gradients agreed across the dense and expert meshes, and QK-clip on an MoE model with
attention. Rank functions over :mod:`support.moe`'s model, sharding and batches.

The global batch is :data:`GLOBAL_BATCH` rows whatever the world size: ``support.moe.batch`` draws
``world * per_rank`` rows from one seed per step and slices them, so ``per_rank = GLOBAL_BATCH // world``
gives every world the same rows (4 ranks x 2 = 2 ranks x 4 = 8), the same mean loss and the same gradient up
to the summation order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from support.moe import (
    ADAMW, DIM, MUON, VOCAB, MoEBlock, MoENet, batch, expert_parallel, full_state, loss_of, stacks,
)
from support.reference import ns_precision

GLOBAL_BATCH = 8
"""Rows of every step's batch, over all ranks (2 a rank on 4 ranks, 4 on 2)."""


def per_rank(world: int) -> int:
    assert GLOBAL_BATCH % world == 0, world
    return GLOBAL_BATCH // world


def global_batch(step: int) -> torch.Tensor:
    """The rows every rank's :func:`support.moe.batch` slices at ``step`` (the reference trains on them)."""
    return batch(step, 0, 1, per_rank=GLOBAL_BATCH)


def local_batch(step: int, world: int) -> torch.Tensor:
    return batch(step, dist.get_rank(), world, per_rank=per_rank(world))


def build(world: int, ep: int, experts: int, dim1: bool | None = None, *, replicate: int = 1, model=None,
          execution=None, qk_clip=None):
    """``model`` (default: :class:`support.moe.MoENet` of ``experts``, seed 0) laid out as torchtitan's expert
    parallelism on ``world`` ranks (``ep``, ``efsdp = world / replicate / ep``), with DMuon (fp32 NS) as
    ``support.moe.train`` builds it. Returns ``(model, opt)``."""
    import dmuon

    if model is None:
        torch.manual_seed(0)
        model = MoENet(experts)
    # FSDP2's sum-then-divide (force_sum, which gloo needs instead of PREMUL_SUM) only where the experts'
    # reduce-scatter has more than one rank: with efsdp == 1 torch 2.13's foreach_reduce divides by the
    # factor in its one-rank copy and again after the replicas' all-reduce, so under FSDP2's own HSDP
    # (replicate > 1) the experts' gradients would come out 1/world of the mean. Muon's update does not see a
    # uniform scale (NS normalizes), so a run on that layout alone trains as it should; its momentum, one
    # world-th of torch.optim.Muon's, would not resume on any other layout (test_moe_state checks the saved
    # momentum against torch.optim.Muon's).
    efsdp = world // replicate // ep
    expert_parallel(model, world, ep, replicate=replicate, dim1=dim1, force_sum=efsdp > 1)
    kw = {} if qk_clip is None else {"qk_clip": qk_clip}
    opt = dmuon.DMuon(model, lr=MUON["lr"], weight_decay=MUON["weight_decay"],
                      ns=dmuon.NSConfig(method="standard", dtype=torch.float32), adamw=dict(ADAMW),
                      execution=execution or dmuon.ExecutionConfig(), **kw)
    return model, opt


def train_steps(model, opt, steps, world: int, clip: float | None = None) -> None:
    """Every rank on its own rows of each step's global batch (``clip``: ``opt.clip_grad_norm_`` first)."""
    for step in steps:
        loss_of(model, local_batch(step, world)).backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()


# --- 1. DCP checkpoints across ep and world size --------------------------------------------------------------

def _state(model, opt) -> dict:
    """What a training script saves: torch's sharded model and optimizer state dicts."""
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _full_states(model, opt) -> dict:
    """The full model and optimizer state dicts (collectives; with cpu_offload only rank 0 gets tensors)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = get_optimizer_state_dict(model, opt, options=options)
    return {"model": {k: v.detach().clone() for k, v in model_sd.items()},
            "optim": {name: {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
                      for name, s in optim_sd.get("state", {}).items()}}


def _built(world: int, layout: tuple, execution: dict | None):
    """:func:`build` of ``layout = (ep, experts, dim1, replicate)`` with ``ExecutionConfig(**execution)``."""
    import dmuon

    ep, experts, dim1, replicate = layout
    return build(world, ep, experts, dim1, replicate=replicate,
                 execution=dmuon.ExecutionConfig(**(execution or {})))


def save_and_go_on(rank: int, world: int, path: str, layout: tuple, saved_at: int, more: int,
                   execution: dict | None = None, clip: float | None = None) -> dict:
    """Trains ``saved_at`` steps on ``layout`` (:func:`_built`; ``clip``: ``opt.clip_grad_norm_`` before each
    step), ``dcp.save``-s at ``path``, trains ``more`` steps on (the run that went on). Returns the full
    states at the save (rank 0's tensors) and the final full parameters."""
    model, opt = _built(world, layout, execution)
    train_steps(model, opt, range(saved_at), world, clip)
    dcp.save(_state(model, opt), checkpoint_id=path)
    saved = _full_states(model, opt)
    train_steps(model, opt, range(saved_at, saved_at + more), world, clip)
    opt.flush_updates()
    return {"saved": saved if rank == 0 else None, "params": full_state(model)}


def resume(rank: int, world: int, path: str, layout: tuple, saved_at: int, more: int,
           execution: dict | None = None, clip: float | None = None) -> dict:
    """A fresh model on ``layout`` (its own initial weights, which the load must replace) loads ``path``
    as a training script does (``dcp.load`` into its own state dicts, then ``set_*_state_dict``), and trains
    the same ``more`` steps. Returns the full states right after the load (rank 0's) and the final full
    parameters."""
    model, opt = _built(world, layout, execution)
    state = _state(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    loaded = _full_states(model, opt)
    train_steps(model, opt, range(saved_at, saved_at + more), world, clip)
    opt.flush_updates()
    return {"loaded": loaded if rank == 0 else None, "params": full_state(model)}


# --- 2. nonfinite across the meshes ---------------------------------------------------------------------------

def poison_expert_grad(model: MoENet, layer: int, stack: str, index: tuple[int, int, int]):
    """Before this forward's experts run, a hook on ``layers[layer].experts.<stack>``'s unsharded local stack
    (this rank's ep experts, FSDP2's all-gathered parameter) puts a NaN at ``index`` of its gradient, before
    FSDP2's reduce-scatter: one expert's gradient on one rank, which the reduction carries to the efsdp rank
    holding that element's shard only. The hook removes itself once it has fired."""
    routed = model.layers[layer].experts

    def before(module, args):
        handle.remove()
        param = getattr(module, stack)

        def poison(grad):
            poison_handle.remove()
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local = local.clone()
            local[index] = float("nan")
            if isinstance(grad, DTensor):
                return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False,
                                          shape=grad.shape, stride=grad.stride())
            return local

        poison_handle = param.register_hook(poison)

    handle = routed.register_forward_pre_hook(before)


def _local_state(opt) -> dict:
    """Copies of this rank's local optimizer state (momenta, AdamW moments and steps), by parameter id."""
    out = {}
    for p, state in opt.state.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                out[(id(p), k)] = (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
    return out


def _states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def nonfinite_run(rank: int, world: int, mode: str, layout: tuple, poisoned_rank: int, poisoned_step: int,
                  steps: int, where: tuple) -> dict:
    """Trains ``steps`` steps with ``ExecutionConfig(nonfinite=mode)``, a NaN put into one expert's gradient on
    ``poisoned_rank`` at ``poisoned_step`` (``where``: :func:`poison_expert_grad`'s layer, stack, index).

    Per step, on this rank: whether one of its local gradient shards held a NaN, whether it was skipped, the
    error ``step()`` raised (``mode="raise"``; the run then zeroes the gradients and goes on), whether the full
    parameters and this rank's optimizer state stayed as they were. Returns those, the initial and final full
    parameters."""
    import dmuon

    ep, experts, dim1 = layout
    model, opt = build(world, ep, experts, dim1, execution=dmuon.ExecutionConfig(nonfinite=mode))
    initial = full_state(model)
    record = []
    for step in range(steps):
        if rank == poisoned_rank and step == poisoned_step:
            poison_expert_grad(model, *where)
        before, state = full_state(model), _local_state(opt)
        loss_of(model, local_batch(step, world)).backward()
        here = any(not torch.isfinite(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).all()
                   for p in model.parameters() if p.grad is not None)
        error = None
        try:
            opt.step()
        except FloatingPointError as exc:
            error = str(exc)
        opt.zero_grad()
        after = full_state(model)
        skipped = bool(opt.last_step_stats().get("skipped_nonfinite", False))
        record.append({"nonfinite_here": here, "skipped": skipped, "error": error,
                       "params_kept": all(torch.equal(before[n], after[n]) for n in before),
                       "state_kept": _states_equal(state, _local_state(opt))})
    opt.flush_updates()
    return {"initial": initial, "params": full_state(model), "steps": record}


# --- 3. QK-clip on an MoE model with attention ----------------------------------------------------------------

HEADS = 2
HEAD_DIM = DIM // HEADS
TAU, ALPHA = 1.5, 0.4
"""Below head 1's logits on the first steps (its query rows scaled up at init, :class:`AttnMoENet`), above head
0's: some heads clip, others do not (the test checks it of the reference)."""


class Attention(nn.Module):
    """Causal attention of :data:`HEADS` heads with separate q, k, v, o projections; reports each forward's
    per-head maximum pre-softmax logit (over batch and positions) to ``report`` under ``key``."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.report = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, HEADS, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) * HEAD_DIM ** -0.5
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        if self.report is not None:
            self.report(self.key, scores.detach().amax(dim=(0, 2, 3)))
        out = torch.softmax(scores, -1) @ v
        return self.o(out.transpose(1, 2).reshape(b, t, DIM))


class AttnMoEBlock(MoEBlock):
    """Attention, then :class:`support.moe.MoEBlock` (its causal mix, routing, routed and shared experts):
    the routed experts stay at ``layers.<i>.experts``, where ``support.moe.expert_parallel`` splits them."""

    def __init__(self, experts: int, key: str) -> None:
        super().__init__(experts)
        self.attn = Attention(key)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.attn(x))


class AttnMoENet(MoENet):
    """:class:`support.moe.MoENet` with :class:`AttnMoEBlock` layers; head 1's query rows scaled by 3 at init,
    so that its logits pass :data:`TAU` and head 0's mostly do not."""

    def __init__(self, experts: int = 3, layers: int = 2) -> None:
        nn.Module.__init__(self)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(AttnMoEBlock(experts, f"attn{i}") for i in range(layers))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        with torch.no_grad():
            for block in self.layers:
                block.attn.q.weight[HEAD_DIM:].mul_(3.0)

    def attention(self) -> list[Attention]:
        return [block.attn for block in self.layers]


def qk_layers(layers: int = 2):
    import dmuon

    return {f"attn{i}": dmuon.AttentionHeads(query=f"layers.{i}.attn.q.weight", key=f"layers.{i}.attn.k.weight",
                                             num_heads=HEADS, head_dim=HEAD_DIM) for i in range(layers)}


def qk_clip_run(rank: int, world: int, ep: int, experts: int, dim1: bool | None, replicate: int,
                steps: int) -> dict:
    """:class:`AttnMoENet` on the expert-parallel layout with DMuon + ``dmuon.QKClip``, every rank reporting
    its own tokens' maxima. Returns the initial and final full parameters, each step's maxima on this rank
    (per key head, ``attn0``'s then ``attn1``'s) and agreed ones (by layer)."""
    import dmuon

    torch.manual_seed(0)
    model = AttnMoENet(experts)
    model, opt = build(world, ep, experts, dim1, replicate=replicate, model=model,
                       qk_clip=dmuon.QKClip(qk_layers(), tau=TAU, alpha=ALPHA))
    initial = full_state(model)
    for layer in model.attention():
        layer.report = opt.report_attention_logits
    agreed, local = [], []
    for step in range(steps):
        loss_of(model, local_batch(step, world)).backward()
        local.append(opt._qk.step_maxima().clone())  # this rank's own maxima per key head, layers in key order
        opt.step()
        opt.zero_grad()
        agreed.append({k: v.clone() for k, v in opt.last_attention_logits().items()})
    opt.flush_updates()
    return {"initial": initial, "params": full_state(model), "agreed": agreed, "local": local}


def clip_written_out(model: AttnMoENet, maxima: dict[str, torch.Tensor], tau: float = TAU,
                     alpha: float = ALPHA) -> None:
    """MuonClip's formula (MHA: a key head per query head): per head ``gamma = tau / S`` if ``S > tau``
    else 1; its query rows times ``gamma ** alpha``, its key rows times ``gamma ** (1 - alpha)``."""
    with torch.no_grad():
        for layer in model.attention():
            for h, s in enumerate(maxima[layer.key].tolist()):
                gamma = tau / s if s > tau else 1.0
                rows = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
                layer.q.weight[rows] *= gamma ** alpha
                layer.k.weight[rows] *= gamma ** (1 - alpha)


# --- The one-process reference --------------------------------------------------------------------------------

def reference(model: MoENet, initial: dict[str, torch.Tensor], steps, *, skipped: tuple[int, ...] = (),
              max_norm: float | None = None, qk_clip: bool = False, maxima: list | None = None,
              momenta: dict | None = None) -> dict[str, torch.Tensor]:
    """``support.moe.reference`` for any :class:`MoENet` (``model``, loaded from ``initial``) on
    :func:`global_batch`: torch.optim.Muon (fp32 NS) on each expert slice and each dense matrix, AdamW on the
    rest; ``skipped`` steps change nothing (their gradients dropped); ``max_norm``: torch's ``clip_grad_norm_``
    over every gradient before each step; ``qk_clip``: an :class:`AttnMoENet`'s
    attention reports its per-head maxima over the whole batch (the maximum of every rank's) and
    :func:`clip_written_out` follows each applied step (the maxima appended to ``maxima``). ``momenta``: filled
    with torch.optim.Muon's momentum at the end by parameter name (an expert stack's slices stacked)."""
    model.load_state_dict(initial)
    experts = model.layers[0].experts.num_experts
    names = set(stacks(model))
    params = dict(model.named_parameters())
    slices = [nn.Parameter(params[n].data[e]) for n in sorted(names) for e in range(experts)]
    matrices = [p for n, p in params.items() if p.ndim == 2 and n not in names and not n.startswith(("embed", "head"))]
    rest = [p for n, p in params.items() if p.ndim < 2 or n.startswith(("embed", "head"))]
    muon = torch.optim.Muon(slices + matrices, **MUON)
    adamw = torch.optim.AdamW(rest, **ADAMW)
    for step in steps:
        seen: dict[str, torch.Tensor] = {}
        if qk_clip:
            for layer in model.attention():
                layer.report = lambda key, values: seen.__setitem__(key, values.clone())
        loss_of(model, global_batch(step)).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm)
        if step not in skipped:
            parts = iter(slices)
            for n in sorted(names):
                for e in range(experts):
                    next(parts).grad = params[n].grad[e].clone()
            with ns_precision(torch.float32):
                muon.step()
            adamw.step()
            if qk_clip:
                clip_written_out(model, seen)
                if maxima is not None:
                    maxima.append(seen)
        for p in [*slices, *model.parameters()]:
            p.grad = None
    if qk_clip:
        for layer in model.attention():
            layer.report = None
    if momenta is not None:
        parts = iter(slices)
        momenta.update({n: torch.stack([muon.state[next(parts)]["momentum_buffer"] for _ in range(experts)])
                        for n in sorted(names)})
        momenta.update({n: muon.state[p]["momentum_buffer"] for n, p in params.items()
                        if any(p is m for m in matrices)})
    return {n: p.detach().clone() for n, p in model.named_parameters()}
