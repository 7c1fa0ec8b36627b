"""Benchmark workloads built from real model definitions, randomly initialised.

Two model families are provided, each in size presets (``"tiny"``,
``"small"``, ``"medium"``, ``"large"``, and for ``qwen2`` also ``"mini"``, the
default of ``dmuon bench``):

* ``"qwen2"``: a scaled-down Qwen2.5-style causal decoder built with
  ``transformers``' :class:`~transformers.Qwen2Config` /
  :class:`~transformers.Qwen2ForCausalLM`, i.e. the real module structure:
  grouped-query attention with biased q/k/v projections and an unbiased o
  projection, a SwiGLU gate/up/down MLP, RMSNorm and an ``lm_head``.  The input
  embedding and ``lm_head`` are **untied**, as in Qwen2.5-7B (the small
  Qwen2.5 checkpoints tie them); keeping them as two separate parameters avoids
  shared parameters across FSDP2 parameter groups and matches the full-size
  ``"qwen2.5-7b"`` shape list in :mod:`dmuon.bench.shapes`.
* ``"vla"``: a vision-language-action model in plain PyTorch, in the spirit of
  Pi0 / Wall-OSS: a ViT vision encoder (patch-embedding convolution plus
  SigLIP-like pre-LayerNorm blocks of width ``dv``), a linear projector into a
  Gemma/Qwen-like language decoder (RMSNorm, grouped-query attention with
  rotary embeddings, SwiGLU MLP, width ``dl``) run with a prefix-LM mask, and
  an action expert of a different width ``da`` trained with flow matching.
  Each expert block projects the decoder's final hidden states from ``dl`` to
  ``da`` and its action tokens attend jointly to that projected context and to
  themselves (Pi0's "prefix + suffix" attention).  The loss is the language
  modelling cross-entropy on the text tokens plus the flow-matching MSE on the
  action velocities.

``"tiny"`` is an alias of the tiny ``"qwen2"`` workload, for tests.

All weights are ordinary :class:`torch.nn.Linear`, :class:`torch.nn.Embedding`
and :class:`torch.nn.Conv2d` parameters, so the workloads can be wrapped with
FSDP2's ``fully_shard`` block by block and optimised with
:class:`torch.optim.Muon`.  Nothing is downloaded: all models are built from
configuration objects and initialised from a seeded generator, so building the
same workload with the same ``seed`` on every rank gives identical weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DEFAULT_SIZES",
    "QWEN2_SIZES",
    "VLA_SIZES",
    "WORKLOAD_NAMES",
    "Qwen2Size",
    "VLAModel",
    "VLASize",
    "Workload",
    "build_workload",
    "resolve_size",
]

Batch = dict[str, torch.Tensor]
"""A batch is a dict of tensors whose first dimension is the sample index."""

WORKLOAD_NAMES: tuple[str, ...] = ("qwen2", "vla", "tiny")
"""Names accepted by :func:`build_workload`."""

SIZE_NAMES: tuple[str, ...] = ("tiny", "mini", "small", "medium", "large")
"""Size presets accepted by :func:`build_workload` (``"mini"``: ``qwen2`` only)."""

DEFAULT_SIZES: dict[str, str] = {"qwen2": "mini", "vla": "small", "tiny": "tiny"}
"""The size each family is built with when none is given."""


@dataclass
class Workload:
    """A model together with its sharding units, loss and synthetic data.

    Batches are dicts of tensors whose first dimension indexes samples; every
    rank gets the same number of samples, so the mean loss over
    ``global_batch(step, world_size)`` equals the average of the per-rank mean
    losses.
    """

    name: str
    """Workload family: ``"qwen2"``, ``"vla"`` or ``"tiny"``."""

    model: nn.Module
    """The randomly initialised model (on the CPU, or the ambient default device)."""

    blocks: list[nn.Module]
    """Modules to ``fully_shard`` one by one, in forward order (transformer
    layers); the caller shards the root ``model`` last."""

    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    """``loss_fn(model, batch)`` returns the scalar mean loss of ``batch``."""

    make_batch: Callable[[int, int], Any]
    """``make_batch(step, rank)`` returns this rank's batch for ``step``:
    deterministic, and different for different ranks and steps."""

    global_batch: Callable[[int, int], Any]
    """``global_batch(step, world_size)`` returns the concatenation of
    ``make_batch(step, r)`` for ``r in range(world_size)`` (along the sample
    dimension), for a single-process reference run."""

    tokens_per_rank: int
    """Token positions one rank processes per step (for throughput numbers):
    ``batch_size * seq_len`` for ``qwen2``; ``batch_size * (image tokens +
    text tokens + state token + action tokens)`` for ``vla``."""

    size: str = ""
    """Size preset the workload was built with."""

    config: Any = None
    """The resolved size preset (a :class:`Qwen2Size` or :class:`VLASize`,
    after ``seq_len`` / ``batch_size`` overrides)."""

    muon_param_names: tuple[str, ...] | None = None
    """Suggested names (as in ``model.named_parameters()``) of the parameters
    for Muon: the 2-D weights of hidden ``nn.Linear`` layers.  Embeddings, the
    LM head, the action input/output and state projections, convolutions,
    biases and norm weights are left for an element-wise optimiser.  ``None``
    when not specified."""


# --------------------------------------------------------------------------
# Size presets
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Qwen2Size:
    """Dimensions of a Qwen2-style benchmark decoder."""

    hidden: int
    """Model width (``hidden_size``)."""

    intermediate: int
    """MLP width (``intermediate_size``)."""

    layers: int
    """Number of decoder layers."""

    heads: int
    """Number of query heads."""

    kv_heads: int
    """Number of key/value heads (grouped-query attention)."""

    vocab: int
    """Vocabulary size."""

    seq_len: int
    """Tokens per sample."""

    batch_size: int
    """Samples per rank per step."""


QWEN2_SIZES: dict[str, Qwen2Size] = {
    # Seconds for a couple of steps on 4 CPU processes.
    "tiny": Qwen2Size(hidden=64, intermediate=192, layers=2, heads=8, kv_heads=2,
                      vocab=256, seq_len=32, batch_size=2),
    # The default of `dmuon bench`: the workload the core-runtime issue specifies, a
    # small decoder with LLM-like proportions (vocabulary 64x the width, Qwen2.5-7B has
    # 42x, -0.5B 170x) and a few hundred tokens per rank, on which FSDP2 +
    # torch.optim.Muon's optimizer step costs about 4x the forward+backward on 4 gloo CPU
    # ranks (4.5-5.2x measured on the 2-core development machine).
    "mini": Qwen2Size(hidden=128, intermediate=384, layers=4, heads=4, kv_heads=2,
                      vocab=8192, seq_len=256, batch_size=2),
    # Twice as wide with a 4x smaller vocabulary and half the tokens: an optimizer-heavy
    # workload, FSDP2 + torch.optim.Muon's optimizer ~19x its forward+backward on the
    # same machine; the default `dmuon bench` took ~100 s on it.
    "small": Qwen2Size(hidden=256, intermediate=768, layers=4, heads=8, kv_heads=2,
                       vocab=2048, seq_len=128, batch_size=2),
    # Qwen2.5-0.5B geometry (untied).
    "medium": Qwen2Size(hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2,
                        vocab=151936, seq_len=1024, batch_size=4),
    # Qwen2.5-1.5B geometry (untied).
    "large": Qwen2Size(hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2,
                       vocab=151936, seq_len=2048, batch_size=4),
}
"""Size presets of the ``qwen2`` workload."""


@dataclass(frozen=True)
class VLASize:
    """Dimensions of the VLA benchmark model."""

    image_size: int
    """Input image side in pixels (square RGB images)."""

    patch: int
    """Patch side in pixels; ``image_size`` must be a multiple of it."""

    dv: int
    """Vision encoder width."""

    vision_layers: int
    """Number of ViT blocks."""

    vision_heads: int
    """Attention heads of the ViT blocks (``dv`` must be divisible by it)."""

    vision_mlp: int
    """MLP width of the ViT blocks."""

    dl: int
    """Language decoder width."""

    lm_layers: int
    """Number of decoder blocks."""

    lm_heads: int
    """Query heads of the decoder."""

    lm_kv_heads: int
    """Key/value heads of the decoder."""

    lm_head_dim: int
    """Head dimension of the decoder (even, for rotary embeddings)."""

    lm_mlp: int
    """MLP width of the decoder."""

    vocab: int
    """Vocabulary size."""

    text_len: int
    """Text tokens per sample."""

    da: int
    """Action expert width."""

    expert_layers: int
    """Number of action-expert blocks."""

    expert_heads: int
    """Query heads of the action expert."""

    expert_kv_heads: int
    """Key/value heads of the action expert."""

    expert_head_dim: int
    """Head dimension of the action expert (even, for rotary embeddings)."""

    expert_mlp: int
    """MLP width of the action expert."""

    action_horizon: int
    """Action tokens (time steps of the predicted action chunk) per sample."""

    action_dim: int
    """Dimension of one action vector."""

    state_dim: int
    """Dimension of the proprioceptive state vector."""

    batch_size: int
    """Samples per rank per step."""

    @property
    def image_tokens(self) -> int:
        """Number of image patches per sample."""
        return (self.image_size // self.patch) ** 2


VLA_SIZES: dict[str, VLASize] = {
    "tiny": VLASize(image_size=32, patch=8, dv=48, vision_layers=2, vision_heads=4,
                    vision_mlp=192, dl=64, lm_layers=2, lm_heads=8, lm_kv_heads=2,
                    lm_head_dim=8, lm_mlp=192, vocab=256, text_len=16, da=32,
                    expert_layers=2, expert_heads=4, expert_kv_heads=1,
                    expert_head_dim=8, expert_mlp=96, action_horizon=8,
                    action_dim=7, state_dim=8, batch_size=2),
    # About the optimizer cost of qwen2 "small" (4.1M matrix params in 60 matrices).
    "small": VLASize(image_size=64, patch=8, dv=128, vision_layers=2, vision_heads=4,
                     vision_mlp=512, dl=256, lm_layers=3, lm_heads=8, lm_kv_heads=2,
                     lm_head_dim=32, lm_mlp=768, vocab=2048, text_len=64, da=192,
                     expert_layers=3, expert_heads=4, expert_kv_heads=1,
                     expert_head_dim=48, expert_mlp=512, action_horizon=16,
                     action_dim=14, state_dim=14, batch_size=2),
    "medium": VLASize(image_size=224, patch=14, dv=768, vision_layers=12, vision_heads=12,
                      vision_mlp=3072, dl=1024, lm_layers=12, lm_heads=16, lm_kv_heads=4,
                      lm_head_dim=64, lm_mlp=4096, vocab=32000, text_len=64, da=512,
                      expert_layers=12, expert_heads=8, expert_kv_heads=2,
                      expert_head_dim=64, expert_mlp=2048, action_horizon=50,
                      action_dim=32, state_dim=32, batch_size=4),
    # Pi0 geometry: SigLIP So400m/14 + Gemma-2B + Gemma-300M action expert.
    "large": VLASize(image_size=224, patch=14, dv=1152, vision_layers=27, vision_heads=16,
                     vision_mlp=4304, dl=2048, lm_layers=18, lm_heads=8, lm_kv_heads=1,
                     lm_head_dim=256, lm_mlp=16384, vocab=257152, text_len=48, da=1024,
                     expert_layers=18, expert_heads=8, expert_kv_heads=1,
                     expert_head_dim=256, expert_mlp=4096, action_horizon=50,
                     action_dim=32, state_dim=32, batch_size=4),
}
"""Size presets of the ``vla`` workload."""


# --------------------------------------------------------------------------
# Deterministic synthetic data
# --------------------------------------------------------------------------

_QWEN2_DATA_SALT = 0x51_57_45_4E  # distinct streams for the two families
_VLA_DATA_SALT = 0x56_4C_41


def _generator(seed: int, salt: int, step: int, rank: int) -> torch.Generator:
    """Returns a CPU generator seeded from ``(seed, salt, step, rank)``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    state = np.random.SeedSequence([seed, salt, step, rank]).generate_state(2, np.uint32)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(state[0]) << 31 | int(state[1]) >> 1)
    return gen


def _concat_batches(batches: Sequence[Batch]) -> Batch:
    """Concatenates dict batches along the sample dimension."""
    return {key: torch.cat([b[key] for b in batches], dim=0) for key in batches[0]}


def _make_global_batch(make_batch: Callable[[int, int], Batch]) -> Callable[[int, int], Batch]:
    """Builds ``global_batch(step, world_size)`` from ``make_batch``."""

    def global_batch(step: int, world_size: int) -> Batch:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        return _concat_batches([make_batch(step, r) for r in range(world_size)])

    return global_batch


def _lm_cross_entropy(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits[:, :-1]`` against ``tokens[:, 1:]``."""
    vocab = logits.shape[-1]
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1)
    )


# --------------------------------------------------------------------------
# qwen2
# --------------------------------------------------------------------------


def _build_qwen2(size: Qwen2Size, dtype: torch.dtype) -> nn.Module:
    """Builds a randomly initialised ``Qwen2ForCausalLM`` (uses the global RNG)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    last_error: Exception | None = None
    for attn in ("sdpa", "eager"):
        config = Qwen2Config(
            vocab_size=size.vocab,
            hidden_size=size.hidden,
            intermediate_size=size.intermediate,
            num_hidden_layers=size.layers,
            num_attention_heads=size.heads,
            num_key_value_heads=size.kv_heads,
            max_position_embeddings=max(4096, size.seq_len),
            tie_word_embeddings=False,
            use_cache=False,
            attention_dropout=0.0,
        )
        config._attn_implementation = attn
        try:
            model = Qwen2ForCausalLM(config)
        except (ValueError, ImportError) as err:  # sdpa unavailable: fall back
            last_error = err
            continue
        return model.to(dtype=dtype)
    raise RuntimeError("could not build Qwen2ForCausalLM") from last_error


def _qwen2_workload(name: str, size_name: str, size: Qwen2Size, seed: int,
                    dtype: torch.dtype) -> Workload:
    model = _build_qwen2(size, dtype)
    model.train()
    blocks = list(model.model.layers)

    def make_batch(step: int, rank: int) -> Batch:
        gen = _generator(seed, _QWEN2_DATA_SALT, step, rank)
        ids = torch.randint(0, size.vocab, (size.batch_size, size.seq_len), generator=gen)
        return {"input_ids": ids}

    def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
        ids = batch["input_ids"]
        device = _module_device(model)
        if ids.device != device:
            ids = ids.to(device)
        logits = model(input_ids=ids, use_cache=False).logits
        return _lm_cross_entropy(logits, ids)

    muon = tuple(
        n for n, p in model.named_parameters()
        if p.ndim == 2 and n.startswith("model.layers.")
    )
    return Workload(
        name=name,
        model=model,
        blocks=blocks,
        loss_fn=loss_fn,
        make_batch=make_batch,
        global_batch=_make_global_batch(make_batch),
        tokens_per_rank=size.batch_size * size.seq_len,
        size=size_name,
        config=size,
        muon_param_names=muon,
    )


def _module_device(model: nn.Module) -> torch.device:
    """Device of the model's first parameter (CPU if it has none)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


# --------------------------------------------------------------------------
# vla
# --------------------------------------------------------------------------


def _rope(seq_len: int, head_dim: int, device: torch.device,
          dtype: torch.dtype, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary-embedding cos/sin tables of shape ``(seq_len, head_dim)``."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Applies rotary embeddings to ``x`` of shape ``(B, heads, S, head_dim)``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class _SwiGLU(nn.Module):
    """Gated MLP ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _GQAttention(nn.Module):
    """Grouped-query attention with separate q/k/v/o projections."""

    def __init__(self, width: int, heads: int, kv_heads: int, head_dim: int,
                 bias: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(width, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(width, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(width, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, width, bias=False)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, kv_input: torch.Tensor | None = None, *,
                q_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                k_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attends from ``x`` to ``kv_input`` (``x`` itself when ``None``).

        Args:
            x: Queries' input, ``(B, Sq, width)``.
            kv_input: Keys'/values' input, ``(B, Skv, width)``.
            q_rope: Rotary cos/sin tables applied to the queries.
            k_rope: Rotary cos/sin tables applied to the keys.
            mask: Boolean ``(Sq, Skv)`` mask, ``True`` where attention is allowed.

        Returns:
            ``(B, Sq, width)``.
        """
        kv_input = x if kv_input is None else kv_input
        q = self._split(self.q_proj(x), self.heads)
        k = self._split(self.k_proj(kv_input), self.kv_heads)
        v = self._split(self.v_proj(kv_input), self.kv_heads)
        if q_rope is not None:
            q = _apply_rope(q, *q_rope)
        if k_rope is not None:
            k = _apply_rope(k, *k_rope)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, _, s, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class _ViTBlock(nn.Module):
    """SigLIP-style pre-LayerNorm ViT block (biased projections, GELU MLP)."""

    def __init__(self, dv: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dv, eps=1e-6)
        self.attn = _GQAttention(dv, heads, heads, dv // heads, bias=True)
        self.norm2 = nn.LayerNorm(dv, eps=1e-6)
        self.fc1 = nn.Linear(dv, mlp)
        self.fc2 = nn.Linear(mlp, dv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class _DecoderBlock(nn.Module):
    """Pre-RMSNorm decoder block: rotary GQA self-attention plus SwiGLU MLP."""

    def __init__(self, dl: int, heads: int, kv_heads: int, head_dim: int, mlp: int) -> None:
        super().__init__()
        self.input_norm = nn.RMSNorm(dl, eps=1e-6)
        self.self_attn = _GQAttention(dl, heads, kv_heads, head_dim, bias=False)
        self.post_attn_norm = nn.RMSNorm(dl, eps=1e-6)
        self.mlp = _SwiGLU(dl, mlp)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_norm(x), q_rope=rope, k_rope=rope, mask=mask)
        return x + self.mlp(self.post_attn_norm(x))


class _ExpertBlock(nn.Module):
    """Action-expert block attending to projected decoder context and itself.

    The decoder's final hidden states (width ``dl``) are projected to the
    expert width ``da`` by ``context_proj``; the action tokens' queries then
    attend to the concatenation ``[context, action tokens]`` (rotary embeddings
    only on the action tokens, no mask), followed by a SwiGLU MLP.
    """

    def __init__(self, dl: int, da: int, heads: int, kv_heads: int, head_dim: int,
                 mlp: int) -> None:
        super().__init__()
        self.context_proj = nn.Linear(dl, da, bias=False)
        self.context_norm = nn.RMSNorm(da, eps=1e-6)
        self.input_norm = nn.RMSNorm(da, eps=1e-6)
        self.attn = _GQAttention(da, heads, kv_heads, head_dim, bias=False)
        self.post_attn_norm = nn.RMSNorm(da, eps=1e-6)
        self.mlp = _SwiGLU(da, mlp)

    def forward(self, x: torch.Tensor, context: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ctx = self.context_norm(self.context_proj(context))
        h = self.input_norm(x)
        kv = torch.cat([ctx, h], dim=1)
        cos, sin = rope
        n_ctx = ctx.shape[1]
        # Identity rotation on the context keys, rotary on the action keys.
        k_cos = torch.cat([torch.ones_like(cos[:1]).expand(n_ctx, -1), cos], dim=0)
        k_sin = torch.cat([torch.zeros_like(sin[:1]).expand(n_ctx, -1), sin], dim=0)
        x = x + self.attn(h, kv, q_rope=rope, k_rope=(k_cos, k_sin))
        return x + self.mlp(self.post_attn_norm(x))


def _sinusoidal(t: torch.Tensor, dim: int, min_period: float = 4e-3,
                max_period: float = 4.0) -> torch.Tensor:
    """Sinusoidal embedding of flow-matching times ``t`` (``(B,)``) into ``(B, dim)``."""
    frac = torch.linspace(0.0, 1.0, dim // 2, device=t.device, dtype=torch.float32)
    period = min_period * (max_period / min_period) ** frac
    angle = t.float()[:, None] * (2 * math.pi / period)[None, :]
    return torch.cat([angle.sin(), angle.cos()], dim=-1).to(t.dtype)


class VLAModel(nn.Module):
    """Pi0-like vision-language-action model (see the module docstring).

    Forward order: patch embedding, ``vision_blocks``, projector, ``lm_blocks``
    (prefix-LM mask: image tokens attend bidirectionally among themselves, text
    tokens causally), ``expert_blocks`` on ``[state token, action tokens]``.

    Args:
        cfg: Model dimensions.
    """

    def __init__(self, cfg: VLASize) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Conv2d(3, cfg.dv, kernel_size=cfg.patch, stride=cfg.patch)
        self.vision_pos = nn.Embedding(cfg.image_tokens, cfg.dv)
        self.vision_blocks = nn.ModuleList(
            _ViTBlock(cfg.dv, cfg.vision_heads, cfg.vision_mlp) for _ in range(cfg.vision_layers)
        )
        self.vision_norm = nn.LayerNorm(cfg.dv, eps=1e-6)
        self.projector = nn.Linear(cfg.dv, cfg.dl)
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.dl)
        self.lm_blocks = nn.ModuleList(
            _DecoderBlock(cfg.dl, cfg.lm_heads, cfg.lm_kv_heads, cfg.lm_head_dim, cfg.lm_mlp)
            for _ in range(cfg.lm_layers)
        )
        self.lm_norm = nn.RMSNorm(cfg.dl, eps=1e-6)
        self.lm_head = nn.Linear(cfg.dl, cfg.vocab, bias=False)
        self.state_proj = nn.Linear(cfg.state_dim, cfg.da)
        self.action_in_proj = nn.Linear(cfg.action_dim, cfg.da)
        self.action_time_mlp_in = nn.Linear(2 * cfg.da, cfg.da)
        self.action_time_mlp_out = nn.Linear(cfg.da, cfg.da)
        self.expert_blocks = nn.ModuleList(
            _ExpertBlock(cfg.dl, cfg.da, cfg.expert_heads, cfg.expert_kv_heads,
                         cfg.expert_head_dim, cfg.expert_mlp)
            for _ in range(cfg.expert_layers)
        )
        self.expert_norm = nn.RMSNorm(cfg.da, eps=1e-6)
        self.action_out_proj = nn.Linear(cfg.da, cfg.action_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialises weights: normal(0, 0.02) matrices, zero biases, unit norms."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    @property
    def blocks(self) -> list[nn.Module]:
        """All ViT, decoder and expert blocks, in forward order."""
        return [*self.vision_blocks, *self.lm_blocks, *self.expert_blocks]

    def forward(self, images: torch.Tensor, input_ids: torch.Tensor, state: torch.Tensor,
                noisy_actions: torch.Tensor, time: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs the model.

        Args:
            images: ``(B, 3, image_size, image_size)``.
            input_ids: ``(B, text_len)`` token ids.
            state: ``(B, state_dim)``.
            noisy_actions: ``(B, action_horizon, action_dim)``.
            time: ``(B,)`` flow-matching times in ``(0, 1]``.

        Returns:
            ``(text_logits, velocity)``: ``(B, text_len, vocab)`` next-token
            logits over the text positions and ``(B, action_horizon,
            action_dim)`` predicted flow velocities.
        """
        cfg = self.cfg
        # Vision encoder.
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = x + self.vision_pos.weight[None]
        for block in self.vision_blocks:
            x = block(x)
        img = self.projector(self.vision_norm(x))
        # Language decoder over [image tokens, text tokens].
        h = torch.cat([img, self.embed_tokens(input_ids)], dim=1)
        n_img, seq = img.shape[1], h.shape[1]
        pos = torch.arange(seq, device=h.device)
        mask = (pos[None, :] <= pos[:, None]) | (pos[None, :] < n_img)
        rope = _rope(seq, cfg.lm_head_dim, h.device, h.dtype)
        for block in self.lm_blocks:
            h = block(h, rope, mask)
        h = self.lm_norm(h)
        logits = self.lm_head(h[:, n_img:])
        # Action expert over [state token, action tokens].
        t_emb = _sinusoidal(time, cfg.da).to(noisy_actions.dtype)
        a = self.action_in_proj(noisy_actions)
        t_emb = t_emb[:, None, :].expand(-1, a.shape[1], -1)
        a = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat([a, t_emb], -1))))
        z = torch.cat([self.state_proj(state)[:, None, :], a], dim=1)
        expert_rope = _rope(z.shape[1], cfg.expert_head_dim, z.device, z.dtype)
        for block in self.expert_blocks:
            z = block(z, h, expert_rope)
        velocity = self.action_out_proj(self.expert_norm(z)[:, 1:])
        return logits, velocity


def _vla_workload(size_name: str, size: VLASize, seed: int, dtype: torch.dtype) -> Workload:
    model = VLAModel(size).to(dtype=dtype)
    model.train()

    def make_batch(step: int, rank: int) -> Batch:
        gen = _generator(seed, _VLA_DATA_SALT, step, rank)
        b = size.batch_size
        shape_a = (b, size.action_horizon, size.action_dim)
        return {
            # Sampled in float32 so the data does not depend on ``dtype``.
            "images": torch.randn(b, 3, size.image_size, size.image_size,
                                  generator=gen).to(dtype),
            "input_ids": torch.randint(0, size.vocab, (b, size.text_len), generator=gen),
            "state": torch.randn(b, size.state_dim, generator=gen).to(dtype),
            "actions": torch.randn(shape_a, generator=gen).to(dtype),
            "noise": torch.randn(shape_a, generator=gen).to(dtype),
            "time": (torch.rand(b, generator=gen) * 0.999 + 0.001).to(dtype),
        }

    def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
        device = _module_device(model)
        batch = {k: v.to(device) for k, v in batch.items()}
        t = batch["time"][:, None, None]
        noisy = t * batch["noise"] + (1 - t) * batch["actions"]
        target = batch["noise"] - batch["actions"]
        logits, velocity = model(batch["images"], batch["input_ids"], batch["state"],
                                 noisy, batch["time"])
        ce = _lm_cross_entropy(logits, batch["input_ids"])
        mse = F.mse_loss(velocity.float(), target.float())
        return ce + mse

    non_muon = ("lm_head.", "state_proj.", "action_in_proj.", "action_out_proj.")
    muon = tuple(
        n for n, p in model.named_parameters()
        if p.ndim == 2 and n.endswith(".weight") and not n.startswith(non_muon)
        and isinstance(model.get_submodule(n.rsplit(".", 1)[0]), nn.Linear)
    )
    tokens = size.image_tokens + size.text_len + 1 + size.action_horizon
    return Workload(
        name="vla",
        model=model,
        blocks=model.blocks,
        loss_fn=loss_fn,
        make_batch=make_batch,
        global_batch=_make_global_batch(make_batch),
        tokens_per_rank=size.batch_size * tokens,
        size=size_name,
        config=size,
        muon_param_names=muon,
    )


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------


def _check_vla_size(size: VLASize) -> None:
    """Raises ``ValueError`` for inconsistent VLA dimensions."""
    if size.image_size % size.patch:
        raise ValueError(f"image_size {size.image_size} is not a multiple of patch {size.patch}")
    if size.dv % size.vision_heads:
        raise ValueError(f"dv {size.dv} is not divisible by vision_heads {size.vision_heads}")
    for name, heads, kv, hd in (("lm", size.lm_heads, size.lm_kv_heads, size.lm_head_dim),
                                ("expert", size.expert_heads, size.expert_kv_heads,
                                 size.expert_head_dim)):
        if heads % kv:
            raise ValueError(f"{name}_heads {heads} is not divisible by {name}_kv_heads {kv}")
        if hd % 2:
            raise ValueError(f"{name}_head_dim must be even, got {hd}")


def resolve_size(name: str, size: str | None) -> str:
    """The size preset :func:`build_workload` uses for ``name`` and ``size``.

    ``"tiny"`` is always built tiny; ``None`` means the family's
    :data:`DEFAULT_SIZES` entry.

    Raises:
        ValueError: For an unknown workload, or a size the family has no preset for.
    """
    if name not in WORKLOAD_NAMES:
        raise ValueError(f"name must be one of {WORKLOAD_NAMES}, got {name!r}")
    if name == "tiny":
        return "tiny"
    if size is None:
        return DEFAULT_SIZES[name]
    presets = VLA_SIZES if name == "vla" else QWEN2_SIZES
    if size not in presets:
        raise ValueError(f"size must be one of {tuple(presets)} for {name!r}, got {size!r}")
    return size


def build_workload(name: str, *, size: str | None = None, seq_len: int | None = None,
                   batch_size: int | None = None, seed: int = 0,
                   dtype: torch.dtype = torch.float32) -> Workload:
    """Builds a benchmark workload with randomly initialised weights.

    The model is built under a forked CPU RNG seeded with ``seed``, so the
    global CPU RNG state is left untouched and every rank building the same workload with
    the same ``seed`` gets bit-identical weights.  Parameters are created on
    the ambient default device (use ``with torch.device("meta"):`` to get
    shapes without allocating).

    Args:
        name: ``"qwen2"``, ``"vla"`` or ``"tiny"`` (the tiny ``qwen2``; ``size``
            is then ignored).
        size: ``"tiny"``, ``"small"``, ``"medium"`` or ``"large"`` (and
            ``"mini"`` for ``qwen2``); see :data:`QWEN2_SIZES` and
            :data:`VLA_SIZES`. ``None``: the family's :data:`DEFAULT_SIZES`.
        seq_len: Overrides the preset's tokens per sample (``qwen2``) or text
            tokens per sample (``vla``).
        batch_size: Overrides the preset's samples per rank per step.
        seed: Non-negative seed for the weights and the synthetic data.
        dtype: Floating-point dtype of the parameters and float inputs.

    Returns:
        The :class:`Workload`.

    Raises:
        ValueError: If an argument is invalid.
    """
    size = resolve_size(name, size)
    for arg, value, low in (("seq_len", seq_len, 2), ("batch_size", batch_size, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < low):
            raise ValueError(f"{arg} must be an int >= {low} or None, got {value!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")

    overrides: dict[str, int] = {}
    if batch_size is not None:
        overrides["batch_size"] = batch_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "vla":
            if seq_len is not None:
                overrides["text_len"] = seq_len
            cfg = _replace(VLA_SIZES[size], overrides)
            _check_vla_size(cfg)
            return _vla_workload(size, cfg, seed, dtype)
        if seq_len is not None:
            overrides["seq_len"] = seq_len
        cfg = _replace(QWEN2_SIZES[size], overrides)
        return _qwen2_workload(name, size, cfg, seed, dtype)


def _replace(preset: Any, overrides: dict[str, int]) -> Any:
    """``dataclasses.replace`` that keeps the preset when there is nothing to change."""
    return replace(preset, **overrides) if overrides else preset
