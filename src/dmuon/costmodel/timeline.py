"""The simulation's event loop: tasks on per-rank streams, links and compute engines shared by
what runs on them at once (:class:`Timeline`). :mod:`dmuon.costmodel.simulate` builds one training
step's tasks (its module docstring says what they are) and runs them here."""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from dmuon.costmodel.collective import AlphaBeta, Collective

@dataclass(eq=False)
class Task:
    """One piece of work: compute on some ranks, or one collective."""

    name: str
    """What it is (a collective's label)."""
    stream: str
    """Per-rank FIFO queue it runs on."""
    seconds: list[float | None] | None
    """Compute seconds per rank (None where it does not run); None for a collective."""
    collective: Collective | None
    """The collective it runs (its ranks, bytes per rank, level, messages), or None for compute."""
    deps: list["Task"]
    """Done on a rank before this starts there (nothing, where the dependency does not run)."""
    barrier: list["Task"]
    """Done on every rank before this starts anywhere."""
    phase: str
    """``"forward"``, ``"backward"`` or ``"step"``."""
    kind: str
    """``"compute"``, ``"ns"``, ``"elementwise"``, ``"wait"`` or ``"collective"``."""
    ranks: list[int] = field(default_factory=list)
    """The ranks it runs on (set by :meth:`Timeline.run`)."""
    start: dict[int, float] = field(default_factory=dict)
    """Per rank, when it started (a collective: when the rank reached it)."""
    end: dict[int, float] = field(default_factory=dict)
    """Per rank, when it ended."""
    moving: float | None = None
    """A collective: when its latency was paid and its bytes started moving."""


BLOCKING_STREAM = "compute"
"""The rank's compute stream: a collective on it blocks the rank's thread (gloo), so the ranks meet there."""


class Timeline:
    """Tasks on ``world`` ranks and a run of them (:meth:`run`).

    ``sync_skew``: at a collective on :data:`BLOCKING_STREAM` the ranks meet; on a shared host they
    drift apart between meetings (the scheduler preempts each at its own moments), so the later
    one is behind by ``sync_skew`` x the compute seconds each ran since its previous meeting,
    added to the latency of every collective it issues until the next meeting (one on another
    stream, which the thread does not wait for, hides it if its landing is not waited for; 0:
    identical ranks meet at once). ``sync_delay``: seconds more of that delay at each such
    collective after any compute, whatever its length (a meeting per matrix costs more than the
    fraction alone says)."""

    def __init__(self, world: int, links: AlphaBeta, overlap: bool = True,
                 op_links: dict[str, AlphaBeta] | None = None, sync_skew: float = 0.0, sync_delay: float = 0.0):
        self.world, self.links, self.overlap = world, links, overlap
        self.op_links = op_links or {}
        self.sync_skew, self.sync_delay = sync_skew, sync_delay
        self.tasks: list[Task] = []

    def _add(self, task: Task) -> Task:
        if not self.overlap:
            # Serialised: one queue, each task after the previous one (that runs anywhere) has ended everywhere.
            task.stream = "serial"
            previous = next((t for t in reversed(self.tasks) if _runs_somewhere(t)), None)
            task.barrier = task.barrier + ([previous] if previous is not None else [])
        self.tasks.append(task)
        return task

    def compute(self, name: str, stream: str, seconds: float | Sequence[float | None], deps=(), *,
                phase: str, kind: str = "compute") -> Task:
        """Compute on every rank (``seconds`` a number) or per rank (a list, None: not there)."""
        per_rank = [float(seconds)] * self.world if isinstance(seconds, (int, float)) else list(seconds)
        return self._add(Task(name, stream, per_rank, None, _present(deps), [], phase, kind))

    def wait(self, name: str, stream: str, deps=(), *, phase: str) -> Task:
        """A point on ``stream`` (every rank) after its earlier work and ``deps``: takes no time."""
        return self._add(Task(name, stream, [0.0] * self.world, None, _present(deps), [], phase, "wait"))

    def collective(self, c: Collective, stream: str, deps=(), *, phase: str) -> Task:
        return self._add(Task(c.label, stream, None, c, _present(deps), [], phase, "collective"))

    # -- the run
    def run(self) -> None:
        """Runs every task; fills each task's per-rank ``start`` and ``end``.

        Events are ``(time, seq, what, payload)`` on one heap. Links share their bandwidth
        equally among the transfers on them (processor sharing), and a rank's compute engine
        its time among the compute tasks running at once, tracked in *virtual time*: the
        resource's virtual clock advances at ``rate / tasks``, and work W that joined at
        virtual time V ends when the clock reaches V + W.
        """
        classes = self._symmetry_classes()
        _EventLoop(self).run()
        stuck = [t.name for t in self.tasks if len(t.end) < len(t.ranks)]
        if stuck:
            raise RuntimeError(f"simulation deadlocked; first unfinished tasks: {stuck[:5]}")
        # Every rank of a class has its representative's times.
        for members in classes:
            for task in self.tasks:
                if members[0] in task.end:
                    for k in members[1:]:
                        task.start[k], task.end[k] = task.start[members[0]], task.end[members[0]]
        for task in self.tasks:
            task.ranks = [k for k, part in enumerate(_parts(task)) if part is not None]

    def _symmetry_classes(self) -> list[list[int]]:
        """Ranks given the same work in every task run the same timeline: one of each class (its
        lowest rank) is simulated, which sets every task's ``ranks`` to the representatives it runs on."""
        classes: dict[tuple, list[int]] = {}
        for k in range(self.world):
            classes.setdefault(tuple(_parts(t)[k] for t in self.tasks), []).append(k)
        simulated = sorted(members[0] for members in classes.values())
        for task in self.tasks:
            parts = _parts(task)
            task.ranks = [k for k in simulated if parts[k] is not None]
        return list(classes.values())

    def _wiring(self):
        """Per (rank, stream) its queue of task indices in issue order; per task and rank its number of
        unmet dependencies; per task who waits for it on the same rank (``after``) and everywhere
        (``after_all``, barriers); per task on how many ranks it still has to end (``left``)."""
        index = {id(t): n for n, t in enumerate(self.tasks)}
        here = [set(t.ranks) for t in self.tasks]
        queues: dict[tuple[int, str], deque] = {}
        for n, task in enumerate(self.tasks):
            for k in task.ranks:
                queues.setdefault((k, task.stream), deque()).append(n)
        unmet = [dict.fromkeys(t.ranks, 0) for t in self.tasks]
        after: list[list[int]] = [[] for _ in self.tasks]
        after_all: list[list[int]] = [[] for _ in self.tasks]
        left = [len(t.ranks) for t in self.tasks]
        for n, task in enumerate(self.tasks):
            for d in task.deps:
                m = index[id(d)]
                after[m].append(n)
                for k in task.ranks:
                    if k in here[m]:  # a dependency that does not run on k does not hold k up
                        unmet[n][k] += 1
            for d in task.barrier:
                m = index[id(d)]
                if left[m]:
                    after_all[m].append(n)
                    for k in task.ranks:
                        unmet[n][k] += 1
        return queues, unmet, after, after_all, left


def _parts(task: Task) -> list:
    """Per rank what the task gives it: compute seconds, or a collective's (sent, received); None: nothing."""
    return task.seconds if task.collective is None else task.collective.ranks


def _present(deps) -> list[Task]:
    """The dependencies that exist (a collective a strategy does not issue here is None)."""
    return [d for d in deps if d is not None]


def _runs_somewhere(task: Task) -> bool:
    return any(p is not None for p in _parts(task))


def _latency(c: Collective, links: AlphaBeta) -> float:
    return c.messages * (links.intra_latency if c.level == "intra" else links.inter_latency)


def _bandwidth(c: Collective, links: AlphaBeta) -> float:
    return links.intra_bandwidth if c.level == "intra" else links.inter_bandwidth


class _Shared:
    """A resource shared equally by the work on it: one direction of one rank's link at one level
    (bytes/s), or one rank's compute engine (seconds of work per second)."""

    def __init__(self, bandwidth: float):
        self.bandwidth = bandwidth
        self.virtual = 0.0   # work each task on it has had done since it was created
        self.at = 0.0        # real time of ``virtual``
        self.flows: list = []  # (virtual end, seq, owner)
        self.seq = 0
        self.version = 0

    def _advance(self, now: float) -> None:
        if self.flows:
            self.virtual += (now - self.at) * self.bandwidth / len(self.flows)
        self.at = now

    def join(self, now: float, nbytes: float, owner) -> None:
        self._advance(now)
        self.seq += 1
        heapq.heappush(self.flows, (self.virtual + nbytes, self.seq, owner))

    def finish(self, now: float) -> list:
        """The owners of the transfers that have ended by ``now``."""
        self._advance(now)
        # What would end within a negligible time (1e-12 of the clock) ends now: with fast
        # resources the remaining time can fall below the clock's resolution.
        slack = 1e-12 * max(now, 1e-9) * self.bandwidth / max(len(self.flows), 1)
        out = []
        while self.flows and self.flows[0][0] <= self.virtual + slack:
            out.append(heapq.heappop(self.flows)[2])
        return out

    def schedule(self, push, key) -> None:
        """Queues the next end of a transfer (any earlier queued one is void)."""
        self.version += 1
        if self.flows:
            remaining = max(self.flows[0][0] - self.virtual, 0.0)
            push(self.at + remaining * len(self.flows) / self.bandwidth, "share", (key, self.version))


class _EventLoop:
    """One run of a :class:`Timeline`'s tasks (:meth:`Timeline.run`): the event heap and the state the
    events change."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.tasks = timeline.tasks
        self.events: list = []
        self.seq = 0
        self.queues, self.unmet, self.after, self.after_all, self.left = timeline._wiring()
        self.arrived = [0] * len(self.tasks)
        # Compute seconds each rank has run since it last reached a collective on its compute stream
        # (one that blocks its thread), and per such collective the skew its latest rank brings.
        self.since = [0.0] * timeline.world
        self.skew: dict[int, float] = {}
        self.parts_left: dict[tuple[int, int], int] = {}  # transfers (or engine work) of a task on a rank still running
        self.shared: dict[tuple[int, str, str], _Shared] = {}  # (rank, level, direction) links and (rank, "engine", "")
        self.now = 0.0

    def push(self, t: float, what: str, payload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, what, payload))

    def run(self) -> None:
        for n, task in enumerate(self.tasks):
            for k in task.ranks:
                self.ready(n, k)
        while self.events:
            self.now, _, what, payload = heapq.heappop(self.events)
            if what == "done":
                self.done(*payload)
            elif what == "moved":
                self.moved(payload)
            elif what == "share":
                self.share(*payload)

    def ready(self, n: int, k: int) -> None:
        """Starts task n on rank k if it heads its stream there and nothing it needs is missing."""
        task, timeline = self.tasks[n], self.timeline
        if self.unmet[n][k] or self.queues[(k, task.stream)][0] != n or k in task.start:
            return
        task.start[k] = self.now
        if task.collective is not None:
            self.arrived[n] += 1
            if timeline.sync_skew or timeline.sync_delay:
                # A collective cannot end before its later rank has issued it; one that blocks the
                # threads (on the compute stream) also brings the ranks back in step.
                behind = timeline.sync_skew * self.since[k] + (timeline.sync_delay if self.since[k] > 0 else 0.0)
                self.skew[n] = max(self.skew.get(n, 0.0), behind)
                if task.stream == BLOCKING_STREAM:
                    self.since[k] = 0.0
            if self.arrived[n] == len(task.ranks):  # the last taking-part rank is here: it runs
                links = timeline.op_links.get(task.collective.op, timeline.links)
                self.push(self.now + _latency(task.collective, links) + self.skew.get(n, 0.0), "moved", n)
        elif task.seconds[k] == 0:
            self.push(self.now, "done", (n, k))
        else:
            # The rank's compute engine is shared by whatever runs on it at once (kernels of
            # several streams interleave), like a link's bandwidth: seconds of work at rate 1.
            self.parts_left[(n, k)] = 1
            engine = self.shared.setdefault((k, "engine", ""), _Shared(1.0))
            engine.join(self.now, task.seconds[k], (n, k))
            engine.schedule(self.push, (k, "engine", ""))

    def done(self, n: int, k: int) -> None:
        task = self.tasks[n]
        task.end[k] = self.now
        if task.seconds is not None and task.seconds[k]:
            self.since[k] += task.seconds[k]
        queue = self.queues[(k, task.stream)]
        queue.popleft()
        if queue:
            self.ready(queue[0], k)
        for m in self.after[n]:
            if k in self.unmet[m]:
                self.unmet[m][k] -= 1
                self.ready(m, k)
        self.left[n] -= 1
        if self.left[n] == 0:
            for m in self.after_all[n]:
                for j in self.tasks[m].ranks:
                    self.unmet[m][j] -= 1
                    self.ready(m, j)

    def moved(self, n: int) -> None:
        """A collective's latency is paid: every rank's bytes start moving."""
        timeline = self.timeline
        c = self.tasks[n].collective
        self.tasks[n].moving = self.now
        bandwidth = _bandwidth(c, timeline.links)
        # A kind with its own bandwidth occupies the level's link for bytes x (link's / its own).
        scale = bandwidth / _bandwidth(c, timeline.op_links[c.op]) if c.op in timeline.op_links else 1.0
        for k in self.tasks[n].ranks:
            flows = [(d, b) for d, b in zip(("tx", "rx"), c.ranks[k]) if b > 0]
            self.parts_left[(n, k)] = len(flows)
            if not flows:
                self.done(n, k)
            for direction, nbytes in flows:
                link = self.shared.setdefault((k, c.level, direction), _Shared(bandwidth))
                link.join(self.now, nbytes * scale, (n, k))
                link.schedule(self.push, (k, c.level, direction))

    def share(self, key: tuple[int, str, str], version: int) -> None:
        """A shared resource's next transfer (or engine work) may have finished."""
        resource = self.shared[key]
        if version != resource.version:
            return  # rescheduled since
        for n, k in resource.finish(self.now):
            self.parts_left[(n, k)] -= 1
            if self.parts_left[(n, k)] == 0:
                self.done(n, k)
        resource.schedule(self.push, key)
