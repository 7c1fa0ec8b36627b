"""``dmuon bench --calibrate``'s arithmetic: the link fits, the machine figures over ranks and points,
the predictions, and the comparison with the bench (no ranks, no timing: the tests run it on
constructed samples)."""

from __future__ import annotations

import dataclasses
import functools
import statistics

from dmuon.bench.shapes import bench_model_shapes
from dmuon.costmodel.offline import plan_offline
from dmuon.costmodel.sim_config import Hardware, SimOptions
from dmuon.costmodel.traffic import AlphaBeta

CONFIGS = {"adamw": ("fsdp_adamw", 3), "gather": ("gather", 3), "dmuon_z2": ("dmuon", 2), "dmuon_z3": ("dmuon", 3)}
"""Bench configuration -> (simulated strategy, ZeRO level)."""
PATH_OF = {"adamw": "adamw", "gather": "gather", "dmuon_z2": "dmuon_z3", "dmuon_z3": "dmuon_z3"}
"""Bench configuration -> the code path whose host factor prices its host work (:func:`path_host_factors`):
``dmuon_z2`` takes ``dmuon_z3``'s (the same ``step()``)."""
TWIN_PATHS = tuple(dict.fromkeys(PATH_OF.values()))
"""The code paths whose optimizer step is measured on the model's tiny twin: configurations the twin is built as."""
LINK_KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
"""The collectives the link is measured with, each fitted on its own (the simulation's ``op_links``)."""
RATES = ("matmul_flops", "effective_flops", "elementwise_bytes", "non_gemm_seconds", "dispatch_seconds",
         "dtensor_dispatch_seconds", "dtensor_layout_seconds", "fsdp_unit_seconds", "twin_plain_seconds",
         "twin_world_seconds")
"""Per-point figures; the first three are rates (the slower rank has the lowest), the rest seconds (the highest).
The ranks' drift comes from every rank's timings together (:func:`drift`)."""


def drift(point: list[dict]) -> tuple[float, float]:
    """The ranks' drift at one point, from every rank's ``skew_seconds``: ``(sync_skew, sync_delay)``,
    the later rank's delay at a meeting as a fraction of the compute since the one before and the
    seconds more at each meeting after compute, relative to the slower rank's compute.

    The ranks meet after every block (``met``) or after every matrix (``met_often``: the same
    compute, more meetings), so either run takes every rank the same time; what the slower rank's own
    compute (the largest ``alone``) and the meetings alone leave of it is the drift, ``count x delay
    + fraction x alone`` in each: two equations for the two figures. Relative to the slower rank because the prediction's compute is the slower rank's (the
    lowest rate, :func:`combine`); the faster rank's own figure, which also holds its wait for the
    slower one, would count that difference twice."""
    def mean(key: str) -> float:
        return statistics.mean(m["skew_seconds"][key] for m in point)

    alone = max(m["skew_seconds"]["alone"] for m in point)
    count, count_often = point[0]["skew_seconds"]["count"], point[0]["skew_seconds"]["count_often"]
    extra = mean("met") - mean("meetings") - alone
    extra_often = mean("met_often") - mean("meetings_often") - alone
    delay = max(0.0, (extra_often - extra) / (count_often - count))
    return max(0.0, extra - count * delay) / alone, delay


def link_messages(op: str, world_size: int) -> int:
    """Latency terms of one collective on ``world_size`` ranks as the step model counts them
    (:mod:`dmuon.costmodel.collectives`): ring steps, ``W - 1`` (an all-reduce ``2 (W - 1)``), or the
    peers of an all_to_all."""
    return 2 * (world_size - 1) if op == "all_reduce" else world_size - 1


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


def fit_links(samples: list[tuple[str, int, float]], world_size: int) -> dict[str, tuple[float, float]]:
    """Per collective kind, ``(latency per message, bandwidth)``: :func:`fit_link` on its own samples
    (bytes as the step model counts what each rank sends), the fitted latency spread over the
    kind's :func:`link_messages`, as the simulation charges ``messages x latency``."""
    out = {}
    for op in sorted({s[0] for s in samples}):
        latency, bandwidth = fit_link([s for s in samples if s[0] == op])
        out[op] = (latency / link_messages(op, world_size), bandwidth)
    return out


def combine(per_rank: list[list[dict]], world_size: int | None = None) -> dict:
    """Machine figures from ``per_rank[rank][point]`` measurements. Collectives make the ranks wait for
    each other every block, so at each point in time the slower rank counts (the lowest rate, the
    highest time); the figures are the means over the points, and ``spread`` each figure's lowest
    and highest point; the ranks' drift at each point by :func:`drift`. The link is fitted to every
    sample of every rank and point: once over every kind (``link_latency``, ``link_bandwidth``), and
    per kind (``link_kinds``)."""
    world_size = world_size or len(per_rank)
    points = list(zip(*per_rank))
    present = [k for k in RATES if k in points[0][0]]
    drifts = [dict(zip(("sync_skew", "sync_delay"), drift(point))) if "skew_seconds" in point[0] else {}
              for point in points]
    tables = [k for k in ("ns_seconds", "twin_ns_seconds", "twin_optimizer_seconds") if k in points[0][0]]
    bound = [{k: (min if k.endswith(("_flops", "_bytes")) else max)(m[k] for m in point) for k in present}
             | {t: {key: max(m[t][key] for m in point) for key in point[0][t]} for t in tables}
             | d for point, d in zip(points, drifts)]
    present += list(drifts[0])
    samples = [tuple(s) for point in points for m in point for s in m["link_samples"]]
    latency, bandwidth = fit_link(samples)
    return {
        **{k: statistics.mean(b[k] for b in bound) for k in present},
        "spread": {k: [min(b[k] for b in bound), max(b[k] for b in bound)] for k in present},
        **{t: {key: statistics.mean(b[t][key] for b in bound) for key in bound[0][t]} for t in tables},
        "link_latency": latency,
        "link_bandwidth": bandwidth,
        "link_kinds": {op: {"latency": a, "bandwidth": b} for op, (a, b) in fit_links(samples, world_size).items()},
        "link_samples": samples,
        "unsupported": per_rank[0][0].get("unsupported", {}),
        "points": len(points),
        **{k: per_rank[0][0][k] for k in ("unlisted_tensors", "twin_units") if k in per_rank[0][0]},
    }


def _ns_lookup(ns: dict):
    def seconds(shape: tuple[int, int], batch: int) -> float:
        key = f"{shape[0]}x{shape[1]}x{batch}"
        return ns[key] if key in ns else batch * ns[f"{shape[0]}x{shape[1]}x1"]
    return seconds


COMPUTE_MODELS = {"gemms_and_rest": "the GEMMs at the matmul rate, the work beyond them as measured and FSDP2's "
                                     "per-unit work (one-rank mesh, and on the ranks' own mesh from the twin)",
                  "matmul_flops": "the matmul rate with FSDP2's per-unit work (the work beyond the GEMMs left out)",
                  "effective_flops": "the effective rate"}
"""How a prediction prices forward and backward, and how :func:`figures_line` names it: ``"gemms_and_rest"``
(the check): 6 x parameters x tokens at the matmul rate, the measured work beyond the GEMMs
(``non_gemm_seconds``) and FSDP2's per-unit host work (on a one-rank mesh, plus :func:`rank_unit_seconds`);
``"matmul_flops"``: the same without the work beyond the GEMMs and without :func:`rank_unit_seconds`; ``"effective_flops"``: everything at the effective rate (FSDP2's forward+backward on a
one-rank mesh, its own work and the non-GEMM work inside, as the presets' rates)."""


def calibrated_hardware(figures: dict, compute: str = "gemms_and_rest", per_kind: bool = True,
                        host: bool = True, skew: bool = True) -> Hardware:
    """This machine as the simulation's :class:`Hardware`: forward and backward as ``compute`` says
    (:data:`COMPUTE_MODELS`); the link per collective kind (``per_kind``) or the one shared fit; the
    host's dispatch figures (``host``); the ranks' drift between meetings (``skew``). FSDP2's per-unit
    host work only at the matmul rate: the effective rate, FSDP2's forward and backward on a one-rank
    mesh, has it inside already."""
    if compute not in COMPUTE_MODELS:
        raise ValueError(f"compute must be one of {list(COMPUTE_MODELS)}, got {compute!r}")
    rate = "effective_flops" if compute == "effective_flops" else "matmul_flops"

    def links(latency: float, bandwidth: float) -> AlphaBeta:
        return AlphaBeta(intra_bandwidth=bandwidth, inter_bandwidth=bandwidth, intra_latency=latency,
                         inter_latency=latency)

    kinds = {op: links(f["latency"], f["bandwidth"]) for op, f in figures.get("link_kinds", {}).items()}
    return Hardware(
        "this machine (dmuon bench --calibrate)", figures[rate], figures["matmul_flops"],
        figures["elementwise_bytes"], links(figures["link_latency"], figures["link_bandwidth"]),
        op_links=kinds if per_kind else {},
        dispatch_seconds=figures.get("dispatch_seconds", 0.0) if host else 0.0,
        dtensor_dispatch_seconds=figures.get("dtensor_dispatch_seconds", 0.0) if host else 0.0,
        dtensor_layout_seconds=figures.get("dtensor_layout_seconds", 0.0) if host else 0.0,
        fsdp_unit_seconds=figures.get("fsdp_unit_seconds", 0.0) if host and rate == "matmul_flops" else 0.0,
        sync_skew=figures.get("sync_skew", 0.0) if skew else 0.0,
        sync_delay=figures.get("sync_delay", 0.0) if skew else 0.0)


def _twin(figures: dict, model: str) -> tuple[dict, int]:
    """``figures`` for predicting the model's tiny twin, and its tokens per rank: the machine's figures with
    the twin's own count of parameter tensors outside its shape lists (the per-tensor host work is priced
    per tensor; the bench model's count, which ``figures`` holds, has more: its blocks are more)."""
    unlisted, tokens = _twin_structure(model)
    return dict(figures, unlisted_tensors=unlisted), tokens


@functools.lru_cache(maxsize=None)
def _twin_structure(model: str) -> tuple[int, int]:
    """The tiny twin's parameter tensors outside its shape lists and its tokens per rank, from the twin
    built on the meta device once per model (every round's prediction asks for them)."""
    import torch

    from dmuon.bench.models import build_workload  # transformers' models: imported only when a twin was measured

    with torch.device("meta"):
        twin = build_workload(model, size="tiny")
    return len(list(twin.model.parameters())) - sum(g.count for g in bench_model_shapes(model, "tiny")), \
        twin.tokens_per_rank


def rank_unit_seconds(figures: dict, model: str, world_size: int) -> float:
    """FSDP2's work per unit and pass on the ranks' own mesh beyond what a one-rank mesh shows, from the
    model's tiny twin: its forward+backward under FSDP2 over every rank (``twin_world_seconds``, ZeRO-3 as
    the bench's ``adamw``) less what the check predicts for it (``adamw``'s forward+backward on the
    twin's shapes and tokens: its GEMMs at the matmul rate, its own work beyond them from its plain
    forward+backward, FSDP2's one-rank figure per unit and pass, its collectives at the fitted links, the
    ranks' drift), spread over its units and passes; 0 without the twin's figures, or where the
    prediction is not short.

    On a one-rank mesh FSDP2 takes its own short paths (``FSDPParamGroup.unshard`` issues no
    all-gather, the copy-in and copy-out differ, the reduce-scatter is a copy), so that figure leaves
    out what it does beside every collective over real ranks. The twin is all units and collectives
    (tiny widths), so what the model misses of it is that work, measured where the bench runs it; the
    bench model's own timings are never used."""
    if "twin_world_seconds" not in figures:
        return 0.0
    twin, tokens = _twin(figures, model)
    shapes = bench_model_shapes(model, "tiny")
    gemms = 6.0 * tokens * sum(g.numel for g in shapes)
    # Only adamw's forward+backward is read, where no NS runs; the simulation prices every strategy's step,
    # so the twin's NS entries are given (as nothing) to let it.
    twin.update(non_gemm_seconds=max(0.0, figures["twin_plain_seconds"] - gemms / figures["matmul_flops"]),
                rank_unit_seconds=0.0, host_factors={},
                ns_seconds={f"{g.shape[0]}x{g.shape[1]}x1": 0.0 for g in shapes if g.muon})
    predicted = predict(twin, model, "tiny", world_size, tokens, configs=("adamw",))["adamw"]
    return max(0.0, figures["twin_world_seconds"] - predicted["forward_backward_seconds"]) / (2 * figures["twin_units"])


def predict(figures: dict, model: str, size: str | None, world_size: int, tokens: int,
            compute: str = "gemms_and_rest", per_kind: bool = True, host: bool = True, skew: bool = True,
            configs: tuple[str, ...] = tuple(CONFIGS)) -> dict:
    """The simulated step of each of ``configs`` (bench configurations) on ``world_size`` ranks (1-D FSDP),
    with :func:`calibrated_hardware`'s figures and, for ``"gemms_and_rest"``, the measured work beyond the
    GEMMs and FSDP2's work on the ranks' own mesh (:func:`rank_unit_seconds`, unless ``figures`` gives
    ``rank_unit_seconds``)."""
    groups = bench_model_shapes(model, size)
    hardware = calibrated_hardware(figures, compute, per_kind, host, skew)
    if compute == "gemms_and_rest" and host:
        extra = figures.get("rank_unit_seconds")
        extra = rank_unit_seconds(figures, model, world_size) if extra is None else extra
        hardware = dataclasses.replace(hardware, fsdp_unit_seconds=hardware.fsdp_unit_seconds + extra)
    factors = figures.get("host_factors")
    if factors is None:
        factors = path_host_factors(figures, model, world_size) if host else {}
    # The bench runs fp32 parameters (FSDP2 gathers and reduces fp32), NS and the wire in bf16.
    options = SimOptions(tokens_per_gpu=tokens, ns_seconds=_ns_lookup(figures["ns_seconds"]), backend="gloo",
                         unlisted_tensors=figures.get("unlisted_tensors", 0) if host else 0,
                         non_gemm_seconds=figures.get("non_gemm_seconds", 0.0) if compute == "gemms_and_rest" else 0.0)
    # One simulated plan per ZeRO level and host factor (the configurations sharing both share it).
    runs = {config: (CONFIGS[config][1], factors.get(PATH_OF[config], 1.0)) for config in configs}
    plans = {(zero, factor): plan_offline(groups, world_size, "greedy", zero, wire_bytes=2, param_bytes=4,
                                          reduce_bytes=4, hardware=_host_scaled(hardware, factor), sim_options=options,
                                          max_waves=1)
             for zero, factor in sorted(set(runs.values()))}
    return {config: plans[runs[config]]["simulation"][CONFIGS[config][0]] for config in configs}


def _host_scaled(hardware: Hardware, factor: float) -> Hardware:
    """``hardware`` with its per-operation host figures ``factor`` times as long."""
    if factor == 1.0:
        return hardware
    return dataclasses.replace(hardware, dispatch_seconds=hardware.dispatch_seconds * factor,
                               dtensor_dispatch_seconds=hardware.dtensor_dispatch_seconds * factor,
                               dtensor_layout_seconds=hardware.dtensor_layout_seconds * factor)


def path_host_factors(figures: dict, model: str, world_size: int) -> dict[str, float]:
    """Per code path (:data:`TWIN_PATHS`), how many times its host work takes what the per-operation figures
    price: the model's tiny twin's optimizer phase over every rank (``twin_optimizer_seconds``) less what the
    check predicts for it without host work, over what the host work adds to that prediction (the twin's NS
    from ``twin_ns_seconds``); empty without the twin's figures.

    The host figures time tiny operations in a tight loop; a code path runs its own Python between its
    operations (the loops over matrices, the bookkeeping of pieces and flags, DTensor's layers), which they
    leave out. The twin has the bench model's tensors at tiny widths, so its optimizer phase is mostly
    that host work, measured where the bench runs it, on the same ranks; the bench model's own timings
    are never used. A factor below 1 (host figures that overprice the path) is kept as measured."""
    measured = figures.get("twin_optimizer_seconds")
    if not measured:
        return {}
    twin, tokens = _twin(figures, model)
    # Only the optimizer phases are read: FSDP2's per-unit figure on the ranks' mesh is left out.
    twin.update(ns_seconds=figures["twin_ns_seconds"], host_factors={}, rank_unit_seconds=0.0)
    paths = tuple(config for config in TWIN_PATHS if config in measured)
    with_host = predict(twin, model, "tiny", world_size, tokens, configs=paths)
    without = predict(twin, model, "tiny", world_size, tokens, host=False, configs=paths)
    factors = {}
    for config in paths:
        host = with_host[config]["optimizer_seconds"] - without[config]["optimizer_seconds"]
        if host > 0:
            factors[config] = max(0.0, measured[config] - without[config]["optimizer_seconds"]) / host
    return factors


PHASES = ("step_seconds", "forward_backward_seconds", "optimizer_seconds")
"""The predicted figures the check holds against the bench's medians."""


def predict_by_round(per_rank: list[list[dict]], world_size: int, model: str, size: str | None, tokens: int,
                     compute: str = "gemms_and_rest") -> dict:
    """Each bench round predicted from the figures measured around it, and per configuration the median
    over the rounds of each of :data:`PHASES` (with ``by_round``, the rounds' own predictions).

    ``per_rank[rank][point]`` holds one measurement before every round and one after the last, so round
    ``k`` ran between points ``k`` and ``k + 1``: its figures are :func:`combine` of those two. The shared
    machine's rates move by tens of percent between points while a round lasts seconds, so each round is
    priced at its own moment, and the predicted median is held against the measured one. A prediction at
    the figures' means over the whole run (:func:`predict` of :func:`combine` of every point) prices every
    round at one average rate; a step's time goes as ``1 / rate``, whose mean over a varying rate is more
    than ``1 / mean rate`` (Jensen's inequality), so on a drifting machine the rounds priced that way come
    out short on average (on a 2-core CPU, by up to 4 points against the bench's medians)."""
    points = len(per_rank[0])
    if points < 2:
        raise ValueError(f"predict_by_round needs a point before and after each round, got {points} point(s)")
    rounds = [predict(combine([r[k:k + 2] for r in per_rank], world_size), model, size, world_size, tokens, compute)
              for k in range(points - 1)]
    return {config: {key: statistics.median(p[config][key] for p in rounds) for key in PHASES}
            | {"by_round": [{key: p[config][key] for key in PHASES} for p in rounds]}
            for config in CONFIGS}


def separated(a: list[float], b: list[float]) -> int:
    """-1 if configuration a was faster than b in every round, 1 if slower in every round, 0 (tied) otherwise.

    The bench interleaves the configurations round by round, so within a round they share the
    machine's state (other work on the shared cores, its clock), which moves more between rounds
    than between configurations: the rounds pair them. A pair counts as ordered by the
    measurement when every round agrees, a sign test of two-sided p = 2^(1 - rounds) (0.125 with
    4 rounds, 0.008 with 8); anything less consistent is a tie no model can be held to."""
    signs = {(x > y) - (x < y) for x, y in zip(a, b)}
    return signs.pop() if len(signs) == 1 and 0 not in signs and len(a) > 1 else 0


def order_check(measured: dict, predicted: dict) -> dict:
    """The orders by step time, and the pairs the measurement separates (:func:`separated`, on the
    per-round medians ``step_s_by_round``): ``agree`` when the prediction orders each of them the same."""
    names = list(CONFIGS)
    order = {"measured": sorted(names, key=lambda c: measured[c]["step_s"]),
             "predicted": sorted(names, key=lambda c: predicted[c]["step_seconds"])}
    pairs = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            sign = separated(measured[a].get("step_s_by_round", []), measured[b].get("step_s_by_round", []))
            p = predicted[a]["step_seconds"] - predicted[b]["step_seconds"]
            pairs.append({"pair": [a, b], "measured": sign, "predicted": (p > 0) - (p < 0)})
    ordered = [p for p in pairs if p["measured"]]
    wrong = [p["pair"] for p in ordered if p["predicted"] != p["measured"]]
    return {**{k: v for k, v in order.items()}, "pairs": pairs, "separated": len(ordered), "disagree": wrong,
            "agree": not wrong, "same_order": order["measured"] == order["predicted"]}


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
    orders = order_check(measured, predicted)
    within = all(abs(row[k]["error"]) <= 0.2 for row in rows.values() for k in ("step", "optimizer"))
    return {"configs": rows, "order_by_step": {k: orders[k] for k in ("measured", "predicted")},
            "same_order": orders["same_order"], "order": orders, "within_20_percent": within}


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us"


def _rank_units(figures: dict) -> str:
    """The twin's figures in :func:`figures_line`, with the per-unit figure the check adds from them."""
    if "twin_world_seconds" not in figures or "rank_unit_seconds" not in figures:
        return ""
    return (f", and {figures['rank_unit_seconds'] * 1e3:.2f} ms more on the ranks' own mesh in the check (the twin "
            f"under FSDP2 over every rank, {figures['twin_world_seconds'] * 1e3:.1f} ms, less its prediction)")


def _path_hosts(figures: dict) -> str:
    """Each code path's host factor in :func:`figures_line`, with the twin's measured optimizer phases."""
    factors, measured = figures.get("host_factors"), figures.get("twin_optimizer_seconds")
    if not factors or not measured:
        return ""
    paths = ", ".join(f"{config} x{factors[config]:.2f} ({measured[config] * 1e3:.1f} ms)" for config in factors)
    return (f"; each code path's host work at the figures above times its factor, from its tiny twin's optimizer "
            f"step over every rank against the check's prediction of it: {paths}")


def figures_line(figures: dict, compute: str = "gemms_and_rest") -> str:
    """The machine's figures the prediction ran with, in one paragraph."""
    kinds = "; ".join(f"{op} {_us(f['latency'])} per message + bytes / {f['bandwidth'] / 1e9:.2f} GB/s"
                      for op, f in figures.get("link_kinds", {}).items())
    host = ""
    if "dtensor_dispatch_seconds" in figures:
        host = (f"; host: {figures['dispatch_seconds'] * 1e6:.1f} us per plain op, "
                f"{figures['dtensor_dispatch_seconds'] * 1e6:.1f} us per DTensor op (tiny elementwise ops, half in "
                f"place, of 48 shapes, on a one-rank mesh), {figures.get('dtensor_layout_seconds', 0.0) * 1e6:.0f} us per DTensor layout call "
                f"(full_tensor() less a plain all-gather, distribute_tensor, on every rank, at the model's Muon shapes in bf16), FSDP2 {figures['fsdp_unit_seconds'] * 1e3:.2f} ms per unit and pass (its qwen2 "
                f"tiny twin under FSDP2 on a one-rank mesh less without; added at the matmul rate only){_rank_units(figures)}, the "
                f"ranks' drift {figures.get('sync_skew', 0.0):.1%} of the compute between meetings and "
                f"{figures.get('sync_delay', 0.0) * 1e6:.0f} us more per meeting (blocks of GEMMs with an all-reduce "
                f"after each block and after each matrix, less both alone, relative to the slower rank), "
                f"{figures.get('unlisted_tensors', 0)} parameter tensors outside the shape lists{_path_hosts(figures)}")
    return (f"machine: matmul {figures['matmul_flops'] / 1e9:.1f} GFLOP/s (fp32, the model's GEMMs), effective "
            f"{figures['effective_flops'] / 1e9:.1f} GFLOP/s (forward+backward under FSDP2 on a one-rank mesh, as "
            f"6 x parameters x tokens), beyond the GEMMs {figures.get('non_gemm_seconds', 0.0) * 1e3:.1f} ms per "
            f"forward+backward (the model without FSDP2 on one rank less 6 x parameters x tokens at the matmul "
            f"rate), elementwise {figures['elementwise_bytes'] / 1e9:.2f} GB/s (AdamW kernel on "
            f"one rank's shards), gloo link per kind ({len(figures['link_samples'])} samples of 16 KiB to 4 MiB per "
            f"rank and peer, bytes each rank sends as the step model counts them): {kinds or '-'} (one fit over "
            f"all: {_us(figures['link_latency'])} + bytes / {figures['link_bandwidth'] / 1e9:.2f} GB/s){host}; "
            f"NS profiled per shape and batch (bf16, auto); forward+backward predicted at {COMPUTE_MODELS[compute]}")


def format_comparison(figures: dict, comparison: dict, header: str, compute: str = "gemms_and_rest",
                      by_round: bool = False) -> str:
    """The figures, the table of measured against predicted phases, the orders and the verdicts; ``by_round``:
    the predictions are :func:`predict_by_round`'s medians (the figures line says so)."""
    when = ("; each round predicted at the figures measured before and after it, the median over the rounds "
            "compared (the figures above are the run's means)" if by_round else
            "; every round at the run's mean figures")
    lines = [header] if header else []
    lines += [figures_line(figures, compute) + when,
              "| config | step ms: measured / predicted (error) | fwd+bwd ms | optimizer ms |",
              "|---|---|---|---|"]
    for config, row in comparison["configs"].items():
        cells = [f"{row[k]['measured'] * 1e3:.1f} / {row[k]['predicted'] * 1e3:.1f} ({row[k]['error']:+.0%})"
                 for k in ("step", "forward_backward", "optimizer")]
        lines.append(f"| `{config}` | " + " | ".join(cells) + " |")
    lines.extend(order_lines(comparison))
    return "\n".join(lines)


def order_lines(comparison: dict) -> list[str]:
    """The orders, the pairs the rounds separate, and the verdicts."""
    o = comparison["order"]
    sign = {-1: "<", 1: ">", 0: "~"}
    pairs = ", ".join(f"{a} {sign[p['measured']]} {b}" + ("" if not p["measured"] or p["measured"] == p["predicted"]
                                                          else " (predicted the reverse)")
                      for p in o["pairs"] for a, b in [p["pair"]])
    rounds = "every round agrees"
    return [f"order by step time: measured {', '.join(o['measured'])}; predicted {', '.join(o['predicted'])} "
            f"({'same' if o['same_order'] else 'different'})",
            f"pairs by round ('<': faster in every round, '~': the rounds disagree, a tie): {pairs}; "
            f"the prediction orders {o['separated'] - len(o['disagree'])} of the {o['separated']} pairs the "
            f"measurement separates ({rounds}) as measured: {'no disagreement' if o['agree'] else 'DISAGREES'}",
            f"within 20% (step and optimizer phase of every configuration): "
            f"{'yes' if comparison['within_20_percent'] else 'no'}"]


__all__ = ["COMPUTE_MODELS", "CONFIGS", "LINK_KINDS", "PHASES", "calibrated_hardware", "combine", "compare", "drift", "fit_link",
           "fit_links", "format_comparison", "link_messages", "order_check", "predict", "predict_by_round", "separated"]
