"""Train a small Qwen2-style causal LM with FSDP2, comparing AdamW and dmuon.

A complete, copyable FSDP2 training script:

* a ``transformers`` ``Qwen2ForCausalLM`` built from a small config (random init, no download),
  ``fully_shard`` per decoder layer and at the root with a bf16 ``MixedPrecisionPolicy``;
* optional non-reentrant activation checkpointing (``--activation-checkpointing``);
* linear warmup + cosine decay (a ``LambdaLR``, which scales Muon's and AdamW's learning rates in
  dmuon's param groups each by the same factor), gradient clipping, gradient accumulation;
* ``--optimizer adamw|dmuon|both`` (both: the same seed, initial weights and data, one after the other);
* real text with no download: the bytes of the Python standard library's own source files
  (``sysconfig.get_paths()["stdlib"]``, sorted, every 20th file held out for validation);
* DCP checkpoints (``--ckpt-dir``, ``--ckpt-every``, ``--resume``); a resumed run reproduces the
  losses of the uninterrupted one;
* ``--json PATH`` (loss curves) and ``--plot PATH`` (validation loss against step and wall-clock).

Launch::

    python examples/train_lm.py --optimizer both --steps 40          # spawns 4 gloo CPU ranks
    torchrun --nproc-per-node 8 examples/train_lm.py --optimizer dmuon  # NCCL on GPUs

The only dmuon-specific line is the optimizer (``dmuon.DMuon(model, lr=..., adamw=dmuon.AdamWConfig(lr=...))``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

OPTIMIZERS = ("adamw", "dmuon")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--optimizer", default="both", choices=[*OPTIMIZERS, "both"])
    a("--steps", type=int, default=40, help="optimizer steps (default: 40)")
    a("--world-size", type=int, default=4, help="gloo CPU ranks to spawn when not under torchrun")
    a("--seed", type=int, default=0)
    # model (Qwen2-style, byte-level vocabulary)
    a("--hidden", type=int, default=128)
    a("--intermediate", type=int, default=384)
    a("--layers", type=int, default=4)
    a("--heads", type=int, default=4)
    a("--kv-heads", type=int, default=2)
    # data
    a("--seq-len", type=int, default=128)
    a("--batch-size", type=int, default=4, help="sequences per rank per micro-batch")
    a("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    a("--val-every", type=int, default=10, help="validation every N steps (and at the last step)")
    a("--val-batches", type=int, default=2, help="validation micro-batches per rank")
    a("--corpus-mb", type=float, default=0.0, help="cap the corpus at this many MB (0: all)")
    # optimization
    a("--muon-lr", type=float, default=0.05,
      help="dmuon: learning rate of the Muon matrices (default: the best of the sweep in "
           "docs/benchmarks/2026-12-01-cpu-2core-epyc-avx512.md)")
    a("--adamw-lr", type=float, default=3e-3,
      help="AdamW's learning rate (the adamw run, and dmuon's embeddings, head, norms and biases)")
    a("--weight-decay", type=float, default=0.1)
    a("--warmup", type=int, default=None, help="warmup steps (default: 10%% of --steps)")
    a("--min-lr-ratio", type=float, default=0.1, help="cosine decays to this fraction of the peak")
    a("--clip", type=float, default=1.0, help="gradient-norm clipping (0: off)")
    a("--ns-method", default="auto", choices=["auto", "standard", "standard32", "gram"],
      help="dmuon's Newton-Schulz method (auto: fastest accurate one, measured on the machine)")
    a("--activation-checkpointing", action="store_true",
      help="recompute each decoder layer in backward (non-reentrant)")
    # checkpoints and output
    a("--ckpt-dir", default=None, help="DCP checkpoints go to DIR/<optimizer>/step_NNNNNN")
    a("--ckpt-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    a("--resume", action="store_true", help="resume from the latest checkpoint in --ckpt-dir")
    a("--resume-step", type=int, default=None, help="with --resume: that step's checkpoint instead")
    a("--json", default=None, metavar="PATH", help="write the loss curves as JSON")
    a("--plot", default=None, metavar="PATH", help="write a PNG of validation loss vs step and vs time")
    a("--quiet", action="store_true", help="no progress bar or per-step prints")
    return p


# --------------------------------------------------------------------------- data


def load_corpus(max_mb: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Byte tokens of the stdlib's ``.py`` files: (train, validation, description).

    Files are sorted by path (the same on every rank and every run); every 20th file is held out.
    Test suites (``test/``, ``tests/``) and ``site-packages`` are left out.
    """
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "__pycache__", "test", "tests", "idle_test"}
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in skip]
        files += [os.path.relpath(os.path.join(d, n), root) for n in names if n.endswith(".py")]
    files.sort()
    train, val, total = [], [], 0
    for i, rel in enumerate(files):
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        (val if i % 20 == 0 else train).append(data)
        total += len(data)
        if max_mb and total >= max_mb * 1e6:
            break
    sep = b"\n\n"
    train_b, val_b = sep.join(train), sep.join(val)
    to_t = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    info = {"source": root, "files": len(train) + len(val), "train_bytes": len(train_b),
            "val_bytes": len(val_b)}
    return to_t(train_b), to_t(val_b), info


def train_batch(data: torch.Tensor, seed: int, step: int, micro: int, rank: int,
                batch: int, seq_len: int) -> torch.Tensor:
    """Random windows; a function of (seed, step, micro-batch, rank) only, so resuming needs no state."""
    g = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_009 + micro) * 10_007 + rank)
    offs = torch.randint(0, data.numel() - seq_len, (batch,), generator=g)
    return torch.stack([data[o:o + seq_len] for o in offs.tolist()]).long()


def val_batches(data: torch.Tensor, rank: int, world: int, n: int, batch: int, seq_len: int):
    """Fixed, evenly spaced windows of the held-out files; each rank takes its share."""
    count = n * batch * world
    offs = torch.linspace(0, data.numel() - seq_len - 1, count).long().tolist()
    mine = offs[rank::world]
    return [torch.stack([data[o:o + seq_len] for o in mine[i * batch:(i + 1) * batch]]).long()
            for i in range(n)]


# --------------------------------------------------------------------------- model, optimizer


def model_config(args):
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=max(2048, args.seq_len),
        tie_word_embeddings=False, use_cache=False, attention_dropout=0.0,
    )
    config._attn_implementation = "sdpa"
    return config


def build_model(args, mesh) -> torch.nn.Module:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(args.seed)            # the same initial weights for every optimizer
    model = Qwen2ForCausalLM(model_config(args))
    if args.activation_checkpointing:
        # Non-reentrant checkpointing of each decoder layer (transformers wraps the layer's
        # __call__, so FSDP2's unshard hooks run again in the recomputation).
        if hasattr(model, "activation_checkpointing_enable"):       # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def build_optimizer(name: str, model, args):
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=args.adamw_lr, betas=(0.9, 0.95),
                                 weight_decay=args.weight_decay)
    import dmuon

    return dmuon.DMuon(model, lr=args.muon_lr, weight_decay=args.weight_decay,
                       ns=dmuon.NSConfig(method=args.ns_method),
                       adamw=dmuon.AdamWConfig(lr=args.adamw_lr, betas=(0.9, 0.95), weight_decay=args.weight_decay))


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine to ``min_ratio`` at ``total``; ``step`` counts from 0."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------- checkpoints


def _ckpt_path(args, name: str, step: int) -> str:
    return os.path.join(args.ckpt_dir, name, f"step_{step:06d}")


def find_checkpoint(args, name: str) -> str | None:
    if args.resume_step is not None:
        path = _ckpt_path(args, name, args.resume_step)
        if not os.path.exists(os.path.join(path, "meta.json")):
            raise SystemExit(f"train_lm: no checkpoint {path}")
        return path
    base = os.path.join(args.ckpt_dir, name)
    done = sorted(d for d in os.listdir(base) if os.path.exists(os.path.join(base, d, "meta.json"))) \
        if os.path.isdir(base) else []
    return os.path.join(base, done[-1]) if done else None


def save_checkpoint(path: str, model, opt, sched, history: dict, step: int) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    if dist.get_rank() == 0:                 # written last: a checkpoint without it is incomplete
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump({"step": step, "scheduler": sched.state_dict(), "history": history}, f)
    dist.barrier()


def load_checkpoint(path: str, model, opt, sched) -> tuple[int, dict]:
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    sched.load_state_dict(meta["scheduler"])
    return meta["step"], meta["history"]


# --------------------------------------------------------------------------- training


def _progress(enabled: bool, total: int, initial: int, desc: str):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, file=sys.stderr)


@torch.no_grad()
def evaluate(model, batches, device) -> float:
    model.eval()
    total = torch.zeros((), device=device)
    for x in batches:
        x = x.to(device)
        total += model(input_ids=x, labels=x).loss.float()
    model.train()
    total /= len(batches)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train_one(name: str, args, mesh, device, train_data, val_data) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args, mesh)
    model.train()
    opt = build_optimizer(name, model, args)
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, args.steps, warmup, args.min_lr_ratio))
    history = {"step": [], "train_loss": [], "seconds": [], "val_step": [], "val_loss": [],
               "val_seconds": []}
    start_step = 0
    if args.resume:
        path = find_checkpoint(args, name)
        if path is not None:
            start_step, history = load_checkpoint(path, model, opt, sched)
            history["resumed_from"] = start_step
            if rank == 0 and not args.quiet:
                print(f"[{name}] resumed from {path} (step {start_step})", file=sys.stderr)
    vals = val_batches(val_data, rank, world, args.val_batches, args.batch_size, args.seq_len)
    tokens_per_step = world * args.grad_accum * args.batch_size * args.seq_len
    elapsed = history["seconds"][-1] if history["seconds"] else 0.0  # training time only
    bar = _progress(rank == 0 and not args.quiet, args.steps, start_step, name)
    for step in range(start_step, args.steps):
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for micro in range(args.grad_accum):
            if args.grad_accum > 1:          # reduce-scatter only after the last micro-batch
                model.set_requires_gradient_sync(micro == args.grad_accum - 1)
            x = train_batch(train_data, args.seed, step, micro, rank, args.batch_size,
                            args.seq_len).to(device)
            loss = model(input_ids=x, labels=x).loss / args.grad_accum
            loss.backward()
            loss_sum += loss.detach().float()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        dist.all_reduce(loss_sum)
        train_loss = loss_sum.item() / world
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        elapsed += dt
        done = step + 1
        history["step"].append(done)
        history["train_loss"].append(train_loss)
        history["seconds"].append(elapsed)
        if done % args.val_every == 0 or done == args.steps:
            val = evaluate(model, vals, device)
            history["val_step"].append(done)
            history["val_loss"].append(val)
            history["val_seconds"].append(elapsed)
        if rank == 0 and not args.quiet:
            msg = {"loss": f"{train_loss:.4f}", "tok/s": f"{tokens_per_step / dt:,.0f}"}
            if history["val_step"] and history["val_step"][-1] == done:
                msg["val"] = f"{history['val_loss'][-1]:.4f}"
            if bar is not None:
                bar.set_postfix(msg)
                bar.update(1)
            else:
                print(f"[{name}] step {done}/{args.steps} " + " ".join(f"{k} {v}" for k, v in msg.items()),
                      file=sys.stderr, flush=True)
        if args.ckpt_dir and args.ckpt_every and (done % args.ckpt_every == 0 or done == args.steps):
            save_checkpoint(_ckpt_path(args, name, done), model, opt, sched, history, done)
    if bar is not None:
        bar.close()
    return history


def _model_summary(args) -> dict:
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen2ForCausalLM(model_config(args)).parameters())
    return {"vocab": 256, "hidden": args.hidden, "intermediate": args.intermediate,
            "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads, "parameters": n}


def run_rank(rank: int, world: int, args) -> dict:
    """Everything a rank does; the process group is already up. Returns the payload (rank 0)."""
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    train_data, val_data, corpus = load_corpus(args.corpus_mb)
    names = OPTIMIZERS if args.optimizer == "both" else (args.optimizer,)
    runs = {name: train_one(name, args, mesh, device, train_data, val_data) for name in names}
    config = dict(vars(args))
    config.update(world_size=world, device=str(device), backend=dist.get_backend(),
                  tokens_per_step=world * args.grad_accum * args.batch_size * args.seq_len,
                  model=_model_summary(args), corpus=corpus, torch=torch.__version__)
    return {"runs": runs, "config": config}


def compare(payload: dict) -> dict:
    """Final validation losses at equal steps and at equal wall-clock (the shorter run's time)."""
    runs = payload["runs"]
    out = {"final_val_loss": {n: r["val_loss"][-1] for n, r in runs.items() if r["val_loss"]}}
    if len(runs) > 1 and all(r["val_loss"] for r in runs.values()):
        t = min(r["val_seconds"][-1] for r in runs.values())
        at = {}
        for n, r in runs.items():            # last validation at or before time t
            i = max(k for k, s in enumerate(r["val_seconds"]) if s <= t + 1e-9) \
                if any(s <= t + 1e-9 for s in r["val_seconds"]) else None
            at[n] = None if i is None else {"val_loss": r["val_loss"][i], "step": r["val_step"][i],
                                             "seconds": r["val_seconds"][i]}
        out["equal_time_seconds"] = t
        out["val_loss_at_equal_time"] = at
    return out


def write_plot(payload: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, r) in enumerate(payload["runs"].items()):
        color = f"C{i}"
        a.plot(r["step"], r["train_loss"], color=color, alpha=0.25, label=f"{name} train")
        a.plot(r["val_step"], r["val_loss"], color=color, marker="o", label=f"{name} val")
        b.plot(r["val_seconds"], r["val_loss"], color=color, marker="o", label=f"{name} val")
    a.set_xlabel("step")
    b.set_xlabel("training wall-clock (s)")
    for ax in (a, b):
        ax.set_ylabel("loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend()
    c = payload["config"]
    fig.suptitle(f"Qwen2-style LM, {c['model']['parameters'] / 1e6:.2f}M params, "
                 f"{c['world_size']} ranks ({c['backend']}), {c['tokens_per_step']} tokens/step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finish(payload: dict, args) -> None:
    payload["comparison"] = compare(payload)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    if args.plot:
        write_plot(payload, args.plot)
    cmp = payload["comparison"]
    for n, v in cmp["final_val_loss"].items():
        print(f"{n}: final val loss {v:.4f} at step {payload['runs'][n]['val_step'][-1]}, "
              f"{payload['runs'][n]['seconds'][-1]:.1f} s training")
    if "val_loss_at_equal_time" in cmp:
        print(f"at equal wall-clock ({cmp['equal_time_seconds']:.1f} s): " + ", ".join(
            f"{n} {v['val_loss']:.4f} (step {v['step']})" for n, v in cmp["val_loss_at_equal_time"].items()
            if v is not None))


def _spawned_rank(rank: int, world: int, args) -> dict:
    # Module level, so that torch.multiprocessing can pickle it (as __main__'s, under spawn).
    return run_rank(rank, world, args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.resume and not args.ckpt_dir:
        raise SystemExit("train_lm: --resume needs --ckpt-dir")
    if args.steps < 1 or args.grad_accum < 1 or args.val_every < 1:
        raise SystemExit("train_lm: --steps, --grad-accum and --val-every must be >= 1")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:      # torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        payload = run_rank(dist.get_rank(), dist.get_world_size(), args)
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank == 0:
            finish(payload, args)
        return 0
    from dmuon.testing.spawn import preload, run_distributed

    preload("transformers.models.qwen2.modeling_qwen2")  # imported once for every rank, not once per rank
    if not args.quiet:
        print(f"train_lm: spawning {args.world_size} gloo CPU ranks", file=sys.stderr)
    payload = run_distributed(_spawned_rank, args.world_size, args, timeout_s=1800)[0]
    finish(payload, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
