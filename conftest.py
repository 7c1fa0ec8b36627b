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
