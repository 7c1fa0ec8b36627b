"""Every private torch API and version-specific FSDP2 behaviour dmuon relies on, one function each.

torch does not promise to keep these: a release may move, rename or change them. Each is reached
only through a function here, which raises ``RuntimeError`` naming the API and the running torch
version when it has moved, instead of an ``AttributeError`` or ``ImportError`` deep inside a step.
``tests/test_torch_compat.py`` calls every one for real (on a one-rank gloo group, with FSDP2 and
DTensor), so a torch release that breaks one fails there first; ``scripts/compat.sh`` runs it with
the rest of the compatibility subset (``pytest -m compat``) on other torch releases, and
docs/torch-versions.md lists the releases tested.

Private APIs:

* :func:`local_shape_and_offset`: ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``.
* :func:`strided_shard_type`: ``torch.distributed.tensor.placement_types._StridedShard``.
* :func:`has_all_reduce_hook`: ``FSDPModule._get_fsdp_state()._fsdp_param_groups[*]._all_reduce_hook``.
* :func:`queue_end_of_backward`: ``torch.autograd.Variable._execution_engine.queue_callback``.
* :func:`gathered_or_gathering`: ``FSDPParamGroup._all_gather_result`` and ``is_unsharded``.
* :func:`fsdp_unit`: ``FSDPModule._get_fsdp_state()``.
* :func:`process_group_count`: ``torch.distributed.distributed_c10d._world.pg_names``.
* :func:`new_group_splits_world`: ``torch.distributed.distributed_c10d._get_split_source``.
* :func:`registered_groups`: ``torch.distributed.distributed_c10d._world.pg_group_ranks``.
* :func:`default_store`: ``torch.distributed.distributed_c10d._get_default_store``.
* :func:`in_backward`: ``torch._C._current_graph_task_id``.
* :func:`root_mesh`: ``DeviceMesh._get_root_mesh``.
* :func:`profiler_active`: ``torch.autograd.profiler._is_profiler_enabled``.
* :func:`keep_partial_in_place`: DTensor's sharding propagator (``DTensor._op_dispatcher.sharding_propagator``,
  ``torch.distributed.tensor._ops._pointwise_ops.common_pointwise_strategy``), on torch 2.11 only.

Behaviour of FSDP2 and DTensor (public APIs whose semantics changed across releases):

* :func:`on_reduced_gradient`: FSDP2 calls a sharded parameter's post-accumulate-grad hooks itself,
  right after writing the reduced gradient shard, on its post-reduce stream.
* :func:`all_gather_into_tensor`: the all-gather into one flat tensor, ``dist.all_gather_single`` from
  torch 2.13 on, ``dist.all_gather_into_tensor`` before.
* :func:`keep_partial_in_place`: an in-place foreach op (``torch._foreach_mul_``, how ``clip_grad_norm_``
  scales) on a ``Partial`` DTensor acts on each rank's local tensor from torch 2.12 on; 2.11 writes into a
  reduced copy and leaves the DTensor unchanged.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Sequence

import torch
import torch.autograd.profiler as _autograd_profiler
import torch.distributed as dist


def _moved(what: str, detail: str) -> RuntimeError:
    return RuntimeError(f"dmuon needs {what}, which torch {torch.__version__} does not have ({detail}); "
                        "this torch release is outside the tested range (docs/torch-versions.md)")


def _private(module: str, name: str) -> Any:
    """``module.name``, or a RuntimeError naming both and the torch version."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise _moved(f"{module}.{name}", f"{type(e).__name__}: {e}") from e


def local_shape_and_offset(global_shape: Sequence[int], mesh, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of this rank's local piece of a DTensor with ``global_shape`` laid out as ``placements``
    on ``mesh``, and the global index of its first element.

    torch's ``compute_local_shape_and_global_offset`` (private; DCP plans its chunks with it) is the
    only function that places uneven and strided shards exactly as DTensor does; dmuon checks and
    builds its momentum layouts with it.
    """
    fn = _private("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset")
    try:
        shape, offset = fn(global_shape, mesh, placements)
    except TypeError as e:  # the signature changed
        raise _moved("compute_local_shape_and_global_offset(global_shape, mesh, placements) returning "
                     "(local_shape, global_offset)", f"TypeError: {e}") from e
    return tuple(shape), tuple(offset)


def strided_shard_type() -> type:
    """The placement class FSDP2 gives a row split inside a tensor-parallel one (``_StridedShard``).

    Private in torch; dmuon recognises FSDP2's rows by it and lays the momentum's column split inside
    TP's out with it (``_StridedShard(dim, split_factor=...)``).
    """
    cls = _private("torch.distributed.tensor.placement_types", "_StridedShard")
    if not isinstance(cls, type):
        raise _moved("torch.distributed.tensor.placement_types._StridedShard as a class",
                     f"it is a {type(cls).__name__}")
    return cls


def _param_groups(module) -> list:
    """An FSDP2 module's parameter groups (FSDP2's ``FSDPParamGroup`` objects; none without parameters)."""
    if not hasattr(module, "_get_fsdp_state"):
        raise _moved("FSDPModule._get_fsdp_state()", f"{type(module).__name__} has no _get_fsdp_state")
    state = module._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):  # a list: one group per mesh (per-parameter meshes)
        return list(state._fsdp_param_groups or [])
    if hasattr(state, "_fsdp_param_group"):  # one optional group per module (releases before the list)
        return [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    raise _moved("FSDPState._fsdp_param_groups (or _fsdp_param_group)",
                 f"{type(state).__name__} has neither")


def has_all_reduce_hook(module) -> bool:
    """Whether ``FSDPModule.set_all_reduce_hook`` has given ``module`` an all-reduce hook.

    FSDP2 has no public getter for the hook, so this reads the attribute its param groups keep it in
    (read only: nothing is changed).
    """
    groups = _param_groups(module)
    for g in groups:
        if not hasattr(g, "_all_reduce_hook"):
            raise _moved("FSDPParamGroup._all_reduce_hook (where set_all_reduce_hook keeps the hook)",
                         f"{type(g).__name__} has no _all_reduce_hook")
    return any(g._all_reduce_hook is not None for g in groups)


def active_ddp_module() -> Any:
    """The torch ``DistributedDataParallel`` whose forward is running now (the one calling its ``module``), or
    None: DDP records it for TorchDynamo (``DistributedDataParallel._get_active_ddp_module``)."""
    from torch.nn.parallel import DistributedDataParallel

    getter = getattr(DistributedDataParallel, "_get_active_ddp_module", None)
    if getter is None:
        raise _moved("DistributedDataParallel._get_active_ddp_module (the DDP whose forward runs)",
                     "DistributedDataParallel has no _get_active_ddp_module")
    return getter()


def fsdp_unit(module) -> object:
    """What ``module`` is gathered with: its FSDP2 state, which ``fully_shard([a, b])`` gives both ``a`` and ``b``
    (one ``unshard`` gathers both); compare with ``is``."""
    if not hasattr(module, "_get_fsdp_state"):
        raise _moved("FSDPModule._get_fsdp_state()", f"{type(module).__name__} has no _get_fsdp_state")
    return module._get_fsdp_state()


def gathered_or_gathering(module) -> bool:
    """Whether ``module``'s parameters are unsharded or an all-gather of them is issued and not waited for
    (an ``unshard()`` of the user's, or FSDP2's explicit prefetch, ``set_modules_to_forward_prefetch``).

    FSDP2 has no public getter for either, so this reads its param groups' state (read only).
    """
    groups = _param_groups(module)
    for g in groups:
        if not hasattr(g, "_all_gather_result") or not hasattr(g, "is_unsharded"):
            raise _moved("FSDPParamGroup._all_gather_result / is_unsharded (FSDP2's unshard state)",
                         f"{type(g).__name__} has no _all_gather_result or is_unsharded")
    return any(g._all_gather_result is not None or g.is_unsharded for g in groups)


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Runs ``callback`` once the current backward pass has finished, after every hook of it.

    Call it from inside a backward (a hook). torch's autograd engine has no public API for this;
    FSDP2, DDP and FSDP1 install their own final callbacks through the same private one.
    """
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is None:
        raise _moved("torch.autograd.Variable._execution_engine.queue_callback",
                     "the autograd engine exposes no queue_callback")
    queue(callback)


def profiler_active() -> bool:
    """Whether a torch profiler records now, on any thread: ``torch.profiler.profile``,
    ``torch.autograd.profiler.profile``, ``emit_nvtx`` or ``emit_itt``.

    torch keeps it in ``torch.autograd.profiler._is_profiler_enabled`` (private), a process-wide bool
    the profilers set on entry and clear on exit; torch's own compiled code reads it the same way
    to skip its ranges. ``torch._C._autograd._profiler_enabled()`` is public but per thread: false on
    a thread the profiler did not start on (dmuon's NS worker) even where ``profile_all_threads``
    records that thread's ranges.
    """
    flag = getattr(_autograd_profiler, "_is_profiler_enabled", None)
    if flag.__class__ is not bool:
        raise _moved("torch.autograd.profiler._is_profiler_enabled (a bool)",
                     f"found {type(flag).__name__}")
    return flag


def on_reduced_gradient(param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> Any:
    """Registers ``hook(param)`` to run whenever FSDP2 has written ``param``'s reduced gradient shard.

    ``param`` is a sharded (DTensor) parameter of a ``fully_shard``-ed module. FSDP2 computes its
    gradient outside autograd (a reduce-scatter, on HSDP then an all-reduce) and calls the
    parameter's post-accumulate-grad hooks itself, right after it has divided, cast and written the
    shard to ``param.grad``, on its post-reduce stream: the hook sees the gradient ``step()`` reads,
    block by block in FSDP2's post-backward order. Returns the handle (``.remove()``).
    """
    return param.register_post_accumulate_grad_hook(hook)


def process_group_count() -> int:
    """How many process groups this rank knows of: what torch's name of a group created with
    ``new_group(..., use_local_synchronization=True)`` depends on, besides its ranks."""
    world = _private("torch.distributed.distributed_c10d", "_world")
    names = getattr(world, "pg_names", None)
    if names is None:
        raise _moved("torch.distributed.distributed_c10d._world.pg_names", "the c10d world has no pg_names")
    return len(names)


def new_group_splits_world() -> bool:
    """Whether ``new_group`` makes a group's communicator by splitting the default group's
    (``ncclCommSplit``), which every rank of the world must then enter, members or not.

    torch 2.13 does so when the default group is bound to a device (``init_process_group(device_id=
    ...)``) and its backend can split (NCCL); ``use_local_synchronization`` does not change it: the
    members split, the ranks that do not call ``new_group`` never do, and the members wait.
    """
    c10d = importlib.import_module("torch.distributed.distributed_c10d")
    default = c10d._get_default_group()
    if getattr(default, "bound_device_id", None) is None:
        return False
    source = _private("torch.distributed.distributed_c10d", "_get_split_source")
    return source(default) is not None


def registered_groups() -> list[tuple[Any, tuple[int, ...]]]:
    """Every process group this rank belongs to, with its members' default-group ranks in the
    group's rank order, in the order this rank created them."""
    world = _private("torch.distributed.distributed_c10d", "_world")
    ranks = getattr(world, "pg_group_ranks", None)
    if ranks is None:
        raise _moved("torch.distributed.distributed_c10d._world.pg_group_ranks", "the c10d world has no pg_group_ranks")
    import torch.distributed as dist

    # torch records the groups this rank is not in too, under the NON_GROUP_MEMBER sentinel.
    return [(group, tuple(sorted(mapping, key=mapping.get))) for group, mapping in ranks.items()
            if isinstance(group, dist.ProcessGroup)]


def default_store() -> Any:
    """The default group's key-value store (the ``TCPStore`` of ``init_process_group``): where ranks
    wait for each other on the host, outside any collective and its watchdog."""
    return _private("torch.distributed.distributed_c10d", "_get_default_store")()


def in_backward() -> bool:
    """Whether this thread runs inside an autograd backward pass (where :func:`queue_end_of_backward`
    may be called); False in FSDP2's reduction called by hand, as torch's pipeline schedules do."""
    current = _private("torch._C", "_current_graph_task_id")
    return current() != -1


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False) -> Any:
    """torch's all-gather of equal tensors into one flat output: ``dist.all_gather_single`` from torch 2.13,
    ``dist.all_gather_into_tensor`` (its earlier name) before."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def root_mesh(mesh) -> Any:
    """The mesh ``mesh`` was sliced from (``mesh`` itself when it is not a slice)."""
    get_root = getattr(mesh, "_get_root_mesh", None)
    if get_root is None:
        raise _moved("DeviceMesh._get_root_mesh", "a DeviceMesh has no _get_root_mesh")
    return get_root()


INPLACE_FOREACH_DROPS_PARTIAL = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 12)
"""Whether this torch runs an in-place foreach op on a ``Partial`` DTensor on a reduced copy, silently
(torch 2.11: the propagator turns the ``Partial`` into ``Replicate`` and the op writes into the all-reduced
copy; single-tensor in-place ops raise there instead). From 2.12 on, ``_foreach_mul_`` and ``_foreach_div_``
by a replicated factor keep the ``Partial`` and scale each rank's local tensor, and the in-place foreach ops
that are not linear raise."""

_SCALING_OPS = ("_foreach_mul_", "_foreach_div_")
_kept_partial = False


def keep_partial_in_place() -> None:
    """Gives DTensor the rules torch 2.12 and later have for in-place foreach ops on a ``Partial`` DTensor,
    on a torch that lacks them (:data:`INPLACE_FOREACH_DROPS_PARTIAL`); nothing on any other.

    dmuon's replicate level leaves a Muon matrix's gradient ``Partial("avg")`` between backward and
    ``step()``. ``torch.nn.utils.clip_grad_norm_`` scales gradients with ``torch._foreach_mul_``, which torch
    2.11 applies to an all-reduced copy: the clip does not clip, and nothing says so. Here
    ``_foreach_mul_`` and ``_foreach_div_`` (every overload) by a replicated factor keep the ``Partial`` and
    scale each rank's local tensor, as ``Tensor.mul_`` does on 2.11 and both do on 2.12+ (a linear op: the
    reduction of the scaled tensors is the scaled reduction); every other in-place foreach op that would
    change a ``Partial`` placement raises, as 2.11 raises for single-tensor in-place ops. Process-wide (it
    is DTensor's own registry), done once; the change only turns a silent no-op into the later releases'
    result or error. The decision is the placements', the same on every rank: no rank enters a collective
    the others skip.
    """
    global _kept_partial
    if _kept_partial or not INPLACE_FOREACH_DROPS_PARTIAL:
        return
    from torch.distributed.tensor import DTensor

    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    strategies = getattr(propagator, "op_strategy_funcs", None)
    if strategies is None:
        raise _moved("DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs",
                     "DTensor's dispatcher has no sharding propagator registry")
    common = _private("torch.distributed.tensor._ops._pointwise_ops", "common_pointwise_strategy")
    schema = importlib.import_module("torch.distributed.tensor._op_schema")
    for op in list(strategies):
        name = op._schema.name
        if not name.startswith("aten::_foreach_") or not name.endswith("_"):
            continue  # only in-place foreach ops: the out-of-place ones return a new (replicated) result
        # A scaling keeps Partial("sum") and Partial("avg"); any placement it would still change (a
        # Partial("max") scaled) is refused like the other ops' changes.
        linear = name.removeprefix("aten::") in _SCALING_OPS
        own = _linear_in_place(common, schema) if linear else strategies[op]
        strategies[op] = _refusing_partial_change(own, schema)
    # Strategies already looked up (cached per op and placements) are computed again.
    _private("torch.distributed.tensor.debug", "_clear_python_sharding_prop_cache")()
    _private("torch.distributed.tensor.debug", "_clear_fast_path_sharding_prop_cache")()
    _kept_partial = True


def _linear_in_place(common: Callable, schema) -> Callable:
    """The strategy of an in-place foreach scaling: per tensor of the list, torch's pointwise strategy with
    multiplicative linearity (the list's tensor followed, ``Partial`` kept; a factor that is a DTensor is
    made ``Replicate``)."""

    def strategy(op_schema):
        args = op_schema.args_schema
        tensors = args[0]

        def part(arg, i):
            if isinstance(arg, schema.TupleStrategy):
                return arg.children[i]
            return arg if isinstance(arg, schema.OpStrategy) else None  # a scalar or a list of them

        return schema.TupleStrategy([common(op_schema.op, [part(a, i) for a in args], child, 0, linearity=2)
                                     for i, child in enumerate(tensors.children)])

    return strategy


def _refusing_partial_change(original: Callable, schema) -> Callable:
    """``original`` (an in-place foreach op's strategy), raising where it would change a ``Partial``
    placement of the list it writes (the op would write into a redistributed copy)."""

    def strategy(op_schema):
        out = original(op_schema)
        tensors = op_schema.args_schema[0]
        for i, child in enumerate(getattr(out, "children", ())):
            before = tensors.children[i].strategies[0].output_spec.placements
            if any(p.is_partial() for p in before) and any(s.output_spec.placements != before
                                                           for s in child.strategies):
                raise RuntimeError(f"{op_schema.op}: in-place operations that require placement changes are not "
                                   f"supported: the input has placement {before}; use the out-of-place operation "
                                   f"(torch {torch.__version__} would write into a redistributed copy)")
        return out

    return strategy
