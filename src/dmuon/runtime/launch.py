"""A block's direction exchange started in backward (:mod:`dmuon.runtime.backward`), as ``step()`` settles it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dmuon.comm import Pending


@dataclass
class Launch:
    """A block's direction exchange started in backward."""

    block: int
    members: list[int]
    """Matrices whose gradients had landed, in plan order."""
    sent: dict[int, torch.Tensor]
    """This rank's part of each member's direction, as sent."""
    pending: Pending
    """The exchange; ``wait()`` gives the owned whole directions."""
    rows: dict[int, torch.Tensor] | None = None
    """With a row state: this rank's rows of each member's row state, as sent."""
    grads: dict[int, torch.Tensor] | None = None
    """While the owners' momentum copies serve (``OwnerMomentum.ready``): a copy of this rank's part of
    each member's local gradient as launched (on the replicate level its reduced form), for ``step()``
    to prove a uniform rescale, bit for bit, before the owners rescale the launch."""
    grad_extrema: dict[int, torch.Tensor] | None = None
    """With ``clipped_overlap``, while the copies do not serve: each part's least and largest element as
    launched (:func:`~dmuon.runtime.gradients.extrema`), for ``step()`` to recognise the first rescale
    (then the owners start keeping the momentum)."""
    returned: Pending | None = None
    """With ``returns_in_backward``: the return of the owners' updates from this launch's directions,
    issued in backward (``wait()`` gives this rank's rows of them); None until then."""
    hops_issued: bool = False
    """Every hop of the directions has been issued (by the last block landing, or the launch itself):
    with ``returns_in_backward`` the return follows at the next landing."""
