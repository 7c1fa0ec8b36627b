"""dmuon: owner-centric Muon for PyTorch FSDP2 and HSDP.

Typical use, exactly as for AdamW plus one line::

    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = dmuon.DMuon(model, lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-4))

``dmuon.prepare(model, balancer=..., profile=..., ns=dmuon.NSConfig(...))``
(after ``fully_shard``) makes a plan with non-default options to pass as
``DMuon(model, plan)``; ``DMuon(..., execution=dmuon.ExecutionConfig(...))``
sets when the runtime moves and computes, ``adamw=dmuon.AdamWConfig(...)`` AdamW's settings; ``DMuon(..., qk_clip=dmuon.QKClip(...))``
adds QK-clip (MuonClip) to the step. ``dmuon.NorMuon``, ``dmuon.MuonH`` and ``dmuon.Dion2``
run those rules on the same runtime.
"""

from dmuon.optim.dion2 import Dion2
from dmuon.optim.dmuon import DMuon
from dmuon.optim.muonh import MuonH
from dmuon.optim.normuon import NorMuon
from dmuon.optim.settings import AdamWConfig
from dmuon.ortho.config import NSConfig
from dmuon.plan.plan import Plan
from dmuon.prepare import prepare
from dmuon.rules.qk_clip import AttentionHeads, QKClip
from dmuon.runtime.config import ExecutionConfig

__all__ = ["AdamWConfig", "AttentionHeads", "DMuon", "Dion2", "ExecutionConfig", "MuonH", "NSConfig", "NorMuon", "Plan", "QKClip",
           "prepare"]
__version__ = "0.1.0"
