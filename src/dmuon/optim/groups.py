"""DMuon's param groups: each torch.optim-style group split into a Muon half and an AdamW half, and the
checks on a group's keys (a mixin of :class:`dmuon.optim.dmuon.DMuon`, which holds the plan, the NS
configuration, the model and the defaults these read)."""

from __future__ import annotations

from typing import Any

import torch

from dmuon.ortho.owner import GROUP_KEYS
from dmuon.rules.muon import RULE_DEFAULTS, check_rule_settings


def _as_tuples(value: Any) -> Any:
    """Lists as tuples, recursively: a state dict's round trip (DCP, JSON) turns tuples into lists."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


MUON_KEYS = ("momentum", "nesterov", "adjust_lr_fn", *RULE_DEFAULTS, *GROUP_KEYS)
"""Param-group keys only the Muon half of a group reads (``eps`` is Muon's NS eps, as in torch.optim.Muon)."""
ADAMW_KEYS = ("betas", "foreach", "fused", "amsgrad", "maximize", "capturable", "differentiable",
              "decoupled_weight_decay")
"""torch.optim.AdamW's keys that Muon has no use for: a group's go to its AdamW half as they are."""
_WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def canonical_name(name: str) -> str:
    """A parameter's name without the parts wrappers insert (activation checkpointing's
    ``_checkpoint_wrapped_module``, ``torch.compile``'s ``_orig_mod``, FSDP1's
    ``_fsdp_wrapped_module``), as torch's distributed state dicts name it."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


class ParamGroups:
    """The param-group half of :class:`~dmuon.optim.dmuon.DMuon`: which parameter goes to which rule, with
    which keys, and the checks that name a group's bad key. Reads the optimizer's ``_index`` (the plan's
    matrices by parameter), ``_lazy_muon`` (before setup: the names chosen), ``ns``, ``model``,
    ``_adamw_lr_given``, ``_muon_defaults``, ``_adamw_defaults`` and ``_rule_defaults()``."""

    def matrix_indices(self, param: torch.Tensor) -> list[int]:
        """The plan indices of ``param``'s matrices (several for a stack of experts or row groups)."""
        return self._index[id(param)]

    def check_ns_keys(self, group: dict[str, Any]) -> None:
        """Raises ``ValueError`` naming the group and key when a Muon group's NS setting differs from ``self.ns``.

        The plan priced (or measured) every owner's work with one NS configuration, and
        the owners batch matrices across groups, so a per-group NS setting is refused.
        """
        for key, field in GROUP_KEYS.items():
            if key in group and _as_tuples(group[key]) != getattr(self.ns, field):
                # A group being added gets the next index.
                index = next((k for k, g in enumerate(self.param_groups) if g is group), len(self.param_groups))
                raise ValueError(
                    f"param group {index}: {key}={group[key]!r} differs from the NS configuration the plan was "
                    f"priced with ({field}={getattr(self.ns, field)!r}); NS settings apply to every matrix: "
                    "set them with DMuon(ns=dmuon.NSConfig(...)) or dmuon.prepare(ns=...)"
                    + ("; AdamW's epsilon is the group key adamw_eps" if key == "eps" else ""))

    def check_rule_keys(self, group: dict[str, Any]) -> None:
        """Raises ``ValueError`` naming the group and key for a Muon group's bad ``adjust_lr_fn``,
        ``extra_scale_factor`` or ``cautious_weight_decay``."""
        index = next((k for k, g in enumerate(self.param_groups) if g is group), len(self.param_groups))
        check_rule_settings(group["adjust_lr_fn"], group["extra_scale_factor"], group["cautious_weight_decay"],
                            f"param group {index}: ")

    def _is_muon(self, param: torch.Tensor, name: str | None) -> bool:
        """Whether ``param`` is a Muon matrix: in the plan, or before setup chosen by the default rule."""
        if self._lazy_muon is None:
            return id(param) in self._index
        return name is not None and name in self._lazy_muon

    def split_group(self, group: dict[str, Any], index: int = 0,
                    names: dict[int, str] | None = None) -> list[dict[str, Any]]:
        """A torch.optim-style param group as DMuon's: a Muon group and an AdamW group (either may be absent).

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
          ``adamw_lr`` nor DMuon's ``adamw_lr=`` is given (as DMuon's ``lr`` does).
        * any other key (yours): both halves.

        Keys a half does not set come from DMuon's keywords (``lr``, ``weight_decay``,
        ... for Muon; ``adamw_lr``, ``adamw_weight_decay``, ... for AdamW).
        """
        if "params" not in group:
            raise ValueError("every param group needs a 'params' entry")
        if "algorithm" in group:
            return [dict(group)]  # already one of DMuon's (add_param_group checks it)
        raw = group["params"]
        if isinstance(raw, (set, frozenset)):
            raise TypeError("optimizer parameters need to be organized in ordered collections (a list), "
                            "not a set, as in torch.optim")
        raw = [raw] if isinstance(raw, torch.Tensor) else list(raw)
        given = group.get("param_names")
        if given is not None and len(given) != len(raw):
            raise ValueError(f"param group {index}: {len(given)} param_names for {len(raw)} params")
        if names is None:
            names = {id(p): canonical_name(n) for n, p in self.model.named_parameters()}
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
        muon = [k for k, p in enumerate(params) if self._is_muon(p, names.get(id(p), labels[k]))]
        other = [k for k in range(len(params)) if k not in set(muon)]
        extra = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        out = []
        if muon:
            g = {k: v for k, v in extra.items() if not k.startswith("adamw_") and k not in ADAMW_KEYS}
            out.append(self._half(params, labels, muon, "muon", g))
        if other:
            g = {k: v for k, v in extra.items()
                 if not k.startswith("adamw_") and k not in MUON_KEYS + tuple(self._rule_defaults())
                 and k not in ("lr", "weight_decay")}
            if "weight_decay" in extra:
                g["weight_decay"] = extra["weight_decay"]
            if "lr" in extra and not self._adamw_lr_given:
                g["lr"] = extra["lr"]
            g.update({k[len("adamw_"):]: v for k, v in extra.items() if k.startswith("adamw_")})
            out.append(self._half(params, labels, other, "adamw", g))
        return out

    @staticmethod
    def _half(params: list, labels: list, members: list[int], algorithm: str, keys: dict) -> dict[str, Any]:
        half = {"params": [params[k] for k in members], "algorithm": algorithm, **keys}
        if all(labels[k] is not None for k in members):
            half["param_names"] = [labels[k] for k in members]
        return half

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group, as torch.optim does: a torch.optim-style group is split as the constructor splits
        them (:meth:`split_group`: a Muon half, an AdamW half); one with DMuon's ``algorithm`` key is added
        as it is, after checking its parameters are of that kind."""
        if "algorithm" not in param_group:
            named = all("param_names" in g for g in self.param_groups)
            for half in self.split_group(param_group, index=len(self.param_groups)):
                if not named:
                    half.pop("param_names", None)
                self.add_param_group(half)
            return
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
        algorithm = param_group["algorithm"]
        if algorithm == "muon":
            names = {id(p): canonical_name(n) for n, p in self.model.named_parameters()}
            for p in tensors:
                if not self._is_muon(p, names.get(id(p))):
                    raise ValueError("a 'muon' param group holds a parameter that is not in the plan")
            defaults = self._muon_defaults
        elif algorithm == "adamw":
            defaults = self._adamw_defaults
        else:
            raise ValueError(f"param group algorithm must be 'muon' or 'adamw', got {algorithm!r}")
        for key, value in defaults.items():
            param_group.setdefault(key, value)
        if algorithm == "muon":
            self.check_ns_keys(param_group)
            self.check_rule_keys(param_group)
        saved, self.defaults = self.defaults, {}
        try:
            super().add_param_group(param_group)
        finally:
            self.defaults = saved
