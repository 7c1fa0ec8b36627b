"""``dmuon bench --calibrate``: the step simulation against the bench on this machine.

One command, on ``--world-size`` gloo ranks (one thread each):

1. **The bench**: ``adamw``, ``gather``, ``dmuon_z2`` and ``dmuon_z3``, built, warmed up and
   timed in interleaved rounds as ``dmuon bench`` does (:func:`dmuon.bench.runner.run_all`).
2. **This machine's figures**, measured on every rank at once before each round and after
   the last, so they cover the same span of time as the timed steps (the shared machine
   drifts by tens of percent within a run): the matmul rate of the bench model's forward
   and backward GEMMs (its Linear layers at its tokens per rank, fp32); an effective rate,
   the model's forward+backward under FSDP2 on a one-rank mesh (no communication) counted as
   6 x parameters x tokens, the sense of the presets' effective rates; the elementwise rate
   of dmuon's AdamW kernel (``torch.optim.adam.adam``, foreach) over tensors shaped like one
   rank's shards; the owners' NS per shape and batch size with the bench's NS settings (bf16,
   ``auto``); and the gloo link: all-gather, reduce-scatter and all-to-all of 16 KiB to 4 MiB
   per rank, one latency and one bandwidth fitted to all of them (relative least squares of
   ``time = latency + bytes / bandwidth``, bytes being what each rank sends). Collectives make
   the ranks wait for each other every block, so at each point the slower rank counts.
3. **The simulation** (:mod:`dmuon.costmodel.simulate`, ``backend="gloo"``: FSDP2's
   collectives block the rank's thread, one speculative return wave, the CPU default) of the
   same four configurations, forward and backward at the matmul rate (the check) and at the
   effective rate (which shows how much of the error is the compute model), beside the
   measured medians, with each prediction's error and the two orders by step time.

Nothing is fitted to the bench's timings: the same machine figures serve every configuration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from dmuon.bench.shapes import bench_model_shapes
from dmuon.costmodel.offline import plan_offline
from dmuon.costmodel.simulate import Hardware, SimOptions
from dmuon.costmodel.traffic import AlphaBeta
from dmuon.util.spawn import run_distributed

CONFIGS = {"adamw": ("fsdp_adamw", 3), "gather": ("gather", 3), "dmuon_z2": ("dmuon", 2), "dmuon_z3": ("dmuon", 3)}
"""Bench configuration -> (simulated strategy, ZeRO level)."""
LINK_SIZES = tuple(16384 * 2**k for k in range(9))
"""Bytes per rank of the link measurements: 16 KiB to 4 MiB, the range of the bench's collectives
(the default workload's blocks all-gather and reduce-scatter 0.4-4 MiB per rank; dmuon's exchanges less)."""


def _median_seconds(fn, repeats: int, barrier: bool = True) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _Meter:
    """One rank's machine measurements; every rank measures at once, as the bench runs them."""

    def __init__(self, rank: int, world_size: int, model: str, size: str | None, tokens: int, repeats: int):
        from dmuon.bench.models import build_workload
        from dmuon.ortho import NSConfig

        self.world_size, self.repeats = world_size, repeats
        self.groups = groups = bench_model_shapes(model, size)
        gen = torch.Generator().manual_seed(rank)
        # Matmul rate: each Linear's forward GEMM and its two backward GEMMs at the bench's tokens.
        self.mats = [(torch.randn(tokens, g.shape[1], generator=gen), torch.randn(g.shape[0], g.shape[1],
                                                                                   generator=gen), g.count)
                     for g in groups if "embed" not in g.name]
        self.gemm_flops = sum(6.0 * tokens * w.shape[0] * w.shape[1] * n for _, w, n in self.mats)
        # Effective rate: a forward and backward of the bench model under FSDP2 (ZeRO-3) on a one-rank
        # mesh: FSDP2's own work on the rank (copies in and out, hooks) without communication, counted as
        # the simulation counts it, 6 x parameters x tokens: the sense of the presets' effective rates.
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        alone = [dist.new_group([r]) for r in range(world_size)][rank]
        mesh = DeviceMesh.from_group(alone, "cpu")
        self.workload = build_workload(model, size=size, seed=0)
        for block in self.workload.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(self.workload.model, mesh=mesh, reshard_after_forward=True)
        self.batch = self.workload.make_batch(0, rank)
        self.counted = 6.0 * tokens * sum(g.numel for g in groups)
        # Elementwise rate: dmuon's AdamW kernel over this rank's shards of every parameter listed.
        shards = [(-(-g.shape[0] // world_size), g.shape[1]) for g in groups for _ in range(g.count)]
        self.adam_state = [[torch.randn(shape, generator=gen) for shape in shards] for _ in range(4)]
        self.adam_state[3] = [x.abs() for x in self.adam_state[3]]
        self.adam_steps = [torch.tensor(1.0) for _ in shards]
        self.adam_bytes = 28 * sum(x.numel() for x in self.adam_state[0])
        # NS: the owners' update per shape and batch size, with the bench's NS settings.
        self.ns = NSConfig(dtype=torch.bfloat16, method="auto")
        self.counts: dict[tuple[int, int], int] = {}
        for g in groups:
            if g.muon:
                self.counts[tuple(g.shape)] = self.counts.get(tuple(g.shape), 0) + g.count

    def gemms(self) -> None:
        for x, w, n in self.mats:
            for _ in range(n):
                y = x @ w.T          # forward
                _ = y @ w            # backward: input gradient
                _ = y.T @ x          # backward: weight gradient

    def forward_backward(self) -> None:
        self.workload.loss_fn(self.workload.model, self.batch).backward()
        self.workload.model.zero_grad(set_to_none=True)

    def adamw(self) -> None:
        from torch.optim.adam import adam
        params, grads, m1, m2 = self.adam_state
        adam(params, grads, m1, m2, [], self.adam_steps, foreach=True, has_complex=False,
             decoupled_weight_decay=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3, weight_decay=0.01,
             eps=1e-8, maximize=False)

    def measure(self) -> dict:
        from dmuon.plan.profile import measure_update

        out = {"matmul_flops": self.gemm_flops / _median_seconds(self.gemms, self.repeats),
               "effective_flops": self.counted / _median_seconds(self.forward_backward, self.repeats),
               "elementwise_bytes": self.adam_bytes / _median_seconds(self.adamw, self.repeats),
               "ns_seconds": {}}
        for shape, count in sorted(self.counts.items()):
            for batch in range(1, count + 1):
                dist.barrier()
                out["ns_seconds"][f"{shape[0]}x{shape[1]}x{batch}"] = measure_update(
                    shape, batch, dtype=torch.float32, ns_kwargs=self.ns.kwargs(), device=torch.device("cpu"),
                    repeats=3)
        out["link_samples"], out["unsupported"] = self.link()
        return out

    def link(self) -> tuple[list, dict]:
        """The gloo link: three collectives, each rank sending n bytes to each peer, n from 16 KiB to 4 MiB."""
        world_size, samples, unsupported = self.world_size, [], {}
        for _ in range(3):  # first uses of the pairs and buffers, untimed
            dist.all_to_all_single(torch.empty(4096 * world_size), torch.ones(4096 * world_size))
            dist.all_gather_into_tensor(torch.empty(4096 * world_size), torch.ones(4096))
            dist.reduce_scatter_tensor(torch.empty(4096), torch.ones(4096 * world_size))
        for n in LINK_SIZES:
            elems = n // 4
            send, gathered, big, out = (torch.ones(elems), torch.empty(elems * world_size),
                                        torch.ones(elems * world_size), torch.empty(elems))
            ops = {"all_gather": lambda: dist.all_gather_into_tensor(gathered, send),
                   "reduce_scatter": lambda: dist.reduce_scatter_tensor(out, big),
                   "all_to_all": lambda: dist.all_to_all_single(gathered, big)}
            for op, fn in ops.items():
                try:
                    samples.append((op, n * (world_size - 1), _median_seconds(fn, self.repeats)))
                except RuntimeError as err:  # a collective this gloo build lacks
                    unsupported[op] = str(err).splitlines()[0]
        return samples, unsupported


def _measure(rank: int, world_size: int, model: str, size: str | None, tokens: int, repeats: int) -> list[dict]:
    """One rank's machine figures, once (``--measure-only``)."""
    return [_Meter(rank, world_size, model, size, tokens, repeats).measure()]


def _bench_between_measurements(rank: int, world_size: int, configs: list[str], opts, model: str,
                                size: str | None, tokens: int, repeats: int) -> tuple[list[dict], list[dict]]:
    """The bench's interleaved run (:func:`dmuon.bench.runner.run_all`) with the machine measured before
    every round and after the last: the figures cover the same span of time as the timed steps."""
    from dmuon.bench.runner import _ConfigRun, _device, _mesh, _prime, round_sizes

    meter = _Meter(rank, world_size, model, size, tokens, repeats)
    _prime(rank, world_size, opts)
    device = _device()
    mesh = _mesh(device, world_size, opts)
    runs = []
    for config in configs:
        run = _ConfigRun(rank, world_size, config, opts, mesh, device)
        for _ in range(opts.warmup):
            run.train_step(timed=False)
        run.record_peak()
        runs.append(run)
        dist.barrier()
    figures = []
    for k, steps in enumerate(round_sizes(opts.steps, opts.rounds)):
        figures.append(meter.measure())
        dist.barrier()
        for run in runs:
            for _ in range(steps):
                run.train_step(timed=True, round_index=k)
    figures.append(meter.measure())
    return [run.result() for run in runs], figures


def fit_link(samples: list[tuple[str, int, float]]) -> tuple[float, float]:
    """``time = latency + bytes / bandwidth`` over ``(op, bytes, seconds)`` samples, least squares of the
    relative error (each sample weighted by 1 / time², so the small sizes set the latency and the large
    ones the bandwidth)."""
    # Minimise sum(((a + b x - y) / y)^2): the normal equations of a weighted linear fit.
    w = [1.0 / t**2 for _, _, t in samples]
    xs, ys = [float(b) for _, b, _ in samples], [t for _, _, t in samples]
    sw = sum(w)
    sx, sy = sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx, sxy = sum(wi * x * x for wi, x in zip(w, xs)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    latency = (sy - slope * sx) / sw
    if latency < 0:  # no latency: refit the bandwidth through the origin
        latency, slope = 0.0, sxy / sxx
    return latency, 1.0 / slope


def combine(per_rank: list[list[dict]]) -> dict:
    """Machine figures from ``per_rank[rank][point]`` measurements. Collectives make the ranks wait for
    each other every block, so at each point in time the slower rank counts (the lowest rate, the
    highest NS time); the figures are the means over the points, and ``spread`` each rate's lowest
    and highest point. The link is fitted to every sample of every rank and point."""
    rates = ("matmul_flops", "effective_flops", "elementwise_bytes")
    points = list(zip(*per_rank))
    bound = [{k: min(m[k] for m in point) for k in rates}
             | {"ns_seconds": {key: max(m["ns_seconds"][key] for m in point) for key in point[0]["ns_seconds"]}}
             for point in points]
    samples = [s for point in points for m in point for s in m["link_samples"]]
    latency, bandwidth = fit_link(samples)
    return {
        **{k: statistics.mean(b[k] for b in bound) for k in rates},
        "spread": {k: [min(b[k] for b in bound), max(b[k] for b in bound)] for k in rates},
        "ns_seconds": {key: statistics.mean(b["ns_seconds"][key] for b in bound) for key in bound[0]["ns_seconds"]},
        "link_latency": latency,
        "link_bandwidth": bandwidth,
        "link_samples": samples,
        "unsupported": per_rank[0][0].get("unsupported", {}),
        "points": len(points),
    }


def _ns_lookup(ns: dict):
    def seconds(shape: tuple[int, int], batch: int) -> float:
        key = f"{shape[0]}x{shape[1]}x{batch}"
        return ns[key] if key in ns else batch * ns[f"{shape[0]}x{shape[1]}x1"]
    return seconds


def predict(figures: dict, model: str, size: str | None, world_size: int, tokens: int,
            compute: str = "matmul_flops") -> dict:
    """The simulated step of each bench configuration on ``world_size`` ranks (1-D FSDP), forward and
    backward at ``figures[compute]`` FLOP/s."""
    groups = bench_model_shapes(model, size)
    # The bench runs fp32 parameters (FSDP2 gathers and reduces fp32), NS and the wire in bf16.
    hardware = Hardware("this machine (dmuon bench --calibrate)", figures[compute], figures["matmul_flops"],
                        figures["elementwise_bytes"],
                        AlphaBeta(intra_bandwidth=figures["link_bandwidth"], inter_bandwidth=figures["link_bandwidth"],
                                  intra_latency=figures["link_latency"], inter_latency=figures["link_latency"]))
    options = SimOptions(tokens_per_gpu=tokens, ns_seconds=_ns_lookup(figures["ns_seconds"]), backend="gloo")
    plans = {zero: plan_offline(groups, world_size, "greedy", zero, wire_bytes=2, param_bytes=4, reduce_bytes=4,
                                hardware=hardware, sim_options=options, max_waves=1)
             for zero in (2, 3)}
    return {config: plans[zero]["simulation"][strategy] for config, (strategy, zero) in CONFIGS.items()}


def compare(measured: dict, predicted: dict) -> dict:
    """Per configuration the measured and predicted step and optimizer phase and their errors; the orders."""
    rows = {}
    for config in CONFIGS:
        m, p = measured[config], predicted[config]
        row = {}
        for key, mkey, pkey in (("step", "step_s", "step_seconds"), ("forward_backward", "fwd_bwd_s",
                                                                      "forward_backward_seconds"),
                                ("optimizer", "optimizer_s", "optimizer_seconds")):
            row[key] = {"measured": m[mkey], "predicted": p[pkey], "error": p[pkey] / m[mkey] - 1}
        rows[config] = row
    order = {k: sorted(CONFIGS, key=lambda c: rows[c]["step"][k]) for k in ("measured", "predicted")}
    return {"configs": rows, "order_by_step": order, "same_order": order["measured"] == order["predicted"]}


def format_comparison(figures: dict, comparison: dict, header: str, compute: str = "matmul") -> str:
    lines = [header] if header else []
    lines += [f"machine: matmul {figures['matmul_flops'] / 1e9:.1f} GFLOP/s (fp32, the model's GEMMs), effective "
             f"{figures['effective_flops'] / 1e9:.1f} GFLOP/s (forward+backward under FSDP2 on a one-rank mesh, as "
             f"6 x parameters x tokens), elementwise "
             f"{figures['elementwise_bytes'] / 1e9:.2f} GB/s (AdamW kernel on one rank's shards), gloo link "
             f"{figures['link_latency'] * 1e6:.0f} us + bytes / {figures['link_bandwidth'] / 1e9:.2f} GB/s "
             f"(fit over {len(figures['link_samples'])} all-gather, reduce-scatter and all-to-all samples of 16 KiB "
             f"to 4 MiB per rank), NS "
             f"profiled per shape and batch (bf16, auto); forward+backward predicted at the {compute} rate",
             "| config | step ms: measured / predicted (error) | fwd+bwd ms | optimizer ms |",
             "|---|---|---|---|"]
    for config, row in comparison["configs"].items():
        cells = [f"{row[k]['measured'] * 1e3:.1f} / {row[k]['predicted'] * 1e3:.1f} ({row[k]['error']:+.0%})"
                 for k in ("step", "forward_backward", "optimizer")]
        lines.append(f"| `{config}` | " + " | ".join(cells) + " |")
    order = comparison["order_by_step"]
    lines.append(f"order by step time: measured {', '.join(order['measured'])}; predicted "
                 f"{', '.join(order['predicted'])} ({'same' if comparison['same_order'] else 'different'})")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dmuon bench --calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2", choices=["qwen2", "vla", "tiny"])
    p.add_argument("--size", default=None)
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks, one thread each (default 2)")
    p.add_argument("--steps", type=int, default=8, help="timed bench steps per configuration (default 8)")
    p.add_argument("--rounds", type=int, default=4, help="bench rounds (default 4)")
    p.add_argument("--repeats", type=int, default=7, help="timed runs of each machine measurement (median)")
    p.add_argument("--measure-only", action="store_true", help="print the machine's figures, run no bench")
    p.add_argument("--json", default=None, metavar="PATH")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dmuon.bench.cli import _options, build_parser as bench_parser
    from dmuon.bench.models import build_workload, resolve_size
    from dmuon.bench.report import machine_description

    size = resolve_size(args.model, args.size)
    with torch.device("meta"):
        tokens = build_workload(args.model, size=size).tokens_per_rank
    start = time.perf_counter()
    if args.measure_only:
        per_rank = run_distributed(_measure, args.world_size, args.model, size, tokens, args.repeats, timeout_s=900)
        measured = None
    else:
        bench_args = bench_parser().parse_args(
            ["--model", args.model, "--size", size, "--world-size", str(args.world_size), "--configs",
             ",".join(CONFIGS), "--steps", str(args.steps), "--rounds", str(args.rounds), "--quiet"])
        per_rank = run_distributed(_bench_between_measurements, args.world_size, list(CONFIGS),
                                   _options(bench_args), args.model, size, tokens, args.repeats, timeout_s=1800)
        measured = {r["config"]: r for r in per_rank[0][0]}
        per_rank = [points for _, points in per_rank]
    figures = combine(per_rank)
    print(f"{args.model} ({size}) on {args.world_size} gloo ranks: {time.perf_counter() - start:.0f} s",
          file=sys.stderr)
    predicted = predict(figures, args.model, size, args.world_size, tokens)
    effective = predict(figures, args.model, size, args.world_size, tokens, compute="effective_flops")
    payload = {"model": args.model, "size": size, "world_size": args.world_size, "tokens_per_rank": tokens,
               "machine": machine_description(), "figures": figures, "predicted": predicted,
               "predicted_at_effective_rate": effective}
    if measured is not None:
        payload["bench"] = {"steps": args.steps, "rounds": args.rounds, "results": list(measured.values())}
        payload["comparison"] = compare(measured, predicted)
        payload["comparison_at_effective_rate"] = compare(measured, effective)
        spread = ", ".join(f"{k.split('_')[0]} {lo / 1e9:.1f}-{hi / 1e9:.1f}"
                           for k, (lo, hi) in figures["spread"].items())
        header = (f"{args.model} ({size}), {args.world_size} gloo ranks, {tokens} tokens per rank; bench: "
                  f"{args.steps} timed steps in {args.rounds} rounds, medians; machine measured on every rank before "
                  f"each round and after the last, the slower rank at each of the {figures['points']} points "
                  f"(range over them, G/s: {spread}); {payload['machine']}")
        print(format_comparison(figures, payload["comparison"], header))
        print("\nthe same, forward+backward at the effective rate (FSDP2's own work on a rank and the model's "
              "non-GEMM work in the rate, as in the presets):")
        print("\n".join(format_comparison(figures, payload["comparison_at_effective_rate"], "",
                                           "effective").splitlines()[1:]))
    else:
        print(json.dumps({k: v for k, v in figures.items() if k not in ("link_samples", "ns_seconds")}, indent=1))
        for rate, table in (("matmul", predicted), ("effective", effective)):
            for config, p in table.items():
                print(f"{config} ({rate} rate): predicted step {p['step_seconds'] * 1e3:.1f} ms, fwd+bwd "
                      f"{p['forward_backward_seconds'] * 1e3:.1f}, optimizer {p['optimizer_seconds'] * 1e3:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {args.json}")
    return 0
