"""What dmuon's profiler ranges (dmuon.util.observe) cost while no profiler records.

Measures, in one process on the CPU:
  1. one range entered and left: dmuon's phase() (a flag read, a shared do-nothing context), torch's
     record_function (what a range would cost without the flag), and an empty ``with`` for reference;
  2. how many ranges a step enters (dmuon.util.observe's flag read counted), in one process and on
     2 gloo ranks (1-D FSDP2, with the exchange's hops);
  3. the step itself (median of --steps), so that ranges x cost per range can be set against it;
  4. the same step with every range forced through record_function (the flag reading False but
     record_function entered anyway): the cost the flag avoids, measured as a step-time difference.

  PYTHONPATH=src python scripts/profiler_ranges_cost.py [--steps 60]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function

import dmuon
from dmuon.util import observe


def per_call_ns(body, n: int = 200_000) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            body()
        best = min(best, (time.perf_counter() - start) / n * 1e9)
    return best


def entered_phase() -> None:
    with observe.phase("x"):
        pass


def entered_record_function() -> None:
    with record_function("dmuon.x"):
        pass


_EMPTY = contextlib.nullcontext()


def entered_nothing() -> None:
    with _EMPTY:
        pass


def model_and_optimizer():
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [nn.Linear(128, 128), nn.ReLU()]
    model = nn.Sequential(*layers, nn.LayerNorm(128))
    opt = dmuon.DMuon(model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-4),
                      ns=dmuon.NSConfig(method="standard", batching="looped", dtype=torch.float32))
    return model, opt


def step_seconds(model, opt, steps: int) -> list[float]:
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    times = []
    for k in range(steps + 3):
        start = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if k >= 3:
            times.append(time.perf_counter() - start)
    return times


def count_ranges(run) -> int:
    calls = [0]
    real = observe.profiler_active

    def counted() -> bool:
        calls[0] += 1
        return real()

    observe.profiler_active = counted
    try:
        run()
    finally:
        observe.profiler_active = real
    return calls[0]


def two_rank_count(rank: int, world_size: int) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.DMuon(model, lr=0.02, ns=dmuon.NSConfig(method="standard", batching="looped"))
    x = torch.randn(8, 64)

    def one_step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    one_step()
    return count_ranges(one_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread")
    rows = [("dmuon phase(), no profiler", per_call_ns(entered_phase)),
            ("record_function, no profiler", per_call_ns(entered_record_function)),
            ("empty with (reference)", per_call_ns(entered_nothing))]
    for label, ns in rows:
        print(f"  {label:<32} {ns:8.0f} ns per range")
    model, opt = model_and_optimizer()
    step_seconds(model, opt, 2)
    per_step = count_ranges(lambda: step_seconds(model, opt, 1)) // 4  # step_seconds runs 1 + 3 warm-up steps
    from dmuon.testing.spawn import run_distributed
    per_step_2 = run_distributed(two_rank_count, 2)
    print(f"ranges per step: {per_step} (one process, 8 matrices), {per_step_2} per rank (2 gloo ranks, 1-D FSDP2)")
    # A and B alternate, so drift of the shared machine hits both alike.
    plain, forced = [], []
    real_active = observe.profiler_active
    for _ in range(4):
        plain += step_seconds(model, opt, args.steps // 4)
        observe.profiler_active = lambda: True  # every range through record_function, no profiler running
        try:
            forced += step_seconds(model, opt, args.steps // 4)
        finally:
            observe.profiler_active = real_active
    med_plain, med_forced = statistics.median(plain), statistics.median(forced)
    phase_ns, rf_ns = rows[0][1], rows[1][1]
    print(f"step (one process): median {med_plain * 1e3:.3f} ms over {len(plain)} steps")
    print(f"  ranges as they are: {per_step} x {phase_ns:.0f} ns = {per_step * phase_ns / 1e3:.2f} us "
          f"= {per_step * phase_ns / (med_plain * 1e9) * 100:.3f}% of the step")
    print(f"  every range through record_function: median {med_forced * 1e3:.3f} ms "
          f"({(med_forced / med_plain - 1) * 100:+.2f}%); predicted {per_step} x {rf_ns:.0f} ns = "
          f"{per_step * rf_ns / 1e3:.2f} us")


if __name__ == "__main__":
    main()
