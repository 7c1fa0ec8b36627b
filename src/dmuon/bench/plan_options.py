"""``dmuon plan``'s command line (:mod:`dmuon.bench.plan_cli` runs it), its options grouped by topic."""

from __future__ import annotations

import argparse

import torch

from dmuon.bench.shapes import FULL_SIZE_NAMES
from dmuon.costmodel.sim_config import HARDWARE_PRESETS, NS_METHODS
from dmuon.plan.balance import BALANCERS, DEFAULT_MEMORY_FACTOR, DEFAULT_TIME_LIMIT_S
from dmuon.plan.batches import RETURN_WAVES

DESCRIPTION = "``dmuon plan``: the ownership plan for a model or shape list, without training."
"""``dmuon plan --help``'s first line."""
NS_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
"""NS dtype: the profile key, and the element type dmuon sends its row shards in."""


def _bounded_float(text: str, minimum: float, inclusive: bool, expected: str, also: str = "") -> float:
    """``text`` as a float ``>= minimum`` (``> minimum`` unless ``inclusive``), for argparse."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not (value >= minimum if inclusive else value > minimum):
        raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {minimum:g}{also}, got {text!r}")
    return value


def _memory_factor(text: str) -> float | None:
    if text.lower() == "none":
        return None
    return _bounded_float(text, 1.0, True, "a number >= 1 or 'none'", also=" (or 'none')")


def _nonnegative_float(text: str) -> float:
    return _bounded_float(text, 0.0, True, "a number >= 0")


def _positive_float(text: str) -> float:
    return _bounded_float(text, 0.0, False, "a positive number")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dmuon plan", description=DESCRIPTION)
    _add_workload_arguments(p)
    _add_balancing_arguments(p)
    _add_traffic_arguments(p)
    _add_simulation_arguments(p)
    _add_output_arguments(p)
    return p


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the matrices and ranks to plan")
    g.add_argument("--model", default="qwen2.5-7b", choices=FULL_SIZE_NAMES,
                   help="a bench model (built on the meta device) or a full-size shape list")
    g.add_argument("--size", default=None, help="size preset of the bench models (default: the bench's, mini for qwen2)")
    g.add_argument("--shapes", default=None, metavar="FILE",
                   help='JSON list of {"name": str, "shape": [m, n], "count": int}; overrides --model')
    g.add_argument("--world-size", type=int, default=8)
    g.add_argument("--ep", type=int, default=None, metavar="K",
                   help="an MoE model's expert parallelism (torchtitan's): each routed-expert stack split over K "
                        "ranks of the shard dim, whole experts each, the rest sharding them (efsdp); K divides "
                        "--ranks-per-node (HSDP) or --world-size (default 1; only for a model with routed experts)")
    g.add_argument("--pp", type=int, default=1, metavar="P",
                   help="pipeline parallelism: the layers split evenly over P stages (embeddings on the first, the "
                        "head on the last), each stage planned (and simulated) on its own world-size/P "
                        "data-parallel ranks")


def _add_balancing_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("owner costs and balancing")
    g.add_argument("--balancer", default="greedy", choices=BALANCERS + ("all",),
                   help="owner balancer; 'all' compares round_robin, lpt and milp side by side")
    g.add_argument("--costs", default=None, metavar="FILE",
                   help='JSON list of {"shape": [m, n], "batch": int, "seconds": float} measured elsewhere; '
                        "default: this machine's profile cache if it covers the shapes, else the analytical model")
    g.add_argument("--profile", action="store_true",
                   help="measure the owner update for every shape and batch size on this machine now (cached)")
    g.add_argument("--profile-budget", type=_positive_float, default=None, metavar="S",
                   help="with --profile: stop measuring batches > 1 after S seconds")
    g.add_argument("--save-costs", default=None, metavar="FILE",
                   help="write the cost table used (e.g. just profiled) in the --costs format")
    g.add_argument("--max-batch", type=int, default=None, metavar="B",
                   help="with --profile: largest batch size to measure (default: each shape's count)")
    g.add_argument("--analytical", action="store_true", help="use the analytical FLOP model even if a cache exists")
    g.add_argument("--ns-steps", type=int, default=5, help="NS iterations (analytical model and profile key)")
    g.add_argument("--ns-dtype", default="bfloat16", choices=sorted(NS_DTYPES),
                   help="NS dtype: profile key (float32 on CPUs without bfloat16 units) and dmuon's wire "
                        "element size for the traffic figures (2 or 4 bytes)")
    g.add_argument("--time-limit", type=_positive_float, default=DEFAULT_TIME_LIMIT_S, metavar="S",
                   help="MILP time limit in seconds (best solution found is kept)")
    g.add_argument("--memory-factor", type=_memory_factor, default=DEFAULT_MEMORY_FACTOR, metavar="F",
                   help="MILP: per-rank optimizer state at most F x the mean ('none' for no limit)")


def _add_traffic_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("FSDP2's layout and the links (traffic figures, and the simulation's links)")
    g.add_argument("--zero", type=int, default=2, choices=[2, 3],
                   help="FSDP2 resharding for the FSDP2 and gather-then-compute figures only: 3 = "
                        "reshard_after_forward (weights all-gathered in forward and again in backward), "
                        "2 = gathered once; dmuon's own traffic is the same for both")
    g.add_argument("--root-reshard", action="store_true",
                   help="the root module sharded with an explicit reshard_after_forward=True (torch 2.13 then "
                        "gathers it again at the start of backward; left unset, FSDP2 keeps it gathered): its "
                        "all-gather in backward in step_comm and the simulation")
    g.add_argument("--ranks-per-node", type=int, default=None, metavar="N",
                   help="HSDP layout: replicate across nodes, shard across the N ranks of a node; "
                        "reports intra- and inter-node bytes (default: one node, 1-D FSDP)")
    g.add_argument("--ddp", action="store_true",
                   help="data parallelism without sharding, DDP with dmuon (README \"DDP\"): an (N, 1) mesh, each rank "
                        "its own replica (--ranks-per-node 1); FSDP2 + AdamW's figures are then DDP's all-reduce. "
                        "Every byte travels on the replicate level's links, --inter-*: give a node's figures "
                        "(e.g. --inter-bandwidth 450) for DDP inside one node")
    g.add_argument("--param-dtype", default="bfloat16", choices=sorted(NS_DTYPES),
                   help="step_comm: FSDP2's all-gather dtype (MixedPrecisionPolicy.param_dtype; default bf16)")
    g.add_argument("--reduce-dtype", default="float32", choices=sorted(NS_DTYPES),
                   help="step_comm: FSDP2's reduce-scatter and all-reduce dtype (reduce_dtype; default fp32)")
    g.add_argument("--intra-bandwidth", type=_positive_float, default=None, metavar="GB/S",
                   help="per-rank, per-direction bandwidth inside a node in GB/s, for step_comm's seconds and the "
                        "simulation (default: the --hardware preset's; h100: 450, NVLink 4's 900 GB/s bidirectional)")
    g.add_argument("--inter-bandwidth", type=_positive_float, default=None, metavar="GB/S",
                   help="per-rank, per-direction bandwidth across nodes in GB/s (default: the preset's; h100: 50, "
                        "one 400 Gb/s NIC per GPU)")
    g.add_argument("--intra-latency", type=_nonnegative_float, default=None, metavar="US",
                   help="latency per message inside a node in microseconds (default: the preset's; h100: 10)")
    g.add_argument("--inter-latency", type=_nonnegative_float, default=None, metavar="US",
                   help="latency per message across nodes in microseconds (default: the preset's; h100: 20)")


def _add_simulation_arguments(p: argparse.ArgumentParser) -> None:
    sim = p.add_argument_group("one step's timeline (--simulate; docs/benchmarks/README.md, 'The step simulation')")
    sim.add_argument("--simulate", action="store_true",
                     help="also simulate one training step on every rank per strategy (FSDP2 + AdamW, "
                          "gather-then-compute, dmuon's two HSDP designs, the all-to-all peer): step, optimizer "
                          "and exposed communication seconds; with --scale-table, its table instead")
    sim.add_argument("--hardware", default="h100", choices=sorted(HARDWARE_PRESETS),
                     help="hardware preset of the simulation and of the link defaults (default h100)")
    sim.add_argument("--compute-tflops", type=_positive_float, default=None, metavar="T",
                     help="effective forward+backward TFLOP/s per GPU, 6 x parameters x tokens (default: the preset's)")
    sim.add_argument("--ns-tflops", type=_positive_float, default=None, metavar="T",
                     help="effective NS TFLOP/s at its analytical FLOPs (default: the preset's)")
    sim.add_argument("--elementwise-gbps", type=_positive_float, default=None, metavar="GB/S",
                     help="memory bandwidth of elementwise work (AdamW, momentum, applies) in GB/s (default: the "
                          "preset's)")
    sim.add_argument("--dispatch-us", type=_nonnegative_float, default=None, metavar="US",
                     help="host microseconds per operation on plain tensors, where the modelled code dispatches "
                          "per tensor (default: the preset's; 0: no host work)")
    sim.add_argument("--dtensor-dispatch-us", type=_nonnegative_float, default=None, metavar="US",
                     help="host microseconds per operation on a DTensor (default: the preset's)")
    sim.add_argument("--layout-us", type=_nonnegative_float, default=None, metavar="US",
                     help="host microseconds per DTensor layout call, full_tensor() or distribute_tensor, beyond "
                          "its collective (default: the preset's)")
    sim.add_argument("--fsdp-unit-us", type=_nonnegative_float, default=None, metavar="US",
                     help="host microseconds of FSDP2's own work per unit and pass (default: the preset's)")
    sim.add_argument("--tokens-per-gpu", type=int, default=4096, metavar="N",
                     help="tokens each GPU runs forward and backward per step (default 4096)")
    sim.add_argument("--non-gemm-ms", type=float, default=0.0, metavar="MS",
                     help="forward+backward milliseconds per step beyond the GEMMs that --compute-tflops prices "
                          "(attention's products, norms, activations, the loss), for a rate that prices the GEMMs "
                          "alone; spread over the units by their parameters (default 0: inside the rate, as in the "
                          "presets)")
    sim.add_argument("--sim-ns", default="auto", choices=NS_METHODS + ("profile",),
                     help="NS cost: 'auto' (fewer FLOPs of standard and Gram NS with symmetric products, per "
                          "shape), 'standard', 'gram', or 'profile' (the plan's measured cost table: --costs, "
                          "--profile or the cache; seconds of the machine that measured them)")
    sim.add_argument("--return-waves", type=int, default=RETURN_WAVES, metavar="K",
                     help=f"dmuon's update returns (ExecutionConfig.return_waves; default {RETURN_WAVES}, the "
                          "accelerator default; 1 makes the step speculative, the CPU default)")
    sim.add_argument("--hop-a-spread", type=int, default=None, metavar="N",
                     help="dmuon's ExecutionConfig.hop_a_spread on HSDP (default: its default, 8, and 1 for "
                          "dmuon_rbwd; 1: a block's direction slices all with the next landing, which lets more "
                          "blocks return in backward)")
    sim.add_argument("--serial", action="store_true",
                     help="no overlap: every task after the previous one on every rank")
    sim.add_argument("--recommend", action="store_true",
                     help="simulate every layout (replicate level, native HSDP), ExecutionConfig and balancer "
                          "dmuon offers on --world-size GPUs of --ranks-per-node each (default 8) and print the "
                          "fastest, its step against FSDP2 + AdamW and what each choice asks of you")
    sim.add_argument("--trace", default=None, metavar="FILE.json",
                     help="write the simulated step as a Chrome trace (Perfetto, chrome://tracing): per rank "
                          "its compute, NS, FSDP2's and dmuon's collectives, one lane each; needs --simulate")
    sim.add_argument("--trace-strategies", default="dmuon,fsdp_adamw", metavar="S,S,...",
                     help="the steps --trace draws, one above the other (default dmuon,fsdp_adamw)")
    sim.add_argument("--trace-ranks", default=None, metavar="K,K,...",
                     help="the ranks --trace draws (default: the first node's, at most 8)")


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--json", default=None, metavar="PATH")
    g.add_argument("--scale-table", default=None, metavar="MODELS",
                   help="instead of one plan, print the cluster-scale table of docs/benchmarks/2026-12-04-modelled-h100-a800.md (Markdown) for these "
                        "comma-separated models over --world-sizes (--ranks-per-node default 8; the other "
                        "options apply as usual)")
    g.add_argument("--world-sizes", default="8,64,256,1024", metavar="W,W,...",
                   help="world sizes of --scale-table (default: 8,64,256,1024)")
    g.add_argument("--show-matrices", action="store_true", help="list each rank's matrices")
