"""DMuon's param groups as torch.optim's (:class:`ParamGroups`): each group of the user's split in a Muon
and an AdamW half, groups added later split alike, one value per user group spread over the halves, and the
checks of a Muon half's settings. A matrix added that the plan does not hold makes the plan again
(:class:`~dmuon.optim.lifecycle.PlanLifecycle`)."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from dmuon.optim.deferred import default_matrices
from dmuon.optim.groups import AdamWGroup, check_named_alike, check_ns_keys, group_index, named_group
from dmuon.plan.selection import select_matrices
from dmuon.rules.adamw import check_adamw_group
from dmuon.rules.muon import check_rule_settings


class ParamGroups:
    """The param-group methods of :class:`dmuon.optim.dmuon.DMuon` (a mixin: it reads the optimizer's
    splitter, matrices, names and deferred setup)."""

    def _split_groups(self, user_groups: list[dict[str, Any]] | None, named: dict[int, str]) -> list[dict[str, Any]]:
        """The user's groups (None: every parameter in one) as DMuon's, each split in its Muon and AdamW halves."""
        if user_groups is None:
            user_groups = [{"params": list(self.model.parameters())}]
        halves = [(k, half) for k, g in enumerate(user_groups)
                  for half in self._splitter.split(g, index=k, names=named)]
        groups = [half for _, half in halves]
        self._user_group_of = [k for k, _ in halves]  # DMuon's group -> the user's group it came from
        if any("param_names" not in g for g in groups):
            for g in groups:
                g.pop("param_names", None)  # torch's rule: every group named, or none
        if self._deferred is not None:
            self._deferred.record(groups, named)
        return groups

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """torch.optim's param groups; before setup, every read first puts the model's current parameters
        in them (:meth:`DeferredSetup.rebind`), so a framework's state-dict code sees the sharded parameters."""
        try:
            groups = self.__dict__["param_groups"]
        except KeyError:
            # A wrapper that took DMuon's class (Lightning's _FabricOptimizer) delegates through __getattr__.
            raise AttributeError("param_groups") from None
        deferred = self.__dict__.get("_deferred")
        if deferred is not None:
            deferred.rebind(groups, self.state)
        return groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.__dict__["param_groups"] = value

    def matrix_indices(self, param: torch.Tensor) -> list[int]:
        """The plan indices of ``param``'s matrices (several for a stack of experts or row groups)."""
        return self._matrices.indices(param)

    def split_group(self, group: dict[str, Any], index: int = 0,
                    names: dict[int, str] | None = None) -> list[dict[str, Any]]:
        """A torch.optim-style param group as DMuon's: a Muon group and an AdamW group (either may be absent);
        :meth:`GroupSplitter.split <dmuon.optim.groups.GroupSplitter.split>` says which key goes where."""
        return self._splitter.split(group, index=index, names=names)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group, as torch.optim does: a torch.optim-style group is split as the constructor splits
        them (:meth:`split_group`: a Muon half, an AdamW half); one with DMuon's ``algorithm`` key is added
        as it is, after checking its parameters are of that kind."""
        if "algorithm" not in param_group:
            check_named_alike(named_group(param_group), self._user_named)
            self._check_not_held(param_group)
            self._plan_new_matrices(param_group)
            named = all("param_names" in g for g in self.param_groups)
            user_index = max(self._user_group_of, default=-1) + 1
            for half in self.split_group(param_group, index=len(self.param_groups)):
                if not named:
                    half.pop("param_names", None)
                self._user_group_of.append(user_index)
                self.add_param_group(half)
            return
        if len(self._user_group_of) == len(self.param_groups):  # one of DMuon's groups, added by the user
            self._user_group_of.append(max(self._user_group_of, default=-1) + 1)
        self._splitter.complete(param_group)
        if param_group["algorithm"] == "muon":
            self.check_ns_keys(param_group)
            self.check_rule_keys(param_group)
        else:
            check_adamw_group(param_group, f"param group {group_index(self.param_groups, param_group)}: ")
            param_group = AdamWGroup(param_group)
        saved, self.defaults = self.defaults, {}
        try:
            super().add_param_group(param_group)
        finally:
            self.defaults = saved
        if self.__dict__.get("_deferred") is not None:
            self._deferred.record([param_group], self._splitter.names())  # swapped for the sharded one at setup
        self._thawing = None  # the group may hold a frozen matrix (_thawed)

    def _check_not_held(self, group: dict[str, Any]) -> None:
        """torch.optim's ``ValueError`` for a parameter already in a group, raised before anything changes
        and saying why it is there (a frozen matrix ``DMuon(model)`` holds is Muon's once it trains)."""
        params = group.get("params", ())
        params = [params] if isinstance(params, torch.Tensor) else params
        if not isinstance(params, (list, tuple)):
            return  # refused by the split, as torch.optim refuses it
        held = {id(p): k for k, g in enumerate(self.param_groups) for p in g["params"]}
        for item in params:
            p = item[1] if isinstance(item, tuple) else item
            if id(p) in held:
                name = self.param_names.get(id(p)) or self._splitter.names().get(id(p), "?")
                raise ValueError(
                    f"some parameters appear in more than one parameter group: {name!r} is in param group "
                    f"{held[id(p)]} already ({self.param_groups[held[id(p)]]['algorithm']!r}). DMuon(model) holds "
                    "every parameter of the model, frozen ones too, and a frozen matrix is stepped by Muon once "
                    "it trains (requires_grad_(True) is enough, no add_param_group)")

    def per_group(self, values: Iterable[Any]) -> list[Any]:
        """One value per user param group (the constructor's groups, then each ``add_param_group``) as one
        per DMuon param group: each user group is split in a Muon and an AdamW half (either may be
        absent), and each half takes its user group's value.

        What torch's schedulers with one value per group take: ``OneCycleLR(opt,
        max_lr=opt.per_group([3e-3, 1e-3]))`` (a list of the user's length raises torch's "max_lr has 2
        values, param_groups has 4"); a value per DMuon group may also be given directly.

        Raises:
            ValueError: For a length other than the number of user groups, naming both.
        """
        values = list(values)
        users = max(self._user_group_of, default=-1) + 1
        if len(values) != users:
            raise ValueError(f"per_group got {len(values)} values for {users} user param groups (DMuon holds "
                             f"{len(self.param_groups)} groups: a Muon and an AdamW half per user group)")
        return [values[k] for k in self._user_group_of]

    def _plan_new_matrices(self, group: dict[str, Any]) -> None:
        """Makes the matrices of ``group`` (a torch.optim-style group being added) that the default selection
        takes now, and the plan does not hold (weights frozen when the plan was made, unfrozen since), Muon
        matrices: before setup by selecting again on the model as it is; after it by making the plan again
        (a collective, as ``dmuon.prepare``: add the group on every rank alike) and restarting the runtime
        on it (:meth:`_replan`: the updates held for the next forward applied first). With a plan of the user's,
        ``ValueError`` naming the first such weight."""
        if self._deferred is not None:
            self._matrices.reselect(default_matrices(self.model))
            return
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        tensors = {id(p[1] if isinstance(p, tuple) else p) for p in params}
        new = [n for n, p in select_matrices(self.model)
               if p.requires_grad and id(p) in tensors and not self._matrices.planned(p)]
        if not new:
            return
        if not self._own_plan:
            raise ValueError(
                f"parameter {new[0]!r} is a matrix Muon updates, but the plan given to DMuon was made while it was "
                "frozen (requires_grad=False) and does not hold it: call dmuon.prepare again on the model as it is "
                "now and build DMuon with that plan, or build DMuon without a plan")
        self._replan()

    def check_ns_keys(self, group: dict[str, Any]) -> None:
        """Raises ``ValueError`` naming the group and key when a Muon group's NS setting differs from
        :attr:`ns` (the plan priced every owner's work with one NS configuration, and the owners batch
        matrices across groups)."""
        check_ns_keys(group, group_index(self.param_groups, group), self.ns)

    def check_rule_keys(self, group: dict[str, Any]) -> None:
        """Raises ``ValueError`` naming the group and key for a Muon group's bad ``adjust_lr_fn``,
        ``extra_scale_factor`` or ``cautious_weight_decay``."""
        check_rule_settings(group["adjust_lr_fn"], group["extra_scale_factor"], group["cautious_weight_decay"],
                            f"param group {group_index(self.param_groups, group)}: ")
