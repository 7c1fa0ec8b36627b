"""``dmuon bench --calibrate``: this machine's figures, as the ``dmuon plan --simulate`` flags to pass.

On ``--world-size`` gloo CPU ranks (one thread each), or under ``torchrun`` on the ranks it starts (NCCL
on GPUs), every rank measures at once (:class:`dmuon.bench.calibrate_meter.Meter`): the forward and
backward rates of the bench model, the work beyond its GEMMs and FSDP2's per unit, the elementwise rate,
the owners' NS per shape and batch, the host's seconds per operation and per DTensor layout call, and the
link per collective kind. The slower rank's figures (:func:`dmuon.bench.calibrate_fit.combine`) are
printed with the ``dmuon plan --simulate`` command that prices a step on this kind of machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import time

import torch
import torch.distributed as dist

from dmuon.bench.calibrate_fit import combine, compute_flags, costs_records, figures_lines, ns_rate, plan_flags
from dmuon.bench.calibrate_meter import Meter, muon_counts
from dmuon.bench.shapes import bench_model_shapes
from dmuon.bench.models.qwen2 import TRANSFORMERS_MODULE
from dmuon.testing.spawn import preload, run_distributed


def _measure(rank: int, world_size: int, model: str, size: str | None, tokens: int, repeats: int) -> dict:
    """One rank's machine figures."""
    return Meter(rank, world_size, model, size, tokens, repeats).measure()


def _measure_under_torchrun(model: str, size: str, tokens: int, repeats: int) -> list[dict] | None:
    """Every rank's figures on rank 0 (None on the others), on the ranks ``torchrun`` started: NCCL where
    there are GPUs, each rank on its own, else gloo."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, _measure(rank, world_size, model, size, tokens, repeats))
    # The meter's tensors and meshes go while the process groups live (destroyed at interpreter exit,
    # gloo's threads can abort the process).
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return gathered if rank == 0 else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dmuon bench --calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2", choices=["qwen2", "vla", "tiny"])
    p.add_argument("--size", default=None, help="size preset of the bench model (default: the bench's)")
    p.add_argument("--world-size", type=int, default=2,
                   help="gloo CPU ranks to spawn, one thread each (default 2; ignored under torchrun)")
    p.add_argument("--repeats", type=int, default=7, help="timed runs of each measurement (their mean)")
    p.add_argument("--save-costs", default=None, metavar="FILE",
                   help="write the owners' NS seconds per shape and batch in `dmuon plan --costs`' format "
                        "(the flags then price NS with them: --sim-ns profile --costs FILE)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every rank's figures and the flags")
    return p


def plan_command(args, world_size: int, tokens: int, figures: dict, device: str) -> list[str]:
    """The ``dmuon plan --simulate`` command for the measured model on this machine."""
    command = ["dmuon", "plan", "--model", args.model, "--size", args.size, "--world-size", str(world_size),
               "--simulate", "--tokens-per-gpu", str(tokens), *plan_flags(figures)]
    if device == "cpu":
        command += ["--return-waves", "1"]  # the runtime's default on CPU ranks (ExecutionConfig.return_waves)
    if args.save_costs:
        command += ["--sim-ns", "profile", "--costs", args.save_costs]
    return command


def _print_report(payload: dict) -> None:
    print(f"{payload['model']} ({payload['size']}), {payload['world_size']} {payload['backend']} ranks "
          f"({payload['device']}), {payload['tokens_per_rank']} tokens per rank, the slower rank's figures, "
          f"each the mean of {payload['repeats']} timed runs; {payload['machine']}")
    for line in figures_lines(payload["figures"]):
        print(f"  {line}")
    print("\nthis machine in the step simulation:")
    print(shlex.join(payload["command"]))
    print("forward and backward at the GEMMs' rate with the work beside them instead: "
          f"{shlex.join(payload['compute_gemms_alone'])} in place of --compute-tflops")
    if payload["device"] == "cpu":
        print("note: `dmuon plan` simulates GPU streams; on gloo CPU ranks FSDP2's collectives block each "
              "rank's one thread, which it does not model")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dmuon.bench.models import build_workload, resolve_size
    from dmuon.bench.report import machine_description

    try:
        args.size = resolve_size(args.model, args.size)
    except ValueError as exc:
        raise SystemExit(f"dmuon bench --calibrate: --size {args.size} for --model {args.model}: {exc}") from None
    with torch.device("meta"):
        tokens = build_workload(args.model, size=args.size).tokens_per_rank
    start = time.perf_counter()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ:
        per_rank = _measure_under_torchrun(args.model, args.size, tokens, args.repeats)
        if per_rank is None:
            return 0
    else:
        if args.world_size < 1:
            raise SystemExit("dmuon bench --calibrate: --world-size must be >= 1")
        preload(TRANSFORMERS_MODULE)
        per_rank = run_distributed(_measure, args.world_size, args.model, args.size, tokens, args.repeats,
                                   timeout_s=900)
    world_size, device = len(per_rank), per_rank[0]["device"]
    figures = combine(per_rank, world_size)
    figures["ns_flops"] = ns_rate(figures["ns_seconds"], muon_counts(bench_model_shapes(args.model, args.size)))
    payload = {"model": args.model, "size": args.size, "world_size": world_size, "device": device,
               "backend": "nccl" if device == "cuda" else "gloo", "tokens_per_rank": tokens,
               "repeats": args.repeats, "machine": machine_description(),
               "seconds": time.perf_counter() - start, "figures": figures,
               "command": plan_command(args, world_size, tokens, figures, device),
               "compute_gemms_alone": compute_flags(figures, gemms_alone=True), "per_rank": per_rank}
    _print_report(payload)
    if args.save_costs:
        with open(args.save_costs, "w") as f:
            json.dump(costs_records(figures["ns_seconds"]), f, indent=1)
        print(f"wrote {args.save_costs}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {args.json}")
    return 0
