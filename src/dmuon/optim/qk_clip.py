"""QK-clip on the optimizer's shards: the model's reports, the step's agreed maxima, each rank's rows.

The rule (:mod:`dmuon.rules.qk_clip`) says which rows of a layer's query and key projections
scale by which power of which head's factor. Here it meets the step:

* **Reports**: the model hands each forward's per-head maxima to
  :meth:`AttentionClip.report`, which keeps their running maximum per query head on the
  device (micro-batches of an accumulation, activation checkpointing's recomputation:
  the maximum of every report since the last ``step()``). Non-finite values are left out.
* **Agreement**: at ``step()`` each rank's maxima, reduced per key head, ride with the
  step's agreement (:meth:`~dmuon.runtime.callbacks.StepMaxima.step_maxima`); every
  rank gets the maximum over every rank's tokens, exactly, and no collective is added.
* **Clip**: after the last update of a step that is not skipped
  (:meth:`~dmuon.runtime.callbacks.StepMaxima.finish_step`), every rank scales its own
  rows of the layers' Muon matrices (each holder of a row, every replica and tensor-parallel
  copy, alike), by the global row index of its shard (``MatrixInfo.pieces``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from dmuon.plan.plan import Plan
from dmuon.rules.qk_clip import AttentionHeads, QKClip, clip_factors, row_factors
from dmuon.util.dtensor import local_tensor


class AttentionClip:
    """A :class:`~dmuon.rules.qk_clip.QKClip` bound to one optimizer's model and, once set up, its plan.

    Args:
        config: The layers, ``tau`` and ``alpha``.
        params: The model's parameters by name (wrappers' name parts left out).
        names: Parameter (by id) -> its name there, to resolve layers given by parameter.

    Raises:
        ValueError: Naming the layer and parameter, for a parameter the model does not have,
            one with fewer than two dims, or heads whose rows run past its rows or overlap.
    """

    def __init__(self, config: QKClip, params: dict[str, torch.Tensor], names: dict[int, str]) -> None:
        self.config = config
        self.param_names: dict[str, tuple[str, str]] = {}
        """Layer key -> the names of its query and key parameters."""
        self.head_start: dict[str, int] = {}
        """Layer key -> its first query head in the reported maxima."""
        self.kv_start: dict[str, int] = {}
        """Layer key -> its first key head in the agreed maxima."""
        heads_to_kv: list[int] = []
        for key in config.order:
            layer = config.layers[key]
            query, keys = (self._resolve(key, which, getattr(layer, which), params, names)
                           for which in ("query", "key"))
            spans = (("query", query, layer.query_rows, layer.num_heads, layer.head_dim + layer.rope_dim),
                     ("key", keys, layer.key_rows, layer.kv_heads, layer.head_dim + layer.value_dim))
            for which, name, (start, stop), count, span in spans:
                p = params[name]
                if p.ndim < 2:
                    raise ValueError(f"qk_clip layer {key!r}: {which} parameter {name!r} has {p.ndim} dims; "
                                     "QK-clip scales the rows of a projection matrix")
                if stop > p.shape[0]:
                    raise ValueError(
                        f"qk_clip layer {key!r}: {which} parameter {name!r} has {p.shape[0]} rows, but {count} "
                        f"heads of {span} rows from row {start} need rows {start}:{stop} (check num_heads, "
                        "num_kv_heads, head_dim, rope_dim, value_dim, query_row and key_row)")
            if query == keys and max(layer.query_rows[0], layer.key_rows[0]) < min(layer.query_rows[1],
                                                                                     layer.key_rows[1]):
                raise ValueError(f"qk_clip layer {key!r}: the query rows {layer.query_rows} and key rows "
                                 f"{layer.key_rows} of {query!r} overlap; set key_row past the query rows")
            self.param_names[key] = (query, keys)
            self.head_start[key] = len(heads_to_kv)
            self.kv_start[key] = sum(config.layers[k].kv_heads for k in self.kv_start)
            group = layer.num_heads // layer.kv_heads
            heads_to_kv += [self.kv_start[key] + h // group for h in range(layer.num_heads)]
        self._head_to_kv = torch.tensor(heads_to_kv, dtype=torch.int64)
        self.kv_heads = sum(config.layers[k].kv_heads for k in config.order)
        """Key heads of every layer: the number of values the step agrees on."""
        self._reported: torch.Tensor | None = None
        self.device: torch.device | None = None
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        """Plan index -> this rank's rows of the matrix: each local row's key head (-1: not
        scaled) and its power (on the device), and the key heads it has rows of (on the host)."""
        self.last_maxima: dict[str, torch.Tensor] = {}
        """Layer key -> the last applied step's agreed maximum per key head (float32, CPU)."""

    @staticmethod
    def _resolve(key: str, which: str, ref, params: dict[str, torch.Tensor], names: dict[int, str]) -> str:
        if isinstance(ref, str):
            if ref not in params:
                raise ValueError(f"qk_clip layer {key!r}: the model has no parameter {ref!r} ({which}); names are "
                                 "model.named_parameters()'s without wrappers' parts (_checkpoint_wrapped_module, "
                                 "_orig_mod)")
            return ref
        name = names.get(id(ref))
        if name is None:
            raise ValueError(f"qk_clip layer {key!r}: the {which} tensor (shape {tuple(ref.shape)}) is not a "
                             "parameter of the model; give the parameter or its name")
        return name

    # ------------------------------------------------------------------ setup
    def bind(self, plan: Plan, matrix_indices: Callable[[torch.Tensor], list[int]],
             params: dict[str, torch.Tensor]) -> None:
        """This rank's rows of every clipped matrix, from the plan (on every rank, once set up).

        Raises:
            ValueError: For a query or key parameter that is not a Muon matrix of the plan (QK-clip
                scales rows after dmuon's update), or a stack of experts.
        """
        self.device = plan.device
        column = plan.position[1]
        by_param: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        where: dict[str, tuple[str, str]] = {}
        for key in self.config.order:
            layer: AttentionHeads = self.config.layers[key]
            for which, name in zip(("query", "key"), self.param_names[key]):
                rows, heads, powers = layer.scaled_rows(self.config.alpha)[which]
                by_param.setdefault(name, []).append((rows, heads + self.kv_start[key], powers))
                where.setdefault(name, (key, which))
        self.rows = {}
        for name, parts in by_param.items():
            rows, heads, powers = (torch.cat(t) for t in zip(*parts))
            try:
                indices = matrix_indices(params[name])
            except KeyError:
                key, which = where[name]
                raise ValueError(
                    f"qk_clip layer {key!r}: the {which} parameter {name!r} is not one of the optimizer's Muon "
                    "matrices (QK-clip scales rows after dmuon's update); select it with dmuon.prepare(select=...) "
                    "or leave the layer out") from None
            first = 0  # the matrix's first row in the parameter (row groups follow each other)
            for i in indices:
                info = plan.infos[i]
                if info.expert is not None:
                    key, which = where[name]
                    raise ValueError(f"qk_clip layer {key!r}: {name!r} is a stack of experts; QK-clip scales "
                                     "rows of a projection matrix")
                piece = info.pieces[column]
                low = first + piece.row
                here = (rows >= low) & (rows < low + piece.rows)
                if here.any():
                    head = torch.full((piece.rows,), -1, dtype=torch.int64)
                    power = torch.zeros(piece.rows)
                    head[rows[here] - low] = heads[here]
                    power[rows[here] - low] = powers[here]
                    # The map on the device (the clip computes there), its key heads on the host (checked there).
                    self.rows[i] = (head.to(self.device), power.to(self.device), heads[here].unique())
                first += info.shape[0] if info.group is not None else 0

    # ---------------------------------------------------------------- reports
    def report(self, key: str, max_logits: torch.Tensor, first_head: int = 0) -> None:
        """Takes one forward's maxima of layer ``key``'s heads ``first_head, first_head + 1, ...``.

        Raises:
            ValueError: Naming the layer, for an unknown key, heads past the layer's, or a tensor
                of more than one dim. TypeError for a DTensor (pass its local heads).
        """
        layer = self.config.layers.get(key)
        if layer is None:
            raise ValueError(f"qk_clip has no layer {key!r}; its layers: {list(self.config.order)[:8]}")
        if isinstance(max_logits, DTensor):
            raise TypeError(f"qk_clip layer {key!r}: report this rank's heads as a plain tensor (to_local()) "
                            "with first_head= their first head; a DTensor's full value would need a collective")
        if not isinstance(max_logits, torch.Tensor) or max_logits.ndim > 1:
            raise ValueError(f"qk_clip layer {key!r}: expected a 1-D tensor of per-head maxima, got "
                             f"{type(max_logits).__name__}{tuple(getattr(max_logits, 'shape', ()))}")
        values = max_logits.detach().reshape(-1)
        if isinstance(first_head, bool) or not isinstance(first_head, int) or first_head < 0 or \
                first_head + values.numel() > layer.num_heads:
            raise ValueError(f"qk_clip layer {key!r}: {values.numel()} maxima from head {first_head!r} run past "
                             f"its {layer.num_heads} query heads")
        if self._reported is None:
            self._reported = torch.zeros(self._head_to_kv.numel(), device=values.device)
        values = values.to(device=self._reported.device, dtype=torch.float32)
        # A non-finite maximum says the forward overflowed: tau / inf would zero the head for good.
        values = torch.where(torch.isfinite(values), values, 0.0)
        start = self.head_start[key] + first_head
        part = self._reported[start : start + values.numel()]
        torch.maximum(part, values, out=part)

    def step_maxima(self) -> torch.Tensor:
        """This rank's maximum per key head since the last step (0 where nothing was reported)."""
        device = self._reported.device if self._reported is not None else self.device
        out = torch.zeros(self.kv_heads, device=device)
        if self._reported is not None:
            out.scatter_reduce_(0, self._head_to_kv.to(device), self._reported, "amax")
        return out

    def reset(self) -> None:
        """Forgets the reports (after every ``step()``, applied or skipped)."""
        if self._reported is not None:
            self._reported.zero_()

    # ------------------------------------------------------------------- clip
    def agreed(self, maxima: torch.Tensor) -> torch.Tensor:
        """Takes a step's maxima over every rank (per key head, every layer's in :attr:`QKClip.order`):
        keeps them per layer (:attr:`last_maxima`) and returns each key head's factor ``gamma``."""
        self.last_maxima = {key: maxima[self.kv_start[key] : self.kv_start[key] + self.config.layers[key].kv_heads]
                            for key in self.config.order}
        return clip_factors(maxima, self.config.tau)

    @torch.no_grad()
    def clip(self, plan: Plan, active: list[int], maxima: torch.Tensor) -> None:
        """Scales this rank's rows of the step's updated matrices by the agreed maxima's factors."""
        gamma = self.agreed(maxima)
        clipped = gamma < 1.0  # on the host: the agreement landed there, no device sync
        if not clipped.any():
            return
        column = plan.position[1]
        on_device = None  # one small copy to the device per step that clips anything
        for i in active:
            if i not in self.rows:
                continue
            head, power, heads = self.rows[i]
            if not clipped[heads].any():
                continue
            if on_device is None:
                on_device = gamma.to(head.device)
            info = plan.infos[i]
            view = info.local_view(local_tensor(info.param), column)
            view.mul_(row_factors(on_device, head, power).view(-1, *[1] * (view.ndim - 1)))


class AttentionClipMethods:
    """QK-clip's methods of :class:`dmuon.optim.dmuon.DMuon` (a mixin: they read the optimizer's
    :class:`AttentionClip`, ``_qk``, None without ``qk_clip``)."""

    @torch.compiler.disable  # bookkeeping on a buffer outside the graph; a compiled forward breaks here
    def report_attention_logits(self, layer: str, max_logits: torch.Tensor, first_head: int = 0) -> None:
        """QK-clip: this rank's largest pre-softmax attention logit per query head of ``layer``.

        Call it from the layer's forward (or anywhere before ``step()``) with the maximum over
        this rank's tokens of ``q . k * softmax_scale`` (masked positions left out): an eager
        ``scores.amax((0, 2, 3))``, or FlexAttention's ``max_scores`` (accelerators only) reduced
        over batch and positions once checked to be on that scale.
        Every call between two ``step()`` calls counts (accumulation micro-batches,
        recomputation): the step takes their maximum, and then the maximum over every rank,
        carried with the step's agreement (no collective of its own). It issues no collective and
        does not synchronize the device.

        Args:
            layer: The layer's key in ``qk_clip.layers``.
            max_logits: 1-D, one value per query head, heads ``first_head, first_head + 1, ...``;
                any float dtype and device, detached here.
            first_head: The first head ``max_logits`` covers (tensor parallelism: this rank's first
                local head), so a rank may report only the heads it computes.

        What is left out, by design: a NaN or infinite value (the forward already overflowed, and
        ``tau / inf`` would zero the head for good), a value ``<= tau`` (nothing to clip), a head
        nobody reported, a layer with no report this step: those heads are not clipped. A skipped
        step (``nonfinite="skip"``) clips nothing and its reports are dropped.

        Raises:
            ValueError: Without ``qk_clip``, for an unknown layer or heads past its ``num_heads``
                (naming the layer); TypeError for a DTensor (pass ``to_local()`` and ``first_head``).
        """
        me = self._me()
        if me._qk is None:
            raise ValueError("report_attention_logits needs QK-clip: build the optimizer with "
                             "qk_clip=dmuon.QKClip(layers={...})")
        me._qk.report(layer, max_logits, first_head)

    @property
    def attention_clip(self) -> AttentionClip | None:
        """QK-clip's runtime part (the logits reported this step, the clip after it); None without ``qk_clip``."""
        return self._qk

    def last_attention_logits(self) -> dict[str, torch.Tensor]:
        """QK-clip: per layer, the last applied step's largest logit per key head over every rank
        (what its factors came from; float32, on the CPU). Empty before the first applied step."""
        me = self._me()
        return {} if me._qk is None else dict(me._qk.last_maxima)
