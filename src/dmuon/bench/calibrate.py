"""``dmuon bench --calibrate``: the step simulation against the bench on this machine.

One command, on ``--world-size`` gloo ranks (one thread each):

1. **The bench**: ``adamw``, ``gather``, ``dmuon_z2`` and ``dmuon_z3``, built, warmed up and
   timed in interleaved rounds as ``dmuon bench`` does (:func:`dmuon.bench.runner.run_all`).
2. **This machine's figures** (:class:`dmuon.bench.calibrate_meter.Meter`), measured on every rank at
   once before each round and after the last, so they cover the same span of time as the timed
   steps (the shared machine drifts by tens of percent within a run): compute rates, the work beyond
   the GEMMs, the elementwise rate, the owners' NS, the gloo link per collective kind, the host's
   work per operation and per code path (from the model's tiny twin), the ranks' drift.
3. **The simulation** (:mod:`dmuon.costmodel.simulate`, ``backend="gloo"``: FSDP2's
   collectives block the rank's thread, one speculative return wave, the CPU default, host and
   device work adding up on the rank's one thread) of the same four configurations, with the
   operations each code path dispatches per tensor (:class:`dmuon.costmodel.host.HostOps`,
   counted from the code, each path's at its twin's factor), forward and backward as the GEMMs at
   the matmul rate plus the work beyond them and FSDP2's per-unit work (the check), and again at
   the effective rate (the presets' sense of a rate), beside the measured medians, with each
   prediction's error, the orders by step time and the pairs the rounds separate
   (:func:`dmuon.bench.calibrate_fit.order_check`).

``--measure-only`` measures the machine's figures and prints them with the predictions, no bench: the
figures are what ``dmuon plan --simulate`` takes as overrides (``--compute-tflops``, ``--non-gemm-ms``,
``--dispatch-us``, ...) to price a step on this kind of host.

Nothing is fitted to the bench's timings: the same machine figures serve every configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from dmuon.bench.calibrate_fit import (
    CONFIGS,
    combine,
    compare,
    figures_line,
    format_comparison,
    path_host_factors,
    predict,
    predict_by_round,
    rank_unit_seconds,
)
from dmuon.bench.calibrate_meter import Meter
from dmuon.util.spawn import run_distributed


def _measure(rank: int, world_size: int, model: str, size: str | None, tokens: int, repeats: int) -> list[dict]:
    """One rank's machine figures, once (``--measure-only``)."""
    return [Meter(rank, world_size, model, size, tokens, repeats).measure()]


def _bench_between_measurements(rank: int, world_size: int, configs: list[str], opts, model: str,
                                size: str | None, tokens: int, repeats: int) -> tuple[list[dict], list[dict]]:
    """The bench's interleaved run (:func:`dmuon.bench.runner.run_all`) with the machine measured before
    every round and after the last: the figures cover the same span of time as the timed steps."""
    from dmuon.bench.runner import _ConfigRun, _device, _mesh, _prime, round_sizes

    meter = Meter(rank, world_size, model, size, tokens, repeats, opts.hyper)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dmuon bench --calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2", choices=["qwen2", "vla", "tiny"])
    p.add_argument("--size", default=None)
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks, one thread each (default 2)")
    p.add_argument("--steps", type=int, default=8, help="timed bench steps per configuration (default 8)")
    p.add_argument("--rounds", type=int, default=4, help="bench rounds (default 4)")
    p.add_argument("--repeats", type=int, default=7, help="timed runs of each machine measurement (their mean)")
    p.add_argument("--measure-only", action="store_true", help="print the machine's figures, run no bench")
    p.add_argument("--json", default=None, metavar="PATH")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dmuon.bench.options import bench_options, build_parser as bench_parser
    from dmuon.bench.models import build_workload, resolve_size
    from dmuon.bench.report import machine_description

    size = resolve_size(args.model, args.size)
    with torch.device("meta"):
        tokens = build_workload(args.model, size=size).tokens_per_rank
    start, load_start = time.perf_counter(), os.getloadavg()
    if args.measure_only:
        per_rank = run_distributed(_measure, args.world_size, args.model, size, tokens, args.repeats, timeout_s=900)
        measured = None
    else:
        bench_args = bench_parser().parse_args(
            ["--model", args.model, "--size", size, "--world-size", str(args.world_size), "--configs",
             ",".join(CONFIGS), "--steps", str(args.steps), "--rounds", str(args.rounds), "--quiet"])
        per_rank = run_distributed(_bench_between_measurements, args.world_size, list(CONFIGS),
                                   bench_options(bench_args), args.model, size, tokens, args.repeats, timeout_s=1800)
        measured = {r["config"]: r for r in per_rank[0][0]}
        per_rank = [points for _, points in per_rank]
    figures = combine(per_rank, args.world_size)
    figures["rank_unit_seconds"] = rank_unit_seconds(figures, args.model, args.world_size)
    figures["host_factors"] = path_host_factors(figures, args.model, args.world_size)
    load = {"start": load_start, "end": os.getloadavg()}
    print(f"{args.model} ({size}) on {args.world_size} gloo ranks: {time.perf_counter() - start:.0f} s",
          file=sys.stderr)
    predicted = predict(figures, args.model, size, args.world_size, tokens)
    # The effective rate prices forward and backward as the presets do (FSDP2's own work on a rank and the
    # model's non-GEMM work inside one rate): how far that simpler model lands shows what a preset's
    # effective rate leaves out.
    effective = predict(figures, args.model, size, args.world_size, tokens, compute="effective_flops")
    payload = {"model": args.model, "size": size, "world_size": args.world_size, "tokens_per_rank": tokens,
               "machine": machine_description(), "load_average": load, "figures": figures, "predicted": predicted,
               "predicted_at_effective_rate": effective,
               "per_rank_points": per_rank}  # every rank's own figures at every point, for analyses after the run
    loads = (f"load average (1, 5, 15 min) {' / '.join(f'{x:.2f}' for x in load['start'])} at the start, "
             f"{' / '.join(f'{x:.2f}' for x in load['end'])} at the end ({os.cpu_count()} cores)")
    if measured is not None:
        # The check: each round predicted at the figures measured around it, its median against the bench's
        # (the machine drifts within a run, so the run's mean figures would misprice the slow and fast rounds).
        by_round = predict_by_round(per_rank, args.world_size, args.model, size, tokens)
        payload["predicted"] = by_round
        payload["bench"] = {"steps": args.steps, "rounds": args.rounds, "results": list(measured.values())}
        payload["comparison"] = compare(measured, by_round)
        payload["comparison_at_effective_rate"] = compare(measured, effective)
        spread = ", ".join(f"{k.split('_')[0]} {lo / 1e9:.1f}-{hi / 1e9:.1f}"
                           for k, (lo, hi) in figures["spread"].items() if k.endswith(("_flops", "_bytes")))
        header = (f"{args.model} ({size}), {args.world_size} gloo ranks, {tokens} tokens per rank; bench: "
                  f"{args.steps} timed steps in {args.rounds} rounds, medians; machine measured on every rank before "
                  f"each round and after the last, the slower rank at each of the {figures['points']} points "
                  f"(range over them, G/s: {spread}); {payload['machine']}; {loads}")
        print(format_comparison(figures, payload["comparison"], header, by_round=True))
        print("\nthe same, forward+backward at the effective rate (FSDP2's own work on a rank and the model's "
              "non-GEMM work in the rate, as in the presets):")
        print("\n".join(format_comparison(figures, payload["comparison_at_effective_rate"], "",
                                          "effective_flops").splitlines()[1:]))
        print("\nrounds' step medians, ms, measured / predicted at the round's figures: " + "; ".join(
            f"{c} " + " ".join(f"{t * 1e3:.0f}/{p['step_seconds'] * 1e3:.0f}"
                               for t, p in zip(measured[c]["step_s_by_round"], by_round[c]["by_round"]))
            for c in CONFIGS))
    else:
        print(loads)
        tables = ("link_samples", "ns_seconds", "twin_ns_seconds")
        print(json.dumps({k: v for k, v in figures.items() if k not in tables}, indent=1))
        print(figures_line(figures))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {args.json}")
    return 0
