"""Side-by-side speed of the orthogonalisation variants.

``python -m dmuon.bench.ortho_bench`` (or ``dmuon bench --ortho``) prints two tables:

* per matrix shape: standard Newton–Schulz, Gram NS with plain matmuls, and Gram NS
  with the half-work symmetric kernels, as times and speed-ups over standard;
* per (batch, shape): one batched call versus a loop of 2-D calls, for the standard
  and the Gram method, plus what a fresh autotuner picks and how close its pick is
  to the better of the two.

All variants of a row are timed in the same process, one block of calls per variant
after a short pause (:func:`dmuon.ortho.timing.time_candidates` with a fixed number
of rounds); the fastest call (or the median) is reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence

import torch

from dmuon.ortho import symmetric as sym
from dmuon.ortho.autotune import Autotuner
from dmuon.ortho.coefficients import KELLER, resolve_schedule
from dmuon.ortho.gram import default_restart_every, gram_newton_schulz
from dmuon.ortho.newton_schulz import newton_schulz
from dmuon.ortho.timing import time_candidates

DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((256, 1024), (512, 2048), (1024, 1024), (1024, 4096), (1024, 8192))
DEFAULT_BATCHES: tuple[tuple[int, int, int], ...] = ((64, 32, 128), (16, 128, 512), (8, 256, 1024), (4, 512, 512))
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


_STATS = {"min": min, "median": statistics.median}


def _timed(fns: dict[str, Callable[[], object]], repeats: int, stat: str = "min", cooldown_s: float = 0.25) -> dict[str, float]:
    """Seconds per function on CPU (``stat`` over exactly ``repeats`` calls), one block per function.

    Each block starts with a pause and an untimed warm-up; blocks rather than
    round-robin, so one variant's OpenBLAS spin does not bill the next (see
    :func:`~dmuon.ortho.timing.time_candidates`).
    """
    return time_candidates(fns, torch.device("cpu"), repeats, cooldown_s=cooldown_s, stat=_STATS[stat],
                           adaptive=False)


def run_ortho_bench(
    shapes: Sequence[tuple[int, int]] | None = None,
    dtype: torch.dtype = torch.float32,
    repeats: int = 3,
    batches: Sequence[tuple[int, int, int]] | None = None,
    steps: int = 5,
    coefficients=KELLER,
    stat: str = "min",
    cooldown_s: float = 0.25,
    restarts: Sequence[int] | None = None,
) -> list[dict]:
    """Times the orthogonalisation variants on CPU.

    Args:
        shapes: ``(m, n)`` shapes for the method comparison (default
            :data:`DEFAULT_SHAPES`); an empty sequence skips it.
        dtype: Compute/result dtype passed to every variant.
        repeats: Timed rounds per variant (median reported).
        batches: ``(B, m, n)`` triples for the batched-vs-looped comparison (default
            :data:`DEFAULT_BATCHES`); an empty sequence skips it.
        steps: Newton–Schulz steps.
        coefficients: Coefficient triple or schedule.
        stat: ``"min"`` (default; on a shared machine the fastest round is the best
            estimate of the uncontended cost) or ``"median"``.
        cooldown_s: Pause before each variant's block of calls.
        restarts: Gram restart cadences for the method table, one row each per
            shape (the standard path is timed once per shape). ``None``: the
            defaults for 16-bit and for float32 results (every 3 and every 2 steps),
            i.e. the Gram path as ``DMuon`` runs it with ``NSConfig(dtype=torch.bfloat16)``
            and with ``NSConfig(dtype=torch.float32)``.

    Returns:
        One dict per row: the method rows (``kind="method"``, :func:`_method_rows`), then the batch rows
        (``kind="batch"``, :func:`_batch_row`).

    Raises:
        ValueError: For a non-positive ``repeats`` or malformed shapes.
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    if stat not in _STATS:
        raise ValueError(f"stat must be one of {sorted(_STATS)}, got {stat!r}")
    shapes = DEFAULT_SHAPES if shapes is None else shapes
    batches = DEFAULT_BATCHES if batches is None else batches
    if restarts is None:
        restarts = (default_restart_every(torch.bfloat16), default_restart_every(torch.float32))
    cadences = list(dict.fromkeys(restarts))
    if not cadences or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in cadences):
        raise ValueError(f"restarts must be non-negative ints, got {restarts!r}")
    gen = torch.Generator().manual_seed(0)
    timing = {"repeats": repeats, "stat": stat, "cooldown_s": cooldown_s}
    rows = _method_rows(shapes, cadences, gen, dtype, steps, coefficients, timing)
    tuner = Autotuner(repeats=repeats, persist=False)
    tuner.cooldown_s = cooldown_s
    for triple in batches:
        if len(triple) != 3 or min(triple) < 1:
            raise ValueError(f"bad batch spec {triple!r}")
        B, m, n = triple
        rows.append(_batch_row(torch.randn(B, m, n, generator=gen), tuner, dtype, steps, coefficients, timing))
    return rows


def _method_rows(shapes, cadences: list[int], gen: torch.Generator, dtype: torch.dtype, steps: int, coefficients,
                 timing: dict) -> list[dict]:
    """Per shape, standard NS timed once, then per restart cadence a row with times in seconds under
    ``standard_s``, ``gram_s`` (plain matmuls) and ``gram_sym_s`` (symmetric kernels) and the speed-ups
    ``gram_speedup``/``gram_sym_speedup`` over standard. ``timing``: :func:`_timed`'s settings."""
    rows = []
    for shape in shapes:
        if len(shape) != 2 or min(shape) < 1:
            raise ValueError(f"bad shape {shape!r}")
        m, n = shape
        G = torch.randn(m, n, generator=gen)
        t_std = _timed({"standard": lambda: newton_schulz(G, coefficients, steps, dtype=dtype)},
                       **timing)["standard"]
        for every in cadences:
            fns = {
                "gram": lambda: gram_newton_schulz(
                    G, coefficients, steps, dtype=dtype, backend="reference", restart_every=every),
                "gram_sym": lambda: gram_newton_schulz(G, coefficients, steps, dtype=dtype, restart_every=every),
            }
            t = _timed(fns, **timing)
            rows.append({
                "kind": "method", "shape": (m, n), "dtype": str(dtype).replace("torch.", ""),
                "restart_every": every,
                "standard_s": t_std, "gram_s": t["gram"], "gram_sym_s": t["gram_sym"],
                "gram_speedup": t_std / t["gram"], "gram_sym_speedup": t_std / t["gram_sym"],
            })
    return rows


def _batch_row(G: torch.Tensor, tuner: Autotuner, dtype: torch.dtype, steps: int, coefficients,
               timing: dict) -> dict:
    """One batched call against a loop of 2-D calls on the stack ``G``, for standard and Gram NS:
    ``{method}_batched_s``, ``{method}_looped_s``, ``{method}_batched_speedup`` (looped / batched); the
    autotuner's ``auto_method`` and ``auto_batched`` (from :meth:`Autotuner.plan`), ``auto_vs_best`` (time
    of its pick over the better of batched/looped for that method; 1.0 is ideal), ``auto_vs_best_any``
    (over the best of all four), ``auto_speedup_vs_loop`` (looped time of that method over its pick) and
    ``auto_speedup_vs_std_loop`` (looped standard NS over its pick)."""
    B, m, n = G.shape
    fns = {}
    for method, fn in (("standard", newton_schulz), ("gram", gram_newton_schulz)):
        fns[f"{method}_batched"] = (lambda fn=fn: fn(G, coefficients, steps, dtype=dtype))
        fns[f"{method}_looped"] = (lambda fn=fn: [fn(g, coefficients, steps, dtype=dtype) for g in G])
    t = _timed(fns, **timing)
    row = {"kind": "batch", "batch": B, "shape": (m, n), "dtype": str(dtype).replace("torch.", "")}
    for method in ("standard", "gram"):
        row[f"{method}_batched_s"] = t[f"{method}_batched"]
        row[f"{method}_looped_s"] = t[f"{method}_looped"]
        row[f"{method}_batched_speedup"] = t[f"{method}_looped"] / t[f"{method}_batched"]
    problem = tuner.problem((m, n), dtype, "cpu", resolve_schedule(coefficients, steps), 1e-7)
    method, batched = tuner.plan(problem, B, "cpu")
    picked = row[f"{method}_{'batched' if batched else 'looped'}_s"]
    best_same = min(row[f"{method}_batched_s"], row[f"{method}_looped_s"])
    best_any = min(row[f"{m}_{mode}_s"] for m in ("standard", "gram") for mode in ("batched", "looped"))
    row.update({
        "auto_method": method, "auto_batched": batched, "auto_vs_best": picked / best_same,
        "auto_vs_best_any": picked / best_any,
        "auto_speedup_vs_loop": row[f"{method}_looped_s"] / picked,
        "auto_speedup_vs_std_loop": row["standard_looped_s"] / picked,
    })
    return row


def run_kernel_bench(sizes: Sequence[int] = (256, 512, 1024, 2048), repeats: int = 5) -> list[dict]:
    """Times each symmetric-product backend against the full-matmul reference.

    For each ``m``: ``gram`` of an ``(m, 4m)`` float32 matrix, ``sym_poly2`` and
    ``sym_product`` of ``(m, m)`` symmetric commuting matrices.

    Returns:
        One dict per (op, m) with ``{backend}_s`` times in seconds.
    """
    gen = torch.Generator().manual_seed(0)
    backends = [b for b in ("reference", "torch", "blas") if b != "blas" or sym._np is not None]
    rows = []
    for m in sizes:
        X = torch.randn(m, 4 * m, generator=gen)
        R = sym.gram_reference(X) / (4 * m)
        P = R @ R + R
        ops = {
            "gram": lambda b: sym.gram(X, b),
            "sym_poly2": lambda b: sym.sym_poly2(R, 2.0, 3.0, b),
            "sym_product": lambda b: sym.sym_product(R, P, b),
        }
        for op, fn in ops.items():
            t = _timed({b: (lambda b=b: fn(b)) for b in backends}, repeats)
            rows.append({"kind": "kernel", "op": op, "m": m, **{f"{b}_s": v for b, v in t.items()}})
    return rows


def format_kernel_table(rows: list[dict]) -> str:
    """Renders :func:`run_kernel_bench` rows."""
    backends = [k[:-2] for k in rows[0] if k.endswith("_s")] if rows else []
    out = [f"{'op':>12} {'m':>5} " + " ".join(f"{b:>10}" for b in backends) + "  (ms; x = speed-up vs reference)"]
    for r in rows:
        ref = r["reference_s"]
        cells = " ".join(f"{r[b + '_s'] * 1e3:>6.2f}/{ref / r[b + '_s']:.1f}x" for b in backends)
        out.append(f"{r['op']:>12} {r['m']:>5} {cells}")
    return "\n".join(out)


def format_table(rows: list[dict]) -> str:
    """Renders :func:`run_ortho_bench` rows as two plain-text tables."""
    out = []
    mrows = [r for r in rows if r["kind"] == "method"]
    if mrows:
        out.append(f"{'shape':>12} {'dtype':>9} {'restart':>7} {'standard':>10} {'gram':>10} {'gram+sym':>10} "
                   f"{'gram x':>7} {'g+sym x':>8}")
        for r in mrows:
            out.append(
                f"{r['shape'][0]:>5}x{r['shape'][1]:<6} {r['dtype']:>9} {r['restart_every']:>7} "
                f"{r['standard_s'] * 1e3:>8.1f}ms "
                f"{r['gram_s'] * 1e3:>8.1f}ms {r['gram_sym_s'] * 1e3:>8.1f}ms "
                f"{r['gram_speedup']:>6.2f}x {r['gram_sym_speedup']:>7.2f}x"
            )
    brows = [r for r in rows if r["kind"] == "batch"]
    if brows:
        if out:
            out.append("")
        out.append(f"{'B x shape':>15} {'dtype':>9} {'std batch':>10} {'std loop':>10} {'std b/l':>8} "
                   f"{'gram batch':>11} {'gram loop':>10} {'gram b/l':>9} {'auto pick':>16} {'pick/best':>9} {'pick/any':>8} {'loop/pick':>9}")
        for r in brows:
            pick = f"{r['auto_method']}/{'batched' if r['auto_batched'] else 'looped'}"
            out.append(
                f"{r['batch']:>4} x {r['shape'][0]:>4}x{r['shape'][1]:<4} {r['dtype']:>9} "
                f"{r['standard_batched_s'] * 1e3:>8.2f}ms {r['standard_looped_s'] * 1e3:>8.2f}ms "
                f"{r['standard_batched_speedup']:>7.2f}x "
                f"{r['gram_batched_s'] * 1e3:>9.2f}ms {r['gram_looped_s'] * 1e3:>8.2f}ms "
                f"{r['gram_batched_speedup']:>8.2f}x {pick:>16} {r['auto_vs_best']:>9.3f} "
                f"{r['auto_vs_best_any']:>8.3f} {r['auto_speedup_vs_loop']:>8.2f}x"
            )
    return "\n".join(out)


def _parse_pairs(text: str, arity: int) -> list[tuple[int, ...]]:
    items = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        dims = tuple(int(v) for v in part.lower().split("x"))
        if len(dims) != arity:
            raise ValueError(f"expected {arity} dimensions in {part!r}")
        items.append(dims)
    return items


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m dmuon.bench.ortho_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="fp32", choices=sorted(_DTYPES), help="compute dtype (default fp32)")
    p.add_argument("--shapes", default=None, help="comma-separated MxN list for the method table ('' skips)")
    p.add_argument("--batches", default=None, help="comma-separated BxMxN list for the batching table ('' skips)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per variant (median)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--restarts", default=None,
                   help="comma-separated Gram restart cadences, a table row each (default: 3,2 — "
                        "DMuon's cadence for bf16 and for fp32 results; 0 never restarts)")
    p.add_argument("--coefficients", default="keller", choices=["keller", "polar_express"])
    p.add_argument("--stat", default="min", choices=sorted(_STATS), help="per-variant statistic over rounds")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (set OPENBLAS_NUM_THREADS in the environment to match)")
    p.add_argument("--json", action="store_true", help="print rows as JSON instead of a table")
    p.add_argument("--kernels", action="store_true", help="time the symmetric-product backends instead")
    args = p.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            print("error: --threads must be positive", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    if args.kernels:
        krows = run_kernel_bench(repeats=args.repeats)
        if args.json:
            import json

            print(json.dumps(krows, indent=1))
        else:
            print(format_kernel_table(krows))
        return 0
    try:
        rows = run_ortho_bench(
            shapes=None if args.shapes is None else _parse_pairs(args.shapes, 2),
            dtype=_DTYPES[args.dtype],
            repeats=args.repeats,
            batches=None if args.batches is None else _parse_pairs(args.batches, 3),
            steps=args.steps,
            coefficients=KELLER if args.coefficients == "keller" else "polar_express",
            stat=args.stat,
            restarts=None if args.restarts is None else [int(v) for v in args.restarts.split(",") if v.strip()],
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        import json

        print(json.dumps(rows, indent=1))
    else:
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
