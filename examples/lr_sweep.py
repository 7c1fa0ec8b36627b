"""The learning-rate sweep behind the training recipe (docs/benchmarks/2026-12-01-cpu-2core-epyc-avx512.md), rerunnable.

Runs ``examples/train_lm.py`` once per learning rate (AdamW's lr for ``adamw``;
the Muon matrices' lr for ``dmuon``, whose AdamW part keeps ``--adamw-lr``),
each a fresh process with the same seed and data, and prints the final
validation loss of each run as a Markdown table, the best marked. Any other
option is passed on to ``train_lm.py`` unchanged::

    python examples/lr_sweep.py --steps 150 --val-every 50 --val-batches 4 \\
        --adamw-lrs 1e-3,3e-3,1e-2 --muon-lrs 0.01,0.02,0.05,0.1 --json sweep.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_lm.py")


def _lrs(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"learning rates must be positive, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adamw-lrs", type=_lrs, default=_lrs("1e-3,3e-3,1e-2"),
                   help="AdamW learning rates to try (empty: skip AdamW)")
    p.add_argument("--muon-lrs", type=_lrs, default=_lrs("0.01,0.02,0.05,0.1"),
                   help="dmuon's Muon learning rates to try")
    p.add_argument("--adamw-lr", type=float, default=3e-3, help="dmuon's AdamW part (embeddings, head, norms)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every run's final losses as JSON")
    return p


def run_one(optimizer: str, lr: float, adamw_lr: float, passthrough: list[str], workdir: str) -> dict:
    """One ``train_lm.py`` run; its final validation and training loss."""
    out = os.path.join(workdir, f"{optimizer}_{lr:g}.json")
    lr_args = ["--adamw-lr", str(lr)] if optimizer == "adamw" else ["--adamw-lr", str(adamw_lr), "--muon-lr", str(lr)]
    cmd = [sys.executable, TRAIN, "--optimizer", optimizer, *lr_args, "--quiet", "--json", out, *passthrough]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    with open(out) as f:
        run = json.load(f)["runs"][optimizer]
    return {"optimizer": optimizer, "lr": lr, "val_loss": run["val_loss"][-1], "val_step": run["val_step"][-1],
            "train_loss": run["train_loss"][-1], "seconds": run["seconds"][-1]}


def format_table(results: list[dict]) -> str:
    """One row per optimizer: the final validation loss at each lr, the best in bold."""
    lines = []
    for optimizer in ("adamw", "dmuon"):
        rows = [r for r in results if r["optimizer"] == optimizer]
        if not rows:
            continue
        best = min(rows, key=lambda r: r["val_loss"])
        label = "AdamW lr" if optimizer == "adamw" else "dmuon Muon lr"
        cells = [f"**{r['lr']:g}**" if r is best else f"{r['lr']:g}" for r in rows]
        losses = [f"**{r['val_loss']:.4f}**" if r is best else f"{r['val_loss']:.4f}" for r in rows]
        lines += [f"| {label} | " + " | ".join(cells) + " |", "|---" * (len(rows) + 1) + "|",
                  f"| val loss @{rows[0]['val_step']} | " + " | ".join(losses) + " |", ""]
    return "\n".join(lines).rstrip()


def main(argv: list[str] | None = None) -> int:
    args, passthrough = build_parser().parse_known_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for optimizer, lrs in (("adamw", args.adamw_lrs), ("dmuon", args.muon_lrs)):
            for lr in lrs:
                results.append(run_one(optimizer, lr, args.adamw_lr, passthrough, workdir))
                print(f"{optimizer} lr {lr:g}: val loss {results[-1]['val_loss']:.4f}", flush=True)
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": results, "train_lm_args": passthrough, "adamw_lr": args.adamw_lr}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
