"""dmuon.comm.streams: an exchange holds its buffers until it lands; time spans on the host and on a device."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from dmuon.comm import device_streams as streams_module
from dmuon.comm.exchange import ShardExchange
from dmuon.comm.stats import CommStats
from dmuon.comm.streams import HostStreams, Interval
from dmuon.comm.topology import from_mesh
from dmuon.plan.plan import MatrixInfo, row_pieces

from support.spawn import run_distributed

# Its point is stream order (the streams themselves): every rank runs under the stream checker.
pytestmark = pytest.mark.streams

SHAPES = [(6, 4), (5, 3)]


def _infos(world_size: int) -> list[MatrixInfo]:
    infos = []
    for k, shape in enumerate(SHAPES):
        info = MatrixInfo(index=k, name=f"m{k}", shape=shape, block=0, param=torch.zeros(shape))
        info.pieces = row_pieces(shape, world_size)
        info.owner = k % world_size
        infos.append(info)
    return infos


def _send_buffers_held_until_landed(rank: int, world_size: int) -> dict:
    topo = from_mesh(init_device_mesh("cpu", (world_size,)), replicated=False)
    infos = _infos(world_size)
    exchange = ShardExchange(infos, topo, CommStats(), torch.float32, torch.device("cpu"))
    sent = []
    cat = exchange.core.cat

    def remember(parts):
        buffer = cat(parts)
        sent.append((weakref.ref(buffer), buffer.clone()))
        return buffer

    exchange.core.cat = remember
    # NCCL keeps no reference to the buffers a caller may count on (it drops its stash at the first
    # wait()); gloo's handle holds them until it is freed. The collective runs at once here and its
    # handle holds nothing, so only what dmuon itself holds keeps the buffer.
    real = torch.distributed.all_to_all_single

    def all_to_all_single(out, inp, out_splits, in_splits, group=None, async_op=False):
        real(out, inp, out_splits, in_splits, group=group)
        return _Done()

    torch.distributed.all_to_all_single = all_to_all_single
    local = {k: torch.full((infos[k].rows[rank] * SHAPES[k][1],), float(10 * rank + k)) for k in range(len(SHAPES))}
    pending = exchange.send_directions([0, 1], local)
    (alive, copy), = sent
    gc.collect()
    # Nothing but the exchange refers to the send buffer now: NCCL drops its own reference at the first
    # wait(), so the exchange must hold it, unchanged, until the stream that consumes it has waited.
    held = alive() is not None and torch.equal(alive(), copy)
    full = pending.wait()
    return {"held": held, "owned": {k: v.tolist() for k, v in full.items()}}


class _Done:
    def wait(self) -> bool:
        return True


def test_an_exchange_holds_its_send_buffer_until_it_lands():
    out = run_distributed(_send_buffers_held_until_landed, 2, timeout_s=60)
    assert all(o["held"] for o in out)
    infos = _infos(2)
    for rank, o in enumerate(out):
        for k, rows in o["owned"].items():
            assert infos[k].owner == rank
            expected = [[float(10 * r + k)] * SHAPES[k][1] for r in range(2) for _ in range(infos[k].rows[r])]
            assert rows == expected


class _FakeTimingEvent:
    """A device event whose clock the test sets (CUDA events are not available on CPU)."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.synchronized = False

    def synchronize(self) -> None:
        self.synchronized = True

    def elapsed_time(self, end: "_FakeTimingEvent") -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as torch.cuda.Event's


class _TimedStreams(HostStreams):
    def __init__(self, stamps: list[float]) -> None:
        super().__init__()
        self.stamps = iter(stamps)

    def _timing_event(self):
        return _FakeTimingEvent(next(self.stamps))


def test_an_interval_reads_the_devices_events_and_the_hosts_clock():
    span = Interval()
    with HostStreams().interval() as span:
        sum(range(10000))
    assert span.host_seconds > 0 and span.device_seconds == span.host_seconds
    with _TimedStreams([2.0, 2.75]).interval() as timed:
        pass
    assert timed.device_seconds == 0.75
    assert timed._end.synchronized  # reading the device's figure waits for the span's end
    assert 0 <= timed.host_seconds < 0.75


def test_the_active_streams_follow_the_runtimes_device():
    before = streams_module.active()
    try:
        assert isinstance(streams_module.streams_for("cpu"), HostStreams)
        assert streams_module.active() is streams_module.streams_for("cpu")
    finally:
        streams_module._active = before
