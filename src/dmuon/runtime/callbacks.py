"""What an optimizer supplies to the runtime: the rule's per-matrix work, under a written contract.

The runtime (:class:`~dmuon.runtime.ShardRuntime`) decides *when* and *where*
everything runs and issues every collective; the optimizer decides *what* is
computed. A matrix rule splits into four pieces of work, each a callback:

* ``peek`` / ``commit``, on every rank: this rank's part of each matrix's
  direction from its gradient and state (elementwise work: Muon's momentum);
* ``owner_work``, on the owner: whole directions in, whole updates out (NS,
  and whatever else needs whole rows and columns);
* ``apply``, on every rank: this rank's rows of the returned updates into its
  parameter shard (learning rate, weight decay);
* ``independent``: work that needs nothing the exchange produces (AdamW on the
  other parameters), run while transfers are in flight.

Contract, for every callback:

1. **No collectives, no waiting on other ranks.** The runtime issues every
   collective, in one order on every rank; a callback that issued one could
   interleave differently on different ranks and deadlock. On an accelerator a
   callback enqueues its work on the current stream and does not synchronize
   the device (no ``.item()``, ``.cpu()``, ``.tolist()`` on results).
2. **Threads.** Everything runs on the thread that calls ``backward()`` and
   ``step()``, except ``owner_work``, which with
   ``ExecutionConfig.ns_in_backward`` also runs on the runtime's one worker
   thread during backward: it must only read its inputs and the rule's
   hyperparameters, never state the main thread writes.
3. **Buffers are borrowed.** The tensors a callback receives are the
   runtime's receive buffers (or views of them): read them, do not keep them
   past the callback's return. What a callback returns the runtime only reads
   (sends, cuts, compares); the callback must not write it afterwards.
4. **Determinism.** ``peek`` and ``commit`` must give bit-identical
   directions for the same gradient and state: the runtime keeps a launch
   from backward only when ``commit``'s direction equals, bit for bit, the one
   ``peek`` gave and the launch sent. ``owner_work`` must depend only on its
   inputs (the speculative step runs it before knowing whether the step keeps
   its result).
5. **Errors are fatal to the step.** A callback may raise (a bad gradient, a
   user error); the exception propagates out of ``backward()`` or ``step()`` on
   that rank. The other ranks then fail at their next collective with the
   process group's error (gloo and NCCL report the peer's exit) or its
   timeout. Validate what can be validated in the constructor, on every rank.
"""

from __future__ import annotations

import abc

import torch


class StepCallbacks(abc.ABC):
    """The optimizer's side of the runtime's step (see the module docstring for the contract).

    Matrices are named by their plan index (``Plan.infos[i]``); "this rank's
    part" of a matrix is ``MatrixInfo.kept_view`` of the rank's local shard: its
    piece, narrowed on HSDP to the columns whose state this replica keeps. The
    runtime hands each rank its part of the reduced gradients; the rule keeps its
    state in the same parts.
    """

    @abc.abstractmethod
    def matrices(self) -> list[int]:
        """The plan indices this optimizer steps now (its matrix param groups), ascending.

        Called once per ``step()`` and per launch from backward, on every rank; every rank
        must return the same list (it decides collectives).
        """

    @abc.abstractmethod
    def peek(self, members: list[int], grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """In backward: this rank's part of each member's direction, state untouched.

        ``grads[i]`` is this rank's part of matrix ``i``'s reduced gradient (a view the
        runtime owns: read it, never write it), shaped ``(rows, cols, *shape[2:])`` of the
        part. Returns, per member, a tensor of the part's elements in the runtime's wire
        dtype (any shape; it is flattened in row-major order).
        """

    @abc.abstractmethod
    def commit(self, members: list[int], grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """In ``step()``: advances each member's state and returns its direction as :meth:`peek` would
        for the same ``grads``.

        Called once per step for the members the step updates (never for a skipped step).
        """

    @abc.abstractmethod
    def owner_work(self, batch: list[int], directions: list[torch.Tensor]) -> list[torch.Tensor]:
        """On the owner: the whole ``(m, n)`` update of each whole direction, in the wire dtype.

        ``batch`` holds matrices of one shape, in the batch the plan's balancer priced;
        ``directions[k]`` is matrix ``batch[k]``'s whole direction (every rank's part
        assembled). May run on the worker thread (contract 2).
        """

    @abc.abstractmethod
    def apply(self, updates: dict[int, torch.Tensor]) -> None:
        """This rank's rows of each returned update, shaped ``(rows, cols * inner)`` of its piece.

        A matrix of which this rank holds nothing has no entry. Called once per return
        wave, in wave order.
        """

    def independent(self) -> None:
        """Work that needs nothing the exchange produces (AdamW), run while transfers travel.

        Called exactly once per step that is not skipped, before the first ``apply``.
        """

    def checked_gradients(self) -> list[tuple[str, torch.Tensor | None]]:
        """With ``ExecutionConfig.nonfinite``: the other gradients (name, this rank's local
        gradient or None) whose NaN/Inf skips or fails the step, in the same order on every rank."""
        return []
