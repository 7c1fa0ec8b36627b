import json
import os

import pytest
import torch

from dmuon.ortho import autotune as at
from dmuon.ortho.autotune import Autotuner
from dmuon.ortho.coefficients import KELLER, resolve_schedule

SCHED = resolve_schedule(KELLER, 5)


def _problem(tuner, shape=(16, 48), dtype=torch.float32):
    return tuner.problem(shape, dtype, "cpu", SCHED, 1e-7)


def _tmp_files(d):
    return [p for p in os.listdir(d) if p.endswith(".tmp")]


def test_cache_written_and_reused(tmp_path):
    t1 = Autotuner(tmp_path, repeats=1)
    p = _problem(t1)
    method = t1.method(p, "cpu")
    assert method in at.METHODS and t1.measurements == 1
    assert t1.batching(p, 4, method, "cpu") in (True, False) and t1.measurements == 2
    path = t1.cache_path(p.device)
    data = json.loads(path.read_text())
    assert data["header"] == {"schema": at.SCHEMA_VERSION, "torch": torch.__version__, "device": p.device}
    assert data["entries"][p.key()]["method"] == method
    assert not _tmp_files(tmp_path)

    # A fresh tuner (new process in real life) must reuse the file and never measure.
    t2 = Autotuner(tmp_path, repeats=1)

    def boom(*a, **k):
        raise AssertionError("measured despite a valid cache entry")

    t2._measure_method = boom
    t2._measure_batching = boom
    assert t2.method(p, "cpu") == method
    assert t2.batching(p, 4, method, "cpu") == data["entries"][p.key(4) + f"|method={method}"]["batched"]
    assert t2.measurements == 0
    # Same tuner: in-memory reuse too.
    t1.method(p, "cpu")
    assert t1.measurements == 2


def test_cached_decision_is_followed(tmp_path):
    # Forge a decision the measurement would be unlikely to produce and check it is used.
    t = Autotuner(tmp_path, repeats=1)
    p = _problem(t, shape=(8, 8))
    path = t.cache_path(p.device)
    path.write_text(json.dumps({"header": t._header(p.device), "entries": {p.key(): {"method": "gram"}}}))
    assert Autotuner(tmp_path).method(p, "cpu") == "gram"


@pytest.mark.parametrize(
    "content",
    ["{not json", "", "[]", json.dumps({"header": None}), "\x00\xff garbage",
     json.dumps({"header": {"schema": 1}, "entries": {"x": {"method": "gram"}}})],
)
def test_corrupt_file_is_ignored_and_replaced(tmp_path, content):
    t = Autotuner(tmp_path, repeats=1)
    p = _problem(t)
    path = t.cache_path(p.device)
    path.write_text(content, errors="surrogateescape")
    t.method(p, "cpu")
    assert t.measurements == 1
    data = json.loads(path.read_text())  # rewritten as a valid file
    assert data["header"]["device"] == p.device


@pytest.mark.parametrize("field,value", [("device", "cuda:Imaginary GPU 9000"), ("torch", "0.0.1"), ("schema", 999)])
def test_file_from_other_device_or_version_is_not_trusted(tmp_path, field, value):
    t = Autotuner(tmp_path, repeats=1)
    p = _problem(t)
    header = dict(t._header(p.device), **{field: value})
    entries = {p.key(): {"method": "gram", "times_s": {}}, p.key(4) + "|method=gram": {"batched": True}}
    t.cache_path(p.device).write_text(json.dumps({"header": header, "entries": entries}))

    calls = []
    real = t._measure_method

    def spy(*a, **k):
        calls.append(1)
        entry = real(*a, **k)
        entry["method"] = "standard"
        return entry

    t._measure_method = spy
    assert t.method(p, "cpu") == "standard"
    assert calls == [1]


def test_two_torch_releases_sharing_a_directory_keep_their_own_verdicts(tmp_path, monkeypatch):
    # Venvs of two torch releases pointed at one cache directory: each finds its verdicts after the other ran.
    t = Autotuner(tmp_path, repeats=1)
    p = _problem(t)
    t.method(p, "cpu")
    first = t.cache_path(p.device)
    assert t.measurements == 1 and first.exists()
    monkeypatch.setattr(torch, "__version__", "0.0.1-other")
    other = Autotuner(tmp_path, repeats=1)
    assert other.cache_path(p.device) != first
    other.method(p, "cpu")
    assert other.measurements == 1  # nothing of the first release's file is trusted
    assert other.cache_path(p.device).exists() and first.exists()
    monkeypatch.undo()
    again = Autotuner(tmp_path, repeats=1)
    again.method(p, "cpu")
    assert again.measurements == 0 and again.cache_path(p.device) == first


def test_malformed_entry_is_remeasured(tmp_path):
    t = Autotuner(tmp_path, repeats=1)
    p = _problem(t)
    t.cache_path(p.device).write_text(
        json.dumps({"header": t._header(p.device), "entries": {p.key(): {"method": "warp-drive"}}})
    )
    assert t.method(p, "cpu") in at.METHODS
    assert t.measurements == 1


def test_cache_dir_from_env_and_argument(tmp_path, monkeypatch):
    monkeypatch.setenv("DMUON_CACHE_DIR", str(tmp_path / "env"))
    assert at.default_cache_dir() == tmp_path / "env"
    assert Autotuner().cache_dir == tmp_path / "env"
    assert at.get_autotuner().cache_dir == tmp_path / "env"
    assert Autotuner(tmp_path / "arg").cache_dir == tmp_path / "arg"
    monkeypatch.delenv("DMUON_CACHE_DIR")
    assert at.default_cache_dir() == at.Path.home() / ".cache" / "dmuon"


def test_unwritable_cache_dir_does_not_break(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    t = Autotuner(blocker / "sub", repeats=1)  # a directory under a regular file
    p = _problem(t)
    assert t.method(p, "cpu") in at.METHODS
    assert t.method(p, "cpu") in at.METHODS and t.measurements == 1


def test_inaccurate_gram_is_never_chosen(tmp_path, monkeypatch):
    # Make Gram instant but wrong: the accuracy bar must reject it.
    monkeypatch.setattr(at, "gram_newton_schulz", lambda G, *a, **k: torch.zeros_like(G, dtype=a[3]))
    t = Autotuner(tmp_path, repeats=1)
    p = _problem(t, shape=(32, 128))
    assert t.method(p, "cpu") == "standard"
    entry = t.lookup(p)
    assert entry["gram_accurate"] is False and "gram" not in entry["times_s"]


def test_faster_accurate_method_is_chosen(tmp_path, monkeypatch):
    import time as _time

    real_ns = at.newton_schulz

    def slow_ns(*a, **k):
        _time.sleep(0.02)
        return real_ns(*a, **k)

    monkeypatch.setattr(at, "newton_schulz", slow_ns)
    t = Autotuner(tmp_path, repeats=1)
    assert t.method(_problem(t, shape=(16, 64)), "cpu") == "gram"


def test_bad_repeats():
    with pytest.raises(ValueError):
        Autotuner(repeats=0)


def test_plan_measures_joint_choice_once_and_caches(tmp_path):
    t = Autotuner(tmp_path, repeats=1)
    p = _problem(t, shape=(8, 24))
    method, batched = t.plan(p, 6, "cpu")
    assert method in at.METHODS and isinstance(batched, bool)
    n = t.measurements  # the single-matrix method entry plus the joint plan
    assert n == 2
    assert t.plan(p, 6, "cpu") == (method, batched) and t.measurements == n
    entry = t.lookup(p, 6) or t._entries(p.device)[p.key(6) + "|method=auto"]
    # Stacks are timed for the accurate methods within PLAN_SLACK of the best single-matrix time (which
    # ones that is depends on the timings: an 8x24 matrix takes microseconds, one hiccup makes a method 3x).
    single = t.lookup(p)
    best = min(single["times_s"].values())
    timed = {m for m, s in single["times_s"].items() if s <= at.PLAN_SLACK * best
             and (m != "gram" or single["gram_accurate"])}
    assert "standard" in single["times_s"] and "gram" in single["times_s"]
    assert set(entry["times_s"]) == {f"{m}|{mode}" for m in timed for mode in ("batched", "looped")}
    assert Autotuner(tmp_path).plan(p, 6, "cpu") == (method, batched)
    assert t.plan(p, 1, "cpu") == (t.method(p, "cpu"), False)
    with pytest.raises(ValueError):
        t.plan(p, 2, "cpu", method="nope")


def test_plan_excludes_inaccurate_gram(tmp_path, monkeypatch):
    monkeypatch.setattr(at, "gram_newton_schulz", lambda G, *a, **k: torch.zeros_like(G, dtype=a[3]))
    t = Autotuner(tmp_path, repeats=1)
    p = _problem(t, shape=(8, 24))
    assert t.plan(p, 4, "cpu")[0] == "standard"
    entry = t._entries(p.device)[p.key(4) + "|method=auto"]
    assert set(entry["times_s"]) == {"standard|batched", "standard|looped"}


def test_standard32_is_a_candidate_only_for_16bit_dtypes(tmp_path):
    t = Autotuner(tmp_path, repeats=1)
    p16, p32 = _problem(t, dtype=torch.bfloat16), _problem(t, dtype=torch.float32)
    t.method(p16, "cpu")
    t.method(p32, "cpu")
    assert "standard32" in t.lookup(p16)["times_s"]
    assert "standard32" not in t.lookup(p32)["times_s"]
    G = torch.randn(16, 48)
    out = at.run_method("standard32", G, p16)
    ref = at.newton_schulz(G, SCHED, 5, 1e-7, torch.float32).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)


def test_plan_does_not_retime_methods_far_slower_on_one_matrix(tmp_path):
    t = Autotuner(tmp_path, repeats=1)
    p = _problem(t, shape=(8, 24), dtype=torch.bfloat16)
    path = t.cache_path(p.device)
    single = {"method": "standard32", "gram_accurate": True,
              "times_s": {"standard": 1.0, "standard32": 0.010, "gram": 0.012}}
    path.write_text(json.dumps({"header": t._header(p.device), "entries": {p.key(): single}}))
    t = Autotuner(tmp_path, repeats=1)
    t.plan(p, 3, "cpu")
    entry = t._entries(p.device)[p.key(3) + "|method=auto"]
    assert {k.split("|")[0] for k in entry["times_s"]} == {"standard32", "gram"}


def _tune_in_a_process(cache_dir: str, barrier) -> int:
    tuner = Autotuner(cache_dir, repeats=1)
    p = tuner.problem((24, 72), torch.float32, "cpu", SCHED, 1e-7)
    barrier.wait()  # both processes ask at the same moment
    tuner.method(p, "cpu")
    tuner.plan(p, 3, "cpu")
    return tuner.measurements


def test_processes_sharing_a_cache_measure_each_problem_once(tmp_path):
    import multiprocessing as mp

    # Separate processes that share nothing but the cache directory. Forked from the forkserver, which
    # in a test session has imported torch and dmuon for the ranks already (a spawned process imports
    # them again: seconds of CPU each); where the platform lacks it, spawned.
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(2)
        with ctx.Pool(2) as pool:
            counts = pool.starmap(_tune_in_a_process, [(str(tmp_path), barrier)] * 2)
    # Two problems (the method and the joint plan), each measured once on this "host",
    # by whichever process took the lock first; without the lock each process measures both.
    assert sum(counts) == 2


def test_key_and_fingerprint_name_the_fp32_matmul_precision():
    # A verdict timed with TF32 allowed ("high") must not be reused with it off.
    from dmuon.ortho.autotune import Problem
    from dmuon.ortho.timing import device_fingerprint

    before = torch.get_float32_matmul_precision()
    try:
        seen = set()
        for setting in ("highest", "high"):
            torch.set_float32_matmul_precision(setting)
            fp = device_fingerprint("cpu")
            p = Problem(fp, torch.bfloat16, (64, 256), ((3.4445, -4.775, 2.0315),), 1e-7)
            assert f"fp32mm={setting}" in fp and f"fp32mm={setting}" in p.key()
            seen.add((fp, p.key(), p.key(4)))
        assert len({s[0] for s in seen}) == 2 and len({s[1] for s in seen}) == 2 and len({s[2] for s in seen}) == 2
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("threads, pauses", [(1, 0), (2, 2)])
def test_candidates_pause_only_where_a_second_thread_may_spin(monkeypatch, threads, pauses):
    # With one torch thread NumPy's BLAS is held to one thread too: no pool is left spinning
    # after a candidate, so there is nothing to wait out before the next.
    from dmuon.ortho import timing

    monkeypatch.setattr(timing, "COOLDOWN_S", 0.05)
    slept = []
    monkeypatch.setattr(timing.time, "sleep", slept.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    x = torch.randn(8, 8)
    timing.time_candidates({"a": lambda: x @ x, "b": lambda: x + x}, torch.device("cpu"), repeats=1)
    assert slept == [0.05] * pauses
    assert timing.default_cooldown_s(torch.device("cpu")) == 0.05 * (threads > 1)
    slept.clear()  # an explicit pause is kept whatever the thread count
    timing.time_candidates({"a": lambda: x @ x}, torch.device("cpu"), repeats=1, cooldown_s=0.01)
    assert slept == [0.01]
