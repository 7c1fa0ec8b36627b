"""Offline models of what a training step moves and costs at cluster scale.

Per-rank traffic (:mod:`~dmuon.costmodel.rank_traffic`), one step collective by
collective with its alpha-beta time (:mod:`~dmuon.costmodel.collectives`), both
importable from :mod:`~dmuon.costmodel.traffic`, and plans from shape lists alone
(:mod:`~dmuon.costmodel.offline`). Used by ``dmuon plan``, ``dmuon bench`` and the
tests, never by the runtime or the optimizer: they read the plan
(:mod:`dmuon.plan`), which does not import this package.
"""
