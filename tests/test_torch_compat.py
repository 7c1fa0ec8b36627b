"""dmuon.util.torch_compat: every private torch API and FSDP2 behaviour dmuon relies on, exercised for real.

Two gloo ranks build a small FSDP2 model and DTensors and call each wrapper; each check returns an
error message (naming the torch version) instead of raising, so every wrapper's test reports on its
own. The last tests make each private API "move" (monkeypatched away) and check the wrapper's error.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmuon.util import torch_compat
from support.spawn import run_distributed

pytestmark = pytest.mark.compat
WORLD = 2
TORCH = f"torch {torch.__version__}"


def _model(mesh, layers: int = 3) -> nn.Module:
    """A stack of Linear blocks, each fully_shard-ed, under a fully_shard-ed root with its own head.

    7 rows do not divide by 2 ranks: uneven shards."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(5 if k == 0 else 7, 7) for k in range(layers)], nn.Linear(7, 3))
    for block in list(model)[:layers]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _check(results: dict, name: str, fn) -> None:
    try:
        problem = fn()
    except Exception as e:  # a wrapper's RuntimeError already names the torch version
        problem = f"{type(e).__name__}: {e}"
    results[name] = problem


def _local_shape_and_offset(rank: int, world_size: int, mesh) -> str | None:
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    for placements in ([Shard(0)], [Shard(1)]):
        dt = distribute_tensor(full, mesh, placements)
        shape, offset = torch_compat.local_shape_and_offset(full.shape, mesh, placements)
        local = dt.to_local()
        if tuple(local.shape) != shape:
            return f"{TORCH}: local shape {shape} for {placements}, the DTensor's is {tuple(local.shape)}"
        box = full[offset[0]:offset[0] + shape[0], offset[1]:offset[1] + shape[1]]
        if not torch.equal(box, local):
            return f"{TORCH}: offset {offset} for {placements} does not place rank {rank}'s local piece"
    return None


def _strided_shard(rank: int, world_size: int, mesh) -> str | None:
    from torch.distributed.tensor import Shard, distribute_tensor

    cls = torch_compat.strided_shard_type()
    # dmuon builds it as _StridedShard(dim, split_factor=s) and reads .dim like a Shard's.
    placement = cls(0, split_factor=2)
    if placement.dim != 0:
        return f"{TORCH}: _StridedShard(0, split_factor=2).dim is {placement.dim}"
    if not isinstance(placement, Shard) and not hasattr(placement, "split_factor"):
        return f"{TORCH}: _StridedShard is neither a Shard nor has split_factor"
    # split_factor=2 on 2 ranks: the rows are cut in 2 chunks first (by a later mesh dim, as FSDP2
    # inside TP), each chunk then split over this dim's ranks: rank r holds rows [2r, 2r+1, 4+2r, 5+2r].
    full = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    local = distribute_tensor(full, mesh, [placement]).to_local()
    rows = [2 * rank, 2 * rank + 1, 4 + 2 * rank, 5 + 2 * rank]
    if not torch.equal(local, full[rows]):
        return f"{TORCH}: _StridedShard(0, split_factor=2) puts rows {local[:, 0].div(3).long().tolist()} on rank {rank}, expected {rows}"
    shape, _ = torch_compat.local_shape_and_offset(full.shape, mesh, [placement])
    if shape != (4, 3):
        return f"{TORCH}: local_shape_and_offset gives {shape} for a _StridedShard, the local piece is (4, 3)"
    return None


def _all_reduce_hook(rank: int, world_size: int, mesh) -> str | None:
    """set_all_reduce_hook on a 1-D mesh: accepted, seen by has_all_reduce_hook, called after the
    reduce-scatter (what a hand-made HSDP over the shard sub-mesh uses, and what prepare refuses)."""
    model = _model(mesh)
    if any(torch_compat.has_all_reduce_hook(m) for m in model.modules() if hasattr(m, "_get_fsdp_state")):
        return f"{TORCH}: has_all_reduce_hook is True on a model without one"
    calls = []
    model[1].set_all_reduce_hook(lambda t: calls.append(t.numel()))
    if not torch_compat.has_all_reduce_hook(model[1]):
        return f"{TORCH}: has_all_reduce_hook does not see the hook set_all_reduce_hook gave model[1]"
    if torch_compat.has_all_reduce_hook(model) or torch_compat.has_all_reduce_hook(model[0]):
        return f"{TORCH}: has_all_reduce_hook sees model[1]'s hook on another module"
    model(torch.randn(4, 5)).sum().backward()
    if len(calls) != 1 or calls[0] == 0:
        return f"{TORCH}: FSDP2 called model[1]'s all-reduce hook {len(calls)} times on a 1-D mesh (expected once)"
    return None


def _unshard_state(rank: int, world_size: int, mesh) -> str | None:
    """gathered_or_gathering: False while sharded, True once an all-gather is issued (an explicit
    ``unshard(async_op=True)``) and while unsharded, False again after ``reshard()``."""
    model = _model(mesh)
    if torch_compat.gathered_or_gathering(model[1]):
        return f"{TORCH}: gathered_or_gathering is True on a sharded module"
    handle = model[1].unshard(async_op=True)
    if not torch_compat.gathered_or_gathering(model[1]):
        return f"{TORCH}: gathered_or_gathering does not see an issued unshard(async_op=True)"
    handle.wait()
    if not torch_compat.gathered_or_gathering(model[1]):
        return f"{TORCH}: gathered_or_gathering is False on an unsharded module"
    model[1].reshard()
    if torch_compat.gathered_or_gathering(model[1]) or torch_compat.gathered_or_gathering(model[0]):
        return f"{TORCH}: gathered_or_gathering is True after reshard(), or on another module"
    if torch_compat.fsdp_unit(model[1]) is torch_compat.fsdp_unit(model[0]):
        return f"{TORCH}: fsdp_unit gives two fully_shard calls one unit"
    return None


def _reduced_gradients(rank: int, world_size: int, mesh) -> str | None:
    """FSDP2 calls each sharded parameter's post-accumulate-grad hooks itself, once per backward,
    right after writing the reduced gradient shard, block after block; a callback queued from a hook
    runs after every one of them (after FSDP2's own final callback, which reduces the root)."""
    from torch.distributed.tensor import DTensor

    model = _model(mesh)
    owner = {id(p): k for k, block in enumerate(model) for p in block.parameters()}
    seen: list[tuple[int, int]] = []
    ends: list[int] = []
    problems: list[str] = []

    def hook(param):
        grad = param.grad
        if not isinstance(grad, DTensor):
            problems.append(f"the gradient in the hook is a {type(grad).__name__}, not FSDP2's DTensor shard")
        seen.append((owner[id(param)], id(param)))
        if len(seen) == 1:
            torch_compat.queue_end_of_backward(lambda: ends.append(len(seen)))
        grads[id(param)] = grad.to_local().clone()

    grads: dict[int, torch.Tensor] = {}
    handles = [torch_compat.on_reduced_gradient(p, hook) for p in model.parameters()]
    # Each rank its own batch: the reduced gradient is the mean over ranks, what one process
    # gets from both batches at once.
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(4, 5, generator=gen) for _ in range(world_size)]
    model(batches[rank]).square().sum().backward()
    n = sum(1 for _ in model.parameters())
    if problems:
        return f"{TORCH}: " + problems[0]
    if len(seen) != n or len({i for _, i in seen}) != n:
        return f"{TORCH}: FSDP2 called the post-accumulate-grad hooks {len(seen)} times for {n} sharded parameters"
    # dmuon's units: a block's hooks come together, never interleaved with another block's.
    blocks = [k for j, (k, _) in enumerate(seen) if j == 0 or seen[j - 1][0] != k]
    if len(blocks) != len(set(blocks)):
        return f"{TORCH}: the hooks did not come block by block: blocks in the order {[k for k, _ in seen]}"
    if ends != [n]:
        return f"{TORCH}: the end-of-backward callback ran {len(ends)} times, after {ends} of {n} hooks"
    for p in model.parameters():
        if not torch.equal(grads[id(p)], p.grad.to_local()):
            return f"{TORCH}: the gradient a hook saw differs from the one backward left"
    torch.manual_seed(0)
    reference = nn.Sequential(*[nn.Linear(5 if k == 0 else 7, 7) for k in range(3)], nn.Linear(7, 3))
    (sum(reference(b).square().sum() for b in batches) / world_size).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        full = p.grad.full_tensor()
        if not torch.allclose(full, q.grad, rtol=1e-5, atol=1e-6):
            return f"{TORCH}: the reduced gradient of a {tuple(q.shape)} parameter is not the mean over ranks"
    for h in handles:
        h.remove()
    model(batches[rank]).sum().backward()
    if len(seen) != n:
        return f"{TORCH}: a removed hook still ran"
    return None


def _groups_and_meshes(rank: int, world_size: int, mesh) -> str | None:
    """process_group_count, in_backward, root_mesh and all_gather_into_tensor, as dmuon's setup and hooks
    read them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    before = torch_compat.process_group_count()
    group = dist.new_group(ranks=list(range(world_size)), use_local_synchronization=True)
    if torch_compat.process_group_count() != before + 1:
        return f"{TORCH}: a new group left the group count at {torch_compat.process_group_count()}, was {before}"
    torch_compat.default_store().set(f"compat/{rank}", "1")
    if torch_compat.default_store().get(f"compat/{rank}") != b"1":
        return f"{TORCH}: default_store does not keep what was set"
    if torch_compat.new_group_splits_world():
        return f"{TORCH}: new_group_splits_world says a gloo default group bound to no device splits"
    if (group, tuple(range(world_size))) not in torch_compat.registered_groups():
        return f"{TORCH}: registered_groups lacks a new group over every rank: {torch_compat.registered_groups()}"
    names = [None] * world_size
    dist.all_gather_object(names, dist.distributed_c10d._get_process_group_name(group))
    if len(set(names)) != 1:
        return f"{TORCH}: one group created with use_local_synchronization has the names {names} on the ranks"
    gathered = torch.empty(2 * world_size)
    torch_compat.all_gather_into_tensor(gathered, torch.full((2,), float(rank)), group=group)
    if gathered.tolist() != [float(r) for r in range(world_size) for _ in range(2)]:
        return f"{TORCH}: all_gather_into_tensor gave {gathered.tolist()} on rank {rank}"
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: seen.append(torch_compat.in_backward()) or grad)
    y.sum().backward()
    if seen != [True] or torch_compat.in_backward():
        return f"{TORCH}: in_backward was {seen} inside a backward hook and {torch_compat.in_backward()} outside"
    two = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("pp", "dp"))
    if torch_compat.root_mesh(two["dp"]) is not two or torch_compat.root_mesh(two) is not two:
        return f"{TORCH}: root_mesh of a slice is not the mesh it was sliced from"
    return None


def _ddp_wrapper(rank: int, world_size: int, mesh) -> str | None:
    """active_ddp_module inside and outside DDP's forward, and DeviceMesh.from_group over DDP's group (what
    dmuon's plan under DDP is made over)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.parallel import DistributedDataParallel

    inner = nn.Linear(3, 2)
    ddp = DistributedDataParallel(inner)
    seen = []
    handle = inner.register_forward_pre_hook(lambda module, args: seen.append(torch_compat.active_ddp_module()))
    ddp(torch.ones(1, 3)).sum().backward()
    handle.remove()
    if seen != [ddp] or torch_compat.active_ddp_module() is not None:
        return f"{TORCH}: active_ddp_module was {seen} inside DDP's forward, {torch_compat.active_ddp_module()} after"
    from_group = DeviceMesh.from_group(ddp.process_group, "cpu", mesh_dim_names=("ddp",))
    if from_group.mesh.tolist() != list(range(world_size)) or from_group.get_rank() != rank:
        return f"{TORCH}: DeviceMesh.from_group(DDP's group) holds {from_group.mesh.tolist()}"
    return None


def _partial_in_place(rank: int, world_size: int, mesh) -> str | None:
    """keep_partial_in_place, as the replicate level calls it: torch's clip_grad_norm_ (its _foreach_mul_) and
    the other in-place foreach scalings scale a Partial DTensor's local tensors and keep it Partial; an
    in-place foreach op that is not linear is refused rather than written into a reduced copy."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    torch_compat.keep_partial_in_place()
    mine = torch.full((2, 3), float(rank + 1))
    scalings = {"_foreach_mul_ by a tensor": lambda ts: torch._foreach_mul_(ts, torch.tensor(0.5)),
                "_foreach_mul_ by a number": lambda ts: torch._foreach_mul_(ts, 0.5),
                "_foreach_mul_ by numbers": lambda ts: torch._foreach_mul_(ts, [0.5]),
                "_foreach_div_ by a number": lambda ts: torch._foreach_div_(ts, 2.0),
                "_foreach_div_ by a tensor": lambda ts: torch._foreach_div_(ts, torch.tensor(2.0))}
    for reduce in ("avg", "sum"):
        for name, scale in scalings.items():
            grad = DTensor.from_local(mine.clone(), mesh, [Partial(reduce)], run_check=False)
            scale([grad])
            if grad.placements != (Partial(reduce),) or not torch.equal(grad.to_local(), mine * 0.5):
                return f"{TORCH}: {name} on a Partial({reduce!r}) DTensor left {grad.to_local()[0, 0].item()} " \
                       f"{grad.placements} on rank {rank}, expected {(mine * 0.5)[0, 0].item()} (Partial)"
    param = nn.Parameter(DTensor.from_local(torch.zeros(2, 3), mesh, [Replicate()]))
    param.grad = DTensor.from_local(mine.clone(), mesh, [Partial("avg")], run_check=False)
    norm = torch.nn.utils.clip_grad_norm_([param], 1.0)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    coef = torch.clamp(1.0 / (norm + 1e-6), max=1.0)  # torch's clip coefficient
    if not torch.equal(param.grad.to_local(), mine * coef):
        return f"{TORCH}: clip_grad_norm_ left a Partial gradient's local tensor {param.grad.to_local()[0, 0].item()} " \
               f"on rank {rank}, expected {(mine * coef)[0, 0].item()}"
    grad = DTensor.from_local(mine.clone(), mesh, [Partial("avg")], run_check=False)
    try:
        torch._foreach_sqrt_([grad])
    except RuntimeError as e:
        if "in-place operations that require placement changes" not in str(e):
            return f"{TORCH}: _foreach_sqrt_ on a Partial DTensor raised {e}"
        return None
    return f"{TORCH}: _foreach_sqrt_ on a Partial DTensor ran (into {grad.to_local()[0, 0].item()}) instead of raising"


def _every_check(rank: int, world_size: int) -> dict[str, str | None]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    results: dict[str, str | None] = {}
    for name, fn in (("local_shape_and_offset", _local_shape_and_offset), ("strided_shard", _strided_shard),
                     ("all_reduce_hook", _all_reduce_hook), ("reduced_gradients", _reduced_gradients),
                     ("unshard_state", _unshard_state), ("groups_and_meshes", _groups_and_meshes),
                     ("ddp_wrapper", _ddp_wrapper), ("partial_in_place", _partial_in_place)):
        _check(results, name, lambda fn=fn: fn(rank, world_size, mesh))
    return results


@pytest.fixture(scope="module")
def on_ranks() -> list[dict[str, str | None]]:
    return run_distributed(_every_check, WORLD)


@pytest.mark.parametrize("name", ["local_shape_and_offset", "strided_shard", "all_reduce_hook", "reduced_gradients",
                                  "unshard_state", "groups_and_meshes", "ddp_wrapper", "partial_in_place"])
def test_each_wrapper_on_fsdp2_and_dtensor(on_ranks, name):
    problems = [f"rank {r}: {res[name]}" for r, res in enumerate(on_ranks) if res[name] is not None]
    assert not problems, "\n".join(problems)


def test_end_of_backward_runs_after_every_hook():
    """Plain autograd: the queued callback runs once, after the hooks of every leaf."""
    order = []
    leaves = [torch.randn(3, requires_grad=True) for _ in range(3)]
    for k, leaf in enumerate(leaves):
        def hook(p, k=k):
            order.append(k)
            if len(order) == 1:
                torch_compat.queue_end_of_backward(lambda: order.append("end"))
        leaf.register_post_accumulate_grad_hook(hook)
    sum((leaf * (k + 1)).sum() for k, leaf in enumerate(leaves)).backward()
    assert sorted(order[:-1]) == [0, 1, 2] and order[-1] == "end", f"{TORCH}: {order}"


# Each private API moved: the wrapper names it and the torch version.

def _raises_naming(fn, what: str):
    with pytest.raises(RuntimeError) as info:
        fn()
    message = str(info.value)
    assert what in message and f"torch {torch.__version__}" in message, message


def test_a_moved_local_shape_function_is_named(monkeypatch):
    import torch.distributed.tensor._utils as utils

    monkeypatch.delattr(utils, "compute_local_shape_and_global_offset")
    _raises_naming(lambda: torch_compat.local_shape_and_offset((4, 4), None, []),
                   "torch.distributed.tensor._utils.compute_local_shape_and_global_offset")


def test_a_changed_local_shape_signature_is_named(monkeypatch):
    import torch.distributed.tensor._utils as utils

    monkeypatch.setattr(utils, "compute_local_shape_and_global_offset", lambda global_shape, mesh: None)
    _raises_naming(lambda: torch_compat.local_shape_and_offset((4, 4), None, []),
                   "compute_local_shape_and_global_offset(global_shape, mesh, placements)")


def test_a_moved_strided_shard_is_named(monkeypatch):
    import torch.distributed.tensor.placement_types as placement_types

    monkeypatch.delattr(placement_types, "_StridedShard")
    _raises_naming(torch_compat.strided_shard_type, "torch.distributed.tensor.placement_types._StridedShard")


def test_moved_fsdp_state_is_named():
    class Group:
        pass

    class State:
        _fsdp_param_groups = [Group()]

    class Module:
        def _get_fsdp_state(self):
            return State()

    _raises_naming(lambda: torch_compat.has_all_reduce_hook(Module()), "FSDPParamGroup._all_reduce_hook")
    State._fsdp_param_groups = None
    assert torch_compat.has_all_reduce_hook(Module()) is False  # a module without parameters
    del State._fsdp_param_groups
    _raises_naming(lambda: torch_compat.has_all_reduce_hook(Module()), "FSDPState._fsdp_param_groups")
    _raises_naming(lambda: torch_compat.has_all_reduce_hook(object()), "FSDPModule._get_fsdp_state()")
    State._fsdp_param_groups = [Group()]
    _raises_naming(lambda: torch_compat.gathered_or_gathering(Module()), "FSDPParamGroup._all_gather_result")
    _raises_naming(lambda: torch_compat.fsdp_unit(object()), "FSDPModule._get_fsdp_state()")


def test_a_moved_queue_callback_is_named(monkeypatch):
    monkeypatch.setattr(torch.autograd.Variable, "_execution_engine", object())
    _raises_naming(lambda: torch_compat.queue_end_of_backward(lambda: None),
                   "torch.autograd.Variable._execution_engine.queue_callback")


def test_moved_group_graph_and_mesh_apis_are_named(monkeypatch):
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh

    monkeypatch.setattr(c10d, "_world", object())
    with pytest.raises(RuntimeError, match=r"_world\.pg_names.*" + TORCH.replace("+", r"\+")):
        torch_compat.process_group_count()
    with pytest.raises(RuntimeError, match=r"_world\.pg_group_ranks"):
        torch_compat.registered_groups()
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    with pytest.raises(RuntimeError, match=r"_current_graph_task_id"):
        torch_compat.in_backward()
    monkeypatch.delattr(DeviceMesh, "_get_root_mesh")
    with pytest.raises(RuntimeError, match=r"_get_root_mesh"):
        torch_compat.root_mesh(object.__new__(DeviceMesh))


def test_a_moved_active_ddp_getter_is_named(monkeypatch):
    from torch.nn.parallel import DistributedDataParallel

    assert torch_compat.active_ddp_module() is None  # no DDP forward running
    monkeypatch.delattr(DistributedDataParallel, "_get_active_ddp_module")
    _raises_naming(torch_compat.active_ddp_module, "DistributedDataParallel._get_active_ddp_module")


def test_profiler_active_follows_every_profiler_on_every_thread():
    """``profiler_active``: False with no profiler; True inside torch.profiler.profile and
    torch.autograd.profiler.profile, also read from another thread (dmuon's NS worker)."""
    from concurrent.futures import ThreadPoolExecutor

    assert torch_compat.profiler_active() is False
    with ThreadPoolExecutor(1) as worker:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            assert torch_compat.profiler_active() is True
            assert worker.submit(torch_compat.profiler_active).result() is True
        with torch.autograd.profiler.profile():
            assert torch_compat.profiler_active() is True
        assert worker.submit(torch_compat.profiler_active).result() is False
    assert torch_compat.profiler_active() is False


def test_a_moved_profiler_flag_is_named(monkeypatch):
    monkeypatch.delattr(torch.autograd.profiler, "_is_profiler_enabled")
    _raises_naming(torch_compat.profiler_active, "torch.autograd.profiler._is_profiler_enabled")


def test_keep_partial_in_place_changes_only_in_place_foreach_ops_and_only_on_torch_2_11():
    from torch.distributed.tensor import DTensor

    strategies = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    before = dict(strategies)
    torch_compat.keep_partial_in_place()
    changed = [op for op in before if strategies[op] is not before[op]]
    assert set(strategies) == set(before)
    assert all(op._schema.name.startswith("aten::_foreach_") and op._schema.name.endswith("_") for op in changed)
    mul = torch.ops.aten._foreach_mul_.Tensor
    if torch_compat.INPLACE_FOREACH_DROPS_PARTIAL:
        assert mul in strategies and strategies[mul].__module__ == torch_compat.__name__  # dmuon's rule
    else:  # torch 2.12 and later have the rules: nothing of theirs is replaced
        assert not changed


def test_a_moved_pointwise_strategy_is_named(monkeypatch):
    import torch.distributed.tensor._ops._pointwise_ops as pointwise

    monkeypatch.setattr(torch_compat, "INPLACE_FOREACH_DROPS_PARTIAL", True)
    monkeypatch.setattr(torch_compat, "_kept_partial", False)
    monkeypatch.delattr(pointwise, "common_pointwise_strategy", raising=False)  # not in torch 2.12+
    _raises_naming(torch_compat.keep_partial_in_place,
                   "torch.distributed.tensor._ops._pointwise_ops.common_pointwise_strategy")
