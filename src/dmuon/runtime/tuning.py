"""The owners' NS tuning: measured when the runtime is built, only read inside a step.

The NS autotuner (:mod:`dmuon.ortho.autotune`) measures a problem (shape, dtype, schedule, batch
and method choice) the first time it is asked for it on a host, under a lock the host's ranks
share. Inside a step that can deadlock: a rank holding the lock may wait on the device for a
return that another rank, waiting for the lock, has not issued (with several return waves, the
CUDA default); and the figures would time the step's own backward and collectives.

So :class:`TunedOwnerWork` asks for every problem this rank's owner work will run when the
runtime is built, before any step, on every rank alike (:meth:`TunedOwnerWork.tune`): it runs the
rule's owner work once on zero directions, batch by batch as a step batches them, with the tuner
measuring what the host's cache lacks. No collective of dmuon is in flight then, and the
measurement waits only for its own stream (:mod:`dmuon.ortho.timing`), so holding the host lock
across it waits for no other rank. Every owner-work call of a step (``step()``, the speculative
run, backward's NS worker) then runs inside :func:`dmuon.ortho.autotune.frozen`: it reads the
verdicts and never measures. A problem the setup did not see (a step whose active matrices
batch differently, a block without gradients) takes the tuner's fixed fallback, standard NS on
each matrix alone, the same on every rank and every run, with a warning; it never measures, and
the choice changes how fast NS runs, never which collectives a rank issues.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dmuon.ortho.autotune import frozen
from dmuon.util import torch_compat
from dmuon.runtime.owner_work import OwnerFn, OwnerWork, Results


class TunedOwnerWork(OwnerWork):
    """:class:`~dmuon.runtime.owner_work.OwnerWork` whose owner-work calls never tune (see the module
    docstring); :meth:`tune` measures what they will need, once, when the runtime is built."""

    def tune(self, work: OwnerFn, matrices: list[int], row_width: int) -> int:
        """Runs ``work`` on zero directions in each batch this rank owns among ``matrices``, tuning
        on a miss. No collective; every rank calls it (each for its own batches).

        Args:
            work: The rule's owner work (:meth:`StepCallbacks.owner_work`).
            matrices: The matrices the optimizer steps (:meth:`StepCallbacks.matrices`).
            row_width: The rule's row state per row (zero rows of it travel beside the directions).

        Returns:
            The number of batches run.
        """
        plan = self.plan
        ns = plan.ns
        if ns.method != "auto" and ns.batching != "auto":
            return 0  # nothing is tuned: every call's choice is the configuration's
        mine = [i for i in matrices if plan.infos[i].owner == plan.rank]
        batches = self.batches(mine, plan.rank)
        # Zeros: no random number is drawn (the user's generators stay as they were), and the owner
        # work's choices depend on shapes only (the tuner times its own probes).
        for batch in batches:
            directions = [torch.zeros(plan.infos[i].matrix_shape, dtype=ns.dtype, device=plan.device)
                          for i in batch]
            rows = None
            if row_width:
                rows = [torch.zeros(plan.infos[i].matrix_shape[0], row_width, device=plan.device) for i in batch]
            super().run_batch(work, batch, directions, rows)
        return len(batches)

    def run_batch(self, work: OwnerFn, batch: list[int], directions: list[torch.Tensor],
                  rows: list[torch.Tensor] | None = None) -> Results:
        """As :meth:`OwnerWork.run_batch`, with tuning frozen (verdicts read, never measured)."""
        with frozen():
            return super().run_batch(work, batch, directions, rows)


TUNING_WAIT_S = 1800.0
"""How long a rank done tuning waits on the store for the mesh's slowest before raising."""

_ROUNDS: dict[tuple[int, ...], int] = {}
"""Per mesh (its global ranks): how many runtimes this process built on it; every rank of a mesh
builds its runtimes in one order, so the count names the same wait on each."""


def wait_for_tuning(global_ranks: tuple[int, ...]) -> float | None:
    """After this rank's tuning at build: waits until every rank of the mesh is done tuning; returns
    the spread between the first and the last rank's end of tuning (their wall clocks), None alone.

    The wait is on the default group's store, not in a collective: the ranks of a host tune one after
    another (the host's lock), and the first done would otherwise sit in the next NCCL collective for
    the others' whole tuning, past a watchdog's timeout (300 s is common).
    """
    if len(global_ranks) <= 1 or not dist.is_initialized():
        return None
    store = torch_compat.default_store()
    round_ = _ROUNDS.get(global_ranks, 0)
    _ROUNDS[global_ranks] = round_ + 1
    prefix = f"dmuon/tuned/{'_'.join(map(str, global_ranks))}/{round_}"
    store.set(f"{prefix}/{dist.get_rank()}", repr(time.time()))
    keys = [f"{prefix}/{g}" for g in global_ranks]
    store.wait(keys, timedelta(seconds=TUNING_WAIT_S))
    ends = [float(store.get(k)) for k in keys]
    return max(ends) - min(ends)
