"""dmuon: owner-centric Muon for PyTorch FSDP2 and HSDP.

Typical use::

    plan = dmuon.prepare(model, mesh, zero=3)
    for block in model.layers:
        fully_shard(block, mesh=mesh, ignored_params=plan.matrices)
    fully_shard(model, mesh=mesh, ignored_params=plan.matrices)
    opt = dmuon.DMuon(model, plan, lr=0.02, adamw_lr=3e-4)
"""

from dmuon.fsdp.runtime import full_weights
from dmuon.optim.clip import clip_grad_norm_
from dmuon.optim.dmuon import DMuon
from dmuon.plan.plan import Plan
from dmuon.prepare import prepare

__all__ = ["DMuon", "Plan", "clip_grad_norm_", "full_weights", "prepare"]
__version__ = "0.1.0"
