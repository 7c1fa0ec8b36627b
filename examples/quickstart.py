"""dmuon's quick start: a tiny language model trained with FSDP2 and DMuon on 2 gloo CPU ranks.

Run it with ``python examples/quickstart.py``. The README's quick start is this file between the two
``# ---`` markers (tests/layouts/test_examples.py checks that they agree, and runs the file).
"""

# --- quick start ---
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.testing.spawn import run_distributed   # local gloo ranks; under torchrun, call train() on each rank

VOCAB, DIM = 64, 32


class Block(nn.Module):                                    # Muon: the Linear weights; AdamW: their biases
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class TinyLM(nn.Module):                                   # AdamW: the embedding and the output head
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.Sequential(*(Block() for _ in range(layers)))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.embed(tokens)))


def batch(step: int, rank: int) -> torch.Tensor:           # 4 sequences counting up from random starts
    start = torch.randint(0, VOCAB, (4, 1), generator=torch.Generator().manual_seed(100 * step + rank))
    return (start + torch.arange(17)) % VOCAB


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def train(rank: int, world_size: int, steps: int = 5) -> None:
    torch.manual_seed(0)                                   # the same initial weights on every rank
    model = TinyLM()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.DMuon(model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3))   # instead of torch.optim.AdamW
    for step in range(steps):
        loss = loss_of(model, batch(step, rank))           # each rank reads its own batch
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.6f} (rank 0's batch)")


if __name__ == "__main__":
    run_distributed(train, 2)
# --- end of the quick start ---
