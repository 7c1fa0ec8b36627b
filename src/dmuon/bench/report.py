"""Tables, ratios, JSON and plots from bench results."""

from __future__ import annotations

import json
import os
import platform

import torch

from dmuon.bench.setups import clip_norm, is_muon_config

LOSS_RTOL = 0.02
"""Muon configurations run the same update rule; final losses within this relative
tolerance agree (torch.optim.Muon iterates NS in bf16, so bit equality is not expected)."""


CPU_MATRIX_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")
"""The x86 flags that decide how fast a CPU's bf16 and fp32 matmuls are (and so what the autotuner picks)."""


def cpu_features(cpuinfo: str) -> tuple[str | None, list[str]]:
    """The model name and the :data:`CPU_MATRIX_FLAGS` present, from ``/proc/cpuinfo``'s text."""
    name, flags = None, set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name is None:
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return name, [f for f in CPU_MATRIX_FLAGS if f in flags]


def machine_description() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}"
    name, flags = platform.processor() or None, []
    try:
        with open("/proc/cpuinfo") as f:
            name, flags = cpu_features(f.read())
    except OSError:  # not Linux
        pass
    features = ", ".join([name or "unknown", *flags])
    return f"{platform.machine()} CPU ({os.cpu_count()} cores, {features}), torch {torch.__version__}, gloo"


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _live(live: dict | None) -> str:
    """``total (params+grads+state)`` in MiB, or ``-`` for a result without live figures."""
    if not live:
        return "-"
    return f"{_mb(live['total'])} ({_mb(live['params'])}+{_mb(live['grads'])}+{_mb(live['optimizer_state'])})"


def format_table(results: list[dict]) -> str:
    head = ("config", "step ms (min-max)", "fwd+bwd ms", "optim ms", "NS ms", "MB/step", "peak MB",
            "live MB (params+grads+state)", "final loss")
    rows = [head]
    for r in results:
        rows.append((
            r["config"],
            f"{1e3 * r['step_s']:.1f} ({1e3 * r['step_s_min']:.1f}-{1e3 * r['step_s_max']:.1f})",
            f"{1e3 * r['fwd_bwd_s']:.1f}",
            f"{1e3 * r['optimizer_s']:.1f}",
            f"{1e3 * r['ns_s']:.1f}" if r.get("ns_s") else "-",
            f"{r['bytes_per_step'] / 2**20:.2f}",
            f"{r['peak_mem_bytes'] / 2**20:.0f}",
            _live(r.get("live_mem_bytes")),
            f"{r['final_loss']:.4f}",
        ))
    widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def timing_note(results: list[dict]) -> str:
    """What the phase columns mean in this run, with each configuration's slowest rank's own ``step()``
    time, and how many of dmuon's launches from backward each timed step kept."""
    kept = "; ".join(f"{r['config']} {','.join(map(str, r['kept_launches_per_step']))} of {r['blocks']}"
                     for r in results if r.get("blocks"))
    kept = f"\nlaunches from backward kept per timed step: {kept}" if kept else ""
    if not results or not all(r.get("phases_on_one_clock") for r in results):
        return "phases: each rank's own durations, the slowest rank's (ranks on several hosts)" + kept
    own = ", ".join(f"{r['config']} {1e3 * r['optimizer_own_s']:.1f}" for r in results)
    return ("phases: from the last rank's entry to the last rank's exit, on this host's clock; "
            f"optim ms as the slowest rank's own step() + zero_grad: {own}" + kept)


def ratios(results: list[dict]) -> dict[str, float | list[float]]:
    """dmuon vs AdamW (overhead %; vs ``adamw_local`` too when it ran), vs each Muon baseline (speedups).

    ZeRO-2 dmuon configurations (``dmuon_z2*``) are also compared with
    ``adamw_z2`` when it ran: the same FSDP2 resharding
    (``reshard_after_forward=False``), so like for like.

    With ``torch_muon`` present, also ``torch_muon_optimizer_per_fwd_bwd``: its
    optimizer step over its forward+backward, which says how optimizer-heavy the
    workload is on this machine.
    """
    by = {r["config"]: r for r in results}
    out: dict[str, float] = {}
    if "torch_muon" in by:
        # What kind of workload this is: how heavy the optimizer users would run
        # otherwise is against the model's own compute (the core-runtime issue's
        # workload has this at about 4x on 4 CPU ranks).
        tm = by["torch_muon"]
        out["torch_muon_optimizer_per_fwd_bwd"] = tm["optimizer_s"] / tm["fwd_bwd_s"]
    for mine in by:
        if not mine.startswith("dmuon_"):
            continue
        d = by[mine]
        # Like for like: a clipping configuration against AdamW clipping the same way.
        refs = ("adamw_clip",) if mine.partition("@")[0].endswith("_clip") else \
            ("adamw", "adamw_local") + (("adamw_z2",) if mine.startswith("dmuon_z2") else ())
        for ref in refs:
            if ref not in by:
                continue
            out[f"{mine}_overhead_vs_{ref}_pct"] = 100.0 * (d["step_s"] / by[ref]["step_s"] - 1.0)
            mine_rounds, base_rounds = d.get("step_s_by_round", []), by[ref].get("step_s_by_round", [])
            if len(mine_rounds) > 1 and len(mine_rounds) == len(base_rounds):
                # Interleaved rounds pair each configuration with AdamW run moments apart.
                out[f"{mine}_overhead_vs_{ref}_by_round_pct"] = [
                    100.0 * (a / b - 1.0) for a, b in zip(mine_rounds, base_rounds)]
        for base in ("torch_muon", "gather"):
            if base in by:
                out[f"{mine}_step_speedup_vs_{base}"] = by[base]["step_s"] / d["step_s"]
                out[f"{mine}_optimizer_speedup_vs_{base}"] = by[base]["optimizer_s"] / d["optimizer_s"]
    return out


def loss_agreement(results: list[dict], exclude: tuple[str, ...] = ()) -> tuple[bool, str]:
    """Whether the Muon configurations (but ``exclude``) end at the same loss, and the sentence saying so.

    Clipping configurations train on other gradients: they are compared among themselves.
    """
    sentences, ok = [], True
    for clipped in (False, True):
        muon = [r for r in results if is_muon_config(r["config"]) and r["config"] not in exclude
                and (clip_norm(r["config"]) is not None) == clipped]
        if len(muon) < 2:
            continue
        ref = muon[0]
        worst = max(abs(r["final_loss"] - ref["final_loss"]) / abs(ref["final_loss"]) for r in muon)
        ok = ok and worst <= LOSS_RTOL
        names = ", ".join(r["config"] for r in muon)
        verdict = "agree" if worst <= LOSS_RTOL else "MISMATCH"
        sentences.append(f"final losses of {names} {verdict} (max relative difference {worst:.2e}, "
                         f"tolerance {LOSS_RTOL})")
    if not sentences:
        return True, "fewer than two Muon configurations: nothing to compare"
    return ok, "; ".join(sentences)


def format_ratios(r: dict[str, float | list[float]]) -> str:
    lines = []
    for key, value in r.items():
        if isinstance(value, list):
            lines.append(f"    per round: {', '.join(f'{v:+.1f}%' for v in value)}")
        elif key.endswith("_pct"):
            lines.append(f"  {key[:-4]}: {value:+.1f}%")
        else:
            lines.append(f"  {key}: {value:.2f}x")
    return "\n".join(lines)


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


def write_plot(path: str, results: list[dict], title: str) -> None:
    """A PNG bar chart of the step-time breakdown per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in results]
    fb = [1e3 * r["fwd_bwd_s"] for r in results]
    op = [1e3 * r["optimizer_s"] for r in results]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar(names, fb, label="forward + backward")
    ax.bar(names, op, bottom=fb, label="optimizer step")
    ax.set_ylabel("median ms per step")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
