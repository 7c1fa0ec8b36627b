"""The figures ``dmuon bench --calibrate`` measures on every rank (:class:`Meter`), the simulation's inputs
for this machine; :mod:`dmuon.bench.calibrate_fit` turns them into predictions, :mod:`dmuon.bench.calibrate`
runs them between the bench's rounds.

**This machine's figures**, measured on every rank at once before each round and after
the last, so they cover the same span of time as the timed steps (the shared machine
drifts by tens of percent within a run): the matmul rate of the bench model's forward
and backward GEMMs (its Linear layers at its tokens per rank, fp32); an effective rate,
the model's forward+backward under FSDP2 on a one-rank mesh (no communication) counted as
6 x parameters x tokens, the sense of the presets' effective rates; the work beyond the
GEMMs, the model's forward+backward without FSDP2 on one rank less 6 x parameters x tokens
at the matmul rate (attention's products, norms, activations, the loss's softmax); the elementwise rate
of dmuon's AdamW kernel (``torch.optim.adam.adam``, foreach) over tensors shaped like one
rank's shards; the owners' NS per shape and batch size with the bench's NS settings (bf16,
``auto``; each measurement the mean of its timed runs, preemptions included as a step
takes them); the gloo link per collective kind: all-gather, reduce-scatter, all-to-all and
all-reduce of 16 KiB to 4 MiB per rank and peer, one latency per message and one bandwidth
fitted to each kind (relative least squares of ``time = messages x latency + bytes /
bandwidth``, bytes and messages as the step model counts them; gloo reduce-scatters by an
all-reduce of the whole input, ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``, so its
bytes cost more than an all-gather's); and the host: seconds per operation on plain tensors
and on DTensors (tiny elementwise operations), per DTensor layout call (``full_tensor()``
less a plain all-gather, ``distribute_tensor``), and FSDP2's work per unit and pass (the
model's tiny twin under FSDP2 on a one-rank mesh less without; and the twin under FSDP2 over
every rank, for the work a one-rank mesh skips: :func:`dmuon.bench.calibrate_fit.rank_unit_seconds`),
and each code path's own host time (the twin's optimizer step with ``adamw``, ``gather`` and
``dmuon_z3`` over every rank, its NS profiled too: :func:`dmuon.bench.calibrate_fit.path_host_factors`);
the ranks' drift (the same GEMMs with a meeting after each block and after each matrix, less both
alone: a fraction of the compute and a delay per meeting, :func:`dmuon.bench.calibrate_fit.drift`).
Collectives make the ranks wait for each other every block, so at each point the slower rank counts.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dmuon.bench.calibrate_fit import TWIN_PATHS
from dmuon.bench.shapes import bench_model_shapes

LINK_SIZES = tuple(16384 * 2**k for k in range(9))
"""Bytes per rank of the link measurements: 16 KiB to 4 MiB, the range of the bench's collectives
(the default workload's blocks all-gather and reduce-scatter 0.4-4 MiB per rank; dmuon's exchanges less)."""
NS_REPEATS = 3
"""Timed runs of each NS entry (shape, batch size)."""
SKEW_BLOCKS = 8
"""Blocks of GEMMs, each followed by a meeting of the ranks, per drift measurement."""
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


def _interleaved_means(fns: dict, repeats: int) -> dict:
    """Mean seconds of each of ``fns`` (name -> callable) over ``repeats`` runs after a warm-up, each
    from a barrier, their runs interleaved (one of each per round): figures that are subtracted from
    each other then sample the same moments of a machine that drifts within seconds.

    The mean, not the median: on a shared machine the scheduler preempts a rank now and then, and a
    training step, hundreds of milliseconds long, takes those preemptions at their average rate; a
    median of short runs would leave them out and price everything as on an idle machine."""
    for fn in fns.values():
        fn()  # warm-up
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.mean(t) for name, t in times.items()}


def _mean_seconds(fn, repeats: int) -> float:
    """:func:`_interleaved_means` of ``fn`` alone."""
    return _interleaved_means({"fn": fn}, repeats)["fn"]


def _muon_counts(groups) -> dict[tuple[int, int], int]:
    """How many Muon matrices of each shape the shape groups hold (the NS batch sizes to profile)."""
    counts: dict[tuple[int, int], int] = {}
    for g in groups:
        if g.muon:
            counts[tuple(g.shape)] = counts.get(tuple(g.shape), 0) + g.count
    return counts


class Meter:
    """One rank's machine measurements; every rank measures at once, as the bench runs them."""

    def __init__(self, rank: int, world_size: int, model: str, size: str | None, tokens: int, repeats: int,
                 hyper=None):
        from dmuon.bench.models import build_workload
        from dmuon.bench.setups import Hyper, build
        from dmuon.ortho import NSConfig

        self.world_size, self.repeats = world_size, repeats
        self.groups = groups = bench_model_shapes(model, size)
        gen = torch.Generator().manual_seed(rank)
        # Matmul rate: each Linear's forward GEMM and its two backward GEMMs at the bench's tokens.
        self.mats = [(torch.randn(tokens, g.shape[1], generator=gen), torch.randn(g.shape[0], g.shape[1],
                                                                                   generator=gen), g.count)
                     for g in groups if "embed" not in g.name]
        self.gemm_flops = sum(6.0 * tokens * w.shape[0] * w.shape[1] * n for _, w, n in self.mats)
        # The ranks' drift between meetings: one block's GEMMs (the groups every layer has) between tiny
        # all-reduces, as FSDP2 makes the ranks meet every block.
        self.block = [(x, w) for x, w, n in self.mats if n > 1] or [(x, w) for x, w, _ in self.mats]
        self.flag = torch.zeros(1)
        # Effective rate: a forward and backward of the bench model under FSDP2 (ZeRO-3) on a one-rank
        # mesh: FSDP2's own work on the rank (copies in and out, hooks) without communication, counted as
        # the simulation counts it, 6 x parameters x tokens: the sense of the presets' effective rates.
        from torch.distributed.device_mesh import DeviceMesh

        from dmuon.bench.setups import shard_workload

        alone = [dist.new_group([r]) for r in range(world_size)][rank]
        mesh = DeviceMesh.from_group(alone, "cpu")
        self.workload = build_workload(model, size=size, seed=0)
        shard_workload(self.workload, mesh, reshard=True)  # as the bench's ZeRO-3 configurations
        self.batch = self.workload.make_batch(0, rank)
        self.counted = 6.0 * tokens * sum(g.numel for g in groups)
        # The work beyond the GEMMs: the same model's forward and backward without FSDP2 (plain tensors, one
        # rank) less what 6 x parameters x tokens at the matmul rate prices: attention's products, norms,
        # activations, the loss's softmax (the embedding lookup, which that count prices as a GEMM, offsets it).
        self.plain = build_workload(model, size=size, seed=0)
        self.plain_batch = self.plain.make_batch(0, rank)
        # Per-tensor dispatch counts every parameter tensor, the 1-D ones the shape lists leave out too.
        self.unlisted_tensors = len(list(self.workload.model.parameters())) - sum(g.count for g in groups)
        # The host's cost per operation: elementwise operations on tiny tensors (the arithmetic negligible),
        # plain and as FSDP2's Shard(0) DTensors on the one-rank mesh, each pair of its own shape as a
        # model's parameters are (DTensor caches its sharding propagation per shape), half of them in
        # place and half making a new tensor (which costs DTensor a new wrapper): the mix of
        # torch.optim.AdamW's per-tensor loop, the largest user of DTensor operations modelled.
        from torch.distributed.tensor import DTensor, Shard

        shapes = [(4 + k, 3) for k in range(DISPATCH_TENSORS)]
        self.plain_pairs = [(torch.ones(s), torch.ones(s)) for s in shapes]
        self.dtensor_pairs = [tuple(DTensor.from_local(torch.ones(s), mesh, [Shard(0)]) for _ in range(2))
                              for s in shapes]
        # DTensor's layout calls as gather-then-compute makes them per matrix, on every rank's mesh, at the
        # bench model's Muon shapes in bf16 (its wire; at 8 elements the figure came out a third of what
        # these sizes cost): full_tensor() less a plain all-gather of the same bytes, and distribute_tensor
        # (each rank cuts its piece, no collective): their host path beyond the collective.
        from torch.distributed.tensor import distribute_tensor

        self.world_mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        muon_shapes = sorted({tuple(g.shape) for g in groups if g.muon}) or [(8 * world_size, 1)]
        self.layout_pieces = [distribute_tensor(torch.ones(shape, dtype=torch.bfloat16), self.world_mesh, [Shard(0)],
                                                src_data_rank=None) for shape in muon_shapes]
        self.layout_buffers = [torch.empty(piece.to_local().numel() * world_size, dtype=torch.bfloat16)
                               for piece in self.layout_pieces]
        # FSDP2's per-unit host work: the model's tiny twin (its blocks and tensors, tiny widths) under
        # FSDP2 on the one-rank mesh, less the same without FSDP2, per unit and pass; and the twin under
        # FSDP2 over every rank, as the bench shards (its collectives, and FSDP2's work beside them that a
        # one-rank mesh skips: calibrate_fit.rank_unit_seconds).
        self.twins = []
        for twin_mesh in (mesh, None, self.world_mesh):
            twin = build_workload(model, size="tiny", seed=0)
            if twin_mesh is not None:
                shard_workload(twin, twin_mesh, reshard=True)
            self.twins.append((twin, twin.make_batch(0, rank)))
        self.units = len(self.twins[0][0].blocks) + 1
        # Each code path's own host time (its Python between the operations the host figures price): the
        # twin's optimizer step over every rank, ZeRO-3, built as the bench builds each configuration.
        self.twin_steps = {}
        for config in TWIN_PATHS:
            twin = build_workload(model, size="tiny", seed=0)
            optimizer, _ = build(config, twin, self.world_mesh, hyper or Hyper())
            self.twin_steps[config] = (twin, optimizer, twin.make_batch(0, rank))
        self.twin_counts = _muon_counts(bench_model_shapes(model, "tiny"))
        # Elementwise rate: dmuon's AdamW kernel over this rank's shards of every parameter listed.
        shards = [(-(-g.shape[0] // world_size), g.shape[1]) for g in groups for _ in range(g.count)]
        self.adam_state = [[torch.randn(shape, generator=gen) for shape in shards] for _ in range(4)]
        self.adam_state[3] = [x.abs() for x in self.adam_state[3]]
        self.adam_steps = [torch.tensor(1.0) for _ in shards]
        self.adam_bytes = 28 * sum(x.numel() for x in self.adam_state[0])
        # NS: the owners' update per shape and batch size, with the bench's NS settings.
        self.ns = NSConfig(dtype=torch.bfloat16, method="auto")
        self.counts = _muon_counts(groups)

    def ns_seconds(self, shape: tuple[int, int], batch: int) -> float:
        """The owners' update of ``batch`` directions of ``shape`` (bf16, as the exchange delivers them), as
        :func:`dmuon.plan.profile.measure_update` times it, its mean over :data:`NS_REPEATS` runs."""
        from dmuon.ortho.owner import owner_update

        gen = torch.Generator().manual_seed(1234 + 7 * batch)
        directions = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(batch)]
        return _mean_seconds(lambda: owner_update(directions, self.ns), NS_REPEATS)

    def gemms(self) -> None:
        for x, w, n in self.mats:
            for _ in range(n):
                y = x @ w.T          # forward
                _ = y @ w            # backward: input gradient
                _ = y.T @ x          # backward: weight gradient

    def forward_backward(self) -> None:
        self.workload.loss_fn(self.workload.model, self.batch).backward()
        self.workload.model.zero_grad(set_to_none=True)

    def plain_forward_backward(self) -> None:
        self.plain.loss_fn(self.plain.model, self.plain_batch).backward()
        self.plain.model.zero_grad(set_to_none=True)

    def block_gemms(self, meet: bool, often: bool = False) -> None:
        """:data:`SKEW_BLOCKS` blocks' GEMMs; with ``meet`` an all-reduce after each block, or with
        ``often`` after each matrix's (the same compute, ``len(self.block)`` times the meetings)."""
        for _ in range(SKEW_BLOCKS):
            for x, w in self.block:
                y = x @ w.T
                _ = y @ w
                _ = y.T @ x
                if often:
                    dist.all_reduce(self.flag)
            if meet and not often:
                dist.all_reduce(self.flag)

    def meetings(self, often: bool = False) -> None:
        for _ in range(SKEW_BLOCKS * (len(self.block) if often else 1)):
            dist.all_reduce(self.flag)

    def skew_seconds(self) -> dict:
        """The timings the ranks' drift comes from (:func:`dmuon.bench.calibrate_fit.drift`): blocks of
        GEMMs with an all-reduce after each (``met``) and after each matrix (``met_often``), the GEMMs
        alone (``alone``), the all-reduces alone (``meetings``, ``meetings_often``), each timed from a
        barrier, so only the drift within a run counts, interleaved (:func:`_interleaved_means`): the
        drift is their difference; and the meetings' counts."""
        out = _interleaved_means({"alone": lambda: self.block_gemms(False), "met": lambda: self.block_gemms(True),
                                  "met_often": lambda: self.block_gemms(True, often=True),
                                  "meetings": self.meetings, "meetings_often": lambda: self.meetings(True)},
                                 self.repeats)
        return out | {"count": SKEW_BLOCKS, "count_often": SKEW_BLOCKS * len(self.block)}

    def twin_forward_backward(self, k: int) -> None:
        twin, batch = self.twins[k]
        twin.loss_fn(twin.model, batch).backward()
        twin.model.zero_grad(set_to_none=True)

    def twin_seconds(self) -> dict:
        """The tiny twin's forward+backward under FSDP2 on the one-rank mesh, without FSDP2 and under FSDP2
        over every rank, interleaved (:func:`_interleaved_means`: the first two are subtracted, the last
        is held against their prediction); FSDP2's per-unit work from the first two."""
        one, plain, world = _interleaved_means({k: (lambda k=k: self.twin_forward_backward(k)) for k in range(3)},
                                               self.repeats).values()
        return {"fsdp_unit_seconds": max(0.0, one - plain) / (2 * self.units), "twin_plain_seconds": plain,
                "twin_world_seconds": world, "twin_units": self.units}

    def twin_optimizer_step(self, config: str) -> float:
        """One untimed forward+backward of ``config``'s twin, then its ``step()`` and ``zero_grad`` timed from a
        barrier, as the bench times an optimizer phase."""
        twin, optimizer, batch = self.twin_steps[config]
        twin.loss_fn(twin.model, batch).backward()
        dist.barrier()
        start = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def twin_optimizer_seconds(self) -> dict:
        """Per code path (:data:`TWIN_PATHS`) the mean of the twin's optimizer phase over ``repeats``
        interleaved runs, after one warm-up each (the mean: a step takes preemptions at their rate)."""
        for config in self.twin_steps:
            self.twin_optimizer_step(config)
        times = {config: [] for config in self.twin_steps}
        for _ in range(self.repeats):
            for config in self.twin_steps:
                times[config].append(self.twin_optimizer_step(config))
        return {config: statistics.mean(t) for config, t in times.items()}

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

    def layout_seconds(self) -> float:
        """Seconds per layout call beyond its collective: :meth:`layout_calls` less
        :meth:`layout_collectives`, interleaved (:func:`_interleaved_means`: they are subtracted)."""
        calls, collectives = _interleaved_means({"calls": self.layout_calls, "collectives": self.layout_collectives},
                                                self.repeats).values()
        return max(0.0, calls - collectives) / (2 * LAYOUT_LOOP * len(self.layout_pieces))

    def adamw(self) -> None:
        from torch.optim.adam import adam
        params, grads, m1, m2 = self.adam_state
        adam(params, grads, m1, m2, [], self.adam_steps, foreach=True, has_complex=False,
             decoupled_weight_decay=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3, weight_decay=0.01,
             eps=1e-8, maximize=False)

    def measure(self) -> dict:
        # The GEMMs and the plain forward+backward interleaved: the work beyond the GEMMs is their difference
        # (timed one after the other, they sampled different moments of the shared machine).
        gemms, fsdp, plain = _interleaved_means({"gemms": self.gemms, "fsdp": self.forward_backward,
                                                 "plain": self.plain_forward_backward}, self.repeats).values()
        matmul = self.gemm_flops / gemms
        out = {"matmul_flops": matmul,
               "effective_flops": self.counted / fsdp,
               "non_gemm_seconds": max(0.0, plain - self.counted / matmul),
               "elementwise_bytes": self.adam_bytes / _mean_seconds(self.adamw, self.repeats),
               "dispatch_seconds": _mean_seconds(lambda: self.dispatch(self.plain_pairs), self.repeats)
               / (DISPATCH_OPS * DISPATCH_TENSORS),
               "dtensor_dispatch_seconds": _mean_seconds(lambda: self.dispatch(self.dtensor_pairs), self.repeats)
               / (DISPATCH_OPS * DISPATCH_TENSORS),
               "dtensor_layout_seconds": self.layout_seconds(),
               **self.twin_seconds(),
               "twin_optimizer_seconds": self.twin_optimizer_seconds(),
               "skew_seconds": self.skew_seconds(),
               "unlisted_tensors": self.unlisted_tensors}
        for key, counts in (("ns_seconds", self.counts), ("twin_ns_seconds", self.twin_counts)):
            out[key] = {}
            for shape, count in sorted(counts.items()):
                for batch in range(1, count + 1):
                    dist.barrier()
                    out[key][f"{shape[0]}x{shape[1]}x{batch}"] = self.ns_seconds(shape, batch)
        out["link_samples"], out["unsupported"] = self.link()
        return out

    def link(self) -> tuple[list, dict]:
        """The gloo link: four collectives, each rank sending n bytes to each peer, n from 16 KiB to 4 MiB;
        the all-reduce of the reduce-scatter's input (n per rank, ``W n`` in all). Each sample's bytes
        are what each rank sends as the step model counts it: ``(W - 1) n``, the all-reduce (a ring)
        ``2 (W - 1) / W`` of its ``W n``."""
        world_size, samples, unsupported = self.world_size, [], {}
        for _ in range(3):  # first uses of the pairs and buffers, untimed
            dist.all_to_all_single(torch.empty(4096 * world_size), torch.ones(4096 * world_size))
            _ALL_GATHER(torch.empty(4096 * world_size), torch.ones(4096))
            _REDUCE_SCATTER(torch.empty(4096), torch.ones(4096 * world_size))
            dist.all_reduce(torch.ones(4096 * world_size))
        for n in LINK_SIZES:
            elems = n // 4
            send, gathered, big, out = (torch.ones(elems), torch.empty(elems * world_size),
                                        torch.ones(elems * world_size), torch.empty(elems))
            ops = {"all_gather": lambda: _ALL_GATHER(gathered, send),
                   "reduce_scatter": lambda: _REDUCE_SCATTER(out, big),
                   "all_to_all": lambda: dist.all_to_all_single(gathered, big),
                   "all_reduce": lambda: dist.all_reduce(big)}
            for op, fn in ops.items():
                sent = 2 * n * (world_size - 1) if op == "all_reduce" else n * (world_size - 1)
                try:
                    samples.append((op, sent, _mean_seconds(fn, self.repeats)))
                except RuntimeError as err:  # a collective this gloo build lacks
                    unsupported[op] = str(err).splitlines()[0]
        return samples, unsupported
