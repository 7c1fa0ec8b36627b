"""Benchmark workloads built from real model definitions, randomly initialised.

Three model families are provided, each in size presets (``"tiny"``,
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

* ``"moe"``: the ``qwen2`` decoder with each MLP replaced by 8 SwiGLU experts
  with top-2 routing, weights stacked per projection (``(E, out, in)``, the
  grouped-GEMM layout), sizes ``"tiny"`` and ``"small"`` (:mod:`dmuon.bench.models.moe`).

``"tiny"`` is an alias of the tiny ``"qwen2"`` workload, for tests.

All weights are ordinary :class:`torch.nn.Linear`, :class:`torch.nn.Embedding`
and :class:`torch.nn.Conv2d` parameters, so the workloads can be wrapped with
FSDP2's ``fully_shard`` block by block and optimised with
:class:`torch.optim.Muon`.  Nothing is downloaded: all models are built from
configuration objects and initialised from a seeded generator, so building the
same workload with the same ``seed`` on every rank gives identical weights.
"""

from dmuon.bench.models.build import DEFAULT_SIZES, SIZE_NAMES, WORKLOAD_NAMES, build_workload, resolve_size
from dmuon.bench.models.moe import MOE_SIZES, MoESize
from dmuon.bench.models.qwen2 import QWEN2_SIZES, Qwen2Size
from dmuon.bench.models.vla import VLA_SIZES, VLASize
from dmuon.bench.models.vla_modules import VLAModel
from dmuon.bench.models.workload import Batch, Workload

__all__ = [
    "DEFAULT_SIZES",
    "MOE_SIZES",
    "MoESize",
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
