"""dmuon's replicate level (``hsdp_mesh``): gradients reduced across replicas, and what ``param.grad`` holds.

FSDP2, applied over the shard sub-mesh, leaves each replica its own mean
gradient. From the moment a Muon matrix's post-accumulate-grad hook fires, and
from the moment any other parameter's reduction lands (before the backward pass
returns), its ``param.grad`` is a DTensor on ``hsdp_mesh`` that *is* the global
mean gradient, whatever has or has not been reduced yet:

* ``(Partial("avg"), *param.placements)``: the true value is the mean over the
  replicas of their local tensors. This is what FSDP2 leaves (each replica's
  mean), and it stays right when FSDP2 accumulates another micro-batch's
  replica mean into it, and under any torch op (``clip_grad_norm_`` reads it
  through DTensor, which all-reduces it for the norm, identically on every
  replica).
* After the reduction lands, a Muon matrix's piece holds, on replica ``r``,
  the *sum* over replicas of its column slice ``r`` and zeros elsewhere: still
  ``Partial("avg")`` of the same value, with each slice on one replica only
  (where its momentum lives). Other parameters hold the mean on every replica:
  ``(Replicate(), *param.placements)``.

The other parameters skip the ``Partial("avg")`` form: between their hook and
their landing, inside the backward pass, they keep FSDP2's DTensor (or, when a
second backward accumulates, the earlier landed form with this replica's mean
added to its local tensor, which the all-reduce turns into the right sum), and
the landing wraps them once. A DTensor built per parameter is the costliest
host work of the hooks (``DTensor.from_local``, about 0.1 ms), and these
parameters (norms, biases, embeddings) are the more numerous.

Every reduction issued in a backward pass lands before that backward returns
(the runtime runs :meth:`ReplicateLevel.land_all` from an autograd final
callback), so user code between backward and ``step()`` always sees reduced
gradients, and torch ops keep them valid: a linear edit (``clip_grad_norm_``'s
scaling) keeps the reduced form, a non-linear in-place one on a
``Partial`` gradient is refused by DTensor itself. So clipping, accumulation
with or without FSDP2's no-sync, and edits give the single-process result on
every replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from dmuon.comm import Pending
from dmuon.comm.replicate import ReplicateReduce
from dmuon.plan.layout import replicated_mesh
from dmuon.plan.plan import Plan
from dmuon.util.dtensor import local_tensor
from dmuon.util.observe import ranged
from dmuon.util.torch_compat import keep_partial_in_place


@dataclass
class Reduction:
    """One group's reduction in flight."""

    others: list[torch.Tensor]
    """Parameters reduced by the all-reduce (not Muon matrices)."""
    matrices: list[torch.Tensor]
    """Parameters holding Muon matrices, reduced by column slices."""
    members: list[int]
    """Their matrices (plan order)."""
    issued: dict[int, int] = field(repr=False)
    """Per parameter (id), the id of the gradient the reduction read (written back only into it)."""
    columns: Pending = field(repr=False)
    """The column reduce-scatter: ``{i: this rank's slice, summed over replicas}``."""
    mean: Pending | None = field(default=None, repr=False)
    """The all-reduce: ``{k: mean of others[k]}`` (issued by :meth:`ReplicateLevel.start_mean`)."""
    landed: bool = False


class ReplicateLevel:
    """Reduces gradients across replicas for one plan (``plan.replicate_level``).

    Args:
        plan: The plan (its ``hsdp_mesh`` and matrices).
        reduce: The collectives.
    """

    def __init__(self, plan: Plan, reduce: ReplicateReduce) -> None:
        # The Muon matrices' gradients are Partial between backward and step(): torch's clip_grad_norm_ must
        # scale them (torch 2.11's DTensor would scale a reduced copy).
        keep_partial_in_place()
        self.plan = plan
        self.reduce = reduce
        self.mesh = plan.hsdp_mesh
        self.replicate = plan.replicate
        self.position = plan.position
        self._matrices: dict[int, list[int]] = {}
        for info in plan.infos:
            self._matrices.setdefault(id(info.param), []).append(info.index)
        self.params = [p for g in plan.groups for p in g.params]
        """Every trainable parameter, in model order (the same on every rank)."""
        # Where each gradient lives: the replicate dim and the parameter's own dims (native HSDP's mesh).
        self._mesh = {id(p): replicated_mesh(self.mesh, p) for p in self.params}
        self._reduced: dict[int, int] = {}  # parameter -> the id of its gradient in reduced form
        self._inflight: list[Reduction] = []

    # ------------------------------------------------------------ backward
    def wrap(self, param: torch.Tensor) -> None:
        """Hook time: ``param.grad`` (FSDP2's replica mean, maybe accumulated) as ``Partial("avg")``
        on ``hsdp_mesh``. No communication, no copy.

        The local tensor stays FSDP2's own (a view of the block's flat reduce-scatter output, as
        with FSDP2 alone): the reduction writes its disjoint pieces in place, and the buffer lives
        as long as the gradients do, which is what FSDP2 relies on to keep a later reduce-scatter
        from reusing it.
        """
        self._reduced.pop(id(param), None)
        self._rewrap(param, Partial("avg"))

    def arrived(self, param: torch.Tensor) -> None:
        """Hook time: a Muon matrix's gradient takes its ``Partial("avg")`` form now (:meth:`wrap`); any
        other parameter's gradient is marked unreduced and takes its reduced form when :meth:`land`
        writes its mean, before this backward returns (the module docstring)."""
        if id(param) in self._matrices:
            self.wrap(param)
        else:
            self._reduced.pop(id(param), None)

    def _rewrap(self, param: torch.Tensor, placement) -> None:
        """``param.grad`` as a DTensor on its ``hsdp_mesh`` sub-mesh with ``placement`` on the replicate
        dim and the parameter's own placements after it, on the same local tensor (built only when it
        is not that already)."""
        grad = param.grad
        mesh, placements = self._mesh[id(param)], (placement, *param.placements)
        if not (isinstance(grad, DTensor) and grad.device_mesh == mesh and tuple(grad.placements) == placements):
            param.grad = DTensor.from_local(local_tensor(grad), mesh, placements, run_check=False,
                                            shape=param.shape, stride=param.stride())

    def start(self, params: list[torch.Tensor]) -> Reduction:
        """Issues the reduction of ``params``' gradients (the same list on every rank)."""
        reduction = self.start_columns(params)
        self.start_mean(reduction)
        return reduction

    def start_columns(self, params: list[torch.Tensor]) -> Reduction:
        """The Muon matrices' part of :meth:`start` (the column all-to-all; inside
        ``GroupAllToAll.coalesced()`` it joins what else goes to the same peers); the caller
        issues the rest with :meth:`start_mean`."""
        params = [p for p in params if p.grad is not None]
        others = [p for p in params if id(p) not in self._matrices]
        matrices = [p for p in params if id(p) in self._matrices]
        members = sorted(i for p in matrices for i in self._matrices[id(p)])
        s = self.position[1]
        infos = self.plan.infos
        reduction = Reduction(
            others, matrices, members, {id(p): id(p.grad) for p in params},
            self.reduce.reduce_columns(members, {i: infos[i].local_view(local_tensor(infos[i].param.grad), s)
                                                 for i in members}))
        self._inflight.append(reduction)
        return reduction

    def start_mean(self, reduction: Reduction) -> None:
        """The other parameters' all-reduce of a reduction :meth:`start_columns` began. After the column
        all-to-all on the same group: the directions' hop A it may carry is on the way to the owners'
        NS, while the other gradients are needed only by ``step()``'s AdamW."""
        reduction.mean = self.reduce.all_reduce_mean([local_tensor(p.grad) for p in reduction.others])

    @ranged("replicate.land")
    def land(self, reduction: Reduction) -> None:
        """Writes a landed reduction into the gradients it read, where they have not changed since."""
        if reduction.landed:
            return
        reduction.landed = True
        means = reduction.mean.wait()
        for k, p in enumerate(reduction.others):
            if id(p.grad) == reduction.issued[id(p)]:
                local_tensor(p.grad).copy_(means[k])
                self._rewrap(p, Replicate())
                self._reduced[id(p)] = id(p.grad)
        sums = reduction.columns.wait()
        r, s = self.position
        infos = self.plan.infos
        for p in reduction.matrices:
            if id(p.grad) != reduction.issued[id(p)]:
                continue
            local = local_tensor(p.grad)
            for i in self._matrices[id(p)]:
                view = infos[i].local_view(local, s)
                if not view.numel():
                    continue
                view.zero_()
                if i in sums:
                    view.narrow(1, infos[i].column_start(r, s), infos[i].replica_columns(s)[r]).copy_(sums[i])
            self._reduced[id(p)] = id(p.grad)

    def land_all(self) -> None:
        """Lands every reduction in flight, in issue order."""
        for reduction in self._inflight:
            self.land(reduction)
        self._inflight = []

    # ---------------------------------------------------------------- step
    def is_reduced(self, param: torch.Tensor) -> bool:
        """Whether ``param.grad`` is the gradient dmuon left reduced (and not replaced or accumulated into since)."""
        return param.grad is not None and self._reduced.get(id(param)) == id(param.grad)

    @ranged("replicate.finish")
    def finish(self) -> None:
        """Before the step (or a clip) reads gradients: everything landed and every gradient reduced.

        After a backward pass nothing is left to do (its reductions landed before it
        returned); a gradient dmuon has not reduced (set by hand, or produced outside
        FSDP2's hooks) is reduced now, blocking. Which ones is the same on every rank as
        long as every rank ran the same backward passes.
        """
        self.land_all()
        again = [p for p in self.params if p.grad is not None and not self.is_reduced(p)]
        if again:
            for p in again:
                # A gradient set by hand is the caller's tensor: the reduction writes into a copy.
                p.grad = p.grad.clone()
                self.wrap(p)
            self.land(self.start(again))
            self._inflight = []

    def holds_sums(self, param: torch.Tensor) -> bool:
        """Whether ``param.grad`` is a Muon matrix's reduced form (R times the mean, one replica per slice)."""
        return id(param) in self._matrices and self.is_reduced(param)

    def mean_part(self, index: int) -> torch.Tensor:
        """Matrix ``index``'s part on this rank of the mean gradient (after :meth:`finish`, or from
        a landed reduction's sums): its kept columns divided by R."""
        r, s = self.position
        info = self.plan.infos[index]
        return info.kept_view(local_tensor(info.param.grad), r, s) / self.replicate

    def mean_parts_of(self, reduction: Reduction, members: list[int],
                      sums: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
        """``members``' mean parts from ``reduction``'s landed sums (whatever the gradients hold now), or
        from ``sums`` given in their place (those divided as a pipeline schedule divides them)."""
        sums = reduction.columns.wait() if sums is None else sums
        out = {}
        for i in members:
            if i in sums:
                out[i] = sums[i] / self.replicate
            else:  # this position holds no rows of it
                info = self.plan.infos[i]
                out[i] = info.kept_view(local_tensor(info.param.grad), *self.position).float()
        return out
