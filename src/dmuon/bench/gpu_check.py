"""``dmuon bench --gpu-check``: one prepared run on one GPU (at most 8 minutes), with a CPU dry run.

Six sections, cheapest and most informative first, each in a subprocess of its own with its own
timeout (:data:`TIMEOUTS_S`; a section that crashes or hangs fails its checks and the others
still run, and a section's JSON is rewritten as it goes, so a timeout keeps what finished):

``syrk``
    Every Triton SYRK tile configuration (:data:`dmuon.ortho.triton_syrk.TILE_CONFIGS`, run with
    ``config=``) against float64 at ragged shapes (M = 1, K = 1, masked tiles, a K tail, one large M),
    for float32, TF32, bfloat16 and the fused ``alpha A Aᵀ + beta C``
    (:mod:`dmuon.bench.gpu_check_sections`).
``bench``
    dmuon's stream paths on one rank with ``ExecutionConfig(loopback_collectives=True)`` (real NCCL
    self all-to-alls and all-reduces): the configurations with NS and returns in backward, clipping
    and the accelerator defaults, each asserting its launches stood, repeated under deterministic
    algorithms to measure a loss tolerance, run again with a delay on FSDP2's reduce-scatter stream
    (:mod:`dmuon.bench.gpu_check_bench`).
``csan``
    Two steps of each configuration under ``TORCH_CUDA_SANITIZER=1``; every report listed verbatim.
``syncs``
    One ``step()`` of dmuon (ZeRO-3) and of AdamW on the bench model at two sizes (14 and 28 Muon
    matrices): how often the host waits for the device (``torch.cuda.set_sync_debug_mode``); dmuon's
    count must not grow with the matrices. Once more with the Muon learning rate a tensor on the device:
    no more waits than with a float.
``runtimes``
    dmuon's other step paths with loopback collectives, each against torch.optim.Muon + AdamW in the same
    process: torch's DDP (:mod:`dmuon.runtime.ddp`), a one-stage pipeline schedule (the by-hand
    reduction and the schedule's divisor), fp16 with ``torch.amp.GradScaler`` (the launches stand rescaled)
    (:mod:`dmuon.bench.gpu_check_runtimes`).
``ns``
    Standard bf16 Newton–Schulz against Gram NS with the symmetric kernels at qwen2.5-7b's shapes,
    alone and as a stack (batched and looped), timed with CUDA events; the autotuner's pick.

It writes ``gpu_check.json`` (every figure and check) and ``gpu_check.md`` (the verdict table) to
the output directory, and prints the table. The dry run (``--dry-run``, no CUDA) builds every
section's command and cases, renders the table from made-up results and checks the time budget.
Exit status: 0 every check passed, 1 a check failed or a section did not finish, 2 usage.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from dmuon.bench.gpu_check_base import one_rank

SECTIONS = ("syrk", "bench", "csan", "syncs", "runtimes", "ns")
TIMEOUTS_S = {"syrk": 80, "bench": 150, "csan": 70, "syncs": 50, "runtimes": 30, "ns": 70}
"""Per section, cold Triton compiles included (the syrk section compiles 20 kernels, the bench
section's first run tunes dmuon's NS). Estimates, no GPU run having measured them yet: the syncs
section's fifth run (the tiny model with a device lr: a build, NS tuned at its shapes, three steps) adds
about 10 s to the four the 40 s were for. The runtimes section (a model of 0.1 M parameters, fp32 NS
without tuning, the references included) takes 6 s of CPU time here on CPU, its interpreter's start
included; its 30 s leave room for CUDA's and NCCL's starts and a slower host. The bench section (22 runs
of the tiny bench model) gives up 20 s of its 170 for them, and the ns section, last and judged on its
rows' errors only (its timings are reported), 10 s."""
BUDGET_S = 480
"""The whole check: 8 minutes."""
OVERHEAD_S = 30
"""What the driver and the sections' interpreter and NCCL starts may add beyond the timeouts."""
BENCH_SIZE, BENCH_STEPS = "tiny", 6
SYNC_SIZES = ("tiny", "mini")
"""The bench model's sizes the syncs section steps (qwen2; 14 and 28 Muon matrices)."""
DETERMINISM_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
"""cuBLAS's deterministic workspace (read at CUDA start: set for the section's process)."""


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


def _step_syncs(config: str, size: str, device: torch.device, device_lr: bool = False) -> dict:
    """The third ``step()`` of ``config`` on the qwen2 bench model of ``size`` (one rank): its syncs.

    ``device_lr``: the Muon learning rate a tensor on ``device`` (what a scheduler writes in place, or
    a captured step reads), not a float: reading it on the host would be one more wait per step."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.bench.models import build_workload
    from dmuon.bench.setups import Hyper, build

    torch.manual_seed(0)
    with torch.device(device):
        workload = build_workload("qwen2", size=size, seed=0)
    hyper = Hyper(lr=torch.tensor(Hyper.lr, device=device)) if device_lr else Hyper()
    opt, plan = build(config, workload, init_device_mesh(device.type, (1,)), hyper)
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
    return {"config": config + ("_device_lr" if device_lr else ""), "size": size,
            "matrices": len(plan.infos) if plan is not None else 0, "syncs": count}


def syncs_section(device: torch.device, out: str) -> dict:
    """How often one ``step()`` makes the host wait for the device, for dmuon and AdamW at two sizes."""
    with one_rank(device) as backend:
        rows = [_step_syncs(config, size, device) for size in SYNC_SIZES for config in ("adamw", "dmuon_z3")]
        rows.append(_step_syncs("dmuon_z3", SYNC_SIZES[0], device, device_lr=True))
    return {"backend": backend, "counted": "cuda sync debug mode" if device.type == "cuda" else "host reads (dispatch)",
            "rows": rows, "passed": syncs_passed(rows), "device_lr_passed": device_lr_passed(rows)}


def syncs_passed(rows: list[dict]) -> bool:
    """Whether dmuon's ``step()`` waited for the device as often at every size (at least two sizes)."""
    counts = [r["syncs"] for r in rows if r["config"] == "dmuon_z3"]
    return len(counts) >= 2 and len(set(counts)) == 1


def device_lr_passed(rows: list[dict]) -> bool:
    """Whether dmuon's ``step()`` with the learning rate a device tensor waited for the device no more
    often than with a float, at the same size (a host read of the lr each step would add one)."""
    float_lr = {r["size"]: r["syncs"] for r in rows if r["config"] == "dmuon_z3"}
    device_lr = [r for r in rows if r["config"] == "dmuon_z3_device_lr"]
    return bool(device_lr) and all(r["size"] in float_lr and r["syncs"] <= float_lr[r["size"]] for r in device_lr)


def syncs_verdicts(payload: dict) -> list[dict]:
    rows = [r for r in payload.get("rows", []) if r["config"] == "dmuon_z3"]
    device_lr = [r for r in payload.get("rows", []) if r["config"] == "dmuon_z3_device_lr"]
    return [{"name": "syncs dmuon step() waits for the device as often with more matrices",
             "passed": bool(payload.get("passed")),
             "detail": ", ".join(f"{r['syncs']} with {r['matrices']} matrices" for r in rows)},
            {"name": "syncs dmuon step() with a device lr waits no more than with a float lr",
             "passed": device_lr_passed(payload.get("rows", [])),
             "detail": ", ".join(f"{r['syncs']} with a device lr, {r['matrices']} matrices" for r in device_lr)
                       or "no device-lr run"}]


def _run_bench(device: torch.device, out: str) -> dict:
    from dmuon.bench.gpu_check_bench import bench_section

    return bench_section(BENCH_SIZE, BENCH_STEPS, device, out)


def _bench_verdicts(payload: dict) -> list[dict]:
    from dmuon.bench.gpu_check_bench import verdicts

    checks = verdicts(payload.get("runs", []), "cuda" if payload.get("backend") == "nccl" else "cpu")
    checks += [{"name": "bench run raised", "passed": False, "detail": e} for e in payload.get("errors", [])]
    return checks


def _sections():
    """Per section: (its function, its verdicts from its JSON, its plan for the dry run)."""
    from dmuon.bench import gpu_check_bench as gb
    from dmuon.bench import gpu_check_runtimes as gr
    from dmuon.bench import gpu_check_sections as gs

    return {"syrk": (gs.syrk_section, gs.syrk_verdicts, gs.plan_syrk),
            "bench": (_run_bench, _bench_verdicts, gb.plan_runs),
            "csan": (gs.csan_section, gs.csan_verdicts, gs.plan_csan),
            "syncs": (syncs_section, syncs_verdicts, lambda: [[s, c] for s in SYNC_SIZES for c in ("adamw", "dmuon_z3")]
                      + [[SYNC_SIZES[0], "dmuon_z3_device_lr"]]),
            "runtimes": (gr.runtimes_section, gr.runtimes_verdicts, gr.plan_runtimes),
            "ns": (gs.ns_section, gs.ns_verdicts, gs.plan_ns)}


def section_command(name: str, out: str) -> tuple[list[str], dict[str, str]]:
    """The subprocess command of one section and the environment it adds."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                       os.environ.get("PYTHONPATH")]))}
    if name in ("bench", "runtimes"):
        env.update(DETERMINISM_ENV)
    if name == "csan":
        env["TORCH_CUDA_SANITIZER"] = "1"  # read when torch initializes, hence its own process
    return [sys.executable, "-m", "dmuon.bench.gpu_check", "--section", name, "--out", out], env


def run_section(name: str, workdir: str, timeout_s: float) -> dict:
    """Runs one section in a subprocess; its JSON (partial after a timeout) with ``error``, ``stderr_tail``
    and ``wall_s`` added where it did not finish."""
    out = os.path.join(workdir, f"{name}.json")
    cmd, extra = section_command(name, out)
    start = time.perf_counter()
    try:
        res = subprocess.run(cmd, env={**os.environ, **extra}, capture_output=True, text=True, timeout=timeout_s)
        code, err = res.returncode, res.stderr
    except subprocess.TimeoutExpired as exc:
        code, err = f"timed out after {timeout_s} s", exc.stderr.decode() if isinstance(exc.stderr, bytes) else str(exc.stderr or "")
    data = {}
    if os.path.exists(out):
        with open(out) as f:
            data = json.load(f)
    if code != 0:
        data.update(error=f"exit code {code}" if isinstance(code, int) else code, stderr_tail=err[-3000:])
    data["wall_s"] = time.perf_counter() - start
    return data


def collect_checks(results: dict) -> list[dict]:
    """Every check, per section in order: the section finished, then its own verdicts."""
    sections, checks = _sections(), []
    for name, payload in results.items():
        finished = "error" not in payload
        checks.append({"section": name, "name": f"section {name} finished", "passed": finished,
                       "detail": f"{payload.get('wall_s', 0.0):.0f} s"
                                 + ("" if finished else f"; {payload['error']}: {payload.get('stderr_tail', '')[-400:]}")})
        try:
            own = sections[name][1](payload)
        except Exception as exc:  # a malformed partial JSON: the section's verdicts fail, the others stand
            own = [{"name": f"{name} verdicts", "passed": False, "detail": f"{type(exc).__name__}: {exc}"}]
        checks += [{"section": name, **c} for c in own]
    return checks


def verdict_table(checks: list[dict]) -> str:
    """The checks as a markdown table (``|`` in details escaped)."""
    lines = ["| verdict | section | check | detail |", "|---|---|---|---|"]
    for c in checks:
        detail = str(c.get("detail", "")).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {'PASS' if c['passed'] else 'FAIL'} | {c['section']} | {c['name']} | {detail} |")
    return "\n".join(lines) + "\n"


def budget(sections: tuple[str, ...] = SECTIONS) -> dict:
    total = sum(TIMEOUTS_S[s] for s in sections) + OVERHEAD_S
    return {"timeouts_s": {s: TIMEOUTS_S[s] for s in sections}, "overhead_s": OVERHEAD_S, "total_s": total,
            "budget_s": BUDGET_S, "fits": total <= BUDGET_S}


def fake_results() -> dict:
    """Made-up section JSONs of the real form, each with a failing case, for the dry run's table."""
    from dmuon.bench import gpu_check_bench as gb
    from dmuon.bench import gpu_check_runtimes as gr
    from dmuon.bench import gpu_check_sections as gs

    syrk = [{**c, "check": {"passed": True, "max_rel_err": 1e-7, "tolerance": gs.syrk_tolerance(c["K"])}}
            for c in gs.plan_syrk()]
    syrk[0]["check"] = {"passed": False, "error": "made-up failure"}
    runs = []
    for config, variant in gb.plan_runs():
        blocks = 4
        exchanged = [0] * 3 if config.endswith("_sync") else ([0, 4, 4] if "_clip" in config else [4] * 3)
        reports = [{"blocks_exchanged_in_backward": e, "rescaled_launches": e if "_clip" in config else 0,
                    "orthogonalized": 14, "orthogonalized_in_backward": 14 if "bwd" in config else 0,
                    "blocks_returned_in_backward": 3 if config.endswith("_rbwd") else 0} for e in exchanged]
        runs.append({"config": config, "variant": variant, "blocks": blocks, "losses": [5.5, 5.4, 5.3],
                     "reports": reports, "collectives": {"all_to_all_single": 9}, "delays": 6})
    runs[-1]["losses"] = [5.5, 5.4, 5.4]  # a made-up difference
    csan = {"sanitizer_enabled": True, "rows": [{"config": c, "reports": []} for c in gs.plan_csan()]}
    csan["rows"][0]["reports"] = ["CSANError: made-up report"]
    ns = {"rows": [{**c, "times_s": {k: 1e-3 for k in c["candidates"]}, "standard_over_gram": 1.0,
                    "rel_err_vs_float32": {"standard": 3e-3, "gram": 4e-3}, "autotune_method": "gram",
                    **({"autotune_batched": True} if c["batch"] > 1 else {})} for c in gs.plan_ns()]}
    syncs = {"rows": [{"config": c, "size": s, "matrices": 14 * (k + 1), "syncs": 3}
                      for k, s in enumerate(SYNC_SIZES) for c in ("adamw", "dmuon_z3")]
             + [{"config": "dmuon_z3_device_lr", "size": SYNC_SIZES[0], "matrices": 14, "syncs": 3}], "passed": True}
    return {"syrk": {**{"cases": syrk}, "wall_s": 1.0}, "bench": {"backend": "nccl", "runs": runs, "wall_s": 1.0},
            "csan": {**csan, "wall_s": 1.0}, "syncs": {**syncs, "wall_s": 1.0},
            "runtimes": {**gr.fake_payload(), "wall_s": 1.0},
            "ns": {**ns, "error": "timed out after 90 s", "stderr_tail": "", "wall_s": 90.0}}


def dry_run(sections: tuple[str, ...]) -> dict:
    """The plumbing without CUDA: each section's command and cases, the budget, the table of fake results."""
    plans = {}
    for name in sections:
        cmd, env = section_command(name, f"<outdir>/{name}.json")
        plans[name] = {"command": cmd, "env": env, "timeout_s": TIMEOUTS_S[name], "cases": _sections()[name][2]()}
    results = {k: v for k, v in fake_results().items() if k in sections}
    return {"sections": plans, "budget": budget(sections), "fake_checks": collect_checks(results)}


def run_check(sections: tuple[str, ...] = SECTIONS) -> dict:
    """Runs the sections one after another (CUDA) and returns the whole payload."""
    import tempfile

    start, results = time.perf_counter(), {}
    with tempfile.TemporaryDirectory() as workdir:
        for name in sections:
            results[name] = run_section(name, workdir, TIMEOUTS_S[name])
            print(f"gpu-check: {name}: {results[name].get('error', 'done')} ({results[name]['wall_s']:.0f} s)",
                  file=sys.stderr, flush=True)
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    checks = collect_checks(results)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton_version,
            "cuda": torch.version.cuda, "python": sys.version.split()[0], "wall_s": time.perf_counter() - start,
            "budget": budget(sections), "sections": results, "checks": checks,
            "passed": all(c["passed"] for c in checks)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dmuon bench --gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="the plumbing without CUDA: commands, cases, "
                   "budget and the verdict table from made-up results")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "gpu_check", metavar="DIR",
                   help="where gpu_check.json and gpu_check.md go (default: $OUT, else ./gpu_check)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)  # internal: run one section
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.section:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        payload = _sections()[args.section][0](device, args.out)
        with open(args.out, "w") as f:
            json.dump(payload, f)
        return 0
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    if not sections or any(s not in SECTIONS for s in sections):
        print(f"dmuon bench --gpu-check: --sections must be from {SECTIONS}", file=sys.stderr)
        return 2
    if not args.dry_run and not torch.cuda.is_available():
        print("dmuon bench --gpu-check: no CUDA device here; --dry-run checks the plumbing without one",
              file=sys.stderr)
        return 2
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = dry_run(sections) if args.dry_run else run_check(sections)
    checks = payload["fake_checks"] if args.dry_run else payload["checks"]
    table = verdict_table(checks)
    (out / "gpu_check.json").write_text(json.dumps(payload, indent=1))
    (out / "gpu_check.md").write_text(table)
    print(table)
    if args.dry_run:
        fits = payload["budget"]
        print(f"dry run: {len(sections)} sections planned; budget {fits['total_s']} s of {fits['budget_s']} s "
              f"({'fits' if fits['fits'] else 'OVER'}); the table above is made-up; wrote {out}")
        return 0 if fits["fits"] else 1
    print(f"{payload['device']}: {'all checks passed' if payload['passed'] else 'CHECKS FAILED'} "
          f"in {payload['wall_s']:.0f} s; wrote {out}")
    return 0 if payload["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
