"""Reading a sharded model into an ownership plan (:func:`prepare`).

* :mod:`dmuon.prepare.build`: :func:`prepare`, its steps in order;
* :mod:`dmuon.prepare.mesh`: the model's mesh, HSDP kind, device and blocks, checked alike on
  every rank; :func:`momentum_layout`, the momentum's DTensor layout on HSDP;
* :mod:`dmuon.prepare.pieces`: where each rank's shard of each matrix sits;
* :mod:`dmuon.prepare.ddp`: torch's DistributedDataParallel found and checked;
* :mod:`dmuon.prepare.setup`: which parallelism (FSDP2, DDP, not sharded yet) an optimizer steps
  its model under, decided once (:class:`~dmuon.prepare.setup.Setup`).
"""

from dmuon.prepare.build import prepare
from dmuon.prepare.mesh import momentum_layout

__all__ = ["momentum_layout", "prepare"]
