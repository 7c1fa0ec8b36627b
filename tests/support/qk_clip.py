"""QK-clip (issue #31, part 2): a small attention model reporting its logit maxima, a single-process
reference written from the formula, and the distributed runs.

``QKNet`` has three attention layers, each reporting its per-head maximum pre-softmax logit
(eager: the causal scores' maximum over batch and positions) through ``model.report``:

* ``gqa``: separate ``q``, ``k``, ``v`` projections, 6 query heads over 2 key heads (GQA, 3 query
  heads a group) of 3 rows: ``q`` has 18 rows, which FSDP2's chunks on 4 ranks (5, 5, 5, 3) and
  TP's then FSDP2's on a (2, 2) mesh (9 = 5 + 4) cut inside heads;
* ``fused``: one fused ``qkv`` (4 heads of 2, MHA), viewed as row groups ``rows:8,8,8``;
* ``mla``: MLA as Megatron-LM's ``MLASelfAttention`` lays it out, without the latent down
  projection: ``q`` holds per head 2 rows without rope then 2 rope rows, ``kv_up`` per head 2 key
  rows then 3 value rows, ``k_rope`` the rope key every head shares (not clipped).

Query rows are scaled at init (head ``h`` of a layer by ``1 + h``) so that some heads' logits pass
``TAU`` and others do not. The reference (:func:`reference`) is torch.optim.Muon (the fused
``qkv`` as three row-group parameters sharing its storage; fp32 NS) + AdamW, or NorMuon's rule
written out, then the clip written out from the formula with the maximum over every rank's reports.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon
from dmuon.baselines import GatherThenCompute
from dmuon.testing.reference import fp32_newton_schulz

from support.reference import ns_precision

VOCAB, WIDTH, SEQ = 16, 10, 6
TAU, ALPHA = 2.0, 0.4
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
ADAMW = dict(lr=3e-3, weight_decay=0.01)
BETA2 = 0.9
STEPS = 4
SKIPPED = 2
"""The step an infinite loss on rank 0 makes ``nonfinite="skip"`` skip (in the runs that skip)."""

GQA = dict(num_heads=6, num_kv_heads=2, head_dim=3)
FUSED = dict(num_heads=4, head_dim=2)
MLA = dict(num_heads=3, head_dim=2, rope_dim=2, value_dim=3)
QKV_GROUPS = (8, 8, 8)


def layers_of(names: tuple[str, ...] = ("gqa", "fused", "mla")) -> dict[str, dmuon.AttentionHeads]:
    """The clipped layers, by the key each reports under."""
    every = {
        "gqa": dmuon.AttentionHeads(query="gqa.q.weight", key="gqa.k.weight", **GQA),
        "fused": dmuon.AttentionHeads(query="fused.qkv.weight", key="fused.qkv.weight", key_row=8, **FUSED),
        "mla": dmuon.AttentionHeads(query="mla.q.weight", key="mla.kv_up.weight", num_kv_heads=3, **MLA),
    }
    return {n: every[n] for n in names}


def _causal_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``(B, H, L, L)`` scores with the future at -inf."""
    scores = q @ k.transpose(-1, -2) * scale
    future = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf"))


class _Attention(nn.Module):
    """Shared by the layers: reports, softmax, output projection."""

    key: str = ""
    heads = 1
    first_head = 0  # TP: this rank's first head

    def __init__(self) -> None:
        super().__init__()
        self.report = None

    def _attend(self, q, k, v, scale):
        scores = _causal_scores(q, k, scale)
        if self.report is not None:
            self.report(self.key, scores.detach().amax(dim=(0, 2, 3)), self.first_head)
        out = torch.softmax(scores, -1) @ v  # (B, H, L, dv)
        return self.out(out.transpose(1, 2).flatten(2))

    def _split(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        return t.unflatten(-1, (heads, -1)).transpose(1, 2)  # (B, H, L, d)


class GQAttention(_Attention):
    key = "gqa"

    def __init__(self) -> None:
        super().__init__()
        nh, nkv, hd = GQA["num_heads"], GQA["num_kv_heads"], GQA["head_dim"]
        self.q, self.k, self.v = (nn.Linear(WIDTH, n * hd, bias=False) for n in (nh, nkv, nkv))
        self.out = nn.Linear(nh * hd, WIDTH, bias=False)
        self.heads, self.kv_heads = nh, nkv  # per TP rank once parallelized

    def forward(self, x):
        q, k, v = self._split(self.q(x), self.heads), self._split(self.k(x), self.kv_heads), \
            self._split(self.v(x), self.kv_heads)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return self._attend(q, k, v, GQA["head_dim"] ** -0.5)


class FusedAttention(_Attention):
    key = "fused"

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, sum(QKV_GROUPS), bias=False)
        self.out = nn.Linear(QKV_GROUPS[0], WIDTH, bias=False)

    def forward(self, x):
        q, k, v = (self._split(t, FUSED["num_heads"]) for t in self.qkv(x).split(QKV_GROUPS, -1))
        return self._attend(q, k, v, FUSED["head_dim"] ** -0.5)


class MLAttention(_Attention):
    key = "mla"

    def __init__(self) -> None:
        super().__init__()
        nh, hd, rope, vd = MLA["num_heads"], MLA["head_dim"], MLA["rope_dim"], MLA["value_dim"]
        self.q = nn.Linear(WIDTH, nh * (hd + rope), bias=False)
        self.kv_up = nn.Linear(WIDTH, nh * (hd + vd), bias=False)
        self.k_rope = nn.Linear(WIDTH, rope, bias=False)
        self.out = nn.Linear(nh * vd, WIDTH, bias=False)

    def forward(self, x):
        nh, hd = MLA["num_heads"], MLA["head_dim"]
        q = self._split(self.q(x), nh)  # (B, H, L, hd + rope): no rope rotation, the layout is what matters
        kv = self._split(self.kv_up(x), nh)
        k_rope = self.k_rope(x).unsqueeze(1).expand(-1, nh, -1, -1)  # one rope key for every head
        k = torch.cat([kv[..., :hd], k_rope], -1)
        return self._attend(q, k, kv[..., hd:], (hd + MLA["rope_dim"]) ** -0.5)


class QKNet(nn.Module):
    def __init__(self, names: tuple[str, ...] = ("gqa", "fused", "mla")) -> None:
        super().__init__()
        kinds = {"gqa": GQAttention, "fused": FusedAttention, "mla": MLAttention}
        self.names = names
        self.embed = nn.Embedding(VOCAB, WIDTH)
        for n in names:
            setattr(self, n, kinds[n]())
        self.head = nn.Linear(WIDTH, VOCAB)
        with torch.no_grad():  # head h's query rows times 1 + h: some heads pass TAU, others do not
            for n in names:
                layer, heads = getattr(self, n), layers_of(names)[n]
                weight = layer.qkv.weight[:QKV_GROUPS[0]] if n == "fused" else layer.q.weight
                weight.view(heads.num_heads, -1, WIDTH).mul_(
                    1.0 + torch.arange(heads.num_heads, dtype=torch.float32).view(-1, 1, 1))

    def attention(self) -> list[_Attention]:
        return [getattr(self, n) for n in self.names]

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.attention():
            x = x + layer(x)
        return self.head(x)


def batch(step: int, rank: int, world: int, per_rank: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(3000 + step)
    tokens = torch.randint(0, VOCAB, (world * per_rank, SEQ + 1), generator=g)
    return tokens[rank * per_rank:(rank + 1) * per_rank]


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def extra_reports(step: int, rank: int, names: tuple[str, ...]) -> list[tuple[str, torch.Tensor, int]]:
    """Reports beside the model's own, ``(layer, maxima, first_head)``, differing per rank: a spike
    only rank ``step % world``-ish sees on one ``gqa`` head; on rank 0 at step 0 a spike on ``fused``
    head 1 followed by NaN, +inf and a negative value (left out: the spike stands, nothing is
    zeroed); at the skipped step a large spike on ``mla`` head 1 (dropped with the step)."""
    out = []
    if "gqa" in names and rank == step % 3:
        out.append(("gqa", torch.tensor([3.0 * TAU + rank]), (step + rank) % GQA["num_heads"]))
    if "fused" in names and (step, rank) == (0, 0):
        out.append(("fused", torch.tensor([4.0 * TAU]), 1))
        out.append(("fused", torch.tensor([float("nan"), float("inf"), -5.0]), 1))
    if "mla" in names and step == SKIPPED and rank == 0:
        out.append(("mla", torch.tensor([50.0 * TAU]), 1))
    return out


# ------------------------------------------------------------------------------ the reference
def clip_written_out(model: QKNet, maxima: dict[str, torch.Tensor], tau: float = TAU, alpha: float = ALPHA) -> None:
    """The formula, per layer: per key head ``g``, ``gamma = tau / S_g`` if ``S_g > tau`` else 1, with
    ``S_g`` the maximum over its query heads; its query heads' rows times ``gamma ** alpha`` (MLA's rope
    rows ``gamma``), its key rows ``gamma ** (1 - alpha)``; values and the shared rope key untouched."""
    with torch.no_grad():
        for name, per_head in maxima.items():
            heads = layers_of(model.names)[name]
            per_group = per_head.view(heads.kv_heads, -1).amax(1)
            gamma = [tau / s if s > tau else 1.0 for s in per_group.tolist()]
            group = heads.num_heads // heads.kv_heads
            layer = getattr(model, name)
            if name == "gqa":
                q = layer.q.weight.view(heads.num_heads, heads.head_dim, WIDTH)
                k = layer.k.weight.view(heads.kv_heads, heads.head_dim, WIDTH)
                for h in range(heads.num_heads):
                    q[h] *= gamma[h // group] ** alpha
                for g in range(heads.kv_heads):
                    k[g] *= gamma[g] ** (1 - alpha)
            elif name == "fused":
                w = layer.qkv.weight
                q, k = w[:8].view(4, 2, WIDTH), w[8:16].view(4, 2, WIDTH)
                for h in range(4):
                    q[h] *= gamma[h] ** alpha
                    k[h] *= gamma[h] ** (1 - alpha)
            else:
                q = layer.q.weight.view(3, 4, WIDTH)
                kv = layer.kv_up.weight.view(3, 5, WIDTH)
                for h in range(3):
                    q[h, :2] *= gamma[h] ** alpha
                    q[h, 2:] *= gamma[h]
                    kv[h, :2] *= gamma[h] ** (1 - alpha)


def _normuon_step(weight: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, v: torch.Tensor) -> None:
    """NorMuon's rule written out (fp32 NS), in place."""
    m, n = weight.shape
    buf.lerp_(grad, 1 - MUON["momentum"])
    d = grad.lerp(buf, MUON["momentum"])
    o = fp32_newton_schulz(d, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    v.lerp_(o.square().mean(dim=-1, keepdim=True), 1 - BETA2)
    o2 = o / (v.sqrt() + 1e-10)
    o2 *= o.norm() / (o2.norm() + 1e-10)
    weight.mul_(1 - MUON["lr"] * MUON["weight_decay"])
    weight.add_(o2, alpha=-MUON["lr"] * math.sqrt(max(1, m / n)))


def _dion2_step(weight: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor) -> None:
    """Dion2's rule written out (fp32 NS, ``support.cases.DION2_KW``, lr sqrt(m/n)), in place."""
    from support.cases import DION2_KW

    m, n = weight.shape
    buf.add_(grad)
    rows = torch.topk(buf.abs().sum(dim=-1), max(1, math.ceil(DION2_KW["fraction"] * m))).indices.sort().values
    o = fp32_newton_schulz(buf[rows], (3.4445, -4.7750, 2.0315), 5, 1e-7)
    buf[rows] *= DION2_KW["ef_decay"]
    weight.mul_(1 - MUON["lr"] * MUON["weight_decay"])
    weight[rows] -= MUON["lr"] * math.sqrt(m / n) * o


def reference(world: int, names: tuple[str, ...] = ("gqa", "fused", "mla"), steps: int = STEPS,
              skipped: tuple[int, ...] = (), rule: str = "muon", clip: bool = True, tau: float = TAU,
              alpha: float = ALPHA, global_maxima: bool = True,
              ) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """One process on every rank's batch: the rule on the matrices, AdamW on the rest, then the clip
    with each head's maximum over every rank's reports (``global_maxima=False``: rank 0's only, the
    ranks-diverging mistake). ``skipped`` steps change nothing and their reports are dropped.
    Returns the final parameters and each applied step's per-head maxima by layer."""
    torch.manual_seed(0)
    model = QKNet(names)
    named = dict(model.named_parameters())
    matrices = [n for n, p in named.items() if p.ndim == 2 and n not in ("embed.weight", "head.weight")]
    # The fused QKV's row groups as parameters sharing its storage: torch.optim.Muon steps each alone.
    parts = {}
    for n in matrices:
        if n == "fused.qkv.weight":
            starts = [0, 8, 16]
            parts[n] = [(nn.Parameter(named[n].data[s:s + 8]), s) for s in starts]
        else:
            parts[n] = [(named[n], None)]
    muon_params = [p for n in matrices for p, _ in parts[n]]
    muon = torch.optim.Muon(muon_params, **MUON, ns_steps=5)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in matrices], **ADAMW)
    buffers = {id(p): (torch.zeros_like(p), torch.zeros(p.shape[0], 1)) for p in muon_params}
    seen: list[dict[str, torch.Tensor]] = []
    for step in range(steps):
        reports: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]

        def recorder(rank):
            def report(key, values, first=0):
                values = values.detach().float()
                values = torch.where(torch.isfinite(values), values, 0.0).clamp_min(0.0)
                got = reports[rank].setdefault(key, torch.zeros(layers_of(names)[key].num_heads))
                got[first:first + values.numel()] = torch.maximum(got[first:first + values.numel()], values)
            return report

        # Each rank's own tokens, so that its maxima are its own (the loss is the global batch's).
        for rank in range(world):
            for layer in model.attention():
                layer.report = recorder(rank)
            with torch.no_grad():
                model(batch(step, rank, world)[:, :-1])
            for key, values, first in extra_reports(step, rank, names):
                recorder(rank)(key, values, first)
        for layer in model.attention():
            layer.report = None
        loss_of(model, torch.cat([batch(step, r, world) for r in range(world)])).backward()
        if step in skipped:
            model.zero_grad(set_to_none=True)
            continue
        with torch.no_grad():
            for n in matrices:
                for p, start in parts[n]:
                    if start is not None:
                        p.grad = named[n].grad[start:start + 8].clone()
        if rule == "muon":
            with ns_precision(torch.float32):
                muon.step()
        elif rule == "dion2":
            with torch.no_grad():
                for p in muon_params:
                    _dion2_step(p.data, p.grad, buffers[id(p)][0])
        else:
            with torch.no_grad():
                for p in muon_params:
                    _normuon_step(p.data, p.grad, *buffers[id(p)])
        adamw.step()
        maxima = {key: torch.stack([reports[r].get(key, torch.zeros(layers_of(names)[key].num_heads))
                                    for r in (range(world) if global_maxima else [0])]).amax(0)
                  for key in names}
        seen.append(maxima)
        if clip:
            clip_written_out(model, maxima, tau, alpha)
        model.zero_grad(set_to_none=True)
        muon.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, seen


# ------------------------------------------------------------------------------------ the runs
def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


class CountCollectives:
    """Counts every ``torch.distributed`` collective issued inside the ``with`` block, by name (FSDP2's
    and dmuon's alike)."""

    NAMES = ("all_reduce", "all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor",
             "reduce_scatter", "reduce_scatter_tensor", "broadcast", "send", "recv", "isend", "irecv", "barrier",
             "all_gather_object", "broadcast_object_list", "gather", "scatter", "reduce")

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._saved: dict[str, object] = {}

    def __enter__(self) -> "CountCollectives":
        import torch.distributed as dist

        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original

            def counted(*args, _name=name, _original=original, **kwargs):
                self.counts[_name] = self.counts.get(_name, 0) + 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for name, original in self._saved.items():
            setattr(dist, name, original)


def build(world: int, *, names=("gqa", "fused", "mla"), mesh_shape=None, hsdp: str = "fsdp2", tp: bool = False,
          rule: str = "muon", clip: bool = True, ns_dtype=torch.float32, mixed_precision: bool = False,
          oracle: bool = False, **execution):
    """QKNet (seed 0) under FSDP2 (each attention layer, then the root; HSDP on ``mesh_shape``: FSDP2's
    native or dmuon's replicate level; ``tp``: a (dp, tp) = (2, 2) mesh, ``gqa``'s q, k, v colwise and
    its out rowwise; ``mixed_precision``: bf16 parameters, float32 reductions) with DMuon or NorMuon and
    QK-clip (``oracle``: gather-then-compute with its naive clip instead). Returns
    ``(model, optimizer, dp_rank, dp)``."""
    model_mesh = None
    dp_rank, dp = torch.distributed.get_rank(), world
    if tp:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp_mesh, dp_rank, dp = mesh["dp"], mesh.get_coordinate()[0], 2
    elif mesh_shape is not None:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
        dp_mesh = mesh["shard"] if hsdp == "dmuon" else mesh
        model_mesh = mesh if hsdp == "dmuon" else None
    else:
        dp_mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = QKNet(names)
    if tp:
        tp_rank = mesh.get_coordinate()[1]
        layer = model.gqa
        parallelize_module(layer, mesh["tp"], {"q": ColwiseParallel(), "k": ColwiseParallel(),
                                               "v": ColwiseParallel(), "out": RowwiseParallel()})
        layer.heads, layer.kv_heads = GQA["num_heads"] // 2, GQA["num_kv_heads"] // 2
        layer.first_head = tp_rank * layer.heads
    mp = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) \
        if mixed_precision else {}
    for layer in model.attention():
        fully_shard(layer, mesh=dp_mesh, **mp)
    fully_shard(model, mesh=dp_mesh, **mp)
    views = {"fused.qkv.weight": "rows:8,8,8"} if "fused" in names else None
    if oracle:
        assert rule == "muon" and model_mesh is None and not execution, "the oracle runs Muon on FSDP2's meshes"
        opt = GatherThenCompute(model, lr=MUON["lr"], weight_decay=MUON["weight_decay"], adamw_lr=ADAMW["lr"],
                                      adamw_weight_decay=ADAMW["weight_decay"], ns_method="standard",
                                      ns_dtype=ns_dtype, matrix_view=views,
                                      qk_clip=dmuon.QKClip(layers_of(names), tau=TAU, alpha=ALPHA) if clip else None)
        return model, opt, dp_rank, dp
    plan = dmuon.prepare(model, matrix_view=views, ns=dmuon.NSConfig(method="standard", dtype=ns_dtype),
                         hsdp_mesh=model_mesh)
    settings = dict(lr=MUON["lr"], weight_decay=MUON["weight_decay"], adamw=ADAMW,
                    execution=dmuon.ExecutionConfig(**execution))
    if clip:
        settings["qk_clip"] = dmuon.QKClip(layers_of(names), tau=TAU, alpha=ALPHA)
    opt = dmuon.DMuon(model, plan, **settings) if rule == "muon" else dmuon.NorMuon(model, plan, beta2=BETA2,
                                                                                    **settings)
    return model, opt, dp_rank, dp


def train(world: int, *, steps: int = STEPS, skip: bool = False, micro_batches: int = 1, count: bool = False,
          **kw) -> dict:
    """:func:`build`, then ``steps`` steps, the model's and :func:`extra_reports`' reports going to the
    optimizer (``skip``: an infinite loss on rank 0 at :data:`SKIPPED`; ``micro_batches``: FSDP2's
    accumulation without sync, one sample each). Returns the full parameters, per step this rank's
    maxima per key head before the step and the agreed ones after it, and with ``count`` the
    collectives each step (backward and ``step()``) issued."""
    model, opt, dp_rank, dp = build(world, **kw)
    rank = torch.distributed.get_rank()
    names = model.names
    clip = opt.qk_clip is not None
    for layer in model.attention():
        layer.report = opt.report_attention_logits if clip else None
    local, agreed, counts, skipped = [], [], [], []
    for step in range(steps):
        tokens = batch(step, dp_rank, dp, per_rank=2)
        with CountCollectives() as counter:
            for m in range(micro_batches):
                model.set_requires_gradient_sync(m == micro_batches - 1)
                part = tokens[m * 2 // micro_batches:(m + 1) * 2 // micro_batches]
                loss = loss_of(model, part) / micro_batches
                if skip and step == SKIPPED and rank == 0:
                    loss = loss * float("inf")
                loss.backward()
            if clip:
                for key, values, first in extra_reports(step, dp_rank, names):
                    opt.report_attention_logits(key, values, first)
                local.append(opt._qk.step_maxima().clone())
            opt.step()
        opt.zero_grad()
        counts.append(dict(counter.counts))
        skipped.append(opt.last_step_stats().get("skipped_nonfinite", False))
        agreed.append(opt.last_attention_logits())
    if hasattr(opt, "flush_updates"):
        opt.flush_updates()  # apply_updates="next_forward": the last step's updates (and their clip)
    out = {"params": {n: full(p) for n, p in model.named_parameters()}, "local": local, "agreed": agreed,
           "skipped": skipped}
    if count:
        out["counts"] = counts
    return out
