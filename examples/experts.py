"""A mixture of experts, expert parallel, as torchtitan lays it out (docs/guides/experts.md): the dense
parameters ``fully_shard``-ed over every data rank (``fsdp``), each block's expert stacks ``(E, m, n)`` split
whole over ``ep`` (``Shard(0)``) and sharded over the rest (``efsdp``), the two meshes views of one world mesh;
one DMuon steps both, each expert slice a Muon matrix with its own owner. ``python examples/experts.py`` runs it
on 4 gloo CPU ranks (``ep = 2``, 4 experts). ``options``: more ``DMuon`` keywords.

Routing is soft (every token to every expert, weighted by the router's softmax) to keep the example short:
each ep rank runs its experts on the tokens of its whole ep group (an all-gather with autograd) and sends each
rank back the sum for its own tokens (a reduce-scatter); torchtitan's top-k routing moves only the routed
tokens, by all-to-all, and steps alike.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_gather_tensor_autograd, reduce_scatter_tensor_autograd
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import dmuon
from dmuon.testing.spawn import run_distributed
from quickstart import DIM, VOCAB, batch, loss_of

EXPERTS, HIDDEN = 4, 48


class Experts(nn.Module):
    """``EXPERTS`` MLPs as two stacks, ``w1 (E, HIDDEN, DIM)`` and ``w2 (E, DIM, HIDDEN)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) / DIM ** 0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) / HIDDEN ** 0.5)

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """``x (T, DIM)`` tokens, ``gates (T, E)``: each token's sum of its experts' outputs, gate-weighted."""
        if not isinstance(self.w1, DTensor):      # one process: every expert here
            return self._mine(x, gates, self.w1, self.w2, range(EXPERTS))
        group = self.w1.device_mesh.get_group("ep")
        size, me = group.size(), group.rank()
        per = EXPERTS // size                     # Shard(0): this rank's experts are a run of ``per``
        x_all = all_gather_tensor_autograd(x.contiguous(), 0, group)        # the ep group's tokens, rank after rank
        gates_all = all_gather_tensor_autograd(gates.contiguous(), 0, group)
        out = self._mine(x_all, gates_all, self.w1.to_local(), self.w2.to_local(), range(me * per, me * per + per))
        return reduce_scatter_tensor_autograd(out, "sum", 0, group)         # each rank its tokens' sum

    @staticmethod
    def _mine(x, gates, w1, w2, experts):
        return sum(gates[:, e:e + 1] * (F.gelu(x @ w1[k].T) @ w2[k].T) for k, e in enumerate(experts))


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, DIM)
        return x + self.experts(tokens, self.router(tokens).softmax(-1)).view_as(x)


class MoELM(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(MoEBlock() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def train(rank: int, world_size: int, ep: int = 2, steps: int = 3, **options) -> dict[str, torch.Tensor]:
    world = init_device_mesh("cpu", (world_size,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (world_size,), ("fsdp",))               # torchtitan's ParallelDims does this
    experts = world._unflatten(0, (world_size // ep, ep), ("efsdp", "ep"))
    torch.manual_seed(0)
    model = MoELM()
    for block in model.layers:
        for name in ("w1", "w2"):                                        # torchtitan's ExpertParallel
            stack = getattr(block.experts, name)
            setattr(block.experts, name, nn.Parameter(distribute_tensor(stack.data, experts["ep"], [Shard(0)])))
        fully_shard(block.experts, mesh=experts["efsdp"])
        block.experts.set_gradient_divide_factor(float(world_size))     # each expert's gradient: the mean over all tokens
        block.experts.set_force_sum_reduction_for_comms(True)           # gloo has no PREMUL_SUM: sum, then divide
        fully_shard(block, mesh=dense)
    fully_shard(model, mesh=dense)
    opt = dmuon.DMuon(model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3), **options)
    for step in range(steps):
        loss = loss_of(model, batch(step, rank))                     # every rank reads its own batch
        loss.backward()
        opt.clip_grad_norm_(1.0)                                         # one norm across both meshes
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f} (rank 0's batch)")
    return {name: p.full_tensor() for name, p in model.named_parameters()}


if __name__ == "__main__":
    run_distributed(train, 4)
