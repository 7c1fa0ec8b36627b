"""What one simulated step runs on, apart from the schedule that uses it (:mod:`dmuon.costmodel.simulate`):
the hardware (:class:`Hardware`, its presets), the simulation's options (:class:`SimOptions`), the
bytes per element of the elementwise passes, and the step itself (:class:`StepInputs`: the matrices,
where they live and who owns them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

from dmuon.costmodel.collective import AlphaBeta
from dmuon.costmodel.host import HostOps


NS_METHODS: tuple[str, ...] = ("auto", "standard", "gram")
"""How NS is priced: ``"standard"`` (:func:`~dmuon.plan.cost.ns_flops`), ``"gram"`` (Gram NS with
symmetric products, :func:`~dmuon.plan.cost.gram_ns_flops`), ``"auto"`` (the fewer FLOPs of the two
per shape, as the autotuner picks the faster one)."""


# ------------------------------------------------------------------ configuration
@dataclass
class Hardware:
    """What one GPU (or CPU rank) and its links do per second."""

    name: str
    """Preset name, or where the figures came from."""
    compute_flops: float
    """Effective FLOP/s of forward and backward (bf16 on GPUs), counted as 6 x parameters x tokens."""
    ns_flops: float
    """Effective FLOP/s of Newton-Schulz at its analytical FLOPs (:data:`NS_METHODS`)."""
    elementwise_bytes: float
    """Bytes/s of memory-bound elementwise work (AdamW, momentum, applying updates)."""
    links: AlphaBeta = field(default_factory=AlphaBeta)
    """Latency and per-direction bandwidth inside a node (intra) and across nodes (inter)."""
    op_links: dict[str, AlphaBeta] = field(default_factory=dict)
    """Per collective kind (:attr:`Collective.op`: ``"all_gather"``, ``"reduce_scatter"``,
    ``"all_reduce"``, ``"all_to_all"``), its own latency and bandwidth in place of :attr:`links`'
    (gloo reduce-scatters by an all-reduce of the whole input: its bytes cost about three times an
    all-gather's); a kind not listed takes :attr:`links`. The link a kind's transfer occupies is
    still the level's one, shared with every other transfer on it."""
    dispatch_seconds: float = 0.0
    """Host seconds per operation on plain tensors (an ATen op; a kernel launch on a GPU), for the
    code paths that dispatch per tensor (:class:`~dmuon.costmodel.host.HostOps`); 0: not modelled."""
    dtensor_dispatch_seconds: float = 0.0
    """Host seconds per operation on a DTensor (DTensor's dispatch and the plain op under it); 0: not modelled."""
    dtensor_layout_seconds: float = 0.0
    """Host seconds per DTensor layout call (``full_tensor()``, ``distribute_tensor``) beyond its
    collective and operations: redistribution planning, functional-collective wrapping; 0: not modelled."""
    sync_skew: float = 0.0
    """Ranks of a shared host drifting apart between the collectives that block their threads (gloo):
    the later rank's delay at each, as a fraction of the compute seconds since the one before
    (:class:`Timeline`); 0: ranks in lockstep (GPUs, an idle host)."""
    sync_delay: float = 0.0
    """Seconds more of that delay at each meeting that follows any compute, whatever its length (a
    rank waking from its wait, a preemption's tail); 0: only :attr:`sync_skew`'s fraction."""
    fsdp_unit_seconds: float = 0.0
    """Host seconds of FSDP2's own work per unit and pass (forward: unshard and reshard; backward:
    unshard, reduce-scatter's copy-in, the gradients' views): on the rank's compute stream, added to
    each unit's forward and backward; 0: not modelled (or inside :attr:`compute_flops`, an effective rate)."""

    def __post_init__(self) -> None:
        for name in ("compute_flops", "ns_flops", "elementwise_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("dispatch_seconds", "dtensor_dispatch_seconds", "dtensor_layout_seconds", "fsdp_unit_seconds",
                     "sync_skew", "sync_delay"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        unknown = set(self.op_links) - {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}
        if unknown:
            raise ValueError(f"op_links: unknown collective kinds {sorted(unknown)}")

    def as_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "links"}, **self.links.as_dict()}


HARDWARE_PRESETS: dict[str, Hardware] = {
    # Typical, not measured. H100 SXM: 989 TFLOP/s dense bf16 peak, of which 400 effective for
    # training (about 40%, the figure), NS 600 (GEMM-bound, about 61%), 2 TB/s of its
    # 3.35 TB/s HBM3 for elementwise work (60%); links: AlphaBeta's defaults (NVLink 4 and one
    # 400 Gb/s NIC per GPU).
    "h100": Hardware("h100", 400e12, 600e12, 2e12, AlphaBeta()),
    # A800 SXM 80GB: 312 TFLOP/s dense bf16 and 2.04 TB/s, at the H100 preset's fractions
    # (40%, 61%, 60%); NVLink capped at 400 GB/s bidirectional (200 each way); one 200 Gb/s
    # HDR NIC per GPU (25 GB/s each way); the same latencies.
    "a800": Hardware("a800", 125e12, 190e12, 1.2e12, AlphaBeta(intra_bandwidth=200e9, inter_bandwidth=25e9)),
    # Both presets: one link figure for every collective kind (NCCL's ring all-gather and
    # reduce-scatter move the same bytes at the same rate), and no host work (dispatch figures 0):
    # on a GPU the host queues kernels ahead of the device. A GPU host's own figures would be a few
    # microseconds per kernel launch (the CUDA launch overhead usually quoted, 3-5 us; not measured
    # here) and tens per DTensor operation (host Python: 15-34 us measured on 2-core x86_64 CPUs by `dmuon bench --calibrate`);
    # `dmuon plan --simulate --dispatch-us 5 --dtensor-dispatch-us 30` prices them, with each
    # task taking the longer of its host and device work (docs/benchmarks/README.md, what the simulation models).
}
"""Hardware presets of ``dmuon plan --simulate --hardware NAME``."""


@dataclass
class SimOptions:
    """How one step is simulated."""

    tokens_per_gpu: int = 4096
    """Tokens each rank runs forward and backward per step."""
    ns_method: str = "auto"
    """How NS is priced (:data:`NS_METHODS`)."""
    ns_steps: int = 5
    """NS iterations."""
    ns_seconds: Callable[[tuple[int, int], int], float] | None = None
    """Measured seconds of one NS batch ``(shape, batch size)`` (a profile), instead of FLOPs."""
    overlap: bool = True
    """False: every task waits for the previous one on every rank (no overlap at all)."""
    compute: bool = True
    """False: no compute (every compute task takes no time)."""
    backend: str = "nccl"
    """``"nccl"``: GPU streams (FSDP2's collectives on their own streams); ``"gloo"``: CPU ranks,
    FSDP2's collectives and every wait block the rank's one thread, dmuon's asynchronous
    collectives progress beside it."""
    agreement_bytes: int = 4
    """Bytes per flag of dmuon's agreement all-reduce (int32; one flag per matrix and block)."""
    peer_concurrency: int = 3
    """The all-to-all peer's batches in flight (its ``AsyncRuntime``'s limit)."""
    host_ops: HostOps = field(default_factory=HostOps)
    """Operations per unit of work of the code paths that dispatch per tensor, priced at the
    hardware's dispatch figures (all 0 by default: no host work)."""
    unlisted_tensors: int = 0
    """Parameter tensors the shape lists leave out (norm weights, biases: their bytes are negligible,
    but per-tensor dispatch counts each), updated by AdamW."""
    non_gemm_seconds: float = 0.0
    """Forward and backward seconds beyond the GEMMs that 6 x parameters x tokens at
    :attr:`Hardware.compute_flops` prices (attention's score and value products, norms,
    activations, the loss's softmax over the vocabulary), for a rate that prices the GEMMs alone
    (``dmuon bench --calibrate``'s matmul rate; it measures this too, as the model's one-rank
    forward+backward less its GEMMs); spread over the units by their parameters, a third in
    forward and two thirds in backward, as the GEMMs are. 0: inside :attr:`Hardware.compute_flops`
    (an effective rate, as the presets' are)."""

    def __post_init__(self) -> None:
        if self.ns_method not in NS_METHODS:
            raise ValueError(f"ns_method must be one of {NS_METHODS}, got {self.ns_method!r}")
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {self.backend!r}")
        if self.tokens_per_gpu < 0 or self.ns_steps < 1 or self.unlisted_tensors < 0 or not self.non_gemm_seconds >= 0:
            raise ValueError("tokens_per_gpu, unlisted_tensors and non_gemm_seconds must be >= 0 and ns_steps >= 1")

    def as_dict(self) -> dict:
        out = asdict(self)
        out["ns_seconds"] = "profiled" if self.ns_seconds is not None else None
        return out


# Bytes per element of the elementwise passes (fp32 state and parameters, bf16 wire).
ADAMW_BYTES = 28
"""AdamW: parameter, first and second moment read and written, gradient read (fp32)."""
MOMENTUM_BYTES = 14
"""Muon's momentum step: gradient read, momentum read and written (fp32), direction written (bf16)."""
PEEK_BYTES = 10
"""dmuon's direction in backward (momentum untouched): gradient and momentum read, direction written."""
STALE_BYTES = 4
"""dmuon's check of a launch: the direction sent and the committed one read (bf16)."""
APPLY_BYTES = 10
"""Applying an update: the fp32 parameter read and written, the bf16 update read."""
OWNER_COPY_BYTES = 8
"""An owner pastes the pieces into the full direction and cuts the update (bf16, read and written)."""


# ------------------------------------------------------------------ one step's schedule
@dataclass
class StepInputs:
    """One step to simulate: the matrices, where they live and who owns them."""

    shapes: list[tuple[int, int]]
    """Muon matrices, ``(rows, prod(shape[1:]))``."""
    owners: list[int]
    """Owner rank of each Muon matrix (plan rank ``r * shard + s``)."""
    blocks: list[int]
    """FSDP2 block of each Muon matrix (the root is :attr:`root_block`, layers ascend in forward order)."""
    replicate: int
    """Replicas R (1: 1-D FSDP)."""
    shard: int
    """Ranks S each parameter is sharded over (a node under HSDP)."""
    ns_batches: dict[int, list[list[int]]]
    """Per owner rank, its NS batches (matrix indices) in the order it runs them."""
    other_shapes: list[tuple[int, int]] = field(default_factory=list)
    """The parameters Muon leaves to AdamW (embeddings, heads), ``(rows, prod(shape[1:]))``."""
    other_blocks: list[int] = field(default_factory=list)
    """Their blocks."""
    return_waves: int = 4
    """The runtime's limit on update returns (4 on an accelerator; 1, the CPU default, makes the
    step speculative: NS on what landed in backward, its return carrying the agreement)."""
    zero: int = 3
    """FSDP2 resharding: 3 re-gathers the weights in backward, 2 keeps them from forward."""
    wire_bytes: int = 2
    """dmuon's (gather's, the peer's) element size on the wire, the NS dtype."""
    param_bytes: int = 2
    """FSDP2's all-gather element size."""
    reduce_bytes: int = 4
    """FSDP2's reduce-scatter and all-reduce element size."""
    root_block: int = 0
    """The root module's block: gathered first, its compute (the head) after the layers', its
    gradients reduced last."""
    root_regathered: bool = False
    """The root resharded after forward and gathered again at the start of backward (an explicit
    ``fully_shard(root, reshard_after_forward=True)`` in torch 2.13; left unset, FSDP2 keeps it)."""
    hop_a_spread: int | None = None
    """The replicate level: the collectives a block's hop A may spread over (``ExecutionConfig.hop_a_spread``;
    None: its default, 1 for ``dmuon_rbwd`` and 8 for the others)."""
    publication: str | None = None
    """dmuon's route across replicas for every return wave (``"direct"``, ``"scatter"``); None: the
    runtime's choice per wave (:func:`dmuon.plan.publication.choose_route`)."""
    pieces: list | None = None
    """Routed experts (:mod:`dmuon.costmodel.moe`): per Muon matrix its pieces per shard position for an
    expert slice, None for a dense matrix; None: no expert."""
    experts: object | None = None
    """The :class:`~dmuon.costmodel.moe.ExpertLayout` of :attr:`pieces` (None without experts)."""
    token_share: list[float] | None = None
    """Per Muon matrix, the share of the rank's tokens its forward and backward run (an expert slice:
    top-k over the experts, the tokens' all-to-all spreading them evenly); None: every token through every one."""

    @property
    def world(self) -> int:
        return self.replicate * self.shard

    def waves(self) -> list[list[int]]:
        """The non-empty return waves, as the runtime pipelines them (:func:`dmuon.plan.batches.return_waves`)."""
        from dmuon.plan.batches import return_waves
        return [w for w in return_waves(self.ns_batches, [], self.return_waves) if w]
