"""What :class:`dmuon.DMuon`'s arguments mean, and their checks: the model and its groups from the first
argument, AdamW's settings (:class:`AdamWConfig`), the one NS configuration, and the keywords whose
settings live in a typed config (each refused with the config that holds it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dmuon.ortho.config import NSConfig
from dmuon.plan.plan import Plan
from dmuon.rules.adamw import ADAMW_GROUP_DEFAULTS
from dmuon.rules.qk_clip import QKClip
from dmuon.runtime import ExecutionConfig

NEEDS_THE_MODEL = (
    "DMuon needs the model, not only its parameters: it reads the module tree (which blocks fully_shard "
    "manages, the meshes) to give each matrix one owner. Pass DMuon(model, ...), or with parameter groups "
    "or (name, param) pairs DMuon(groups, module=model, ...); the HF Trainer: "
    "optimizer_cls_and_kwargs=(dmuon.DMuon, {'module': model, ...}); torchtitan: "
    "examples/integrations/torchtitan_container.py"
)

SETTINGS_ELSEWHERE = {
    **{f"adamw_{key}": f"adamw=dmuon.AdamWConfig({key}=...)"
       for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")},
    "ns_method": "ns=dmuon.NSConfig(method=...)",
    "ns_dtype": "ns=dmuon.NSConfig(dtype=...)",
    **{key: f"execution=dmuon.ExecutionConfig({key}=...)"
       for key in ("overlap", "nonfinite", "ns_in_backward", "post_optim_event", "return_waves")},
    "param_groups": "the groups as the first argument, DMuon(groups, module=model)",
}
"""Keywords DMuon does not take, each with where its setting goes."""


def refuse_settings_elsewhere(optimizer: str, keywords: Mapping[str, Any]) -> None:
    """Raises ``TypeError`` for a keyword of :data:`SETTINGS_ELSEWHERE`, naming where its setting goes."""
    for key in keywords:
        if key in SETTINGS_ELSEWHERE:
            raise TypeError(f"{optimizer}() got an unexpected keyword argument {key!r}: "
                            f"pass {SETTINGS_ELSEWHERE[key]}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_tensor_lr(lr: Any, name: str = "lr") -> None:
    """Raises torch.optim's ``ValueError`` for a tensor learning rate of more than one element."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"Tensor lr must be 1-element ({name} has {lr.numel()})")


def check_nonnegative(**values: Any) -> None:
    """Raises ``ValueError`` naming the first value that is not ``>= 0`` (NaN included)."""
    for name, value in values.items():
        if not value >= 0.0:
            raise ValueError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW's settings (``torch.optim.AdamW``'s, decoupled weight decay) for every parameter Muon does
    not update: biases, norms, embeddings, heads. A param group's ``adamw_<key>`` overrides them there.

    Raises:
        ValueError: Naming the field, for a value out of its range.
    """

    lr: float | None = None
    """Learning rate; None: Muon's ``lr`` (and a group's ``lr`` reaches its AdamW half too)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """The first and second moments' decays, each in ``[0, 1)``."""
    eps: float = 1e-8
    """Added to the second moment's root (``>= 0``)."""
    weight_decay: float = 0.01
    """Decoupled weight decay (``>= 0``)."""
    amsgrad: bool = False
    """torch.optim.AdamW's ``amsgrad``: the step divides by the largest second moment so far."""
    maximize: bool = False
    """torch.optim.AdamW's ``maximize``: ascend the objective."""

    def __post_init__(self) -> None:
        check_tensor_lr(self.lr, "AdamWConfig.lr")
        for name in ("amsgrad", "maximize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"AdamWConfig.{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("lr", "eps", "weight_decay"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor) and name == "lr":
                value = value.item()  # 1-element (checked above)
            if not (value is None and name == "lr" or _number(value) and value >= 0.0):
                raise ValueError(f"AdamWConfig.{name} must be a number >= 0{' or None' if name == 'lr' else ''}, "
                                 f"got {value!r}")
        betas = self.betas
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2
                and all(_number(b) and 0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"AdamWConfig.betas must be two numbers in [0, 1), got {betas!r}")
        object.__setattr__(self, "betas", tuple(betas))  # frozen and hashable: a list (JSON, YAML) as a tuple

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | AdamWConfig | None) -> AdamWConfig:
        """An ``AdamWConfig`` from a dict of its fields (an ``AdamWConfig`` passes through; None: defaults).

        Raises:
            ValueError: Naming every unknown key. TypeError: For anything but a mapping, an ``AdamWConfig`` or None.
        """
        if values is None or isinstance(values, AdamWConfig):
            return values or cls()
        if not isinstance(values, Mapping):
            raise TypeError(f"adamw must be a dmuon.AdamWConfig or a dict of its fields, got {type(values).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(f"adamw: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                             f"(allowed: {', '.join(names)})")
        return cls(**values)

    def group_defaults(self, muon_lr: float) -> dict[str, Any]:
        """The keys an AdamW param group leaves out, as torch.optim.AdamW's (``lr`` None: ``muon_lr``)."""
        lr = self.lr
        if lr is None:
            # A tensor lr is the AdamW half's own tensor (a scheduler fills each group's in place).
            lr = muon_lr.detach().clone() if isinstance(muon_lr, torch.Tensor) else muon_lr
        return dict(lr=lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                    **{**ADAMW_GROUP_DEFAULTS, "amsgrad": self.amsgrad, "maximize": self.maximize})


def model_and_groups(model: Any, module: Any) -> tuple[nn.Module, list[dict[str, Any]] | None]:
    """The model and the user's groups (None: every parameter in one) from DMuon's first argument and ``module=``."""
    if module is not None and not isinstance(module, nn.Module):
        raise TypeError(f"module= must be the model (an nn.Module), got {type(module).__name__}")
    if isinstance(model, nn.Module):
        if module is not None and module is not model:
            raise TypeError("DMuon got two models (model and module=); pass the model once")
        return model, None
    if model is None:
        if module is None:
            raise TypeError(NEEDS_THE_MODEL)
        return module, None
    if isinstance(model, torch.Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                        "but got a tensor: DMuon's first argument must be the model or an iterable of parameters "
                        f"or groups; {NEEDS_THE_MODEL}")
    if isinstance(model, (set, frozenset)):
        raise TypeError("parameters need an ordered collection (a list), not a set, as in torch.optim")
    try:
        groups = list(model)
    except TypeError:
        raise TypeError(f"DMuon's first argument must be the model or an iterable of parameters or groups, "
                        f"got {type(model).__name__}") from None
    if module is None:
        raise TypeError(NEEDS_THE_MODEL)
    if not groups:
        raise ValueError("optimizer got an empty parameter list")
    return module, groups if isinstance(groups[0], dict) else [{"params": groups}]


def check_plan_inputs(plan: Any, hsdp_mesh: Any, qk_clip: Any) -> None:
    """Raises ``ValueError`` for a ``plan`` that is not a :class:`Plan`, an ``hsdp_mesh`` other than the
    plan's, or a ``qk_clip`` that is not a :class:`QKClip`."""
    if plan is not None and not isinstance(plan, Plan):
        raise ValueError(f"plan must be the Plan returned by dmuon.prepare, got {type(plan).__name__}")
    if plan is not None and hsdp_mesh is not None and hsdp_mesh != plan.hsdp_mesh:
        raise ValueError("hsdp_mesh differs from the plan's; pass it to dmuon.prepare(hsdp_mesh=...)")
    if qk_clip is not None and not isinstance(qk_clip, QKClip):
        raise ValueError(f"qk_clip must be a dmuon.QKClip, got {type(qk_clip).__name__}")


def pipeline_group(pp_group: Any):
    """``DMuon(pp_group=...)`` as a process group (None stays None): a 1-D DeviceMesh's group, or a
    process group this rank belongs to; ``ValueError`` naming ``pp_group`` for anything else."""
    if pp_group is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(pp_group, DeviceMesh):
        if pp_group.ndim != 1:
            raise ValueError(f"pp_group must be a 1-D DeviceMesh (world_mesh['pp']), got {pp_group.ndim} dims")
        return pp_group.get_group()
    if not isinstance(pp_group, dist.ProcessGroup):
        raise ValueError(f"pp_group must be a 1-D DeviceMesh or a ProcessGroup, got {type(pp_group).__name__}")
    if dist.get_rank(pp_group) < 0:
        raise ValueError("pp_group is a process group this rank is not in; pass the group of this rank's "
                         "pipeline peers (world_mesh['pp'])")
    return pp_group


def check_execution(execution: Any) -> ExecutionConfig:
    """``execution`` (None: the defaults); ``ValueError`` for anything but an :class:`ExecutionConfig`."""
    if execution is None:
        return ExecutionConfig()
    if not isinstance(execution, ExecutionConfig):
        raise ValueError(f"execution must be a dmuon.ExecutionConfig, got {type(execution).__name__}")
    return execution


def resolve_ns(plan: Plan | None, ns: NSConfig | None, **keywords: Any) -> NSConfig:
    """The one NS configuration from ``ns=``, torch.optim.Muon's NS keywords and the plan; errors name what
    differs."""
    if ns is not None and not isinstance(ns, NSConfig):
        raise ValueError(f"ns must be a dmuon.NSConfig, got {type(ns).__name__}")
    base = ns if ns is not None else None if plan is None else plan.ns
    resolved = NSConfig.from_keywords(base, **keywords)
    if ns is not None and resolved != ns:
        raise ValueError("the NS keywords contradict ns= (" + "; ".join(resolved.differences(ns))
                         + "); set each NS field in one place")
    if plan is not None and resolved != plan.ns:
        raise ValueError(
            "the NS keywords differ from the plan's NS configuration, which its costs were priced with ("
            + "; ".join(resolved.differences(plan.ns)) + "); pass ns=dmuon.NSConfig(...) to dmuon.prepare instead")
    return resolved
