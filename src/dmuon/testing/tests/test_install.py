"""The stream checker runs where it is asked for: in a spawned rank with ``$DMUON_CHECK_STREAMS=1`` (the suite sets
it for the tests marked ``streams``), never in a process without a process group, and installing nothing leaves
dmuon's CPU streams the host's."""

from __future__ import annotations

import pytest

from dmuon.comm import device_streams
from dmuon.comm.streams import HostStreams
from dmuon.testing import CHECK_ENV, install_checker_from_env

from support.spawn import run_distributed


def _streams_kind(rank: int, world_size: int) -> str:
    streams = device_streams.streams_for("cpu")
    kind = type(streams).__name__
    if hasattr(streams, "stop"):
        streams.stop()
    return kind


@pytest.mark.parametrize("check, expected", [("1", "CheckedStreams"), ("0", "HostStreams")])
def test_a_spawned_rank_runs_under_the_checker_when_asked(monkeypatch, check, expected):
    monkeypatch.setenv(CHECK_ENV, check)
    assert run_distributed(_streams_kind, 2) == [expected, expected]


def test_no_checker_without_a_process_group(monkeypatch):
    monkeypatch.setenv(CHECK_ENV, "1")
    assert not install_checker_from_env()
    assert type(device_streams.streams_for("cpu")) is HostStreams


def _installed_then_removed(rank: int, world_size: int) -> list[str]:
    seen = [type(device_streams.streams_for("cpu")).__name__]
    device_streams.active().stop()
    device_streams.install_cpu_streams(None)
    seen.append(type(device_streams.streams_for("cpu")).__name__)
    return seen


def test_installing_none_builds_host_streams_again(monkeypatch):
    monkeypatch.setenv(CHECK_ENV, "1")
    assert run_distributed(_installed_then_removed, 1) == [["CheckedStreams", "HostStreams"]]


@pytest.mark.streams
def test_a_test_marked_streams_runs_its_ranks_under_the_checker(request):
    """The suite's rule (conftest.py): the marker asks for the checker in every rank the test spawns."""
    if request.config.check_streams_choice == "0":
        pytest.skip("DMUON_CHECK_STREAMS=0: the caller chose no checker for every test")
    assert run_distributed(_streams_kind, 2) == ["CheckedStreams", "CheckedStreams"]


def test_an_unmarked_test_runs_its_ranks_without_the_checker(request):
    if request.config.check_streams_choice == "1":
        pytest.skip("DMUON_CHECK_STREAMS=1: the caller chose the checker for every test")
    assert run_distributed(_streams_kind, 2) == ["HostStreams", "HostStreams"]
