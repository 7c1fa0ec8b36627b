"""``dmuon bench``: training steps side by side with what users would run instead."""

from __future__ import annotations

import gc
import os
import sys
import time

import torch
import torch.distributed as dist

from dmuon.bench.report import (
    format_ratios, format_table, loss_agreement, machine_description, ratios, timing_note, write_json, write_plot,
)
from dmuon.bench.models import resolve_size
from dmuon.bench.options import bench_options, build_parser
from dmuon.bench.runner import run_all
from dmuon.bench.setups import ALL_CONFIGS, CONFIGS, DDP_CONFIGS, SWEPT_BALANCERS
from dmuon.bench.models.qwen2 import TRANSFORMERS_MODULE
from dmuon.testing.spawn import preload, run_distributed

def _configs(args) -> list[str]:
    """The configurations ``--configs`` names, each dmuon one once per balancer with ``--balancer all``."""
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in ALL_CONFIGS]
    if bad:
        raise SystemExit(f"dmuon bench: --configs: unknown {bad}; choose from {ALL_CONFIGS}")
    if args.balancer == "all":
        configs = [f"{c}@{b}" if c.startswith("dmuon_") else c for c in configs
                   for b in (SWEPT_BALANCERS if c.startswith("dmuon_") else ("",))]
    return configs


def _check_args(args) -> None:
    """Refuses a size the model lacks and counts out of range, before any rank is spawned."""
    try:
        args.size = resolve_size(args.model, args.size)
    except ValueError as exc:
        raise SystemExit(f"dmuon bench: --size {args.size} for --model {args.model}: {exc}") from None
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        raise SystemExit("dmuon bench: --steps and --rounds must be >= 1 and --warmup >= 0")
    if not args.sequential and args.warmup < 1:
        raise SystemExit("dmuon bench: interleaved runs need --warmup >= 1 (peak memory and "
                         "autotuning are taken there); use --sequential for --warmup 0")


def _check_mesh(args, world_size: int) -> None:
    if world_size % (args.hsdp * args.tp):
        raise SystemExit(f"dmuon bench: --hsdp {args.hsdp} x --tp {args.tp} does not divide the world size "
                         f"{world_size}")


def _run_under_torchrun(args, configs: list[str], opts) -> tuple[list[dict], int] | None:
    """The bench on the ranks ``torchrun`` started (NCCL on GPUs): rank 0's results and the world size,
    None on the other ranks."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    world_size = dist.get_world_size()
    _check_mesh(args, world_size)
    results = run_all(dist.get_rank(), world_size, configs, opts)
    rank = dist.get_rank()
    # The models, optimizers and their collectives' work objects go while the process
    # groups live: destroyed later, at interpreter exit, gloo's threads can abort the
    # process ("terminate called without an active exception").
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return (results, world_size) if rank == 0 else None


def _run_spawned(args, configs: list[str], opts) -> tuple[list[dict], int]:
    """The bench on ``--world-size`` gloo CPU ranks spawned here: rank 0's results and the world size."""
    world_size = args.world_size
    if world_size < 1:
        raise SystemExit("dmuon bench: --world-size must be >= 1")
    _check_mesh(args, world_size)
    if not args.quiet:
        print(f"dmuon bench: {args.model} ({args.size}) on {world_size} gloo CPU ranks, "
              f"configs {', '.join(configs)}", file=sys.stderr)
    # One spawn for all configurations: process start-up (torch, transformers)
    # would otherwise dominate a short run. Peak memory is reset per config.
    preload(TRANSFORMERS_MODULE)
    return run_distributed(run_all, world_size, configs, opts, timeout_s=600)[0], world_size


def run(args) -> dict:
    """Runs the bench; returns the JSON payload (on rank 0 / the launcher)."""
    configs = _configs(args)
    _check_args(args)
    if args.ddp:  # every data-parallel rank its own replica
        if args.hsdp != 1:
            raise SystemExit("dmuon bench: --ddp is the (N, 1) mesh; drop --hsdp")
        if args.configs == ",".join(CONFIGS):  # not named: torch's DDP three ways, and the route
            args.configs = ",".join(DDP_CONFIGS)
            configs = _configs(args)
        under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ
        world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.world_size
        args.hsdp = max(1, world_size // args.tp)
    opts = bench_options(args)
    if args.hsdp < 1 or args.tp < 1:
        raise SystemExit("dmuon bench: --hsdp and --tp must be >= 1")
    start = time.perf_counter()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ:
        ran = _run_under_torchrun(args, configs, opts)
        if ran is None:
            return {}
    else:
        ran = _run_spawned(args, configs, opts)
    results, world_size = ran
    payload = {
        "machine": machine_description(),
        "world_size": world_size,
        "mesh": [args.hsdp] * (args.hsdp > 1) + [world_size // (args.hsdp * args.tp)] + [args.tp] * (args.tp > 1),
        "model": args.model,
        "size": args.size,
        "tokens_per_rank": results[0]["tokens_per_rank"],
        "steps": args.steps,
        "warmup": args.warmup,
        "schedule": "sequential" if args.sequential else f"interleaved, {args.rounds} rounds",
        "ns_dtype": str(opts.hyper.ns_dtype).replace("torch.", ""),
        "ns_method": opts.hyper.ns_method,
        "wall_seconds": time.perf_counter() - start,
        "results": results,
        "ratios": ratios(results),
    }
    # torch.optim.Muon takes 2-D parameters only, so on expert stacks it runs AdamW there: other math.
    ok, verdict = loss_agreement(results, exclude=("torch_muon",) if args.model == "moe" else ())
    payload["losses_agree"] = ok
    payload["loss_check"] = verdict
    return payload


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--ortho" in argv:
        # `dmuon bench --ortho ...`: the owner-math benchmark (standard vs Gram NS, batched vs looped).
        from dmuon.bench.ortho_bench import main as ortho_main

        argv.remove("--ortho")
        return ortho_main(argv)
    if "--calibrate" in argv:
        # `dmuon bench --calibrate`: this machine's figures as `dmuon plan --simulate` flags.
        from dmuon.bench.calibrate import main as calibrate_main

        argv.remove("--calibrate")
        return calibrate_main(argv)
    if "--gpu-check" in argv:
        # `dmuon bench --gpu-check [--dry-run]`: the prepared one-GPU check (see dmuon.bench.gpu_check).
        from dmuon.bench.gpu_check import main as gpu_check_main

        argv.remove("--gpu-check")
        return gpu_check_main(argv)
    args = build_parser().parse_args(argv)
    payload = run(args)
    if not payload:
        return 0
    print(f"\n{payload['machine']}; {payload['world_size']} ranks; model {payload['model']} "
          f"({payload['size']}, {payload['tokens_per_rank']} tokens/rank); NS {payload['ns_dtype']}, "
          f"{payload['steps']} timed steps ({payload['schedule']})")
    print(format_table(payload["results"]))
    print(timing_note(payload["results"]))
    if payload["ratios"]:
        print("\nratios (median step times):")
        print(format_ratios(payload["ratios"]))
    print("\n" + payload["loss_check"])
    if args.json:
        write_json(args.json, payload)
        print(f"wrote {args.json}")
    if args.trace:
        print(f"wrote torch.profiler traces to {args.trace}/ (<config>-rank<k>.json; open them in Perfetto)")
    if args.plot:
        write_plot(args.plot, payload["results"], f"{payload['model']} on {payload['world_size']} ranks")
        print(f"wrote {args.plot}")
    return 0 if payload["losses_agree"] else 1
