"""Settings for every test of the suite (tests/ and each package's tests)."""

import os

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


def pytest_collection_modifyitems(config, items):
    """Marks the compatibility subset (tests/support/compat.py) ``compat``; with ``-m compat``, a listed
    test that is not collected fails the run instead of leaving the subset."""
    import pytest

    from support.compat import COMPAT_TESTS

    found = set()
    for item in items:
        if item.nodeid in COMPAT_TESTS:
            item.add_marker(pytest.mark.compat)
            found.add(item.nodeid)
    if "compat" in (config.getoption("markexpr") or "") and not config.getoption("keyword"):
        # Run on the default paths, every listed test must be there; on chosen paths, those of their files.
        everything = config.args_source == pytest.Config.ArgsSource.TESTPATHS
        files = {item.nodeid.split("::")[0] for item in items}
        missing = sorted(t for t in COMPAT_TESTS - found if everything or t.split("::")[0] in files)
        if missing:
            raise pytest.UsageError("tests/support/compat.py lists tests that were not collected (renamed or "
                                    "removed?): " + ", ".join(missing))


def pytest_terminal_summary(terminalreporter):
    """Every native crash of a rank that the tests' launcher saw (support.spawn.run_distributed runs the
    function again once): the test, the rank, the signal and the rank's stacks, so a retry that let a
    test pass is still in plain sight."""
    from support.spawn import CRASHES

    if not CRASHES:
        return
    terminalreporter.section(f"ranks that died of a native crash ({len(CRASHES)})", yellow=True)
    for crash in CRASHES:
        outcome = "ran again on fresh ranks" if crash.retried else "no retry left: the test failed"
        terminalreporter.write_line(f"{crash.test}: {crash.launch}: rank {crash.rank} died of {crash.signal}; "
                                    f"{outcome}")
        for line in crash.stacks.splitlines():
            terminalreporter.write_line("    " + line)
