"""Many scenarios in one process group, each with its own result or its own error (run inside spawned ranks).

A spawn costs more than most scenarios, so a worker runs several in turn on the same ranks. Without
care, a Python exception in one of them kills the rank, the launcher ends the others, and every test
that reads the run fails with one traceback. :func:`run_each` catches a scenario's exception, agrees
with the other ranks on what happened, and returns :class:`ScenarioFailed` (``{"error": text}``) for that
scenario only; a test that reads anything else from it fails with that text.

Keeping the ranks together: after each scenario every rank takes part in one gather on a group of its
own (:func:`_side_group`), so a rank whose scenario raised never issues a collective the others do not.
A rank still waiting in one of the scenario's collectives reaches the gather once that collective
fails or times out (the process group's timeout); the gather waits that long and a minute more. If the
ranks then stand at different points of the default group's collective sequence (a rank raised where
the others went into a collective), that group is out of step for good: no later scenario, nor the
launcher's closing barrier, can run on it, so every rank raises an error naming the scenario with the
ranks' tracebacks, and the whole run fails with that text. A rank that does not reach the gather in time
raises its scenario's exception, and the run fails as it would without this module. A scenario that
raised a :class:`~dmuon.testing.stream_check.StreamOrderError` (the CPU stream checker's) skips the agreement:
the checker raises mid-step, where the other ranks wait in the step's collectives until the group's
timeout, so the rank raises at once and the launcher ends every rank.
"""

from __future__ import annotations

import functools
import traceback
from datetime import timedelta
from typing import Any, Callable, Hashable, Mapping

import torch
import torch.distributed as dist

from dmuon.testing.stream_check import StreamOrderError


class ScenarioFailed(dict):
    """A scenario's result when it raised on some rank: ``{"error": text}``, the text naming the scenario,
    the ranks and their tracebacks. Reading any other key fails (an AssertionError with the text), so
    the test that reads this scenario fails with the cause and the others do not notice."""

    def __init__(self, text: str) -> None:
        super().__init__(error=text)

    def _fail(self, key: Any) -> AssertionError:
        return AssertionError(f"the scenario failed in its ranks, so it has no {key!r}:\n{dict.get(self, 'error')}")

    def __getitem__(self, key: Any) -> Any:
        if key == "error":
            return dict.__getitem__(self, key)
        raise self._fail(key)

    def get(self, key: Any, default: Any = None) -> Any:
        if key == "error":
            return dict.__getitem__(self, key)
        raise self._fail(key)


_side = None
"""This rank's group for the agreement after each scenario (one per rank process)."""

_MARGIN_S = 60.0
"""How much longer than the default group's timeout the agreement waits for a rank."""


def _side_group():
    """A gloo group over every rank for the agreement only, created once per rank process: its
    collectives never interleave with a scenario's, whichever point a scenario stopped at."""
    global _side
    if _side is None:
        world = dist.group.WORLD
        # The default group's timeout (how long a rank can wait in a scenario's collective), when torch
        # exposes it; 10 minutes, the longest any test gives its ranks, otherwise.
        options = getattr(world._get_backend(torch.device("cpu")), "options", None)
        timeout = getattr(options, "_timeout", None) or timedelta(minutes=10)
        _side = dist.new_group(backend="gloo", timeout=timeout + timedelta(seconds=_MARGIN_S))
    return _side


def run_each(scenarios: Mapping[Hashable, Callable[[], Any]]) -> dict[Hashable, Any]:
    """Runs each scenario in turn (the same order on every rank) and returns ``{name: its result}``, or
    :class:`ScenarioFailed` for a scenario that raised on any rank (on every rank, with the ranks' texts)."""
    side = _side_group()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out: dict[Hashable, Any] = {}
    for name, scenario in scenarios.items():
        raised = None
        try:
            out[name] = scenario()
        except Exception as exc:
            if _from_the_stream_checker(exc):
                # An unordered hand-over, raised mid-step (in a hook, a worker thread): the other ranks wait in
                # the step's collectives, where the agreement would wait for them until the group's timeout.
                # The rank leaves now, and the launcher ends the others.
                raise
            raised = exc
            text = f"rank {rank}: {traceback.format_exc()}"
        sequence = dist.group.WORLD._get_sequence_number_for_group()
        states: list = [None] * world_size
        try:
            dist.all_gather_object(states, (None if raised is None else text, sequence), group=side)
        except Exception:
            if raised is not None:
                # The others did not come: they wait in a collective this rank left. Fail as without this
                # module (the launcher ends every rank), with the scenario's own error.
                raise raised
            raise
        errors = [t for t, _ in states if t is not None]
        if errors:
            text = f"scenario {name!r} raised on {len(errors)} of {world_size} ranks:\n" + "\n".join(errors)
            sequences = [s for _, s in states]
            if len(set(sequences)) > 1:
                raise RuntimeError(f"{text}\nand left the ranks at different points of the default group's "
                                   f"collectives (sequence numbers {sequences}): the run cannot go on")
            out[name] = ScenarioFailed(text)
    return out


def _from_the_stream_checker(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was raised while handling or because of, a :class:`StreamOrderError`."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, StreamOrderError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def succeeded(result: Any) -> Any:
    """``result`` itself, or an AssertionError with the ranks' text when it is :class:`ScenarioFailed`: for
    a test that reads a result other than through its keys (a string, a list, a comparison)."""
    if isinstance(result, ScenarioFailed):
        raise AssertionError(f"the scenario failed in its ranks:\n{dict.get(result, 'error')}")
    return result


def run_grouped(scenarios: Mapping[tuple[Hashable, Hashable], Callable[[], Any]]) -> dict[Hashable, dict]:
    """:func:`run_each` over ``{(group, name): scenario}``: the results as ``{group: {name: result}}``."""
    out: dict[Hashable, dict] = {}
    for (group, name), result in run_each(scenarios).items():
        out.setdefault(group, {})[name] = result
    return out


def run_listed(scenarios: list[Callable[[], Any]]) -> list[Any]:
    """:func:`run_each` over a list: the results in the list's order."""
    return list(run_each(dict(enumerate(scenarios))).values())


def shared_runs(on_ranks: Callable[[int, int], dict], world_size: int, timeout_s: float = 300.0
                ) -> Callable[[Hashable], list]:
    """One launch of ``on_ranks`` (each rank returning :func:`run_each`'s ``{name: result}``) that several tests
    read: ``runs(name)`` gives each rank's result of ``name`` (its error raised again where it raised, through
    :func:`succeeded`). The ranks start at the first read, once per test process."""

    @functools.cache
    def launched() -> list[dict]:
        from support.spawn import run_distributed

        return run_distributed(on_ranks, world_size, timeout_s=timeout_s)

    def runs(name: Hashable) -> list:
        return [succeeded(r[name]) for r in launched()]

    return runs


class LaunchesByWorld:
    """Each world size's runs of ``on_ranks(rank, world, part)`` in one launch, read by several tests, except on
    ``split_world`` ranks: there two launches, ``part="default"`` with the runs named in ``by_default`` and
    ``part="rest"`` with the others, so that a default run (whose tests read only the first) starts no more."""

    def __init__(self, on_ranks: Callable[[int, int, str], dict], split_world: int, by_default: tuple,
                 timeout_s: float = 600.0) -> None:
        self.on_ranks, self.split_world, self.by_default, self.timeout_s = on_ranks, split_world, by_default, timeout_s

    def keep(self, part: str, runs: dict) -> dict:
        """Of ``runs`` (name -> run), those launch ``part`` holds: all of them for ``"all"``."""
        if part == "all":
            return runs
        return {name: run for name, run in runs.items() if (name in self.by_default) == (part == "default")}

    @functools.cache
    def _launched(self, world: int, part: str) -> list[dict]:
        from support.spawn import run_distributed

        return run_distributed(self.on_ranks, world, part, timeout_s=self.timeout_s)

    def __call__(self, world: int, name: Hashable) -> list:
        """Each rank's result of the run ``name`` on ``world`` ranks (its error raised again where it raised)."""
        part = "all" if world != self.split_world else "default" if name in self.by_default else "rest"
        return [succeeded(r[name]) for r in self._launched(world, part)]
