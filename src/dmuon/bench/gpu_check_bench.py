"""The GPU check's ``bench`` section: dmuon's stream paths on one device, with real collectives.

At one rank dmuon hands every exchange over locally; here every run sets
``ExecutionConfig(loopback_collectives=True)``, so the directions, the updates and the
agreement go through self all-to-alls and all-reduces on NCCL's one-member groups: NCCL's
buffer handling and every stream wait of ``docs/architecture.md`` ("Streams") run for real.

Each configuration (:data:`BENCH_CONFIGS`) runs under ``torch.use_deterministic_algorithms(True)``
(``CUBLAS_WORKSPACE_CONFIG=:4096:8``, set by the parent) as four variants:

``run``
    the reference run; its :class:`~dmuon.runtime.report.StepReport` figures must show every
    launch from backward standing (:func:`launch_verdict`);
``repeat``
    the same again: the relative difference of its losses from ``run``'s is the configuration's
    tolerance (measured, so a nondeterministic kernel left over widens it and nothing else does);
``delayed``
    with ``torch.cuda._sleep`` queued on FSDP2's reduce-scatter stream before every reduction
    (:func:`delayed_reduce_scatter`): a wait missing anywhere downstream of the reduced
    gradients (dmuon's stream, the NS worker's, the compute stream) then reads them early;
    its losses must stay within the tolerance;
``local`` (only :data:`LOCAL_CONFIG`)
    without loopback (the exchanges handed over on the device): within the tolerance too.

Pairs that are bit-identical by design are compared as well (:data:`SAME_RESULTS`).
"""

from __future__ import annotations

import contextlib
import json
import math

import torch
import torch.distributed as dist

BENCH_CONFIGS = ("dmuon_z3_sync", "dmuon_z3", "dmuon_z3_nsbwd", "dmuon_z3_rbwd", "dmuon_z2_clip", "dmuon_z3_clip",
                 "dmuon_z3_nfwd")
"""``dmuon_z3`` runs the accelerator defaults (``return_waves=4`` on CUDA: the owners' work waits for
the agreement, no speculation); ``_sync`` has every collective inside ``step()``; ``_nsbwd`` and
``_rbwd`` run NS (and the returns) on the worker during backward; ``_clip`` clips every step; ``_nfwd``
applies the updates in the next forward (the publication on dmuon's stream, each unit's all-gather from
its forward hooks)."""
LOCAL_CONFIG = "dmuon_z3_rbwd"
"""The configuration also run without loopback: the most paths of one configuration."""
SAME_RESULTS = (("dmuon_z3", "dmuon_z3_sync"), ("dmuon_z3_rbwd", "dmuon_z3_nsbwd"))
"""Configurations whose parameters are bit-identical by design (``ExecutionConfig``: ``overlap`` and
``return_waves``; the returns' timing with the same per-block NS batches)."""
DELAY_CYCLES = 10 ** 7
"""``torch.cuda._sleep`` cycles per reduction (about 5 ms at 2 GHz): longer than a tiny block's backward."""


def variants(config: str) -> tuple[str, ...]:
    """The variants (module docstring) a configuration runs as."""
    return ("run", "repeat", "delayed") + (("local",) if config == LOCAL_CONFIG else ())


def plan_runs(configs: tuple[str, ...] = BENCH_CONFIGS) -> list[tuple[str, str]]:
    """Every ``(config, variant)`` the section runs, in order."""
    return [(c, v) for c in configs for v in variants(c)]


@contextlib.contextmanager
def delayed_reduce_scatter(cycles: int, counter: list[int]):
    """Queues ``torch.cuda._sleep(cycles)`` on FSDP2's reduce-scatter stream before each reduction.

    FSDP2 calls ``foreach_reduce`` (bound by name in its param-group module) with its reduce-scatter
    stream; the sleep goes first on that stream, so the reduced gradients, and the post-reduce hooks
    FSDP2 runs behind them, come late. ``counter[0]`` counts the delays (a patch that never fires
    must not pass as "no change").
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

    original = group_module.foreach_reduce

    def delayed(*args, **kwargs):
        stream = kwargs.get("reduce_scatter_stream")
        if stream is None:
            stream = next((a for a in args if isinstance(a, torch.cuda.Stream)), None)
        if stream is None:
            raise RuntimeError("no CUDA reduce-scatter stream among foreach_reduce's arguments: "
                               "FSDP2's call changed in this torch; update delayed_reduce_scatter")
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)
        counter[0] += 1
        return original(*args, **kwargs)

    group_module.foreach_reduce = delayed
    try:
        yield
    finally:
        group_module.foreach_reduce = original


@contextlib.contextmanager
def counting_collectives(group, counts: dict[str, int],
                         names: tuple[str, ...] = ("all_to_all_single", "all_reduce")):
    """Counts the calls of the ``torch.distributed`` functions ``names`` on ``group`` (dmuon's) inside the block."""
    originals = {name: getattr(dist, name) for name in names}

    def counting(name):
        def call(*args, **kwargs):
            if kwargs.get("group") is group:
                counts[name] = counts.get(name, 0) + 1
            return originals[name](*args, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def train(config: str, variant: str, size: str, steps: int, device: torch.device) -> dict:
    """One run of ``config`` on the qwen2 bench model (this process's one-rank group)."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.bench.models import build_workload
    from dmuon.bench.setups import Hyper, build, clip_norm

    torch.manual_seed(0)
    with torch.device(device):
        workload = build_workload("qwen2", size=size, seed=0)
    opt, plan = build(config, workload, init_device_mesh(device.type, (1,)), Hyper(loopback=variant != "local"))
    clip = clip_norm(config)
    losses, reports, counts, delays = [], [], {}, [0]
    delay = delayed_reduce_scatter(DELAY_CYCLES, delays) if variant == "delayed" else contextlib.nullcontext()
    # The baselines (no plan) have no group of dmuon's to count on.
    counted = counting_collectives(plan.topology.mesh_group, counts) if plan is not None else contextlib.nullcontext()
    with delay, counted:
        for step in range(steps):
            batch = workload.make_batch(step, 0)
            batch = {k: v.to(device) for k, v in batch.items()} if isinstance(batch, dict) else batch.to(device)
            loss = workload.loss_fn(workload.model, batch)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(workload.model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            stats = opt.last_step_stats() if hasattr(opt, "last_step_stats") else {}
            reports.append({k: stats.get(k, 0) for k in ("blocks_exchanged_in_backward", "rescaled_launches",
                                                  "orthogonalized", "orthogonalized_in_backward",
                                                  "blocks_returned_in_backward")})
        if hasattr(opt, "flush_updates"):
            # ``_nfwd``: the last step's returns land here. Left in flight, they are dropped with the run, their
            # buffers freed with no stream ever waiting for them (the stream checker raises that in the next
            # run, at whichever op follows the garbage collection that frees them).
            opt.flush_updates()
    return {"config": config, "variant": variant, "blocks": len(plan.blocks) if plan is not None else 0, "losses": losses,
            "reports": reports, "collectives": counts, "delays": delays[0]}


def launch_verdict(config: str, run: dict) -> dict:
    """What ``run``'s step reports must show for ``config`` (one rank: every block is this rank's).

    Without clipping every launch from backward stands on every step (``_sync`` launches none); with
    ``_nsbwd``/``_rbwd`` every matrix's NS ran in backward; with ``_rbwd`` every block's updates but
    the last one's came back in backward (the last block's directions land when backward ends). With
    clipping the first step exchanges every block again (the owners hold no momentum copies yet) and
    every later step keeps every launch as a rescaled one.
    """
    blocks, reports = run["blocks"], run["reports"]
    got = [r["blocks_exchanged_in_backward"] for r in reports]
    if config.endswith("_sync"):
        want = [0] * len(reports)
    elif "_clip" in config:
        want = [0] + [blocks] * (len(reports) - 1)
        rescaled = [r["rescaled_launches"] for r in reports]
        if rescaled != want:
            return {"passed": False, "detail": f"rescaled launches {rescaled}, expected {want}"}
    else:
        want = [blocks] * len(reports)
    if got != want:
        return {"passed": False, "detail": f"blocks exchanged in backward {got}, expected {want} of {blocks}"}
    if config.endswith(("_nsbwd", "_rbwd")):
        early = [(r["orthogonalized_in_backward"], r["orthogonalized"]) for r in reports]
        if any(e != o or o == 0 for e, o in early):
            return {"passed": False, "detail": f"NS in backward / orthogonalized per step {early}"}
    if config.endswith("_rbwd"):
        back = [r["blocks_returned_in_backward"] for r in reports]
        if back != [blocks - 1] * len(reports):
            return {"passed": False, "detail": f"blocks returned in backward {back}, expected {blocks - 1}"}
    if not sum(run["collectives"].values()):
        return {"passed": False, "detail": "no collective on dmuon's group: loopback did not engage"}
    return {"passed": True, "detail": f"{got} of {blocks} blocks; collectives {run['collectives']}"}


def rel_diff(a: list[float], b: list[float]) -> float:
    """The largest relative difference of two loss curves (inf if their lengths or finiteness differ)."""
    if len(a) != len(b) or not all(math.isfinite(x) for x in a + b):
        return math.inf
    return max((abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b)), default=0.0)


def verdicts(runs: list[dict], device_type: str) -> list[dict]:
    """Every check of the section from its runs (a missing run fails the checks that need it)."""
    by = {(r["config"], r["variant"]): r for r in runs}
    checks, tolerance = [], {}
    for config in dict.fromkeys(c for c, _ in plan_runs()):
        run, repeat = by.get((config, "run")), by.get((config, "repeat"))
        if run is None:
            checks.append({"name": f"bench {config} ran", "passed": False, "detail": "no run"})
            continue
        checks.append({"name": f"bench {config} launches stand", **launch_verdict(config, run)})
        if repeat is not None:
            tolerance[config] = rel_diff(repeat["losses"], run["losses"])
            checks.append({"name": f"bench {config} repeat (deterministic) gives finite losses",
                           "passed": math.isfinite(tolerance[config]),
                           "detail": f"tolerance {tolerance[config]:.3e} (measured)"})
        tol = tolerance.get(config, math.nan)
        for variant, what in (("delayed", "reduce-scatter stream delayed"), ("local", "loopback off")):
            other = by.get((config, variant))
            if variant not in variants(config) or (variant == "delayed" and device_type != "cuda"):
                continue
            diff = rel_diff(other["losses"], run["losses"]) if other else math.inf
            fired = variant != "delayed" or (other is not None and other["delays"] > 0)
            checks.append({"name": f"bench {config} {what}: same losses", "passed": fired and diff <= tol,
                           "detail": f"rel diff {diff:.3e} <= {tol:.3e}"
                                     + ("" if fired else "; the delay never fired")})
    for a, b in SAME_RESULTS:
        ra, rb = by.get((a, "run")), by.get((b, "run"))
        tol = max(tolerance.get(a, math.nan), tolerance.get(b, math.nan))
        diff = rel_diff(ra["losses"], rb["losses"]) if ra and rb else math.inf
        checks.append({"name": f"bench {a} equals {b}", "passed": diff <= tol,
                       "detail": f"rel diff {diff:.3e} <= {tol:.3e}"})
    return checks


def released_cleanly() -> None:
    """Frees what the run just left (its model, optimizer, buffers) now, and raises what the stream
    checker (on CPU) found in their release (a buffer freed with its collective never landed), so the
    error names this run, not whichever later run a garbage collection happens to fall in."""
    import gc

    from dmuon.comm import device_streams
    from dmuon.testing.stream_check import CheckedStreams

    gc.collect()
    streams = device_streams.active()
    if isinstance(streams, CheckedStreams):
        streams.raise_pending()


def bench_section(size: str, steps: int, device: torch.device, out: str) -> dict:
    """Runs :func:`plan_runs` in this process's one-rank group; the JSON at ``out`` is rewritten after
    every run, so a timeout still leaves the runs done."""
    from dmuon.bench.gpu_check_base import one_rank
    from dmuon.ortho.autotune import get_autotuner

    if device.type == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
    get_autotuner().cooldown_s = 0.0
    payload = {"size": size, "steps": steps, "deterministic": torch.are_deterministic_algorithms_enabled(),
               "runs": []}
    with one_rank(device) as backend:
        payload["backend"] = backend
        for config, variant in plan_runs():
            if variant == "delayed" and device.type != "cuda":
                continue  # no stream to delay on CPU
            try:
                payload["runs"].append(train(config, variant, size, steps, device))
                released_cleanly()
            except Exception as exc:  # the others still run; the verdict names the missing run
                payload.setdefault("errors", []).append(f"{config} {variant}: {type(exc).__name__}: {exc}")
            with open(out, "w") as f:
                json.dump(payload, f)
    return payload
