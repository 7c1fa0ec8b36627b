"""What the tests share and the library does not ship: odd-shaped models, distributed training
cases, single-process references, fault and checkpoint scenarios (run inside spawned ranks).

Importable as ``support`` through pytest's ``pythonpath = ["tests"]`` (pyproject.toml), in the
test processes and in the ranks they spawn (the spawn start method hands the children
``sys.path``). Spawning ranks is :mod:`support.spawn` (:mod:`dmuon.testing.spawn` with a recorded retry
after a native crash); live-bytes measurement is :mod:`dmuon.bench.memory`.
"""
