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

import torch

from dmuon.ortho.autotune import frozen
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
