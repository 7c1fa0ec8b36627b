"""The GPU check's kernel, sanitizer and Newton–Schulz sections (the stream section:
:mod:`dmuon.bench.gpu_check_bench`; the driver and the verdict table: :mod:`dmuon.bench.gpu_check`).

Each section has a ``plan_*`` function (what it will run; the dry run prints and tests it), a
``*_section`` function that runs it on CUDA and rewrites its JSON after every case (a timeout still
leaves the cases done), and a ``*_verdicts`` function giving its checks from that JSON.
"""

from __future__ import annotations

import json
import math
import traceback

import torch

U_FP32 = 2.0 ** -24  # unit roundoff of float32 (the kernel's accumulator)
U_TF32 = 2.0 ** -11  # of TF32 inputs (10 stored mantissa bits)

# ------------------------------------------------------------------ syrk: every tile configuration
SYRK_SHAPES = ((1, 1), (1, 777), (333, 1), (97, 131), (1000, 3000), (4099, 129))
"""Ragged ``(M, K)``: one row, one column, masked row tiles and a K tail for every BLOCK/BLOCK_K."""
SYRK_LARGE = (16384, 64)
"""One large M (about 8.4k 128-tiles, 33k 64-tiles of the triangle): the tile enumeration's far end."""
SYRK_VARIANTS = ("float32", "float32+tf32", "bfloat16", "fused")
"""Inputs per tile configuration: IEEE float32, TF32, bfloat16, and float32 ``alpha A Aᵀ + beta C``."""


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
        ``max_rel_err`` (see :func:`syrk_tolerance`), ``tolerance``, ``symmetric`` (exactly),
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
    return {"max_rel_err": rel, "tolerance": tol, "symmetric": symmetric, "finite": finite,
            "passed": bool(finite and symmetric and rel <= tol)}


def plan_syrk() -> list[dict]:
    """Every case: each tile configuration on each ragged shape in each variant, and at the large M in
    IEEE float32."""
    from dmuon.ortho.triton_syrk import TILE_CONFIGS

    cases = [{"config": list(cfg), "M": M, "K": K, "variant": v}
             for cfg in TILE_CONFIGS for M, K in SYRK_SHAPES for v in SYRK_VARIANTS]
    return cases + [{"config": list(cfg), "M": SYRK_LARGE[0], "K": SYRK_LARGE[1], "variant": "float32"}
                    for cfg in TILE_CONFIGS]


def syrk_section(device: torch.device, out: str) -> dict:
    from dmuon.ortho import triton_syrk

    gen, payload = torch.Generator().manual_seed(0), {"cases": []}
    for case in plan_syrk():
        M, K, variant, cfg = case["M"], case["K"], case["variant"], tuple(case["config"])
        A = torch.randn(M, K, generator=gen).to(device)
        try:
            if variant == "fused":
                C = triton_syrk.syrk(A, config=cfg) / max(K, 1)
                got = triton_syrk.syrk(A, alpha=2.0, beta=-0.5, C=C, config=cfg)
                check = compare_syrk(got, A, alpha=2.0, beta=-0.5, C=C)
            else:
                tf32 = variant == "float32+tf32"
                A = A.to(torch.bfloat16) if variant == "bfloat16" else A
                check = compare_syrk(triton_syrk.syrk(A, allow_tf32=tf32, config=cfg), A, tf32=tf32)
        except Exception as exc:  # a config that fails to compile or launch is a failed case, listed
            check = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
        payload["cases"].append({**case, "check": check})
        with open(out, "w") as f:
            json.dump(payload, f)
    return payload


def syrk_verdicts(payload: dict) -> list[dict]:
    cases = payload.get("cases", [])
    failed = [c for c in cases if not c["check"]["passed"]]
    worst = max((c["check"].get("max_rel_err", math.inf) / c["check"].get("tolerance", 1.0) for c in cases),
                default=math.nan)
    detail = f"{len(cases) - len(failed)}/{len(plan_syrk())} cases; worst error/tolerance {worst:.2e}"
    if failed:
        detail += "; failed: " + ", ".join(f"{tuple(c['config'])} {c['M']}x{c['K']} {c['variant']}"
                                           + (f" ({c['check']['error']})" if "error" in c["check"] else "")
                                           for c in failed[:8])
    return [{"name": "syrk every tile config vs float64", "passed": not failed and len(cases) == len(plan_syrk()),
             "detail": detail}]


# ------------------------------------------------------------------ csan: TORCH_CUDA_SANITIZER=1
CSAN_STEPS = 2
CSAN_EXTRA = ("dmuon_z3_nsbwd", "dmuon_z3_rbwd", "dmuon_z3_nfwd", "dmuon_z3_muonh_nfwd")


def plan_csan() -> list[str]:
    """The configurations stepped under the sanitizer: the bench's set on CUDA (FSDP2 with AdamW,
    torch's Muon and the gather baseline show which reports are FSDP2's own), with NS and returns in
    backward; dmuon's with loopback collectives."""
    from dmuon.bench.gpu_check_base import bench_configs

    return bench_configs(torch.device("cuda")) + list(CSAN_EXTRA)


def csan_section(device: torch.device, out: str) -> dict:
    """Two steps of each configuration; every sanitizer report (an exception it raises) verbatim."""
    from dmuon.bench.gpu_check_base import one_rank
    from dmuon.bench.gpu_check_bench import train

    enabled = False
    try:
        from torch.cuda import _sanitizer

        enabled = bool(getattr(_sanitizer, "cuda_sanitizer", None) and _sanitizer.cuda_sanitizer.enabled)
    except ImportError:
        pass
    payload = {"sanitizer_enabled": enabled, "rows": []}
    with one_rank(device):
        for config in plan_csan():
            row = {"config": config, "reports": []}
            try:
                run = train(config, "run" if config.startswith("dmuon") else "local", "tiny", CSAN_STEPS, device)
                row["losses"] = run["losses"]
            except Exception as exc:
                row["reports"].append("".join(traceback.format_exception_only(type(exc), exc)))
            payload["rows"].append(row)
            with open(out, "w") as f:
                json.dump(payload, f)
    return payload


def csan_verdicts(payload: dict) -> list[dict]:
    checks = [{"name": "csan sanitizer on", "passed": payload.get("sanitizer_enabled", False)}]
    for row in payload.get("rows", []):
        checks.append({"name": f"csan {row['config']} {CSAN_STEPS} steps, no report", "passed": not row["reports"],
                       "detail": "; ".join(row["reports"])[:4000] if row["reports"] else "none"})
    return checks


# ------------------------------------------------------------------ ns: qwen2.5-7b's shapes
NS_SHAPES = ((3584, 3584), (512, 3584), (18944, 3584))
"""qwen2.5-7b: attention output / q (3584x3584), k and v (512x3584), the MLP (18944x3584; its transpose
for the down projection runs the same NS)."""
NS_BATCH = 4
NS_REPEATS = 10


def plan_ns() -> list[dict]:
    """Each shape alone and as a stack of :data:`NS_BATCH`; candidates ``standard`` (bf16 products) and
    ``gram`` (Gram NS, symmetric kernels), batched calls and loops over the stack."""
    cases = [{"shape": list(s), "batch": 1, "candidates": ["standard", "gram"]} for s in NS_SHAPES]
    return cases + [{"shape": list(s), "batch": NS_BATCH,
                     "candidates": ["standard", "gram", "standard_looped", "gram_looped"]} for s in NS_SHAPES]


def ns_section(device: torch.device, out: str) -> dict:
    """Times every candidate with CUDA events (:func:`dmuon.ortho.autotune.time_candidates`), its
    error against float32 NS, and the pick of a fresh autotuner."""
    import tempfile

    from dmuon.ortho import symmetric as sym
    from dmuon.ortho.autotune import Autotuner, run_looped, run_method, time_candidates
    from dmuon.ortho.coefficients import KELLER, resolve_schedule

    bf16, gen, payload = torch.bfloat16, torch.Generator().manual_seed(0), {"rows": []}
    payload["symmetric_backend"] = sym.default_backend(device)
    with tempfile.TemporaryDirectory() as cache:
        tuner = Autotuner(cache_dir=cache, persist=False)
        tuner.cooldown_s = 0.0
        for case in plan_ns():
            (m, n), batch = case["shape"], case["batch"]
            G = torch.randn(*(() if batch == 1 else (batch,)), m, n, generator=gen).to(device)
            problem = tuner.problem((m, n), bf16, device, resolve_schedule(KELLER, 5), 1e-7)
            fns = {"standard": lambda: run_method("standard", G, problem),
                   "gram": lambda: run_method("gram", G, problem),
                   "standard_looped": lambda: run_looped("standard", G, problem),
                   "gram_looped": lambda: run_looped("gram", G, problem)}
            times = time_candidates({k: fns[k] for k in case["candidates"]}, device, NS_REPEATS, cooldown_s=0.0,
                                    adaptive=False)
            ref = run_method("standard32", G, problem).double()
            err = {k: float((run_method(k, G, problem).double() - ref).norm() / ref.norm())
                   for k in ("standard", "gram")}
            row = {**case, "times_s": times, "standard_over_gram": times["standard"] / times["gram"],
                   "rel_err_vs_float32": err}
            row["autotune_method"] = tuner.method(problem, device)
            if batch > 1:
                row["autotune_batched"] = tuner.batching(problem, batch, row["autotune_method"], device)
                row["looped_over_batched"] = {k: times[f"{k}_looped"] / times[k] for k in ("standard", "gram")}
            payload["rows"].append(row)
            with open(out, "w") as f:
                json.dump(payload, f)
    return payload


NS_MAX_REL_ERR = 0.1
"""The largest distance of a bf16 NS result from float32 NS that is a rounding difference, not a
miswired kernel (bf16 NS's own distance is a few 1e-3; a wrong product gives O(1))."""


def ns_verdicts(payload: dict) -> list[dict]:
    """One check per row: both methods finite and near float32 NS; the timings are reported, not judged."""
    checks = []
    for row in payload.get("rows", []):
        err = row["rel_err_vs_float32"]
        name = f"ns {row['shape'][0]}x{row['shape'][1]} batch {row['batch']}"
        detail = (f"standard/gram time {row['standard_over_gram']:.2f}x; autotuner picks {row['autotune_method']}"
                  + (f", batched {row['autotune_batched']}" if "autotune_batched" in row else "")
                  + f"; rel err standard {err['standard']:.1e}, gram {err['gram']:.1e}")
        checks.append({"name": name, "passed": all(math.isfinite(e) and e <= NS_MAX_REL_ERR for e in err.values()),
                       "detail": detail})
    return checks
