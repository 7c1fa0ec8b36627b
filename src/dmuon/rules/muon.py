"""The per-matrix Muon update rule, exactly as ``torch.optim.Muon`` applies it.

Kept apart from the distributed runtime: given a reduced gradient and the
owner's momentum buffer, these functions produce the new weights.
"""

from __future__ import annotations

import math

import torch

ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped", "unscaled")
"""The shape scalings of the step, for an ``(m, n)`` matrix (rows ``m`` = fan-out):

* ``None``/``"original"``: ``sqrt(max(1, m / n))`` (torch.optim.Muon's default, Keller Jordan's rule);
* ``"match_rms_adamw"``: ``0.2 * sqrt(max(m, n))`` (torch.optim.Muon; Moonshot's rule);
* ``"spectral_unclamped"``: ``sqrt(m / n)``, below 1 for wide matrices too (torchtitan's
  ``adjust_lr_fn`` of that name, dion's ``adjust_lr="spectral_norm"``, Emerging-Optimizers'
  ``scale_mode="unit_rms_norm"``);
* ``"unscaled"``: 1 (dion's ``adjust_lr=None``; torch's ``None`` means ``"original"``).
"""


def adjusted_lr(lr: float, adjust_lr_fn: str | None, matrix_shape: tuple[int, int]) -> float:
    """The learning rate scaled for a matrix's shape (:data:`ADJUST_LR_FNS`).

    Raises:
        ValueError: For an ``adjust_lr_fn`` not in :data:`ADJUST_LR_FNS`.
    """
    rows, cols = matrix_shape
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))  # torch.optim.Muon's order: bit-identical steps
    if adjust_lr_fn == "spectral_unclamped":
        return lr * math.sqrt(rows / cols)
    if adjust_lr_fn == "unscaled":
        return lr
    raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")


def scalar_lr(lr: float | torch.Tensor) -> float | torch.Tensor:
    """A group's learning rate as torch.optim.Muon uses it (``torch.optim.optimizer._to_scalar``): a
    float as it is, a 1-element tensor (``lr=torch.tensor(0.02)``) as a 0-dim one, so that the decay
    factor and the step's ``alpha`` are computed by the same tensor arithmetic as torch's."""
    if isinstance(lr, torch.Tensor) and lr.dim() != 0:
        return lr.squeeze()
    return lr


RULE_DEFAULTS = {"extra_scale_factor": 1.0, "cautious_weight_decay": False}
"""Muon group keys added after torch.optim.Muon's, and the value a state dict saved without them means
(torch's rule: ``apply_update``'s defaults)."""


def fill_rule_defaults(param_groups: list[dict]) -> None:
    """Gives the Muon groups of a state loaded from before :data:`RULE_DEFAULTS`' keys existed
    their values (torch.optim's way for keys added later, as Adam's ``amsgrad``: the state loads
    with the values that reproduce what it was trained with)."""
    for group in param_groups:
        if group.get("algorithm") == "muon":
            for key, value in RULE_DEFAULTS.items():
                group.setdefault(key, value)


def check_rule_settings(adjust_lr_fn: object, extra_scale_factor: object, cautious_weight_decay: object,
                        where: str = "") -> None:
    """Raises ``ValueError`` naming the setting (after ``where``, e.g. ``"param group 2: "``) for a bad value."""
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"{where}Adjust learning rate function {adjust_lr_fn} is not supported (torch.optim.Muon's "
                         f"words): adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
    if isinstance(extra_scale_factor, bool) or not isinstance(extra_scale_factor, (int, float)) \
            or not math.isfinite(extra_scale_factor) or extra_scale_factor < 0:
        raise ValueError(f"{where}extra_scale_factor must be a finite number >= 0, got {extra_scale_factor!r}")
    if not isinstance(cautious_weight_decay, bool):
        raise ValueError(f"{where}cautious_weight_decay must be True or False, got {cautious_weight_decay!r}")


def momentum_update(
    grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool
) -> torch.Tensor:
    """Advances ``buf`` in place and returns the direction to orthogonalize."""
    buf.lerp_(grad.to(buf.dtype), 1 - momentum)
    return grad.to(buf.dtype).lerp(buf, momentum) if nesterov else buf


def peek_direction(
    grad: torch.Tensor, buf: torch.Tensor | None, momentum: float, nesterov: bool
) -> torch.Tensor:
    """The direction :func:`momentum_update` would return, leaving ``buf`` as it is.

    Same kernels on the same numbers, so the result is bit-identical to the
    committed update's (``buf=None`` stands for a fresh zero buffer).
    """
    grad = grad.to(torch.float32 if buf is None else buf.dtype)
    # Out of place, the same elementwise kernel as ``lerp_``: bit-identical, one pass fewer than a clone.
    advanced = (torch.zeros_like(grad) if buf is None else buf).lerp(grad, 1 - momentum)
    return grad.lerp(advanced, momentum) if nesterov else advanced


def apply_update(
    param: torch.Tensor,
    ortho: torch.Tensor,
    *,
    lr: float,
    weight_decay: float,
    adjust_lr_fn: str | None,
    matrix_shape: tuple[int, int],
    extra_scale_factor: float = 1.0,
    cautious_weight_decay: bool = False,
    alpha: float | None = None,
) -> None:
    """Decoupled weight decay with the raw lr, then the shape-adjusted step.

    ``param <- param - lr * weight_decay * mask * param - adjusted_lr * extra_scale_factor * ortho``,
    ``mask`` all ones, or with ``cautious_weight_decay`` 1 where ``param * ortho >= 0`` (the update
    and the weight share a sign, or one is zero) and 0 elsewhere, taken before either change:
    ``alpha``: the step's ``-adjusted_lr * extra_scale_factor`` already on the host (a tensor ``lr``: read
    once for every matrix, :class:`HostAlphas`; None computes it here, a device read for a tensor ``lr``);
    microsoft/dion's ``cautious_wd=True`` (``muon_update_post_orthogonalize``), modded-nanogpt's
    and nanochat's mask (Chen et al., arXiv:2510.12402). ``extra_scale_factor`` multiplies the step
    only, not the decay (NVIDIA Emerging-Optimizers' ``extra_scale_factor``).
    """
    ortho = ortho.view(param.shape)
    if cautious_weight_decay:
        # A tensor lr is not read to ask: a zero decay subtracts zeros, the same weights.
        if isinstance(lr, torch.Tensor) or lr * weight_decay:
            # The mask from the weight before decay, as dion and modded-nanogpt take it.
            param.sub_(param * ((param * ortho) >= 0) * (lr * weight_decay))
    else:
        param.mul_(1 - lr * weight_decay)
    # As torch.optim.Muon: the NS-dtype update added as is (promoted inside the kernel, no copy);
    # extra_scale_factor=1.0 leaves alpha, so the result stays bit-identical to torch's.
    if alpha is None:
        alpha = -adjusted_lr(lr, adjust_lr_fn, matrix_shape) * extra_scale_factor
    param.add_(ortho, alpha=alpha)


class HostAlphas:
    """Each matrix's step ``-adjusted_lr * extra_scale_factor`` on the host, for groups whose ``lr`` is a tensor.

    ``add_(alpha=...)`` takes a Python number: a tensor ``lr`` (on an accelerator) handed to it reads the device,
    which waits for everything queued before it, once per matrix (and under ``apply_updates="next_forward"``
    inside each unit's forward). Here every matrix's value is computed on the device with the same ops
    (the same bits: torch.optim.Muon's) and read in one ``tolist()``, again only once an ``lr`` changed in
    place (a scheduler's ``fill_``: its version counter) or a group's keys did: one read per step at most.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._kept: list[torch.Tensor] = []  # the lrs the key names, alive while it names them (ids not reused)
        self._alphas: dict[int, float] = {}

    def get(self, groups: dict[int, dict], shapes: dict[int, tuple[int, int]]) -> dict[int, float]:
        """Per matrix index of ``groups`` (index -> its group) whose ``lr`` is a tensor, its alpha;
        ``shapes``: index -> the matrix's shape."""
        seen: dict[int, dict] = {}
        for group in groups.values():
            if isinstance(group["lr"], torch.Tensor):
                seen.setdefault(id(group), group)
        if not seen:
            return {}
        key = tuple((k, id(g["lr"]), g["lr"]._version, g["adjust_lr_fn"], g["extra_scale_factor"])
                    for k, g in seen.items()) + (tuple(groups), )
        if key != self._key:
            values: dict[tuple[int, tuple[int, int]], torch.Tensor] = {}
            order = []
            for i, group in groups.items():
                if id(group) in seen:
                    at = (id(group), tuple(shapes[i]))
                    if at not in values:
                        values[at] = -adjusted_lr(scalar_lr(group["lr"]), group["adjust_lr_fn"],
                                                  shapes[i]) * group["extra_scale_factor"]
                    order.append((i, at))
            slots = list(values)
            read = torch.stack([values[at].reshape(()).double() for at in slots]).tolist()  # the one read (exact)
            by_slot = dict(zip(slots, read))
            self._alphas = {i: by_slot[at] for i, at in order}
            self._key, self._kept = key, [g["lr"] for g in seen.values()]
        return self._alphas


def rescaled_direction(launched: torch.Tensor, momentum_before: torch.Tensor, scale: float, momentum: float,
                       nesterov: bool) -> torch.Tensor:
    """The direction for the gradient ``scale * g`` from the one :func:`peek_direction` gave for ``g``.

    Both are linear in the gradient with the same momentum part: with ``buf`` the momentum
    before the step, Nesterov's direction is ``mu^2 buf + (1 - mu^2) g`` and the plain one
    ``mu buf + (1 - mu) g``, so the direction for ``scale * g`` is
    ``scale * launched + (1 - scale) * K * buf`` with ``K = mu^2`` (Nesterov) or ``mu``
    (float32; equal to torch's up to rounding, see :func:`momentum_after`).
    """
    k = momentum * momentum if nesterov else momentum
    return launched.float().mul(scale).add_(momentum_before, alpha=(1.0 - scale) * k)


def momentum_after(momentum_before: torch.Tensor, direction: torch.Tensor, momentum: float,
                   nesterov: bool) -> torch.Tensor:
    """Advances ``momentum_before`` in place to the momentum after a step whose direction was
    ``direction``, without the gradient: ``(mu buf + d) / (1 + mu)`` (Nesterov, since
    ``d = mu^2 buf + (1 - mu^2) g`` and the new ``buf = mu buf + (1 - mu) g``), ``d`` (plain).

    An owner keeps its matrices' whole momentum this way from the directions it receives: an error
    ``e`` in it (the wire's rounding of ``d``) shrinks by ``mu / (1 + mu) < 1/2`` a step, so it stays
    within the largest rounding of the recent directions.
    """
    if nesterov:
        # buf + (d - buf) / (1 + mu) = (mu buf + d) / (1 + mu), in one pass.
        return momentum_before.lerp_(direction.float(), 1.0 / (1.0 + momentum))
    return momentum_before.copy_(direction)
