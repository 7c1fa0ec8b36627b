"""``dmuon bench --gpu-check``: one prepared check for a lent GPU, with a CPU dry run.

Five sections, each in a subprocess of its own (a section that crashes or hangs is
reported and the others still run; the dry run can switch Triton's interpreter on
before Triton is imported):

``kernel``
    The Triton SYRK kernel (:func:`dmuon.ortho.triton_syrk.syrk`) against a float64
    product for float32, float32 with TF32 and bfloat16 inputs, and in its fused
    ``alpha A Aᵀ + beta C`` form; timed against ``torch.matmul(A, A.mT)``, the full
    float32 product (:func:`~dmuon.ortho.symmetric.gram_reference`), the
    block-triangular torch schedule and the Triton path Gram NS calls.
``ortho``
    Standard Newton–Schulz against Gram NS (plain matmuls, and with the symmetric
    kernels) in bfloat16, and what a fresh :class:`~dmuon.ortho.autotune.Autotuner`
    picks, per shape.
``bench``
    ``dmuon bench`` on one rank (NCCL; gloo in the dry run): AdamW, torch.optim.Muon,
    gather-then-compute and dmuon, through :func:`dmuon.bench.runner.run_all`.
``syncs``
    One ``step()`` of dmuon (ZeRO-3) and of AdamW on one rank, on the bench model at two sizes
    (14 and 28 Muon matrices): how often the host waits for the device (CUDA: every call
    ``torch.cuda.set_sync_debug_mode`` flags; the dry run: :class:`~dmuon.bench.op_count.HostReadCounter`).
    dmuon's count must not grow with the matrices.
``recipe``
    ``examples/train_lm.py`` for a few steps (AdamW and dmuon), read from its ``--json``.

Everything goes into one JSON (``--json``). The exit status is 1 if a correctness check
failed or a section did not finish, 2 for usage errors (no CUDA without ``--dry-run``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

SECTIONS = ("kernel", "ortho", "bench", "syncs", "recipe")
U_FP32 = 2.0 ** -24  # unit roundoff of float32 (the kernel's accumulator)
U_TF32 = 2.0 ** -11  # of TF32 inputs (10 stored mantissa bits)
U_BF16 = 2.0 ** -8  # of bfloat16 (7 stored mantissa bits)
_REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Sizes:
    """Problem sizes and limits of one mode (GPU or dry run)."""

    kernel_shapes: tuple[tuple[int, int], ...]
    poly_sizes: tuple[int, ...]
    ortho_shapes: tuple[tuple[int, int], ...]
    repeats: int
    cooldown_s: float
    bench: dict = field(default_factory=dict)
    sync_sizes: tuple[str, ...] = ("tiny", "mini")
    """The bench model's sizes the syncs section steps (qwen2; 14 and 28 Muon matrices)."""
    recipe_args: tuple[str, ...] = ()
    timeouts_s: dict = field(default_factory=dict)


# 1000x3000 is ragged (masked tile edges and K tail); 4096x4096 is the shape of Gram NS's
# m x m squares. Timeouts add up to 490 s, so the whole check stays under 8.5 minutes.
GPU = Sizes(
    kernel_shapes=((1000, 3000), (1024, 4096), (2048, 8192), (4096, 4096), (4096, 16384)),
    poly_sizes=(1000, 4096),
    ortho_shapes=((1024, 4096), (4096, 1024), (2048, 8192), (4096, 16384)),
    repeats=10, cooldown_s=0.0,
    bench=dict(model="qwen2", size="mini", steps=6, warmup=1, rounds=2),
    recipe_args=("--steps", "30", "--val-every", "10", "--hidden", "512", "--intermediate", "1536",
                 "--layers", "8", "--heads", "8", "--kv-heads", "2", "--seq-len", "512",
                 "--batch-size", "8", "--corpus-mb", "8"),
    timeouts_s={"kernel": 110, "ortho": 100, "bench": 140, "syncs": 40, "recipe": 100},
)
# The recipe's tiny model has the bench's tiny shapes (vocabulary 256 both), so its
# dmuon reuses the autotune cache entries the bench section just measured.
DRY = Sizes(
    kernel_shapes=((33, 70), (64, 96)),
    poly_sizes=(40,),
    ortho_shapes=((16, 64), (64, 16), (32, 128), (64, 256)),
    repeats=2, cooldown_s=0.0,
    bench=dict(model="tiny", size="tiny", steps=2, warmup=1, rounds=1),
    recipe_args=("--steps", "2", "--val-every", "1", "--val-batches", "1", "--hidden", "64",
                 "--intermediate", "192", "--layers", "2", "--heads", "8", "--kv-heads", "2",
                 "--seq-len", "32", "--batch-size", "2", "--corpus-mb", "0.2"),
    timeouts_s={"kernel": 120, "ortho": 120, "bench": 180, "syncs": 120, "recipe": 180},
)


def syrk_tolerance(K: int, tf32: bool = False) -> float:
    """Bound on ``|C_ij - (A Aᵀ)_ij| / (‖a_i‖ ‖a_j‖)`` for the kernel's float32 accumulation.

    A dot product of length ``K`` accumulated in float32, in any order, errs by at most
    ``γ_K |a_i|ᵀ|a_j| <= K u ‖a_i‖ ‖a_j‖`` (Higham, Accuracy and Stability, Thm. 3.5, and
    Cauchy–Schwarz), ``u = 2^-24``; the ``alpha``/``beta`` scaling and addend add two
    more roundings. bfloat16 products are exact in float32, so bf16 inputs get the same
    bound. TF32 rounds both inputs to ``u = 2^-11``: ``2 u`` more per product. The
    factor 2 allows for matrix units whose adders truncate instead of rounding. This is
    a worst-case bound (observed errors are near ``sqrt(K) u``): it never fails a right
    result, and a wrong tile, mirror or K tail errs by orders of magnitude more.
    """
    return 2 * (K + 2) * U_FP32 + (2 * U_TF32 if tf32 else 0.0)


def compare_syrk(out: torch.Tensor, A: torch.Tensor, *, alpha: float = 1.0, beta: float = 0.0,
                 C: torch.Tensor | None = None, tf32: bool = False) -> dict:
    """Checks a SYRK result against ``alpha A Aᵀ + beta C`` computed in float64.

    Returns:
        ``max_rel_err`` (see :func:`syrk_tolerance`), ``tolerance``, ``err_over_sqrtK_u``
        (the error in units of ``sqrt(K) u``, for reading), ``symmetric`` (exactly),
        ``finite`` and ``passed``.
    """
    M, K = A.shape
    A64 = A.double()
    ref = alpha * (A64 @ A64.mT)
    norms = A64.norm(dim=1)
    scale = abs(alpha) * norms[:, None] * norms[None, :]
    if C is not None:
        ref = ref + beta * C.double()
        scale = scale + abs(beta) * C.double().abs()
    ok_shape = tuple(out.shape) == (M, M) and out.dtype == torch.float32
    finite = bool(torch.isfinite(out).all()) if ok_shape else False
    if not ok_shape:
        rel = math.inf
    else:
        rel = float(((out.double() - ref).abs() / scale.clamp(min=1e-300)).max()) if M else 0.0
    symmetric = ok_shape and bool(torch.equal(out, out.mT))
    tol = syrk_tolerance(K, tf32)
    return {"max_rel_err": rel, "tolerance": tol, "err_over_sqrtK_u": rel / (math.sqrt(max(K, 1)) * U_FP32),
            "symmetric": symmetric, "finite": finite, "passed": bool(finite and symmetric and rel <= tol)}


def _timer(device: torch.device, sizes: Sizes):
    from dmuon.ortho.autotune import time_candidates

    return lambda fns: time_candidates(fns, device, sizes.repeats, cooldown_s=sizes.cooldown_s)


def kernel_section(sizes: Sizes, device: torch.device) -> dict:
    """Correctness and speed of the Triton SYRK kernel (see the module docstring)."""
    from dmuon.ortho import symmetric as sym
    from dmuon.ortho import triton_syrk
    from dmuon.ortho.coefficients import KELLER

    timed, gen, cases = _timer(device, sizes), torch.Generator().manual_seed(0), []
    tf32_flag = torch.backends.cuda.matmul.allow_tf32
    for M, K in sizes.kernel_shapes:
        base = torch.randn(M, K, generator=gen).to(device)
        for name, dtype, tf32 in (("float32", torch.float32, False), ("float32+tf32", torch.float32, True),
                                  ("bfloat16", torch.bfloat16, False)):
            A = base.to(dtype)
            check = compare_syrk(triton_syrk.syrk(A, allow_tf32=tf32), A, tf32=tf32)
            fns = {"syrk": lambda A=A, t=tf32: triton_syrk.syrk(A, allow_tf32=t),
                   "matmul": lambda A=A: torch.matmul(A, A.mT)}
            if not tf32:  # these paths never use TF32
                fns.update(gram_reference=lambda A=A: sym.gram_reference(A),
                           gram_torch=lambda A=A: sym.gram(A, "torch"),
                           gram_triton=lambda A=A: sym.gram(A, "triton"))
            torch.backends.cuda.matmul.allow_tf32 = tf32
            try:
                times = timed(fns)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = tf32_flag
            cases.append({"op": "syrk", "dtype": name, "M": M, "K": K, "check": check, "times_s": times,
                          "full_product_tflops": {k: 2 * M * M * K / t / 1e12 for k, t in times.items()},
                          "tile_config": triton_syrk.best_config(M, K, dtype, False, dtype == torch.float32 and not tf32)})
    _, b, c = KELLER  # the quintic step's sym_poly2(R, b, c)
    for m in sizes.poly_sizes:
        X = torch.randn(m, 2 * m, generator=gen).to(device)
        R = sym.gram_reference(X)
        R = R / torch.linalg.matrix_norm(R, ord=2)
        check = compare_syrk(triton_syrk.syrk(R, alpha=c, beta=b, C=R), R, alpha=c, beta=b, C=R)
        times = timed({"syrk": lambda R=R: triton_syrk.syrk(R, alpha=c, beta=b, C=R),
                       "addmm": lambda R=R: sym.sym_poly2_reference(R, b, c),
                       "sym_poly2_triton": lambda R=R: sym.sym_poly2(R, b, c, "triton")})
        cases.append({"op": "syrk_poly2", "dtype": "float32", "M": m, "K": m, "check": check, "times_s": times,
                      "tile_config": triton_syrk.best_config(m, m, R.dtype, True, True)})
    return {"interpreted": triton_syrk.interpreting(), "cases": cases}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def ortho_section(sizes: Sizes, device: torch.device) -> dict:
    """Standard NS vs Gram NS in bfloat16 and the autotuner's pick, per shape."""
    from dmuon.ortho import symmetric as sym
    from dmuon.ortho.autotune import Autotuner
    from dmuon.ortho.coefficients import KELLER, resolve_schedule
    from dmuon.ortho.gram import gram_newton_schulz
    from dmuon.ortho.newton_schulz import newton_schulz

    bf16, timed, gen, rows = torch.bfloat16, _timer(device, sizes), torch.Generator().manual_seed(0), []
    with tempfile.TemporaryDirectory() as cache:
        tuner = Autotuner(cache_dir=cache, persist=False)
        tuner.cooldown_s = sizes.cooldown_s
        for m, n in sizes.ortho_shapes:
            G = torch.randn(m, n, generator=gen).to(device)
            fns = {"standard": lambda G=G: newton_schulz(G, KELLER, 5, dtype=bf16),
                   "gram": lambda G=G: gram_newton_schulz(G, KELLER, 5, dtype=bf16, backend="reference"),
                   "gram_sym": lambda G=G: gram_newton_schulz(G, KELLER, 5, dtype=bf16)}
            times = timed(fns)
            outs = {k: fn() for k, fn in fns.items()}
            ref = newton_schulz(G, KELLER, 5, dtype=torch.float32)
            problem = tuner.problem((m, n), bf16, device, resolve_schedule(KELLER, 5), 1e-7)
            pick = tuner.method(problem, device)
            sym_vs_plain = _rel(outs["gram_sym"], outs["gram"])
            # Both paths round one float32 iterate to bf16: they may differ by one bf16
            # rounding step (2u) per element, plus float32 summation-order effects that
            # the polynomial amplifies; 4u bounds that, a miswired kernel errs O(1).
            rows.append({"shape": [m, n], "dtype": "bfloat16", "times_s": times,
                         "speedup_vs_standard": {k: times["standard"] / t for k, t in times.items()},
                         "rel_err_vs_fp32_standard": {k: _rel(o, ref) for k, o in outs.items()},
                         "gram_sym_vs_gram": sym_vs_plain, "gram_sym_vs_gram_tolerance": 4 * U_BF16,
                         "gram_sym_vs_gram_passed": sym_vs_plain <= 4 * U_BF16,
                         "symmetric_backend": sym.default_backend(device),
                         "autotune": {"method": pick, **(tuner.lookup(problem) or {})}})
    return {"rows": rows}


SYNC_RTOL = 1e-6
"""``overlap=True`` gives bit-identical results to ``overlap=False``; a relative loss difference
above this (room for a nondeterministic library kernel, not for a stream race) fails the check."""


def bench_configs(device: torch.device) -> list[str]:
    """The bench section's configurations: the default set, dmuon with ``overlap=False``
    (``dmuon_z3_sync``, whose losses must equal ``dmuon_z3``'s: what the exchanges from backward,
    the speculation and the return waves do must not change the result on the device's streams),
    and on an accelerator also dmuon with ``post_optim_event=True`` (CPU has no events), whose
    losses must agree with the others'."""
    from dmuon.bench.setups import CONFIGS

    return list(CONFIGS) + ["dmuon_z3_sync"] + (["dmuon_z3_event"] if device.type == "cuda" else [])


def overlap_vs_sync(results: list[dict]) -> dict:
    """The largest relative difference of ``dmuon_z3``'s losses from ``dmuon_z3_sync``'s, and its verdict."""
    losses = {r["config"]: r["losses"] for r in results}
    diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses["dmuon_z3"], losses["dmuon_z3_sync"]))
    return {"max_rel_diff": diff, "tolerance": SYNC_RTOL, "passed": diff <= SYNC_RTOL}


@contextlib.contextmanager
def _one_rank(device: torch.device):
    """A one-rank process group in this process (NCCL on CUDA, else gloo); yields the backend."""
    import torch.distributed as dist

    from dmuon.util.spawn import free_port

    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def bench_section(sizes: Sizes, device: torch.device) -> dict:
    """``dmuon bench`` on one rank of this process (NCCL on CUDA, else gloo)."""
    from dmuon.bench.report import loss_agreement, machine_description, ratios
    from dmuon.bench.runner import BenchOptions, run_all
    from dmuon.ortho.autotune import get_autotuner

    # dmuon's own tuner measures in the warm-up steps; the dry run skips its CPU pauses.
    get_autotuner().cooldown_s = sizes.cooldown_s
    with _one_rank(device) as backend:
        results = run_all(0, 1, bench_configs(device), BenchOptions(progress=False, **sizes.bench))
    ok, verdict = loss_agreement(results)
    return {"machine": machine_description(), "backend": backend, "world_size": 1, **sizes.bench,
            "results": results, "ratios": ratios(results), "losses_agree": ok, "loss_check": verdict,
            "overlap_vs_sync": overlap_vs_sync(results)}


@contextlib.contextmanager
def _counting_syncs(device: torch.device, ignored=()):
    """Counts the host's waits for the device inside the block; yields a function giving the count."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield lambda: sum("synchroniz" in str(w.message) for w in caught)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return
    from dmuon.bench.op_count import HostReadCounter

    counter = HostReadCounter(ignored)
    with counter:
        yield lambda: counter.count


def _step_syncs(config: str, size: str, device: torch.device) -> dict:
    """The third ``step()`` of ``config`` on the qwen2 bench model of ``size`` (one rank): its syncs."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.bench.models import build_workload
    from dmuon.bench.setups import Hyper, build

    torch.manual_seed(0)
    with torch.device(device):
        workload = build_workload("qwen2", size=size, seed=0)
    opt, plan = build(config, workload, init_device_mesh(device.type, (1,)), Hyper())
    count = 0
    for step in range(3):  # the third counted: the state exists, the launches from backward are checked
        batch = workload.make_batch(step, 0)
        batch = {k: v.to(device) for k, v in batch.items()} if isinstance(batch, dict) else batch.to(device)
        workload.loss_fn(workload.model, batch).backward()
        if step < 2:
            opt.step()
        else:
            counters = [s["step"] for s in getattr(opt, "state", {}).values()
                        if isinstance(s, dict) and isinstance(s.get("step"), torch.Tensor)]
            with _counting_syncs(device, counters) as counted:
                opt.step()
            count = counted()
        opt.zero_grad(set_to_none=True)
    return {"config": config, "size": size, "matrices": len(plan.infos) if plan is not None else 0,
            "syncs": count}


def syncs_section(sizes: Sizes, device: torch.device) -> dict:
    """How often one ``step()`` makes the host wait for the device, for dmuon and AdamW at two sizes."""
    with _one_rank(device) as backend:
        rows = [_step_syncs(config, size, device) for size in sizes.sync_sizes for config in ("adamw", "dmuon_z3")]
    return {"backend": backend, "counted": "cuda sync debug mode" if device.type == "cuda" else "host reads (dispatch)",
            "rows": rows, "passed": syncs_passed(rows)}


def syncs_passed(rows: list[dict]) -> bool:
    """Whether dmuon's ``step()`` waited for the device as often at every size (at least two sizes)."""
    counts = [r["syncs"] for r in rows if r["config"] == "dmuon_z3"]
    return len(counts) >= 2 and len(set(counts)) == 1


_SECTION_FNS = {"kernel": kernel_section, "ortho": ortho_section, "bench": bench_section, "syncs": syncs_section}


def summarize_recipe(payload: dict) -> dict:
    """The figures of a ``train_lm.py --json`` payload: losses, times and tokens/s per run."""
    tokens = payload["config"]["tokens_per_step"]
    runs = {name: {"steps": r["step"][-1], "first_train_loss": r["train_loss"][0],
                   "final_train_loss": r["train_loss"][-1], "final_val_loss": r["val_loss"][-1],
                   "train_seconds": r["seconds"][-1], "tokens_per_s": tokens * r["step"][-1] / r["seconds"][-1],
                   "finite": all(math.isfinite(v) for v in r["train_loss"] + r["val_loss"])}
            for name, r in payload["runs"].items()}
    cfg = payload["config"]
    return {"runs": runs, "backend": cfg["backend"], "device": cfg["device"], "model": cfg["model"],
            "tokens_per_step": tokens, "comparison": payload["comparison"]}


def _run_section(name: str, dry_run: bool, sizes: Sizes, recipe: Path, workdir: str) -> dict:
    """Runs one section in a subprocess; its JSON, or ``error`` and the stderr tail."""
    out = os.path.join(workdir, f"{name}.json")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                       env.get("PYTHONPATH")]))
    if dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""
        if name == "kernel":
            env["TRITON_INTERPRET"] = "1"  # read when Triton is imported, hence the subprocess
    if name == "recipe":
        from dmuon.util.spawn import free_port

        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        cmd = [sys.executable, str(recipe), "--optimizer", "both", *sizes.recipe_args, "--quiet", "--json", out]
    else:
        cmd = [sys.executable, "-m", "dmuon.bench.gpu_check", "--section", name, "--out", out]
        cmd += ["--dry-run"] if dry_run else []
    start = time.perf_counter()
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=sizes.timeouts_s[name])
        code, err = res.returncode, res.stderr
    except subprocess.TimeoutExpired as exc:
        code, err = f"timed out after {sizes.timeouts_s[name]} s", str(exc.stderr or "")
    wall = time.perf_counter() - start
    if code != 0 or not os.path.exists(out):
        return {"error": f"exit code {code}", "stderr_tail": err[-3000:], "wall_s": wall}
    with open(out) as f:
        data = json.load(f)
    return {**(summarize_recipe(data) if name == "recipe" else data), "wall_s": wall}


def collect_checks(sections: dict) -> list[dict]:
    """Pass/fail of every correctness check, and of every section having finished."""
    checks = [{"name": f"section {k} finished", "passed": "error" not in v} for k, v in sections.items()]
    for case in sections.get("kernel", {}).get("cases", []):
        checks.append({"name": f"kernel {case['op']} {case['dtype']} {case['M']}x{case['K']}",
                       "passed": case["check"]["passed"],
                       "detail": f"max rel err {case['check']['max_rel_err']:.2e} <= {case['check']['tolerance']:.2e}, "
                                 f"symmetric {case['check']['symmetric']}"})
    for row in sections.get("ortho", {}).get("rows", []):
        checks.append({"name": f"ortho gram+sym vs gram {row['shape'][0]}x{row['shape'][1]}",
                       "passed": row["gram_sym_vs_gram_passed"], "detail": f"rel diff {row['gram_sym_vs_gram']:.2e}"})
    if "losses_agree" in sections.get("bench", {}):
        checks.append({"name": "bench Muon losses agree", "passed": sections["bench"]["losses_agree"],
                       "detail": sections["bench"]["loss_check"]})
    if "overlap_vs_sync" in sections.get("bench", {}):
        same = sections["bench"]["overlap_vs_sync"]
        checks.append({"name": "bench dmuon overlap=True equals overlap=False", "passed": same["passed"],
                       "detail": f"max rel loss diff {same['max_rel_diff']:.2e} <= {same['tolerance']:.0e}"})
    if "rows" in sections.get("syncs", {}):
        rows = [r for r in sections["syncs"]["rows"] if r["config"] == "dmuon_z3"]
        checks.append({"name": "syncs dmuon step() waits for the device as often with more matrices",
                       "passed": sections["syncs"]["passed"],
                       "detail": ", ".join(f"{r['syncs']} with {r['matrices']} matrices" for r in rows)})
    for name, run in sections.get("recipe", {}).get("runs", {}).items():
        checks.append({"name": f"recipe {name} losses finite", "passed": run["finite"]})
    return checks


def run_check(dry_run: bool, sections: tuple[str, ...] = SECTIONS, recipe: Path | None = None) -> dict:
    """Runs the sections one after another and returns the whole payload."""
    sizes = DRY if dry_run else GPU
    recipe = recipe or _REPO / "examples" / "train_lm.py"
    start, results = time.perf_counter(), {}
    with tempfile.TemporaryDirectory() as workdir:
        for name in sections:
            if name == "recipe" and not recipe.exists():
                results[name] = {"error": f"recipe not found at {recipe} (pass --recipe)", "wall_s": 0.0}
                continue
            results[name] = _run_section(name, dry_run, sizes, recipe, workdir)
            status = results[name].get("error", "done")
            print(f"gpu-check: {name}: {status} ({results[name]['wall_s']:.1f} s)", file=sys.stderr, flush=True)
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    checks = collect_checks(results)
    return {"device": "cpu (dry run)" if dry_run else torch.cuda.get_device_name(),
            "dry_run": dry_run, "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "python": sys.version.split()[0], "wall_s": time.perf_counter() - start, "sections": results,
            "checks": checks, "passed": all(c["passed"] for c in checks)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dmuon bench --gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="the same code paths at tiny sizes on CPU")
    p.add_argument("--json", default="gpu_check.json", metavar="PATH", help="output (default: gpu_check.json)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--recipe", default=None, type=Path, help="path of examples/train_lm.py")
    p.add_argument("--section", choices=sorted(_SECTION_FNS), help=argparse.SUPPRESS)  # internal: one section
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.section:
        sizes, device = (DRY, torch.device("cpu")) if args.dry_run else (GPU, torch.device("cuda"))
        with open(args.out, "w") as f:
            json.dump(_SECTION_FNS[args.section](sizes, device), f)
        return 0
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    if not sections or any(s not in SECTIONS for s in sections):
        print(f"dmuon bench --gpu-check: --sections must be from {SECTIONS}", file=sys.stderr)
        return 2
    if not args.dry_run and not torch.cuda.is_available():
        print("dmuon bench --gpu-check: no CUDA device here; pass --dry-run to run the same code paths "
              "at tiny sizes on CPU", file=sys.stderr)
        return 2
    payload = run_check(args.dry_run, sections, args.recipe)
    with open(args.json, "w") as f:
        json.dump(payload, f, indent=1)
    for c in payload["checks"]:
        print(f"{'PASS' if c['passed'] else 'FAIL'}  {c['name']}" + (f"  ({c['detail']})" if c.get("detail") else ""))
    print(f"{payload['device']}: {'all checks passed' if payload['passed'] else 'CHECKS FAILED'} "
          f"in {payload['wall_s']:.0f} s; wrote {args.json}")
    return 0 if payload["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
