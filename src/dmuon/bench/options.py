"""``dmuon bench``'s command line and the runner options it makes."""

from __future__ import annotations

import argparse

import torch

from dmuon.bench.models import SIZE_NAMES
from dmuon.bench.runner import BenchOptions
from dmuon.bench.setups import ALL_CONFIGS, CONFIGS, SWEPT_BALANCERS, Hyper

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# Reads better whole: an argparse table, one option after another.
def build_parser() -> argparse.ArgumentParser:
    """``dmuon bench``'s command line."""
    p = argparse.ArgumentParser(
        prog="dmuon bench",
        description="Time FSDP2+AdamW, FSDP2+torch.optim.Muon, gather-then-compute and dmuon side by side.",
    )
    p.add_argument("--model", default="qwen2", choices=["qwen2", "vla", "moe", "tiny"],
                   help="moe: the qwen2 decoder with 8 routed experts (top-2) per layer, stacked weights")
    p.add_argument("--size", default=None, choices=SIZE_NAMES,
                   help="size preset (default: mini for qwen2, small for vla; mini is qwen2 only)")
    p.add_argument("--world-size", type=int, default=4, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--hsdp", type=int, default=1, metavar="R",
                   help="run on an R x (N/R) (replicate, shard) HSDP mesh")
    p.add_argument("--ddp", action="store_true",
                   help="data parallelism without sharding: the (N, 1) mesh (--hsdp N; with --tp T, (N/T, 1, T)); "
                        "by default runs ddp_adamw,ddp_torch_muon,ddp_dmuon,dmuon_z2 side by side: torch's "
                        "DistributedDataParallel with AdamW, with torch.optim.Muon (NS on every rank) and with dmuon "
                        "(ddp_dmuon), and \"DDP with dmuon\" (dmuon_z2 on the (N, 1) mesh, README \"DDP\")")
    p.add_argument("--tp", type=int, default=1, metavar="T",
                   help="tensor parallel: a (N/T, T) (dp, tp) mesh, with --hsdp R (R, N/(R*T), T); torch's "
                        "parallelize_module splits each block (colwise q/k/v/gate/up/fc1, rowwise o/down/fc2), "
                        "then fully_shard over dp; other Linears and expert stacks stay whole on each tp rank")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated, from {ALL_CONFIGS} (*_z2: fully_shard with reshard_after_forward="
                        "False, ZeRO-2; *_z3 and the others: FSDP2's default True, ZeRO-3; adamw_z2: "
                        "torch.optim.AdamW on ZeRO-2, the reference for dmuon_z2; *_sync: dmuon with "
                        "overlap=False; *_nsbwd: with ns_in_backward=True; *_rbwd: also returns_in_backward=True; "
                        "adamw_local: AdamW on the local shards, dmuon's kernel for non-matrix parameters; "
                        "*_normuon, *_muonh, *_dion2: dmuon.NorMuon, dmuon.MuonH, dmuon.Dion2 in place of DMuon)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per configuration first")
    p.add_argument("--rounds", type=int, default=2,
                   help="take the timed steps in this many rounds through the configurations, so a "
                        "drift in machine speed falls on all of them alike (default: 2)")
    p.add_argument("--sequential", action="store_true",
                   help="run the configurations one after another instead of interleaved "
                        "(holds one model at a time: for models too big to hold several)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--ns-dtype", default="bfloat16", choices=list(DTYPES),
                   help="NS dtype for dmuon/gather (default: bfloat16, as torch.optim.Muon; "
                        "ns-method auto may compute in float32 where that is faster and rounds the result)")
    p.add_argument("--ns-method", default="auto", choices=["auto", "standard", "standard32", "gram"])
    p.add_argument("--balancer", default="greedy", choices=["greedy", "lpt", "milp", "auto", "round_robin", "all"],
                   help="dmuon owner balancer; all: run each dmuon config once per balancer "
                        f"({', '.join(SWEPT_BALANCERS)}), named dmuon_z2@lpt etc.")
    p.add_argument("--profile", action="store_true",
                   help="dmuon: balance with measured, batch-aware owner-update costs (cached on disk)")
    p.add_argument("--json", default=None, metavar="PATH", help="write results as JSON")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG step-time breakdown")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="after the timed steps, one more step of each configuration under torch.profiler, "
                        "written as DIR/<config>-rank<k>.json (Chrome traces; dmuon's phases are ranges dmuon.*)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--ortho", action="store_true",
                   help="run the owner-math benchmark instead (see `dmuon bench --ortho --help`)")
    p.add_argument("--gpu-check", action="store_true",
                   help="run the prepared one-GPU check instead (see `dmuon bench --gpu-check --help`)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine's figures instead and print them as `dmuon plan --simulate` "
                        "flags (see `dmuon bench --calibrate --help`)")
    return p


def bench_options(args) -> BenchOptions:
    """The parsed command line as the runner's :class:`BenchOptions`."""
    ns_dtype = DTYPES[args.ns_dtype]
    return BenchOptions(
        model=args.model, size=args.size, seq_len=args.seq_len, batch_size=args.batch_size,
        steps=args.steps, warmup=args.warmup, progress=not args.quiet, hsdp=args.hsdp, tp=args.tp,
        rounds=args.rounds, interleave=not args.sequential, trace_dir=args.trace,
        hyper=Hyper(ns_dtype=ns_dtype, ns_method=args.ns_method,
                    balancer="greedy" if args.balancer == "all" else args.balancer, profile=args.profile),
    )
