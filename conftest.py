"""Settings for every test of the suite (tests/ and each package's tests)."""

import os

from dmuon.util.spawn import CRASH_RETRIES_ENV

# A rank that dies of a native crash (SIGSEGV in torch's gloo ranks, about once in a few full runs, never
# twice in a row so far) runs its function again once, with a RuntimeWarning in pytest's summary; see
# dmuon.util.spawn.run_distributed. A Python exception or a wrong value still fails at once.
os.environ.setdefault(CRASH_RETRIES_ENV, "1")

# Every rank the suite spawns runs dmuon's streams under the CPU stream checker
# (dmuon.comm.stream_check): an unordered hand-over between CUDA streams fails the test here.
os.environ.setdefault("DMUON_CHECK_STREAMS", "1")


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
