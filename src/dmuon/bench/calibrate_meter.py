"""The figures ``dmuon bench --calibrate`` measures on every rank (:class:`Meter`): what ``dmuon plan
--simulate`` takes as overrides, on this machine; :mod:`dmuon.bench.calibrate_fit` combines the ranks'
figures and turns them into the flags.

Every rank measures at once, on its own device (CPU ranks on gloo; under ``torchrun`` with NCCL, each
rank's GPU), each figure the mean of its timed runs after a warm-up:

* **compute**: the matmul rate of the bench model's forward and backward GEMMs (its Linear layers at its
  tokens per rank, fp32); an effective rate, the model's forward+backward under FSDP2 on a one-rank mesh
  (no communication) counted as 6 x parameters x tokens, the sense of the presets' rates; the work beyond
  the GEMMs, the model's forward+backward without FSDP2 less 6 x parameters x tokens at the matmul rate
  (attention's products, norms, activations, the loss's softmax); FSDP2's own work per unit and pass, the
  model's tiny twin under FSDP2 on the one-rank mesh less without;
* **elementwise**: dmuon's AdamW kernel (``torch.optim.adam.adam``, foreach) over tensors shaped like one
  rank's shards;
* **NS**: the owners' update per Muon shape and batch size with the bench's settings (bf16, ``auto``);
* **host**: seconds per operation on plain tensors and on DTensors (tiny elementwise operations), and per
  DTensor layout call (``full_tensor()`` less a plain all-gather, ``distribute_tensor``);
* **link**: all-gather, reduce-scatter, all-to-all and all-reduce of 16 KiB to 4 MiB per rank and peer
  (on gloo a reduce-scatter is an all-reduce of the whole input,
  ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``, so its bytes cost more than an all-gather's).

Collectives make the ranks wait for each other, so the slower rank's figures count
(:func:`dmuon.bench.calibrate_fit.combine`).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dmuon.bench.shapes import bench_model_shapes

LINK_SIZES = tuple(16384 * 2**k for k in range(9))
"""Bytes per rank of the link measurements: 16 KiB to 4 MiB, the range of the bench's collectives
(the default workload's blocks all-gather and reduce-scatter 0.4-4 MiB per rank; dmuon's exchanges less)."""
NS_REPEATS = 3
"""Timed runs of each NS entry (shape, batch size)."""
DISPATCH_TENSORS = 48
"""Tensor pairs, each of its own shape, of the dispatch measurement."""
DISPATCH_OPS = 8
"""Operations per pair in it (:meth:`Meter.dispatch`)."""
LAYOUT_LOOP = 4
"""Rounds over the bench model's Muon shapes of ``full_tensor()`` and ``distribute_tensor`` timed per layout
measurement."""


# torch 2.13 names them *_single (FSDP2 calls reduce_scatter_single); older releases have only the *_tensor names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def rank_device() -> torch.device:
    """This rank's device: its GPU on NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _synchronize(device: torch.device) -> None:
    """Waits for the device's queued work, so a host clock times it (a CPU's work is done on return)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _interleaved_means(fns: dict, repeats: int, device: torch.device) -> dict:
    """Mean seconds of each of ``fns`` (name -> callable) over ``repeats`` runs after a warm-up, each
    from a barrier, their runs interleaved (one of each per round): figures that are subtracted from
    each other then sample the same moments of a machine whose speed drifts.

    The mean, not the median: on a shared machine the scheduler preempts a rank now and then, and a
    training step takes those preemptions at their average rate; a median of short runs would leave
    them out and price everything as on an idle machine."""
    for fn in fns.values():
        fn()  # warm-up
    _synchronize(device)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            _synchronize(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.mean(t) for name, t in times.items()}


def _mean_seconds(fn, repeats: int, device: torch.device) -> float:
    """:func:`_interleaved_means` of ``fn`` alone."""
    return _interleaved_means({"fn": fn}, repeats, device)["fn"]


def muon_counts(groups) -> dict[tuple[int, int], int]:
    """How many Muon matrices of each shape the shape groups hold (the NS batch sizes to profile)."""
    counts: dict[tuple[int, int], int] = {}
    for g in groups:
        if g.muon:
            counts[tuple(g.shape)] = counts.get(tuple(g.shape), 0) + g.count
    return counts


def _forward_backward(workload, batch) -> None:
    workload.loss_fn(workload.model, batch).backward()
    workload.model.zero_grad(set_to_none=True)


class Meter:
    """One rank's machine measurements; every rank measures at once."""

    def __init__(self, rank: int, world_size: int, model: str, size: str | None, tokens: int, repeats: int):
        from torch.distributed.device_mesh import DeviceMesh

        from dmuon.ortho import NSConfig

        self.rank, self.world_size, self.repeats = rank, world_size, repeats
        self.device = rank_device()
        self.groups = bench_model_shapes(model, size)
        self.gen = torch.Generator().manual_seed(rank)
        # A one-rank group per rank (every rank creates every group, as new_group requires): FSDP2's own
        # work without communication; and every rank's mesh, for the layout calls.
        alone = [dist.new_group([r]) for r in range(world_size)][rank]
        self.one_mesh = DeviceMesh.from_group(alone, self.device.type)
        self.world_mesh = DeviceMesh.from_group(dist.group.WORLD, self.device.type)
        self._gemms(tokens)
        self._models(model, size, tokens)
        self._dispatch_pairs()
        self._layout_pieces()
        self._adam_state()
        # NS: the owners' update per shape and batch size, with the bench's NS settings.
        self.ns = NSConfig(dtype=torch.bfloat16, method="auto")
        self.counts = muon_counts(self.groups)

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen).to(self.device)

    def _ones(self, *shape: int) -> torch.Tensor:
        return torch.ones(shape, device=self.device)

    def _empty(self, *shape: int) -> torch.Tensor:
        return torch.empty(shape, device=self.device)

    def _gemms(self, tokens: int) -> None:
        """Matmul rate: each Linear's forward GEMM and its two backward GEMMs at the bench's tokens."""
        self.mats = [(self._randn(tokens, g.shape[1]), self._randn(g.shape[0], g.shape[1]), g.count)
                     for g in self.groups if "embed" not in g.name]
        self.gemm_flops = sum(6.0 * tokens * w.shape[0] * w.shape[1] * n for _, w, n in self.mats)

    def _models(self, model: str, size: str | None, tokens: int) -> None:
        """The bench model under FSDP2 (ZeRO-3) on the one-rank mesh and without FSDP2, and its tiny twin
        the same two ways (FSDP2's per-unit work: the twin is all units at tiny widths)."""
        from dmuon.bench.models import build_workload
        from dmuon.bench.setups import shard_workload

        def built(size_name: str | None, sharded: bool):
            with torch.device(self.device):
                workload = build_workload(model, size=size_name, seed=0)
            if sharded:
                shard_workload(workload, self.one_mesh, reshard=True)  # as the bench's ZeRO-3 configurations
            return workload, workload.make_batch(0, self.rank)

        self.fsdp, self.plain = built(size, True), built(size, False)
        # Counted as the simulation counts forward and backward, 6 x parameters x tokens.
        self.counted = 6.0 * tokens * sum(g.numel for g in self.groups)
        self.twin_fsdp, self.twin_plain = built("tiny", True), built("tiny", False)
        self.units = len(self.twin_fsdp[0].blocks) + 1

    def _dispatch_pairs(self) -> None:
        """The host's cost per operation: elementwise operations on tiny tensors (the arithmetic negligible),
        plain and as FSDP2's Shard(0) DTensors on the one-rank mesh, each pair of its own shape as a model's
        parameters are (DTensor caches its sharding propagation per shape), half of them in place and half
        making a new tensor (which costs DTensor a new wrapper): the mix of torch.optim.AdamW's per-tensor
        loop, the largest user of DTensor operations modelled."""
        from torch.distributed.tensor import DTensor, Shard

        shapes = [(4 + k, 3) for k in range(DISPATCH_TENSORS)]
        self.plain_pairs = [(self._ones(*s), self._ones(*s)) for s in shapes]
        self.dtensor_pairs = [tuple(DTensor.from_local(self._ones(*s), self.one_mesh, [Shard(0)]) for _ in range(2))
                              for s in shapes]

    def _layout_pieces(self) -> None:
        """DTensor's layout calls as gather-then-compute makes them per matrix, on every rank's mesh, at the
        bench model's Muon shapes in bf16 (its wire): their host path beyond the collective is
        ``full_tensor()`` less a plain all-gather of the same bytes, plus ``distribute_tensor``."""
        from torch.distributed.tensor import Shard, distribute_tensor

        shapes = sorted({tuple(g.shape) for g in self.groups if g.muon}) or [(8 * self.world_size, 1)]
        self.layout_pieces = [distribute_tensor(torch.ones(shape, dtype=torch.bfloat16, device=self.device),
                                                self.world_mesh, [Shard(0)], src_data_rank=None)
                              for shape in shapes]
        self.layout_buffers = [torch.empty(piece.to_local().numel() * self.world_size, dtype=torch.bfloat16,
                                           device=self.device) for piece in self.layout_pieces]

    def _adam_state(self) -> None:
        """Elementwise rate: dmuon's AdamW kernel over this rank's shards of every parameter listed."""
        shards = [(-(-g.shape[0] // self.world_size), g.shape[1]) for g in self.groups for _ in range(g.count)]
        self.adam_state = [[self._randn(*shape) for shape in shards] for _ in range(4)]
        self.adam_state[3] = [x.abs() for x in self.adam_state[3]]
        self.adam_steps = [torch.tensor(1.0, device=self.device) for _ in shards]
        self.adam_bytes = 28 * sum(x.numel() for x in self.adam_state[0])

    def ns_seconds(self, shape: tuple[int, int], batch: int) -> float:
        """The owners' update of ``batch`` directions of ``shape`` (bf16, as the exchange delivers them), as
        :func:`dmuon.plan.profile.measure_update` times it, its mean over :data:`NS_REPEATS` runs."""
        from dmuon.ortho.owner import owner_update

        gen = torch.Generator().manual_seed(1234 + 7 * batch)
        directions = [torch.randn(shape, generator=gen).to(self.device, torch.bfloat16) for _ in range(batch)]
        return _mean_seconds(lambda: owner_update(directions, self.ns), NS_REPEATS, self.device)

    def gemms(self) -> None:
        for x, w, n in self.mats:
            for _ in range(n):
                y = x @ w.T          # forward
                _ = y @ w            # backward: input gradient
                _ = y.T @ x          # backward: weight gradient

    @torch.no_grad()
    def dispatch(self, pairs) -> None:
        """:data:`DISPATCH_OPS` operations per pair: four in place, four making a new tensor."""
        for x, y in pairs:
            x.mul_(0.999)
            y.lerp_(x, 0.1)
            y.addcmul_(x, x, value=1e-3)
            z = y.sqrt()
            z = z / 0.5
            z = z + 1e-8
            z = x * z
            x.sub_(z)

    def layout_calls(self) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        for _ in range(LAYOUT_LOOP):
            for piece in self.layout_pieces:
                full = piece.full_tensor()
                distribute_tensor(full, self.world_mesh, [Shard(0)], src_data_rank=None)

    def layout_collectives(self) -> None:
        for _ in range(LAYOUT_LOOP):
            for piece, buffer in zip(self.layout_pieces, self.layout_buffers):
                _ALL_GATHER(buffer, piece.to_local().reshape(-1))

    def adamw(self) -> None:
        from torch.optim.adam import adam
        params, grads, m1, m2 = self.adam_state
        adam(params, grads, m1, m2, [], self.adam_steps, foreach=True, has_complex=False,
             decoupled_weight_decay=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3, weight_decay=0.01,
             eps=1e-8, maximize=False)

    def compute_figures(self) -> dict:
        """The rates of forward and backward, the work beyond the GEMMs and FSDP2's per unit and pass. The
        GEMMs and the plain forward+backward are interleaved, as are the twin's two runs: each pair is
        subtracted, and timed one after the other they would sample different moments of the machine."""
        gemms, fsdp, plain = _interleaved_means({"gemms": self.gemms,
                                                 "fsdp": lambda: _forward_backward(*self.fsdp),
                                                 "plain": lambda: _forward_backward(*self.plain)},
                                                self.repeats, self.device).values()
        twin_fsdp, twin_plain = _interleaved_means({"fsdp": lambda: _forward_backward(*self.twin_fsdp),
                                                    "plain": lambda: _forward_backward(*self.twin_plain)},
                                                   self.repeats, self.device).values()
        matmul = self.gemm_flops / gemms
        return {"matmul_flops": matmul, "effective_flops": self.counted / fsdp,
                "non_gemm_seconds": max(0.0, plain - self.counted / matmul),
                "fsdp_unit_seconds": max(0.0, twin_fsdp - twin_plain) / (2 * self.units),
                "elementwise_bytes": self.adam_bytes / _mean_seconds(self.adamw, self.repeats, self.device)}

    def host_figures(self) -> dict:
        """Seconds per plain and per DTensor operation, and per layout call beyond its collective."""
        per_op = DISPATCH_OPS * DISPATCH_TENSORS
        calls, collectives = _interleaved_means({"calls": self.layout_calls, "collectives": self.layout_collectives},
                                                self.repeats, self.device).values()
        return {"dispatch_seconds": _mean_seconds(lambda: self.dispatch(self.plain_pairs), self.repeats,
                                                  self.device) / per_op,
                "dtensor_dispatch_seconds": _mean_seconds(lambda: self.dispatch(self.dtensor_pairs), self.repeats,
                                                          self.device) / per_op,
                "dtensor_layout_seconds": max(0.0, calls - collectives) / (2 * LAYOUT_LOOP * len(self.layout_pieces))}

    def ns_table(self) -> dict[str, float]:
        """``"RxCxB"`` -> seconds of the owners' update of B matrices of R x C, for every batch size up to the
        model's count of that shape."""
        table = {}
        for shape, count in sorted(self.counts.items()):
            for batch in range(1, count + 1):
                dist.barrier()
                table[f"{shape[0]}x{shape[1]}x{batch}"] = self.ns_seconds(shape, batch)
        return table

    def measure(self) -> dict:
        samples, unsupported = self.link()
        return {"device": self.device.type, **self.compute_figures(), **self.host_figures(),
                "ns_seconds": self.ns_table(), "link_samples": samples, "unsupported": unsupported}

    def link(self) -> tuple[list, dict]:
        """The link: four collectives, each rank sending n bytes to each peer, n from 16 KiB to 4 MiB;
        the all-reduce of the reduce-scatter's input (n per rank, ``W n`` in all). Each sample's bytes
        are what each rank sends as the step model counts it: ``(W - 1) n``, the all-reduce (a ring)
        ``2 (W - 1) / W`` of its ``W n``. One rank has no link: no samples."""
        world_size, samples, unsupported = self.world_size, [], {}
        if world_size < 2:
            return samples, unsupported
        new, ones = self._empty, self._ones
        for _ in range(3):  # first uses of the pairs and buffers, untimed
            dist.all_to_all_single(new(4096 * world_size), ones(4096 * world_size))
            _ALL_GATHER(new(4096 * world_size), ones(4096))
            _REDUCE_SCATTER(new(4096), ones(4096 * world_size))
            dist.all_reduce(ones(4096 * world_size))
        for n in LINK_SIZES:
            elems = n // 4
            send, gathered, big, out = ones(elems), new(elems * world_size), ones(elems * world_size), new(elems)
            ops = {"all_gather": lambda: _ALL_GATHER(gathered, send),
                   "reduce_scatter": lambda: _REDUCE_SCATTER(out, big),
                   "all_to_all": lambda: dist.all_to_all_single(gathered, big),
                   "all_reduce": lambda: dist.all_reduce(big)}
            for op, fn in ops.items():
                sent = 2 * n * (world_size - 1) if op == "all_reduce" else n * (world_size - 1)
                try:
                    samples.append((op, sent, _mean_seconds(fn, self.repeats, self.device)))
                except RuntimeError as err:  # a collective this backend's build lacks
                    unsupported[op] = str(err).splitlines()[0]
        return samples, unsupported
