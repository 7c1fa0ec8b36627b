"""QK-clip (MuonClip, Kimi K2; Megatron-LM's ``qk_clip``): after the update, each attention head's
query and key rows are scaled down so that its largest pre-softmax logit would not exceed ``tau``.

Per key/value group ``g`` of a layer (a head of its own without GQA), with ``S_g`` the largest
pre-softmax logit of any of the group's query heads over every rank's tokens in the step::

    gamma_g = tau / S_g  if S_g > tau  else 1
    W_q[rows of each query head of g] *= gamma_g ** alpha
    W_k[rows of key head g]           *= gamma_g ** (1 - alpha)

so the head's logits ``q . k`` scale by ``gamma_g`` (Megatron-LM's ``SelfAttention.clip_qk``: the
maximum over the group's query heads, every query head of the group scaled by the group's factor).
MLA (Megatron-LM's ``MLASelfAttention.clip_qk``, Kimi K2's ``q_C``, ``k_C``, ``q_R``): per head,
the query's rope rows scale by ``gamma`` itself (the rope key they meet is shared by every head,
so it is not scaled), the key projection's value rows not at all. Momentum is untouched.

This module is the rule alone: the configuration and, for one layer, which rows scale by which
factor. :mod:`dmuon.optim.qk_clip` binds it to the optimizer's shards and the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch


@dataclass(frozen=True)
class AttentionHeads:
    """Where one attention layer's query and key rows are, by head.

    Query head ``h`` (of ``num_heads``) owns rows ``query_row + h * (head_dim + rope_dim)`` onwards
    of ``query``: ``head_dim`` rows, then (MLA) ``rope_dim`` rope rows. Key head ``g`` (of
    ``num_kv_heads``) owns rows ``key_row + g * (head_dim + value_dim)`` onwards of ``key``:
    ``head_dim`` rows, then (MLA's ``linear_kv_up_proj``) ``value_dim`` value rows, which are not
    scaled. Query head ``h`` belongs to key head ``h // (num_heads // num_kv_heads)`` (GQA).
    A fused QKV is ``query`` and ``key`` the same parameter with ``key_row`` after the query rows
    (its rows may be viewed as row groups, ``matrix_view="rows:q,k,v"``: the clip scales rows,
    whichever matrix NS ran them in).
    """

    query: str | torch.Tensor
    """The parameter holding the query rows: its name in the model (wrappers' parts such as
    ``_checkpoint_wrapped_module`` left out, as in state dicts), or the parameter itself."""
    key: str | torch.Tensor
    """The parameter holding the key rows (the same as ``query`` for a fused QKV)."""
    num_heads: int
    """Query heads of the layer (all of them, not one tensor-parallel rank's)."""
    head_dim: int
    """Rows of each query and key head (MLA: ``qk_head_dim``, the part without rope)."""
    num_kv_heads: int | None = None
    """Key heads (GQA groups); None: ``num_heads``. Must divide ``num_heads``."""
    query_row: int = 0
    """First row of query head 0 in ``query`` (0 for a separate query projection or a fused QKV)."""
    key_row: int = 0
    """First row of key head 0 in ``key`` (a fused QKV: ``num_heads * head_dim``)."""
    rope_dim: int = 0
    """MLA: rope rows after each query head's ``head_dim`` rows, scaled by ``gamma`` (the shared rope
    key is not scaled, and is not registered here)."""
    value_dim: int = 0
    """MLA: value rows after each key head's ``head_dim`` rows in ``key`` (``linear_kv_up_proj``),
    not scaled."""

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim"):
            _check_int(name, getattr(self, name), 1)
        for name in ("query_row", "key_row", "rope_dim", "value_dim"):
            _check_int(name, getattr(self, name), 0)
        if self.num_kv_heads is not None:
            _check_int("num_kv_heads", self.num_kv_heads, 1)
            if self.num_heads % self.num_kv_heads:
                raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} "
                                 "(each key head serves the same number of query heads)")
        if (self.rope_dim or self.value_dim) and self.kv_heads != self.num_heads:
            raise ValueError("rope_dim and value_dim describe MLA, whose key projection has one key head per "
                             f"query head: num_kv_heads must be num_heads ({self.num_heads}), got {self.num_kv_heads}")
        for name in ("query", "key"):
            if not isinstance(getattr(self, name), (str, torch.Tensor)):
                raise ValueError(f"{name} must be a parameter's name or the parameter, got "
                                 f"{type(getattr(self, name)).__name__}")

    @property
    def kv_heads(self) -> int:
        """Key heads: the clip's factors, one per group of query heads."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def query_rows(self) -> tuple[int, int]:
        """The ``[start, stop)`` rows of ``query`` the query heads span."""
        return self.query_row, self.query_row + self.num_heads * (self.head_dim + self.rope_dim)

    @property
    def key_rows(self) -> tuple[int, int]:
        """The ``[start, stop)`` rows of ``key`` the key heads span (value rows included, for MLA)."""
        return self.key_row, self.key_row + self.kv_heads * (self.head_dim + self.value_dim)

    def scaled_rows(self, alpha: float) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """For ``"query"`` and ``"key"``: the rows that scale, each one's key head (the factor it
        takes) and the power of that factor, as ``(rows, kv_head, exponent)`` (int64, int64, float32)."""
        group = self.num_heads // self.kv_heads
        q_span = self.head_dim + self.rope_dim
        q_rows, q_heads, q_powers = [], [], []
        for h in range(self.num_heads):
            start = self.query_row + h * q_span
            q_rows.append(torch.arange(start, start + q_span))
            q_heads.append(torch.full((q_span,), h // group))
            q_powers.append(torch.tensor([alpha] * self.head_dim + [1.0] * self.rope_dim))
        k_span = self.head_dim + self.value_dim
        k_rows = [torch.arange(self.key_row + g * k_span, self.key_row + g * k_span + self.head_dim)
                  for g in range(self.kv_heads)]
        k_heads = [torch.full((self.head_dim,), g) for g in range(self.kv_heads)]
        return {
            "query": (torch.cat(q_rows), torch.cat(q_heads), torch.cat(q_powers).float()),
            "key": (torch.cat(k_rows), torch.cat(k_heads), torch.full((self.kv_heads * self.head_dim,), 1.0 - alpha)),
        }


@dataclass(frozen=True)
class QKClip:
    """QK-clip for :class:`~dmuon.DMuon` and :class:`~dmuon.NorMuon` (``qk_clip=``).

    The model reports each step's per-head logit maxima with
    :meth:`DMuon.report_attention_logits <dmuon.DMuon.report_attention_logits>`; after the
    step's update every rank scales its rows of the layers' query and key projections (see
    the module docstring for the formula).
    """

    layers: Mapping[str, AttentionHeads]
    """The clipped attention layers by a key of yours (the one the model reports under), each
    with where its query and key rows are."""
    tau: float = 100.0
    """The largest pre-softmax logit a head may keep (> 0): heads whose maximum exceeds it are
    scaled back to it."""
    alpha: float = 0.5
    """The share of the scaling the query rows take, in ``[0, 1]``: ``gamma ** alpha`` on the
    query rows, ``gamma ** (1 - alpha)`` on the key rows."""

    def __post_init__(self) -> None:
        if isinstance(self.tau, bool) or not isinstance(self.tau, (int, float)) or not (
                math.isfinite(self.tau) and self.tau > 0):
            raise ValueError(f"qk_clip tau must be a finite number > 0, got {self.tau!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"qk_clip alpha must be a number in [0, 1], got {self.alpha!r}")
        if not isinstance(self.layers, Mapping) or not self.layers:
            raise ValueError("qk_clip layers must be a non-empty dict: {layer key: dmuon.AttentionHeads(...)}")
        for key, heads in self.layers.items():
            if not isinstance(key, str):
                raise ValueError(f"qk_clip layer keys must be strings, got {key!r}")
            if not isinstance(heads, AttentionHeads):
                raise ValueError(f"qk_clip layer {key!r}: expected a dmuon.AttentionHeads, got {type(heads).__name__}")
        object.__setattr__(self, "layers", dict(self.layers))

    @property
    def order(self) -> tuple[str, ...]:
        """The layer keys in the order their maxima travel: sorted, so the same on every rank
        whatever order the dict was built in."""
        return tuple(sorted(self.layers))


def clip_factors(maxima: torch.Tensor, tau: float) -> torch.Tensor:
    """``gamma = tau / S`` where ``S > tau``, else 1 (also for ``S <= 0``: no division by it, no NaN)."""
    maxima = maxima.to(torch.float32)
    clipped = maxima > tau  # False for NaN too
    return torch.where(clipped, tau / torch.where(clipped, maxima, 1.0), 1.0)


def row_factors(gamma: torch.Tensor, kv_head: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """Each row's factor ``gamma[kv_head] ** exponent``; rows with ``kv_head == -1`` keep 1."""
    padded = torch.cat([gamma.to(torch.float32), gamma.new_ones(1, dtype=torch.float32)])
    return padded[kv_head] ** exponent


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
