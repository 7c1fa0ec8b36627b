"""Weight-free matrix shape lists of full-size models, for ``dmuon plan``.

A shape list says which weight matrices a model has (PyTorch ``nn.Linear``
convention: ``(out_features, in_features)``), how many of each, and whether
each is optimised by Muon (hidden-layer matrices) or by an element-wise
optimiser (embeddings, output heads, input/output projections, convolutions).
Only matrices are listed: biases and norm weights are left out; convolutions
are listed flattened to ``(out_channels, in_channels * kh * kw)`` with
``muon=False``.

Available lists (see :func:`full_size_shapes`):

* ``"qwen2.5-7b"``: Qwen2.5-7B.
* ``"pi0"``: a Pi0-like VLA (PaliGemma-3B backbone + Gemma-300M action expert).
* ``"deepseek-v2-lite"``: DeepSeek-V2-Lite, a 16B-A2.4B MoE of Moonlight-16B-A3B's
  shape (64 routed experts, 2 shared, 27 layers).
* ``"deepseek-v3-12l"``: DeepSeek-V3's widths and 256 routed experts, 12 of its 61
  layers (a scaled-down variant: 3 dense layers and 9 MoE layers).
* ``"qwen2"`` / ``"vla"`` / ``"tiny"``: the benchmark models of
  :mod:`dmuon.bench.models` at a given size preset.
"""

from __future__ import annotations

import dataclasses

import os
import re
from dataclasses import dataclass

import torch

from dmuon.util.records import check_positive_int, check_shape, iter_records, load_json

__all__ = [
    "FULL_SIZE_NAMES",
    "MOE_NAMES",
    "MatrixShape",
    "full_size_shapes",
    "load_shapes_json",
    "total_params",
]


@dataclass(frozen=True)
class MatrixShape:
    """A group of identically shaped weight matrices."""

    name: str
    """What the matrices are, e.g. ``"layers.*.self_attn.q_proj"``."""

    shape: tuple[int, int]
    """``(rows, cols)``; for linear layers ``(out_features, in_features)``."""

    count: int
    """How many matrices of this kind the model has."""

    muon: bool = True
    """Whether Muon optimises these matrices (``False`` for embeddings, output
    heads, input/output projections and convolutions)."""

    experts: int = 0
    """Routed experts: each of the ``count`` entries is a stack ``(experts, *shape)``, one
    slice ``shape`` per expert, each slice a Muon matrix of its own (0: plain matrices)."""

    experts_per_token: int = 0
    """Routed experts each token runs through (top-k), for the share of the tokens one
    expert computes: ``experts_per_token / experts``."""

    first_layer: int = 0
    """The decoder layer of the first of the ``count`` entries (the k-th is in layer
    ``first_layer + k``): MoE layers after leading dense ones."""

    @property
    def numel(self) -> int:
        """Total number of elements over all ``count`` matrices (every expert of a stack)."""
        return self.shape[0] * self.shape[1] * self.count * max(1, self.experts)


MOE_NAMES: tuple[str, ...] = ("deepseek-v2-lite", "deepseek-v3-12l")
"""The mixture-of-experts lists among :data:`FULL_SIZE_NAMES` (routed-expert stacks: ``dmuon plan --ep``)."""
FULL_SIZE_NAMES: tuple[str, ...] = ("qwen2.5-7b", "pi0", "qwen2", "vla", "tiny") + MOE_NAMES
"""Names accepted by :func:`full_size_shapes`."""


def total_params(shapes: list[MatrixShape], *, prefix: str = "",
                 muon: bool | None = None) -> int:
    """Sums the matrix elements of a shape list.

    Args:
        shapes: The shape list.
        prefix: Only count entries whose name starts with this.
        muon: If not ``None``, only count entries whose ``muon`` flag equals it.

    Returns:
        The number of matrix parameters.
    """
    return sum(s.numel for s in shapes
               if s.name.startswith(prefix) and (muon is None or s.muon == muon))


def _qwen25_7b() -> list[MatrixShape]:
    """Qwen2.5-7B (``Qwen/Qwen2.5-7B`` ``config.json``).

    hidden 3584, intermediate 18944, 28 layers, 28 query heads and 4 KV heads
    of dimension 128, vocabulary 152064, untied input embedding and LM head.
    Matrices: 6.53B non-embedding, 0.545B per embedding table (7.07B with one
    table, 7.62B with both).
    """
    h, i, layers, kv, vocab = 3584, 18944, 28, 4 * 128, 152064
    return [
        MatrixShape("embed_tokens", (vocab, h), 1, muon=False),
        MatrixShape("layers.*.self_attn.q_proj", (h, h), layers),
        MatrixShape("layers.*.self_attn.k_proj", (kv, h), layers),
        MatrixShape("layers.*.self_attn.v_proj", (kv, h), layers),
        MatrixShape("layers.*.self_attn.o_proj", (h, h), layers),
        MatrixShape("layers.*.mlp.gate_proj", (i, h), layers),
        MatrixShape("layers.*.mlp.up_proj", (i, h), layers),
        MatrixShape("layers.*.mlp.down_proj", (h, i), layers),
        MatrixShape("lm_head", (vocab, h), 1, muon=False),
    ]


def _mla(h: int, heads: int, q_lora: int | None, kv_lora: int, nope: int, rope: int, v: int, layers: int
         ) -> list[MatrixShape]:
    """DeepSeek's multi-head latent attention of ``layers`` layers (``modeling_deepseek.py``): queries
    straight from the hidden state (``q_lora`` None) or through a rank-``q_lora`` bottleneck; keys and
    values from one ``kv_lora``-rank latent plus a shared rope key."""
    qk = heads * (nope + rope)
    q = ([MatrixShape("layers.*.self_attn.q_proj", (qk, h), layers)] if q_lora is None else
         [MatrixShape("layers.*.self_attn.q_a_proj", (q_lora, h), layers),
          MatrixShape("layers.*.self_attn.q_b_proj", (qk, q_lora), layers)])
    return q + [
        MatrixShape("layers.*.self_attn.kv_a_proj_with_mqa", (kv_lora + rope, h), layers),
        MatrixShape("layers.*.self_attn.kv_b_proj", (heads * (nope + v), kv_lora), layers),
        MatrixShape("layers.*.self_attn.o_proj", (h, heads * v), layers),
    ]


def _deepseek_moe(h: int, vocab: int, layers: int, dense: int, dense_mlp: int, expert_mlp: int, routed: int,
                  shared: int, top_k: int, attention: list[MatrixShape]) -> list[MatrixShape]:
    """A DeepSeek-MoE decoder: ``dense`` leading layers with a ``dense_mlp`` SwiGLU MLP, then MoE layers
    with a router ``(routed, h)``, ``shared`` shared experts (one SwiGLU MLP ``shared x expert_mlp`` wide,
    as ``DeepseekV2MoE`` builds them) and ``routed`` routed experts as torchtitan's ``GroupedExperts``
    stacks ``w1``/``w3`` ``(routed, expert_mlp, h)`` and ``w2`` ``(routed, h, expert_mlp)``; untied
    embedding and head."""
    moe, wide = layers - dense, shared * expert_mlp
    at = {"first_layer": dense}
    return [
        MatrixShape("embed_tokens", (vocab, h), 1, muon=False),
        *attention,
        MatrixShape("layers.*.mlp.gate_proj", (dense_mlp, h), dense),
        MatrixShape("layers.*.mlp.up_proj", (dense_mlp, h), dense),
        MatrixShape("layers.*.mlp.down_proj", (h, dense_mlp), dense),
        MatrixShape("layers.*.moe.router.gate", (routed, h), moe, **at),
        MatrixShape("layers.*.moe.shared_experts.gate_proj", (wide, h), moe, **at),
        MatrixShape("layers.*.moe.shared_experts.up_proj", (wide, h), moe, **at),
        MatrixShape("layers.*.moe.shared_experts.down_proj", (h, wide), moe, **at),
        MatrixShape("layers.*.moe.experts.w1", (expert_mlp, h), moe, experts=routed, experts_per_token=top_k, **at),
        MatrixShape("layers.*.moe.experts.w2", (h, expert_mlp), moe, experts=routed, experts_per_token=top_k, **at),
        MatrixShape("layers.*.moe.experts.w3", (expert_mlp, h), moe, experts=routed, experts_per_token=top_k, **at),
        MatrixShape("lm_head", (vocab, h), 1, muon=False),
    ]


def _deepseek_v2_lite() -> list[MatrixShape]:
    """DeepSeek-V2-Lite (``deepseek-ai/DeepSeek-V2-Lite`` ``config.json``), the shape of Moonlight-16B-A3B
    (``moonshotai/Moonlight-16B-A3B``: the same layers and widths, vocabulary 163840, dense MLP 11264).

    hidden 2048, 27 layers of which the first is dense (``first_k_dense_replace`` 1, MLP 10944), 26 MoE
    layers of 64 routed experts (``moe_intermediate_size`` 1408, 6 per token) and 2 shared experts;
    attention MLA without a query bottleneck (``q_lora_rank`` null): 16 heads, ``kv_lora_rank`` 512,
    ``qk_nope_head_dim`` 128, ``qk_rope_head_dim`` 64, ``v_head_dim`` 128; vocabulary 102400, untied head.
    About 15.7B parameters in matrices; per token 2.2B of the Muon matrices (6 of the 64 experts) and the
    0.42B embedding and head.
    """
    h = 2048
    return _deepseek_moe(h, 102400, 27, 1, 10944, 1408, 64, 2, 6,
                         _mla(h, 16, None, 512, 128, 64, 128, 27))


def _deepseek_v3_12l() -> list[MatrixShape]:
    """DeepSeek-V3's widths (``deepseek-ai/DeepSeek-V3`` ``config.json``) on 12 of its 61 layers: a
    scaled-down variant that keeps every matrix's shape and the expert count (256 routed, 8 per token,
    one shared; ``moe_intermediate_size`` 2048), the 3 leading dense layers (MLP 18432) and 9 MoE layers
    in place of 58, so that a step of its 7000 Muon matrices simulates on a laptop.

    hidden 7168; MLA with a query bottleneck: 128 heads, ``q_lora_rank`` 1536, ``kv_lora_rank`` 512,
    ``qk_nope_head_dim`` 128, ``qk_rope_head_dim`` 64, ``v_head_dim`` 128; vocabulary 129280, untied head.
    About 107B parameters in matrices, 101B of them routed experts (the full model: 671B).
    """
    h = 7168
    return _deepseek_moe(h, 129280, 12, 3, 18432, 2048, 256, 1, 8,
                         _mla(h, 128, 1536, 512, 128, 64, 128, 12))


def _gemma_layers(prefix: str, width: int, mlp: int, layers: int, heads: int,
                  kv_heads: int, head_dim: int) -> list[MatrixShape]:
    """Matrices of ``layers`` Gemma decoder layers (no biases)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return [
        MatrixShape(f"{prefix}layers.*.self_attn.q_proj", (q, width), layers),
        MatrixShape(f"{prefix}layers.*.self_attn.k_proj", (kv, width), layers),
        MatrixShape(f"{prefix}layers.*.self_attn.v_proj", (kv, width), layers),
        MatrixShape(f"{prefix}layers.*.self_attn.o_proj", (width, q), layers),
        MatrixShape(f"{prefix}layers.*.mlp.gate_proj", (mlp, width), layers),
        MatrixShape(f"{prefix}layers.*.mlp.up_proj", (mlp, width), layers),
        MatrixShape(f"{prefix}layers.*.mlp.down_proj", (width, mlp), layers),
    ]


def _pi0() -> list[MatrixShape]:
    """Pi0 (Physical Intelligence, 2024; ``openpi`` ``pi0.py`` / ``gemma.py``).

    Sources and assumptions:

    * Backbone: PaliGemma-3B at 224 px (``google/paligemma-3b-pt-224``).
      Vision tower SigLIP So400m/14: width 1152, MLP 4304, 27 layers, 16 heads,
      patch 14 so 256 patches; the attention-pooling head is not used by
      PaliGemma and is not listed.  Multimodal projector 1152 -> 2048.
      Language model Gemma-2B: hidden 2048, MLP 16384 (GeGLU gate/up/down),
      18 layers, 8 query heads and 1 KV head of dimension 256, vocabulary
      257152, LM head tied to the input embedding (listed once).  About 0.41B
      (vision) + 2.51B (language) = 2.92B matrix parameters.
    * Action expert: openpi's ``gemma_300m``: width 1024, MLP 4096, 18 layers,
      8 query heads and 1 KV head of dimension 256 (the same head layout as
      the backbone, so its queries can attend to the backbone's keys/values
      layer by layer); no embedding table.  About 0.31B parameters.
    * Small projections as in openpi ``Pi0``: action and state dimension 32
      (padded), ``state_proj`` 32 -> 1024, ``action_in_proj`` 32 -> 1024,
      ``action_time_mlp_in`` 2048 -> 1024, ``action_time_mlp_out``
      1024 -> 1024, ``action_out_proj`` 1024 -> 32.  The input/output
      projections (state, action in/out) are flagged non-Muon like embeddings
      and heads; the time MLP is a hidden layer and uses Muon.
    * Names: ``paligemma.vision.*``, ``paligemma.projector``,
      ``paligemma.llm.*`` for the backbone, ``expert.*`` for the action expert,
      ``proj.*`` for the small projections.
    """
    dv, mlp_v, layers_v, patch, patches = 1152, 4304, 27, 14, 256
    dl, dl_mlp, vocab = 2048, 16384, 257152
    da, da_mlp, action_dim = 1024, 4096, 32
    v = "paligemma.vision."
    return [
        MatrixShape(f"{v}patch_embed", (dv, 3 * patch * patch), 1, muon=False),
        MatrixShape(f"{v}position_embedding", (patches, dv), 1, muon=False),
        MatrixShape(f"{v}layers.*.self_attn.q_proj", (dv, dv), layers_v),
        MatrixShape(f"{v}layers.*.self_attn.k_proj", (dv, dv), layers_v),
        MatrixShape(f"{v}layers.*.self_attn.v_proj", (dv, dv), layers_v),
        MatrixShape(f"{v}layers.*.self_attn.out_proj", (dv, dv), layers_v),
        MatrixShape(f"{v}layers.*.mlp.fc1", (mlp_v, dv), layers_v),
        MatrixShape(f"{v}layers.*.mlp.fc2", (dv, mlp_v), layers_v),
        MatrixShape("paligemma.projector", (dl, dv), 1),
        MatrixShape("paligemma.llm.embed_tokens", (vocab, dl), 1, muon=False),
        *_gemma_layers("paligemma.llm.", dl, dl_mlp, 18, 8, 1, 256),
        *_gemma_layers("expert.", da, da_mlp, 18, 8, 1, 256),
        MatrixShape("proj.state_proj", (da, action_dim), 1, muon=False),
        MatrixShape("proj.action_in_proj", (da, action_dim), 1, muon=False),
        MatrixShape("proj.action_time_mlp_in", (da, 2 * da), 1),
        MatrixShape("proj.action_time_mlp_out", (da, da), 1),
        MatrixShape("proj.action_out_proj", (action_dim, da), 1, muon=False),
    ]


_LAYER_INDEX = re.compile(r"\.\d+\.")


def bench_model_shapes(name: str, size: str | None = None) -> list[MatrixShape]:
    """Shape list of a benchmark model of :mod:`dmuon.bench.models`.

    The model is built on the meta device (no memory, no initialisation cost);
    every parameter with two or more dimensions is listed (flattened to 2-D),
    with layer indices replaced by ``*`` and identical ``(name, shape, muon)``
    entries merged and counted.  ``muon`` follows the workload's
    ``muon_param_names``.

    Args:
        name: ``"qwen2"``, ``"vla"`` or ``"tiny"``.
        size: Size preset, as for :func:`~dmuon.bench.models.build_workload`.

    Returns:
        The shape list, in parameter order.

    Raises:
        ValueError: If ``name`` or ``size`` is unknown.
    """
    from dmuon.bench.models import build_workload

    with torch.device("meta"):
        workload = build_workload(name, size=size)
    muon_names = set(workload.muon_param_names or ())
    groups: dict[tuple[str, tuple[int, int], bool], int] = {}
    for pname, param in workload.model.named_parameters():
        if param.ndim < 2:
            continue
        key_name = _LAYER_INDEX.sub(".*.", pname).removesuffix(".weight")
        shape = (int(param.shape[0]), int(param[0].numel()))
        key = (key_name, shape, pname in muon_names)
        groups[key] = groups.get(key, 0) + 1
    return [MatrixShape(n, s, c, muon=m) for (n, s, m), c in groups.items()]


def full_size_shapes(name: str, *, size: str | None = None) -> list[MatrixShape]:
    """Returns the weight-matrix shape list of a model.

    Args:
        name: ``"qwen2.5-7b"``, ``"pi0"``, an MoE list (:data:`MOE_NAMES`), or a benchmark model ``"qwen2"``,
            ``"vla"`` or ``"tiny"``.
        size: Size preset for the benchmark models (``None``: the family's
            default); ignored otherwise.

    Returns:
        The list of :class:`MatrixShape`.

    Raises:
        ValueError: If ``name`` (or, for benchmark models, ``size``) is unknown.
    """
    if name == "qwen2.5-7b":
        return _qwen25_7b()
    if name == "pi0":
        return _pi0()
    if name == "deepseek-v2-lite":
        return _deepseek_v2_lite()
    if name == "deepseek-v3-12l":
        return _deepseek_v3_12l()
    if name in ("qwen2", "vla", "tiny"):
        return bench_model_shapes(name, size)
    raise ValueError(f"name must be one of {FULL_SIZE_NAMES}, got {name!r}")


def load_shapes_json(path: str | os.PathLike[str]) -> list[MatrixShape]:
    """Reads a shape list from a JSON file.

    The file holds a list of objects ``{"name": str, "shape": [m, n],
    "count": int}`` with an optional ``"muon": bool`` (default ``true``).

    Args:
        path: Path of the JSON file.

    Returns:
        The list of :class:`MatrixShape`, in file order.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: If the file is not valid JSON or an entry is malformed; the
            message names the entry index and the field.
    """
    shapes = []
    fields = ("name", "shape", "count", "muon")
    for where, entry in iter_records(load_json(path), os.fspath(path), "shape entries", fields, fields[:3]):
        name = entry["name"]
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: field 'name' must be a non-empty string, got {name!r}")
        at = f"{where} ({name!r})"
        shape = check_shape(at, entry["shape"])
        count = check_positive_int(at, "count", entry["count"])
        muon = entry.get("muon", True)
        if not isinstance(muon, bool):
            raise ValueError(f"{at}: field 'muon' must be true or false, got {muon!r}")
        shapes.append(MatrixShape(name, shape, count, muon=muon))
    return shapes


def pipeline_stages(groups: list[MatrixShape], pp: int) -> list[list[MatrixShape]]:
    """The shape groups each of ``pp`` pipeline stages holds: every group of repeated layers (a name with
    ``layers.`` or a count above 1) split evenly over the stages, the earlier stages taking one more
    where the count does not divide (torchtitan's even split); the groups listed before the first such
    group (embeddings) on the first stage, those after the last (the head) on the last stage."""
    if pp < 1:
        raise ValueError(f"--pp must be >= 1, got {pp}")
    layered = [k for k, g in enumerate(groups) if "layers." in g.name or g.count > 1]
    first, last = (layered[0], layered[-1]) if layered else (len(groups), len(groups) - 1)
    stages: list[list[MatrixShape]] = [[] for _ in range(pp)]
    for k, g in enumerate(groups):
        if k < first:
            stages[0].append(g)
        elif k > last:
            stages[-1].append(g)
        else:
            for stage in range(pp):
                count = g.count // pp + (1 if stage < g.count % pp else 0)
                if count:
                    stages[stage].append(dataclasses.replace(g, count=count))
    return stages
