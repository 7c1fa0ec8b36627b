"""What an optimizer supplies to the runtime: the rule's per-matrix work, under a written contract.

The runtime (:class:`~dmuon.runtime.ShardRuntime`) decides *when* and *where*
everything runs and issues every collective; the optimizer decides *what* is
computed. A matrix rule is a :class:`StepCallbacks`, six pieces of work:

* ``matrices``, on every rank: which matrices the rule steps now;
* ``peek`` / ``commit``, on every rank: this rank's part of each matrix's
  direction from its gradient and state (elementwise work: Muon's momentum);
* ``owner_work``, on the owner: whole directions in, whole updates out (NS,
  and whatever else needs whole rows and columns);
* ``apply``, on every rank: this rank's rows of the returned updates into its
  parameter shard (learning rate, weight decay);
* ``independent``: work that needs nothing the exchange produces (AdamW on the
  other parameters), run while transfers are in flight.

A rule that needs more declares it by also deriving from a **capability**, each
a few abstract methods the runtime calls only on rules that declare it (and
each costing nothing, no byte and no collective, to a rule that does not):

* :class:`RowState`: a small per-row state that travels with the matrices
  (NorMuon's second moment): ``row_width`` float32 values per matrix row, kept by
  every holder of the row and sharded with the rows like the parameter. The
  runtime sends each row's state once beside the direction, ``owner_work`` gets
  the whole ``(m, row_width)`` states and returns the new ones, and ``apply``
  gets this rank's rows of them back with its rows of the update
  (:mod:`dmuon.comm.exchange`).
* :class:`Rescalable`: a direction linear in the gradient with a momentum part
  (Muon's), so that with ``ExecutionConfig.clipped_overlap`` each owner keeps its
  matrices' whole momentum and a launch whose gradients were since scaled by one
  factor (clipping) still stands.
* :class:`WeightSums`: per-matrix sums over the weight (MuonH's Frobenius norms),
  before the step's first ``apply`` and after its last (with the updates applied in
  the next forward: computed ahead, per return); the runtime adds them over exactly
  the ranks that split each matrix in one all-gather per call
  (:mod:`dmuon.runtime.matrix_norms`).
* :class:`StepMaxima`: a few values agreed as their maximum over every rank each
  step (QK-clip's per-head attention logit maxima: every rank must scale the same
  heads by the same factor, and data-parallel ranks see different tokens),
  carried with the step's agreement without a collective of their own
  (:mod:`dmuon.runtime.agreement`) and handed to ``finish_step``.
* :class:`CheckedGradients`: the gradients ``independent`` steps, checked for
  NaN/Inf with the matrices' under ``ExecutionConfig.nonfinite``.

Contract, for every callback:

1. **No collectives, no waiting on other ranks.** The runtime issues every
   collective, in one order on every rank; a callback that issued one could
   interleave differently on different ranks and deadlock. On an accelerator a
   callback enqueues its work on the current stream and does not synchronize
   the device (no ``.item()``, ``.cpu()``, ``.tolist()`` on results).
2. **Threads and streams.** Callbacks run under the thread and the stream the
   runtime selected, and order nothing themselves (no stream switch, no event,
   no wait: :mod:`dmuon.comm.streams` is the runtime's). ``peek`` runs in
   backward's hooks (the autograd engine's thread; on CUDA FSDP2's post-reduce
   stream, or dmuon's own on the replicate level); ``owner_work`` with
   ``ExecutionConfig.ns_in_backward`` also runs on the runtime's one worker
   thread, on the NS stream, during backward: it must only read its inputs and
   the rule's hyperparameters, never state the other threads write; everything
   else runs on the thread that calls ``step()``, on the compute stream
   (docs/architecture.md, "Streams").
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
6. **No tuning inside a step.** ``owner_work`` may choose how to compute
   (the NS autotuner's method and batching), but only from verdicts measured
   before the step: the runtime runs it once per batch on zero directions
   when it is built (:mod:`dmuon.runtime.tuning`), where the tuner measures
   what the cache lacks, and calls it during backward and ``step()`` with
   tuning frozen (:func:`dmuon.ortho.autotune.frozen`: a miss takes a fixed
   fallback, never a measurement). A callback holds no host-wide lock and
   waits on no timer across the device work it enqueues.

Whether a rank enters a collective never depends on a local event's, a
timer's or a lock's state. Every rank issues the same collectives in the same
order, decided by the plan and by values agreed over the ranks (the step's
agreement), never by how fast something ran, whether an event has fired or who
got a lock first: those differ between ranks, and a rank that waits for one of
them while another rank waits for it in a collective hangs both. So nothing a
rank waits for while it holds a lock another rank may want may depend on a
collective (tuning measures only when the runtime is built, its waits on its
own stream's events), and timings only choose how fast a rank computes what it
computes, never what it sends.
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
    def owner_work(self, batch: list[int], directions: list[torch.Tensor],
                   rows: list[torch.Tensor] | None = None):
        """On the owner: the whole ``(m, n)`` update of each whole direction, in the wire dtype.

        ``batch`` holds matrices of one shape, in the batch the plan's balancer priced;
        ``directions[k]`` is matrix ``batch[k]``'s whole direction (every rank's part
        assembled). May run on the worker thread (contract 2).

        A :class:`RowState` rule also gets ``rows``, each matrix's whole ``(m, row_width)`` row
        state, and returns ``(updates, new_rows)``: the updates and each matrix's new
        ``(m, row_width)`` float32 row state. Any other rule returns the list of updates.
        """

    @abc.abstractmethod
    def apply(self, updates: dict[int, torch.Tensor], rows: dict[int, torch.Tensor] | None = None) -> None:
        """This rank's rows of each returned update, shaped ``(rows, cols * inner)`` of its piece.

        A matrix of which this rank holds nothing has no entry. Called once per return
        wave, in wave order. A :class:`RowState` rule gets in ``rows`` this rank's rows of
        each returned matrix's new row state, ``(rows, row_width)``, to store.
        """

    @abc.abstractmethod
    def independent(self) -> None:
        """Work that needs nothing the exchange produces (AdamW), run while transfers travel.

        Called exactly once per step that is not skipped, before the first ``apply``.
        """


class RowState(abc.ABC):
    """Capability: a per-row state that travels with the matrices (module docstring)."""

    row_width: int
    """float32 values of row state per matrix row (an int >= 1)."""

    @abc.abstractmethod
    def row_states(self, members: list[int]) -> dict[int, torch.Tensor]:
        """This rank's rows of each member's row state, ``(rows, row_width)`` float32 (rows of its
        piece; ``(0, row_width)`` where it holds none), as the rule's state is now (read-only: the
        runtime only sends it).

        Called beside :meth:`StepCallbacks.peek` and :meth:`StepCallbacks.commit` for the same
        members; for the same state it must give bit-identical values (a launch is kept only if
        both agree, contract 4).
        """


class Rescalable(abc.ABC):
    """Capability: a launch whose gradients were since scaled by one factor still stands, the owner
    rescaling its direction from the whole momentum it keeps (``ExecutionConfig.clipped_overlap``)."""

    @abc.abstractmethod
    def rescale_direction(self, index: int, launched: torch.Tensor, momentum: torch.Tensor,
                          scale: float) -> torch.Tensor:
        """On the owner: matrix ``index``'s whole direction for the gradient ``scale * g``, from the
        whole direction launched for ``g`` (wire dtype) and the momentum before the step (whole,
        float32, read-only). Returns a float32 ``(m, n)`` tensor."""

    @abc.abstractmethod
    def advance_momentum(self, index: int, momentum: torch.Tensor, direction: torch.Tensor) -> None:
        """On the owner: advances the whole float32 momentum of matrix ``index`` in place to what it
        is after a step whose whole direction was ``direction``."""

    @abc.abstractmethod
    def momentum_parts(self, members: list[int]) -> dict[int, torch.Tensor]:
        """This rank's part of each member's momentum, float32 (zeros where the rule has none yet),
        read-only; the runtime sends them to the owners once, after the state was loaded from a
        checkpoint or when the owners start keeping copies."""


class WeightSums(abc.ABC):
    """Capability: per-matrix sums over the weight, added over the ranks that split each matrix."""

    @abc.abstractmethod
    def weight_sums(self, active: list[int], applied: bool) -> dict[int, torch.Tensor]:
        """This rank's partial sums over its part of some matrices' weight (float32, any small shape,
        on any device), by plan index; empty: none (nothing moves).

        Called on every rank of a step that is not skipped, twice: with ``applied=False`` before
        the step's first ``apply`` (the weights as the previous step left them) and with
        ``applied=True`` after its last. ``active`` holds the matrices the step updates. Every
        rank must return the same keys with the same shapes (they size the collective). A rank
        sums over its part of the weight (``MatrixInfo.local_view`` of its local shard: the whole
        piece, every column of it, also on HSDP); the runtime counts each piece once (a copy of a
        piece another position also holds, TP's ``Replicate``, counts 0) and adds over the ranks
        that split the matrix (the shard level: FSDP2's shards and TP), not over HSDP's replicas,
        which hold the same weights. No collective, no device sync.
        """

    @abc.abstractmethod
    def weight_sums_after(self, members: list[int], updates: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """What :meth:`weight_sums` ``(members, applied=True)`` will return once ``apply(updates)`` has
        run, computed now, the weight left as it is: the same bits (the same arithmetic, on a copy).

        With ``ExecutionConfig(apply_updates="next_forward")`` it replaces ``weight_sums(...,
        applied=True)``: ``step()`` asks it once per return of updates, as soon as the return has landed
        (``members``: every rank's matrices of the return, the keys to give, the same on every rank;
        ``updates``: this rank's rows of them, as ``apply`` will get them, none for a matrix of which
        this rank holds nothing), so the totals are added while the updates wait for the next forward.
        That forward then calls ``apply(updates)`` and ``weight_totals(totals, applied=True)`` for those
        members, with no collective. No collective, no device sync.
        """

    @abc.abstractmethod
    def weight_totals(self, totals: dict[int, torch.Tensor], applied: bool) -> None:
        """The totals of :meth:`weight_sums` (same keys and shapes, float32, on the runtime's device),
        each the sum over the whole matrix, the same on every rank; called right after the
        :meth:`weight_sums` call that asked for them, when it asked for any. With
        ``apply_updates="next_forward"``, those of :meth:`weight_sums_after` (``applied=True``), right
        after the ``apply`` of their updates."""


class StepMaxima(abc.ABC):
    """Capability: values agreed as their maximum over every rank, once per step."""

    @abc.abstractmethod
    def step_maxima(self) -> torch.Tensor | None:
        """This rank's values to agree on by their maximum over every rank (float32, on any device),
        or None for none.

        Called once per ``step()``, at its start, on every rank; every rank must return the same
        number of values (it sizes the agreement's collective). The maximum is exact for
        non-negative values (+inf included); NaN and negative values count as 0. It reaches
        :meth:`finish_step`, also on a step the speculative path redoes, and is dropped with a
        skipped step.
        """

    @abc.abstractmethod
    def finish_step(self, active: list[int], maxima: torch.Tensor) -> None:
        """After the last ``apply`` of a step that is not skipped (before the post-optimizer event).

        ``active`` holds the matrices the step updated (plan order); ``maxima`` the elementwise
        maximum over every rank of :meth:`step_maxima` (float32, on the CPU; empty without).
        Called exactly once per step that is not skipped, and never for a skipped one. With
        ``ExecutionConfig(apply_updates="next_forward")`` the step's end calls it with no matrices,
        and then each unit's apply in the next forward (or a flush) with that unit's matrices, right
        after their update: what it does must be per matrix (QK-clip's row scaling is).
        """


class CheckedGradients(abc.ABC):
    """Capability: the other gradients whose NaN/Inf skips or fails the step (``ExecutionConfig.nonfinite``)."""

    @abc.abstractmethod
    def checked_gradients(self) -> list[tuple[str, torch.Tensor | None]]:
        """(name, this rank's local gradient or None) of each parameter ``independent`` steps, in the
        same order on every rank."""


def row_width(callbacks: StepCallbacks) -> int:
    """The rule's row state per matrix row: ``row_width`` for a :class:`RowState` rule, else 0.

    Raises:
        ValueError: A :class:`RowState` rule whose ``row_width`` is not an int >= 1.
    """
    if not isinstance(callbacks, RowState):
        return 0
    width = getattr(callbacks, "row_width", None)
    if not (isinstance(width, int) and not isinstance(width, bool) and width >= 1):
        raise ValueError(f"{type(callbacks).__name__} declares RowState, so its row_width must be an int >= 1, "
                         f"got {width!r}")
    return width
