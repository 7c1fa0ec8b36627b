"""The simulation's host operation counts (:class:`dmuon.costmodel.host.HostOps`) against the code:
one optimizer step of each bench configuration on 2 gloo ranks, its operations counted (not timed)."""

from __future__ import annotations

import pytest

from dmuon.bench.shapes import bench_model_shapes
from dmuon.bench.tests._host_ops_worker import count_step
from dmuon.costmodel.host import HostOps
from support.spawn import run_distributed

OPS = HostOps()
MATRICES = sum(g.count for g in bench_model_shapes("qwen2", "tiny") if g.muon)


@pytest.mark.parametrize("config", ["adamw", "gather", "dmuon_z3"])
def test_host_op_counts_match_the_code_paths(config):
    result = run_distributed(count_step, 2, config, timeout_s=300)[0]
    counts, tensors = result["counts"], result["tensors"]
    plain, dtensor = counts.get("plain", 0), counts.get("dtensor", 0)
    if config == "adamw":
        # torch.optim.AdamW's per-tensor loop on CPU (and its profiler record's enter and exit).
        assert dtensor == OPS.adamw_per_tensor.dtensor * tensors
        assert plain == OPS.adamw_per_tensor.plain * tensors + 2
    elif config == "gather":
        others = tensors - MATRICES
        assert dtensor == OPS.gather_per_matrix.dtensor * MATRICES
        expected = (OPS.gather_per_matrix.plain * MATRICES + OPS.local_foreach_adamw.plain
                    + OPS.foreach_adamw_per_tensor.plain * others)
        assert plain == pytest.approx(expected, rel=0.05)
    else:
        assert dtensor == 0
        assert plain == pytest.approx(OPS.dmuon_per_step.plain + OPS.dmuon_per_matrix.plain * MATRICES, rel=0.1)
