"""dmuon's owner exchange priced collective by collective (:func:`~dmuon.costmodel.collectives.owner_exchange_collectives`):
each hop's per-rank bytes and peers, as ``src/dmuon/comm/`` issues them."""

from __future__ import annotations

import math
from typing import Callable, Sequence

from dmuon.costmodel.backward_order import backward_with_returns, spread_backward
from dmuon.costmodel.collective import Collective, Parts, a2a, merge_parts, shard_rows, stage_parts
from dmuon.costmodel.rank_traffic import piece_table, published_wave
from dmuon.plan.hop_a import resolve_spread
from dmuon.plan.layout import position
from dmuon.plan.publication import DIRECT, SCATTER, choose_route, route_stages


class ExchangeModel:
    """The matrices' pieces and owners on an ``R x S`` mesh, and what each hop of dmuon's exchange moves.

    Args: as :func:`~dmuon.costmodel.collectives.owner_exchange_collectives` (validated there).
    """

    def __init__(self, shapes: Sequence[Sequence[int]], owners: Sequence[int], replicate: int, shard: int,
                 elem_bytes: int, pieces: Sequence[Sequence] | None, row_bytes: int, publication: str | None) -> None:
        self.shapes, self.owners = shapes, owners
        self.replicate, self.shard, self.world = replicate, shard, replicate * shard
        self.elem_bytes, self.row_bytes, self.publication = elem_bytes, row_bytes, publication
        self.tables = [piece_table(shp, shard, None if pieces is None else pieces[i]) for i, shp in enumerate(shapes)]
        self.inner = [math.prod(int(d) for d in shp[2:]) for shp in shapes]  # a conv kernel's elements per column
        self.first_col = [[True] * shard if pieces is None or pieces[i] is None else [p.col == 0 for p in pieces[i]]
                          for i in range(len(shapes))]

    # ------------------------------------------------------------- bytes of one matrix's part
    def piece(self, i: int, s: int) -> int:
        """Bytes of matrix ``i``'s update that come back to position ``s`` (with its rows' state)."""
        rows, cols, _ = self.tables[i][s]
        return rows * cols * self.inner[i] * self.elem_bytes + rows * self.row_bytes

    def direction_bytes(self, i: int, s: int) -> int:
        """Bytes of matrix ``i``'s direction position ``s`` sends (none from a copy)."""
        rows, cols, sends = self.tables[i][s]
        return rows * cols * self.inner[i] * self.elem_bytes if sends else 0

    def sent_bytes(self, i: int, s: int) -> int:
        """Bytes position ``s`` sends the owner of matrix ``i``: its direction piece and, from the
        box at column 0, its rows' state."""
        rows, _, sends = self.tables[i][s]
        return self.direction_bytes(i, s) + (rows * self.row_bytes if sends and self.first_col[i][s] else 0)

    def column_piece(self, i: int, r: int, s: int) -> int:
        """Bytes of the direction's column slice ``r`` position ``s`` sends to the owner's replica."""
        rows, cols, sends = self.tables[i][s]
        return rows * shard_rows(cols, self.replicate)[r] * self.inner[i] * self.elem_bytes if sends else 0

    def _fresh(self):
        world = self.world
        return [0] * world, [0] * world, [set() for _ in range(world)], [set() for _ in range(world)]

    # --------------------------------------------------------------------------- the hops
    def hop_a(self, members: list[int]) -> Parts:
        """Across replicas, each member's column slices to its owner's replica."""
        sent, received, out, inn = self._fresh()
        shard, owners = self.shard, self.owners
        for i in members:
            r_o = owners[i] // shard
            for s in range(shard):
                for r in range(self.replicate):
                    moved = self.column_piece(i, r, s)
                    if r != r_o and moved:
                        src, dst = r * shard + s, r_o * shard + s
                        sent[src] += moved
                        received[dst] += moved
                        out[src].add(dst)
                        inn[dst].add(src)
        return sent, received, out, inn, [any(self.direction_bytes(i, position(k, shard)[1]) for i in members)
                                          for k in range(self.world)]

    def hop_a_alone(self, b: int, members: list[int]) -> Collective:
        return a2a("inter", "backward", b, self.world, *self.hop_a(members), f"dmuon direction slices block {b}",
                   "hop_a")

    def within_owner_replica(self, members: Sequence[int], size: Callable[[int, int], int], to_owner: bool) -> Parts:
        """Inside each owner's replica, ``size(i, s)`` bytes of each member between every other shard
        position ``s`` and the member's owner, to it (hop B) or from it (hop 1); a replica owning none
        of them takes no part."""
        sent, received, out, inn = self._fresh()
        shard, owners = self.shard, self.owners
        for i in members:
            r_o, s_o = position(owners[i], shard)
            for s in range(shard):
                moved = size(i, s)
                if s != s_o and moved:
                    src, dst = (r_o * shard + s, owners[i]) if to_owner else (owners[i], r_o * shard + s)
                    sent[src] += moved
                    received[dst] += moved
                    out[src].add(dst)
                    inn[dst].add(src)
        owning = {owners[i] // shard for i in members}
        return sent, received, out, inn, [k // shard in owning for k in range(self.world)]

    def hop_b(self, b: int, members: list[int]) -> list[Collective]:
        if self.shard == 1:
            return []
        return [a2a("intra", "backward", b, self.world, *self.within_owner_replica(members, self.sent_bytes, True),
                    f"dmuon directions block {b}", "hop_b")]

    def return_shard(self, wave: Sequence[int]) -> Parts | None:
        """Hop 1 of a return: each owner's update pieces to its replica's shard positions."""
        return None if self.shard == 1 else self.within_owner_replica(wave, self.piece, False)

    def across(self, wave: Sequence[int]) -> tuple[str, list[Parts]]:
        """Hop 2 of a return: its route and the route's stages (one direct, or scatter then all-gather;
        none with one replica)."""
        if self.replicate == 1:
            return DIRECT, []
        replicate, shard, elem_bytes, row_bytes = self.replicate, self.shard, self.elem_bytes, self.row_bytes
        published = published_wave(wave, self.owners, shard, self.tables, self.inner)
        route = self.publication or choose_route(published, replicate, shard, elem_bytes, row_bytes)
        return route, [stage_parts(st) for st in route_stages(route, published, replicate, shard, elem_bytes,
                                                                row_bytes, peers=True)]

    # ------------------------------------------------------------------ backward and step
    def backward(self, order: list[int], blocks: Sequence[int], gradient_bytes: int | None, hop_a_spread: int | None,
                 returns_in_backward: bool) -> tuple[list[Collective], list[int]]:
        """The backward's collectives in issue order, and the blocks whose return goes in backward."""
        replicate, world = self.replicate, self.world
        returns = (self.return_shard, self.across) if returns_in_backward and world > 1 else None
        if returns is not None and (replicate == 1 or gradient_bytes is None):
            return backward_with_returns(order, blocks, replicate, world, self.hop_a_alone, self.hop_b, *returns)
        if replicate == 1 or gradient_bytes is None:
            backward: list[Collective] = []
            for b in order:
                members = [i for i in range(len(self.shapes)) if blocks[i] == b]
                if members:
                    backward += ([self.hop_a_alone(b, members)] if replicate > 1 else []) + self.hop_b(b, members)
            return backward, []
        return spread_backward(order, blocks, self.tables, self.inner, self.owners, replicate, self.shard,
                               self.elem_bytes, gradient_bytes, resolve_spread(hop_a_spread, returns_in_backward),
                               self.hop_b, returns)

    def step(self, waves: list[list[int]], labelled: bool) -> list[Collective]:
        """The step's returns, wave by wave: hop 1 inside each owner's replica, then across replicas (the
        scatter route's all-gather of a wave riding in the next wave's first collective across)."""
        step: list[Collective] = []
        world = self.world
        # The scatter route's all-gather of the wave before (its wave, label and parts): it travels in
        # this wave's first collective across replicas.
        gathering: tuple[int, str, Parts] | None = None
        for w, wave in enumerate(waves):
            label = f" wave {w}" if labelled else ""
            hop1 = self.return_shard(wave)
            if hop1 is not None:
                step.append(a2a("intra", "step", None, world, *hop1, "dmuon updates to the shard columns" + label,
                                "return_shard", w))
            if self.replicate > 1:
                route, stages = self.across(wave)
                first = stages[0]
                name = "dmuon updates to the replicas" if route == DIRECT else "dmuon update slices to the replicas"
                name += label
                if gathering is not None:
                    first = merge_parts(first, gathering[2])
                    name += f" + the slices' all-gather{gathering[1]}"
                step.append(a2a("inter", "step", None, world, *first, name,
                                "return_replicas" if route == DIRECT else "return_scatter", w))
                step[-1].carries_gather = None if gathering is None else gathering[0]
                gathering = (w, label, stages[1]) if route == SCATTER else None
        if gathering is not None:
            step.append(a2a("inter", "step", None, world, *gathering[2],
                            "dmuon update slices' all-gather" + gathering[1], "return_gather", gathering[0]))
        return step
