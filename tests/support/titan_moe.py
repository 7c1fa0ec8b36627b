"""examples/integrations/torchtitan_moe.py against one process.

:func:`reference`: torchtitan's model unsharded, on the global batch, torch.optim.Muon (fp32 NS) on every
expert's ``(m, n)`` slice and every dense matrix but the embedding and the head, torch.optim.AdamW on the
rest, torch's ``clip_grad_norm_`` over every gradient, and torchtitan's own load-balancing hook (one
process: the token counts need no reduction).

:func:`fp32_experts`: torchtitan's ``GroupedExperts`` with its grouped GEMMs in fp32, in both runs.
torchtitan casts the experts' inputs and weights to bf16, so each expert's weight gradient is a bf16
sum over the tokens it received: with ep = 2 and efsdp = 2 that is two bf16 partial sums, added in fp32
by the reduce-scatter, against one bf16 sum in one process. The difference, ~2^-9 of each element and of
full rank, is what Newton-Schulz amplifies most (a direction of singular value s of the normalized
matrix comes out near min(1, 3.4^5 s)): measured, one step leaves the experts ~3e-4 apart (a tenth of
their update) while every dense matrix agrees to 2e-7. In fp32 the same difference is ~2^-24.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from support.reference import ns_precision


def _fp32_grouped_experts_forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    # torchtitan 0.3.0's GroupedExperts.forward (partial_dtensor backend) without its .bfloat16() casts.
    w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    h_RF = F.silu(torch._grouped_mm(x_RD, w1.transpose(-2, -1), offs=offsets_E))
    h_RF = h_RF * torch._grouped_mm(x_RD, w3.transpose(-2, -1), offs=offsets_E)
    return torch._grouped_mm(h_RF, w2.transpose(-2, -1), offs=offsets_E).type_as(x_RD)


@contextlib.contextmanager
def fp32_experts():
    from torchtitan.models.common.moe import GroupedExperts

    original = GroupedExperts.forward
    GroupedExperts.forward = _fp32_grouped_experts_forward
    try:
        yield
    finally:
        GroupedExperts.forward = original


def train_fp32_experts(rank: int, world: int, recipe_dir: str, steps: int, ns) -> dict:
    """The recipe's ``train`` on this rank with :func:`fp32_experts`."""
    import sys

    if recipe_dir not in sys.path:
        sys.path.insert(0, recipe_dir)
    import torchtitan_moe

    with fp32_experts():
        return torchtitan_moe.train(rank, world, steps, ns)


class _HookedOptimizers:
    """What torchtitan's ``register_moe_load_balancing_hook`` uses of its optimizer container."""

    def __init__(self) -> None:
        self.hooks = []

    def register_step_pre_hook(self, hook) -> None:
        self.hooks.append(hook)

    def run_pre_hooks(self) -> None:
        for hook in self.hooks:
            hook()


# A one-process ParallelDims as torchtitan's hook reads it: no expert or tensor parallelism, no "loss"
# mesh to reduce the token counts over (ParallelDims.get_optional_mesh gives None for a size-1 dim).
_ONE_PROCESS = types.SimpleNamespace(ep_enabled=False, tp=1, get_optional_mesh=lambda dims: None)


def reference(recipe, initial: dict[str, torch.Tensor], steps: int, world: int) -> dict:
    """Trains the recipe's model from ``initial`` (the sharded run's own full initial weights) for ``steps``
    steps on ``world`` ranks' batches at once; returns the final parameters, losses and gradient norms."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed import utils as dist_utils

    training = recipe.training_config()
    spec, parallelism = recipe.model_spec(1, training)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # the buffers (RoPE, expert bias); the weights come next
    missing, unexpected = model.load_state_dict(initial, strict=False)
    assert not unexpected and not set(missing) & set(initial), (missing, unexpected)
    model.train()
    params = dict(model.named_parameters())
    assert set(params) == set(initial)
    stacks = [n for n, p in params.items() if p.ndim == 3]
    slices = [nn.Parameter(params[n].data[e]) for n in stacks for e in range(params[n].shape[0])]
    matrices = [p for n, p in params.items() if p.ndim == 2 and not n.startswith(("tok_embeddings", "lm_head"))]
    rest = [p for n, p in params.items() if p.ndim < 2 or n.startswith(("tok_embeddings", "lm_head"))]
    group = recipe.GROUP
    muon = torch.optim.Muon(slices + matrices, lr=group["lr"], weight_decay=group["weight_decay"])
    adamw = torch.optim.AdamW(rest, lr=group["adamw_lr"], weight_decay=group["adamw_weight_decay"])
    hooked = _HookedOptimizers()
    spec.post_optimizer_build_fn(hooked, [model], _ONE_PROCESS)
    assert hooked.hooks, "torchtitan registered no load-balancing hook"
    loss_fn = CrossEntropyLoss.Config().build()
    vocab = spec.model.vocab_size
    losses, norms = [], []
    for step in range(steps):
        parts = [recipe.batch(step, r, world, vocab) for r in range(world)]
        inputs, labels = (torch.cat(t) for t in zip(*parts))
        loss, _ = loss_fn(model(inputs), labels, torch.tensor(labels.numel()))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.MAX_NORM)))
        hooked.run_pre_hooks()
        it = iter(slices)
        for n in stacks:
            for e in range(params[n].shape[0]):
                next(it).grad = params[n].grad[e].clone()
        with ns_precision(torch.float32):
            muon.step()
        adamw.step()
        for p in [*slices, *model.parameters()]:
            p.grad = None
        losses.append(loss.item())
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "losses": losses, "norms": norms, "muon_matrices": len(slices) + len(matrices)}
