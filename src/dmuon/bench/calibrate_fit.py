"""``dmuon bench --calibrate``'s arithmetic: the link fits, the machine's figures over its ranks, and the
``dmuon plan --simulate`` flags they make (no ranks, no timing: the tests run it on constructed samples)."""

from __future__ import annotations

from dmuon.plan.cost import gram_ns_flops, ns_flops

LINK_KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
"""The collectives the link is measured with, each fitted on its own."""
RATES = ("matmul_flops", "effective_flops", "elementwise_bytes")
"""Per-rank rates: the slower rank has the lowest."""
SECONDS = ("non_gemm_seconds", "fsdp_unit_seconds", "dispatch_seconds", "dtensor_dispatch_seconds",
           "dtensor_layout_seconds")
"""Per-rank seconds: the slower rank has the highest."""
NS_STEPS = 5
"""NS iterations of the bench's settings (``NSConfig``'s default), at which the NS rate counts FLOPs."""


def link_messages(op: str, world_size: int) -> int:
    """Latency terms of one collective on ``world_size`` ranks as the step model counts them
    (:mod:`dmuon.costmodel.collectives`): ring steps, ``W - 1`` (an all-reduce ``2 (W - 1)``), or the
    peers of an all_to_all."""
    return 2 * (world_size - 1) if op == "all_reduce" else world_size - 1


def _weighted_fit(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """``(a, c)`` minimising ``sum(((a m + c x - y) / y)^2)`` over ``(m, x, y)`` rows: the relative error,
    each row weighted by ``1 / y²``, so the small sizes set ``a`` and the large ones ``c``; ``a`` is
    refitted as 0 where the fit makes it negative."""
    w = [1.0 / y**2 for _, _, y in rows]
    smm = sum(wi * m * m for wi, (m, _, _) in zip(w, rows))
    smx = sum(wi * m * x for wi, (m, x, _) in zip(w, rows))
    sxx = sum(wi * x * x for wi, (_, x, _) in zip(w, rows))
    smy = sum(wi * m * y for wi, (m, _, y) in zip(w, rows))
    sxy = sum(wi * x * y for wi, (_, x, y) in zip(w, rows))
    det = smm * sxx - smx * smx
    a, c = (sxx * smy - smx * sxy) / det, (smm * sxy - smx * smy) / det
    if a < 0:
        a, c = 0.0, sxy / sxx
    return a, c


def fit_link(samples: list[tuple[str, int, float]]) -> tuple[float, float]:
    """``time = latency + bytes / bandwidth`` over ``(op, bytes, seconds)`` samples, least squares of the
    relative error: ``(latency, bandwidth)``."""
    latency, slope = _weighted_fit([(1.0, float(b), t) for _, b, t in samples])
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


def fit_shared_link(samples: list[tuple[str, int, float]], world_size: int) -> tuple[float, float]:
    """One ``(latency per message, bandwidth)`` for every kind: ``time = messages x latency + bytes /
    bandwidth`` over all the samples, each with its kind's :func:`link_messages` (``dmuon plan`` takes one
    link per level, which every collective kind shares)."""
    latency, slope = _weighted_fit([(float(link_messages(op, world_size)), float(b), t) for op, b, t in samples])
    return latency, 1.0 / slope


def combine(per_rank: list[dict], world_size: int | None = None) -> dict:
    """The machine's figures from every rank's measurement. Collectives make the ranks wait for each
    other, so the slower rank counts: the lowest rate, the highest time (each NS entry's too). The link is
    fitted to every rank's samples, per kind (``link_kinds``) and once over every kind (``link_latency``,
    ``link_bandwidth``); without samples (one rank) there is no link figure."""
    world_size = world_size or len(per_rank)
    out = {k: min(m[k] for m in per_rank) for k in RATES}
    out |= {k: max(m[k] for m in per_rank) for k in SECONDS}
    out["ns_seconds"] = {key: max(m["ns_seconds"][key] for m in per_rank) for key in per_rank[0]["ns_seconds"]}
    samples = [tuple(s) for m in per_rank for s in m["link_samples"]]
    out["link_samples"] = samples
    out["unsupported"] = per_rank[0].get("unsupported", {})
    if samples:
        out["link_latency"], out["link_bandwidth"] = fit_shared_link(samples, world_size)
        out["link_kinds"] = {op: {"latency": a, "bandwidth": b} for op, (a, b) in fit_links(samples, world_size).items()}
    return out


def ns_rate(ns_seconds: dict[str, float], counts: dict[tuple[int, int], int], steps: int = NS_STEPS) -> float:
    """The owners' NS as ``dmuon plan --simulate --ns-tflops`` prices it (its ``auto``: each shape at the
    fewer analytical FLOPs of standard and Gram NS), in FLOP/s: the model's Muon matrices' FLOPs over their
    measured seconds, one matrix at a time (``ns_seconds``' batch-1 entries)."""
    flops = sum(n * min(ns_flops(shape, steps), gram_ns_flops(shape, steps)) for shape, n in counts.items())
    seconds = sum(n * ns_seconds[f"{shape[0]}x{shape[1]}x1"] for shape, n in counts.items())
    return flops / seconds


def costs_records(ns_seconds: dict[str, float]) -> list[dict]:
    """``ns_seconds`` in ``dmuon plan --costs``' format: ``{"shape": [m, n], "batch": b, "seconds": s}``."""
    records = []
    for key, seconds in ns_seconds.items():
        rows, cols, batch = (int(x) for x in key.split("x"))
        records.append({"shape": [rows, cols], "batch": batch, "seconds": seconds})
    return records


def _g(value: float) -> str:
    return f"{value:.6g}"


def compute_flags(figures: dict, gemms_alone: bool = False) -> list[str]:
    """Forward and backward as ``dmuon plan --simulate`` overrides: at the effective rate (the presets'
    sense: FSDP2's own work and the work beyond the GEMMs inside it), or with ``gemms_alone`` at the matmul
    rate with the work beyond the GEMMs and FSDP2's per-unit work beside it."""
    if not gemms_alone:
        return ["--compute-tflops", _g(figures["effective_flops"] / 1e12)]
    return ["--compute-tflops", _g(figures["matmul_flops"] / 1e12),
            "--non-gemm-ms", _g(figures["non_gemm_seconds"] * 1e3),
            "--fsdp-unit-us", _g(figures["fsdp_unit_seconds"] * 1e6)]


def plan_flags(figures: dict, gemms_alone: bool = False) -> list[str]:
    """The hardware figures as ``dmuon plan --simulate`` overrides: :func:`compute_flags`, NS, the
    elementwise rate, the host's figures and the link (when measured) as the one level a single-node plan
    uses, ``--intra-*``."""
    flags = compute_flags(figures, gemms_alone) + [
        "--ns-tflops", _g(figures["ns_flops"] / 1e12),
        "--elementwise-gbps", _g(figures["elementwise_bytes"] / 1e9),
        "--dispatch-us", _g(figures["dispatch_seconds"] * 1e6),
        "--dtensor-dispatch-us", _g(figures["dtensor_dispatch_seconds"] * 1e6),
        "--layout-us", _g(figures["dtensor_layout_seconds"] * 1e6)]
    if "link_latency" in figures:
        flags += ["--intra-latency", _g(figures["link_latency"] * 1e6),
                  "--intra-bandwidth", _g(figures["link_bandwidth"] / 1e9)]
    return flags


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us"


def figures_lines(figures: dict) -> list[str]:
    """The machine's figures, one line per kind of work."""
    lines = [f"compute: matmul {figures['matmul_flops'] / 1e9:.1f} GFLOP/s (fp32, the model's GEMMs), effective "
             f"{figures['effective_flops'] / 1e9:.1f} GFLOP/s (forward+backward under FSDP2 on a one-rank mesh, as "
             f"6 x parameters x tokens); beyond the GEMMs {figures['non_gemm_seconds'] * 1e3:.1f} ms per "
             f"forward+backward; FSDP2 {figures['fsdp_unit_seconds'] * 1e3:.2f} ms per unit and pass",
             f"elementwise: {figures['elementwise_bytes'] / 1e9:.2f} GB/s (AdamW kernel on one rank's shards)",
             f"NS (bf16, auto): {figures['ns_flops'] / 1e9:.1f} GFLOP/s at its analytical FLOPs, one matrix at a time; "
             f"{len(figures['ns_seconds'])} shapes and batch sizes measured",
             f"host: {figures['dispatch_seconds'] * 1e6:.1f} us per plain op, "
             f"{figures['dtensor_dispatch_seconds'] * 1e6:.1f} us per DTensor op, "
             f"{_us(figures['dtensor_layout_seconds'])} per DTensor layout call beyond its collective"]
    if "link_kinds" not in figures:
        return lines + ["link: none (one rank)"]
    kinds = "; ".join(f"{op} {_us(f['latency'])} per message + bytes / {f['bandwidth'] / 1e9:.2f} GB/s"
                      for op, f in figures["link_kinds"].items())
    unsupported = f" (not in this build: {', '.join(figures['unsupported'])})" if figures["unsupported"] else ""
    return lines + [f"link per collective kind ({len(figures['link_samples'])} samples of 16 KiB to 4 MiB per rank "
                    f"and peer): {kinds}{unsupported}; one fit over all: {_us(figures['link_latency'])} per "
                    f"message + bytes / {figures['link_bandwidth'] / 1e9:.2f} GB/s"]


__all__ = ["LINK_KINDS", "RATES", "SECONDS", "combine", "compute_flags", "costs_records", "figures_lines", "fit_link", "fit_links",
           "fit_shared_link", "link_messages", "ns_rate", "plan_flags"]
