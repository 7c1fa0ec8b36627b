"""Settings for every test of the suite (tests/ and each package's tests)."""

import dataclasses
import os
import sys

import pytest

# The CPU stream checker (dmuon.testing.stream_check) fails a test on an unordered hand-over between
# CUDA streams, at about twice a run's time: it watches the ranks of the tests whose point is stream
# order (marked ``streams``) and of no other. DMUON_CHECK_STREAMS set by the caller decides for every
# test instead (1: each rank checked, the thorough run; 0: none).
CHECK_ENV = "DMUON_CHECK_STREAMS"
_CALLERS_CHOICE = os.environ.get(CHECK_ENV)


def pytest_configure(config):
    config.check_streams_choice = _CALLERS_CHOICE  # what the caller set (None: per marker), for the tests of the rule


@pytest.fixture(autouse=True)
def _stream_checker(request, monkeypatch):
    """``$DMUON_CHECK_STREAMS`` for the ranks this test spawns (each rank installs the checker by it)."""
    if _CALLERS_CHOICE is None:
        monkeypatch.setenv(CHECK_ENV, "1" if request.node.get_closest_marker("streams") else "0")


# The default run takes two pytest-xdist workers (pyproject.toml's addopts: ``-n 2 --dist loadgroup``), each
# running a test file at a time: a file is one xdist group, so the launches its tests share (support.scenarios)
# and its module's caches stay in one process; files that read the same launches are one group by an
# ``xdist_group`` mark (tests/rules/test_muonh.py and test_dion2.py). Two launches then share the two cores,
# which one launch leaves partly idle while its ranks wait on each other's collectives. ``-n 0`` runs every test
# in this process (a debugger, ``-s``).


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Marks the compatibility subset (tests/support/compat.py) ``compat``; with ``-m compat``, a listed
    test that is not collected fails the run instead of leaving the subset. Puts each test in its file's
    pytest-xdist group unless it is marked with one."""
    from support.compat import COMPAT_TESTS

    found = set()
    for item in items:
        if item.nodeid in COMPAT_TESTS:
            item.add_marker(pytest.mark.compat)
            found.add(item.nodeid)
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    if "compat" in (config.getoption("markexpr") or "") and not config.getoption("keyword"):
        # Run on the default paths, every listed test must be there; on chosen paths, those of their files.
        everything = config.args_source == pytest.Config.ArgsSource.TESTPATHS
        files = {item.nodeid.split("::")[0] for item in items}
        missing = sorted(t for t in COMPAT_TESTS - found if everything or t.split("::")[0] in files)
        if missing:
            raise pytest.UsageError("tests/support/compat.py lists tests that were not collected (renamed or "
                                    "removed?): " + ", ".join(missing))


_CRASHES_ON_REPORTS = [0]
"""How many of this process's crashes (``support.spawn.CRASHES``) a test report carries already."""
_REPORTED_CRASHES: list[dict] = []
"""The crashes the reports carried, from this process or from each pytest-xdist worker."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Puts each native crash of a rank on the report of the test phase that saw it (the report reaches the
    process that prints the summary, a pytest-xdist worker's included)."""
    outcome = yield
    launcher = sys.modules.get("support.spawn")
    if launcher is None:
        return
    new = launcher.CRASHES[_CRASHES_ON_REPORTS[0]:]
    _CRASHES_ON_REPORTS[0] += len(new)
    outcome.get_result().user_properties.extend(("rank_crash", dataclasses.asdict(c)) for c in new)


def pytest_runtest_logreport(report):
    _REPORTED_CRASHES.extend(value for key, value in report.user_properties if key == "rank_crash")


def pytest_terminal_summary(terminalreporter):
    """Every native crash of a rank that the tests' launcher saw (support.spawn.run_distributed runs the
    function again once): the test, the rank, the signal and the rank's stacks, so a retry that let a
    test pass is still in plain sight."""
    if not _REPORTED_CRASHES:
        return
    terminalreporter.section(f"ranks that died of a native crash ({len(_REPORTED_CRASHES)})", yellow=True)
    for crash in _REPORTED_CRASHES:
        outcome = "ran again on fresh ranks" if crash["retried"] else "no retry left: the test failed"
        terminalreporter.write_line(f"{crash['test']}: {crash['launch']}: rank {crash['rank']} died of "
                                    f"{crash['signal']}; {outcome}")
        for line in crash["stacks"].splitlines():
            terminalreporter.write_line("    " + line)
