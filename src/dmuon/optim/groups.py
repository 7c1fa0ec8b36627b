"""DMuon's param groups: which parameters are Muon matrices (:class:`MuonMatrices`), each
torch.optim-style group split into a Muon half and an AdamW half and DMuon's own groups completed with
their defaults (:class:`GroupSplitter`), and the check on a group's NS keys."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dmuon.ortho.config import NSConfig
from dmuon.ortho.owner import GROUP_KEYS
from dmuon.plan.plan import Plan
from dmuon.rules.muon import RULE_DEFAULTS


def _as_tuples(value: Any) -> Any:
    """Lists as tuples, recursively: a state dict's round trip (DCP, JSON) turns tuples into lists."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


MUON_KEYS = ("momentum", "nesterov", "adjust_lr_fn", *RULE_DEFAULTS, *GROUP_KEYS)
"""Param-group keys only the Muon half of a group reads (``eps`` is Muon's NS eps, as in torch.optim.Muon)."""
ADAMW_KEYS = ("betas", "foreach", "fused", "amsgrad", "maximize", "capturable", "differentiable",
              "decoupled_weight_decay")
"""torch.optim.AdamW's keys that Muon has no use for: a group's go to its AdamW half as they are."""
_WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


class AdamWGroup(dict):
    """An AdamW param group (a plain dict otherwise) whose ``momentum``, when written, is its first beta.

    torch's momentum-cycling schedulers (``OneCycleLR``, ``CyclicLR`` with ``cycle_momentum=True``)
    read one optimizer's ``defaults`` to decide between writing each group's ``momentum`` (SGD, Muon)
    and its ``betas[0]`` (Adam); DMuon's defaults are Muon's, so they write ``momentum`` into every
    group. Here that write sets ``betas[0]``, what the same scheduler on a torch.optim.AdamW would
    write, so one scheduler on DMuon cycles what torch's pair, one scheduler each, cycles: Muon's
    momentum and AdamW's beta1. A ``momentum`` key is never stored in an AdamW group.
    """

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "momentum":
            key, value = "betas", (value, *self["betas"][1:])
        super().__setitem__(key, value)


def as_adamw_groups(groups: list[dict[str, Any]]) -> None:
    """Makes every AdamW group of ``groups`` an :class:`AdamWGroup` (in place; a state load gives plain dicts)."""
    for k, group in enumerate(groups):
        if group.get("algorithm") == "adamw" and not isinstance(group, AdamWGroup):
            groups[k] = AdamWGroup(group)


def canonical_name(name: str) -> str:
    """A parameter's name without the parts wrappers insert (activation checkpointing's
    ``_checkpoint_wrapped_module``, ``torch.compile``'s ``_orig_mod``, FSDP1's
    ``_fsdp_wrapped_module``), as torch's distributed state dicts name it."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


class MuonMatrices:
    """Which parameters Muon updates: before a plan, those the default selection chose (by canonical name);
    with one, the plan's matrices (by parameter object, with their plan indices) and the matrices the plan's
    selection takes once they train (``requires_grad=False`` when the plan was made: a frozen backbone).

    A frozen matrix sits in a Muon group from the start, as it would in ``torch.optim.Muon``'s (which steps
    nothing without a gradient): once it trains the plan is made again (:meth:`DMuon.follow_requires_grad
    <dmuon.optim.dmuon.DMuon.follow_requires_grad>`), and the groups, a scheduler's view of them, stay as
    they are."""

    def __init__(self, selected: set[str] | None = None) -> None:
        self._selected = None if selected is None else frozenset(selected)
        self._index: dict[int, list[int]] = {}  # parameter id -> its matrices (several for a stack of experts)
        self._selectable: frozenset[int] = frozenset()
        self.frozen: frozenset[int] = frozenset()
        """With a plan: the parameters (by id) the default selection takes but the plan left out, frozen then."""

    def reselect(self, selected: set[str]) -> None:
        """Before a plan: from now on, the parameters named in ``selected`` (a selection made again)."""
        self._selected = frozenset(selected)

    def adopt(self, plan: Plan, selectable: set[int], frozen: set[int]) -> None:
        """From now on, the matrices of ``plan``, and ``selectable`` (ids): the parameters its selection takes
        whether or not they train now (the plan's own matrices for a plan DMuon cannot make again);
        ``frozen`` (ids): the default selection's matrices the plan left out, frozen when it was made."""
        self._index = {}
        for info in plan.infos:
            self._index.setdefault(id(info.param), []).append(info.index)
        self._selectable = frozenset(selectable) | frozenset(self._index)
        self.frozen = frozenset(frozen)
        self._selected = None

    def holds(self, param: torch.Tensor, name: str | None) -> bool:
        """Whether ``param`` (named ``name`` in the model, if it is one of its parameters) is a Muon matrix."""
        if self._selected is None:
            return id(param) in self._selectable
        return name is not None and name in self._selected

    def planned(self, param: torch.Tensor) -> bool:
        """Whether the plan holds ``param`` (False before a plan)."""
        return id(param) in self._index

    def indices(self, param: torch.Tensor) -> list[int]:
        """The plan indices of ``param``'s matrices (several for a stack of experts or row groups; none for a
        frozen matrix the plan does not hold yet). ``KeyError`` for a parameter that is no Muon matrix."""
        if id(param) not in self._index and id(param) in self._selectable:
            return []
        return self._index[id(param)]


def group_index(groups: list[dict[str, Any]], group: dict[str, Any]) -> int:
    """``group``'s position in ``groups``; a group being added gets the next one."""
    return next((k for k, g in enumerate(groups) if g is group), len(groups))


def check_ns_keys(group: dict[str, Any], index: int, ns: NSConfig) -> None:
    """Raises ``ValueError`` naming the group and key when a Muon group's NS setting differs from ``ns``.

    The plan priced (or measured) every owner's work with one NS configuration, and the owners batch
    matrices across groups, so a per-group NS setting is refused.
    """
    for key, field in GROUP_KEYS.items():
        if key in group and _as_tuples(group[key]) != getattr(ns, field):
            raise ValueError(
                f"param group {index}: {key}={group[key]!r} differs from the NS configuration the plan was "
                f"priced with ({field}={getattr(ns, field)!r}); NS settings apply to every matrix: "
                "set them with DMuon(ns=dmuon.NSConfig(...)) or dmuon.prepare(ns=...)"
                + ("; AdamW's epsilon is the group key adamw_eps" if key == "eps" else ""))


class GroupSplitter:
    """Turns param groups into DMuon's: a torch.optim-style group into a Muon half and an AdamW half
    (:meth:`split`), and one of DMuon's completed with the defaults of its algorithm (:meth:`complete`).

    Args:
        model: The model (its parameters' names label the halves).
        matrices: Which parameters are Muon matrices.
        muon_defaults: A Muon group's keys and their defaults (DMuon's keywords and the rule's own).
        adamw_defaults: An AdamW group's keys and their defaults.
        adamw_lr_given: Whether AdamW has a learning rate of its own (else a group's ``lr`` reaches both halves).
    """

    def __init__(self, model: nn.Module, matrices: MuonMatrices, muon_defaults: dict[str, Any],
                 adamw_defaults: dict[str, Any], adamw_lr_given: bool) -> None:
        self.model = model
        self.matrices = matrices
        self.muon_defaults = muon_defaults
        self.adamw_defaults = adamw_defaults
        self.adamw_lr_given = adamw_lr_given
        self._muon_only = frozenset(MUON_KEYS) | (frozenset(muon_defaults) - {"lr", "weight_decay"})  # with the rule's

    def names(self) -> dict[int, str]:
        """The model's parameters (by id) -> their canonical names."""
        return {id(p): canonical_name(n) for n, p in self.model.named_parameters()}

    def split(self, group: dict[str, Any], index: int = 0,
              names: dict[int, str] | None = None) -> list[dict[str, Any]]:
        """``group`` (torch.optim-style) as DMuon's: a Muon group and an AdamW group (either may be absent).

        ``"params"`` may hold tensors or ``(name, param)`` pairs; every half gets the
        names of its parameters as ``"param_names"`` (given ones, else the model's).
        The group's keys go where torch.optim users mean them:

        * ``momentum``, ``nesterov``, ``adjust_lr_fn``, ``extra_scale_factor``,
          ``cautious_weight_decay`` and the NS keys (``ns_steps``,
          ``ns_coefficients``, ``eps``: torch.optim.Muon's): the Muon half.
        * ``adamw_<key>``: the AdamW half's ``<key>``; AdamW-only keys (``betas``,
          ``foreach``, ``fused``, ...): the AdamW half.
        * ``weight_decay``: both halves (so a group of biases and norms with
          ``weight_decay=0.0`` decays neither), unless ``adamw_weight_decay`` sets the
          AdamW half's.
        * ``lr``: the Muon half; the AdamW half too when neither the group's
          ``adamw_lr`` nor DMuon's ``adamw=AdamWConfig(lr=...)`` is given (as DMuon's ``lr`` does).
        * any other key (yours): both halves.

        Keys a half does not set come from DMuon's keywords (``lr``, ``weight_decay``,
        ... for Muon; ``adamw``'s for AdamW).
        """
        if "params" not in group:
            raise ValueError("every param group needs a 'params' entry")
        if "algorithm" in group:
            return [dict(group)]  # already one of DMuon's (complete() checks it)
        names = self.names() if names is None else names
        params, labels = _params_and_labels(group, index, names)
        muon = [k for k, p in enumerate(params) if self.matrices.holds(p, names.get(id(p), labels[k]))]
        other = [k for k in range(len(params)) if k not in set(muon)]
        extra = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        out = []
        if muon:
            g = {k: v for k, v in extra.items() if not k.startswith("adamw_") and k not in ADAMW_KEYS}
            out.append(_half(params, labels, muon, "muon", g))
        if other:
            out.append(_half(params, labels, other, "adamw", self._adamw_keys(extra)))
        return out

    def _adamw_keys(self, extra: dict[str, Any]) -> dict[str, Any]:
        """A group's keys for its AdamW half."""
        g = {k: v for k, v in extra.items()
             if not k.startswith("adamw_") and k not in self._muon_only and k not in ("lr", "weight_decay")}
        if "weight_decay" in extra:
            g["weight_decay"] = extra["weight_decay"]
        if "lr" in extra and not self.adamw_lr_given:
            lr = extra["lr"]  # a tensor lr: the half's own (a scheduler fills each group's in place)
            g["lr"] = lr.detach().clone() if isinstance(lr, torch.Tensor) else lr
        g.update({k[len("adamw_"):]: v for k, v in extra.items() if k.startswith("adamw_")})
        return g

    def complete(self, group: dict[str, Any]) -> None:
        """Fills one of DMuon's groups (with its ``algorithm``) with the defaults it leaves out, after checking
        the algorithm and that a ``"muon"`` group holds Muon matrices only."""
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
        algorithm = group["algorithm"]
        if algorithm == "muon":
            names = self.names()
            for p in tensors:
                if not self.matrices.holds(p, names.get(id(p))):
                    raise ValueError("a 'muon' param group holds a parameter that is not in the plan")
            defaults = self.muon_defaults
        elif algorithm == "adamw":
            defaults = self.adamw_defaults
        else:
            raise ValueError(f"param group algorithm must be 'muon' or 'adamw', got {algorithm!r}")
        for key, value in defaults.items():
            group.setdefault(key, value)


def named_group(group: dict[str, Any]) -> bool:
    """Whether a torch.optim-style group names its parameters (``(name, param)`` pairs or ``param_names``).

    Raises:
        ValueError: torch.optim's, for a group where some parameters are named and some not.
    """
    raw = group.get("params", ())
    if isinstance(raw, (set, frozenset)) or not isinstance(raw, (torch.Tensor, list, tuple)) and \
            not hasattr(raw, "__iter__"):
        return "param_names" in group  # refused by the split, as in torch.optim
    if isinstance(raw, torch.Tensor):
        raw = [raw]
    elif not isinstance(raw, (list, tuple)):
        raw = group["params"] = list(raw)  # a generator, read once
    pairs = [isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) for item in raw]
    if any(pairs) and not all(pairs):
        raise ValueError("all optimizer params should be with/without names. Some param names are missing")
    return all(pairs) and bool(pairs) or "param_names" in group


def check_named_alike(named: bool, optimizer_named: bool) -> None:
    """Raises torch.optim's ``ValueError`` for a group named otherwise than the optimizer's groups (by the
    user: DMuon names every half from the model either way)."""
    if named != optimizer_named:
        raise ValueError("all optimizer param groups should be with/without names. "
                         f"cannot add param group {'with' if named else 'without'} names to the optimizer")


def _params_and_labels(group: dict[str, Any], index: int, names: dict[int, str]) -> tuple[list, list]:
    """A group's tensors and their names (a ``(name, param)`` pair's, the group's ``param_names``, else the
    model's; None for a tensor that is not the model's)."""
    raw = group["params"]
    if isinstance(raw, (set, frozenset)):
        raise TypeError("optimizer parameters need to be organized in ordered collections (a list), "
                        "not a set, as in torch.optim")
    raw = [raw] if isinstance(raw, torch.Tensor) else list(raw)
    given = group.get("param_names")
    if given is not None and len(given) != len(raw):
        raise ValueError(f"param group {index}: {len(given)} param_names for {len(raw)} params")
    params, labels = [], []
    for k, item in enumerate(raw):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            label, p = item
        else:
            p, label = item, (given[k] if given is not None else None)
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"param group {index}: DMuon can only optimize tensors, got {type(p).__name__}")
        params.append(p)
        labels.append(label if label is not None else names.get(id(p)))
    return params, labels


def _half(params: list, labels: list, members: list[int], algorithm: str, keys: dict) -> dict[str, Any]:
    half = {"params": [params[k] for k in members], "algorithm": algorithm, **keys}
    if all(labels[k] is not None for k in members):
        half["param_names"] = [labels[k] for k in members]
    return half
