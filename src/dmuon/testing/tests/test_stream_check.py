"""The stream checker itself: each rule raises on a deliberately broken hand-over and passes the correct one."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
import torch.distributed as dist

from dmuon.testing.stream_check import CheckedStreams, StreamOrderError


@pytest.fixture
def streams():
    checker = CheckedStreams().start()
    try:
        yield checker
    finally:
        checker.stop()


def test_a_read_on_another_stream_needs_an_event(streams):
    with streams.use("a"):
        x = torch.ones(4) * 2
        made = streams.record()
    with streams.use("b", fork=False):
        with pytest.raises(StreamOrderError, match=r"written on stream 'a'.*read on stream 'b'"):
            x + 1
    with streams.use("b", fork=False):
        streams.wait(made)
        assert (x + 1).sum().item() == 12


def test_a_fork_orders_what_came_before(streams):
    x = torch.ones(4) * 2  # compute
    with streams.use("dmuon"):
        assert (x * 3).sum().item() == 24


def test_a_write_over_another_streams_read_needs_an_event(streams):
    x = torch.ones(4) * 2
    with streams.use("ns"):  # forked: sees x
        y = x * 3
    with pytest.raises(StreamOrderError, match=r"written on stream 'compute'.*'ns' may still be reading"):
        x.add_(1)
    del y


def test_waits_on_fsdp2s_stream_and_on_compute_in_backward_raise(streams):
    event = streams.record()
    raised = []

    def in_a_backward_pass(grad):
        with streams.fsdp2_hook():
            with pytest.raises(StreamOrderError, match="FSDP2's post-reduce stream"):
                streams.wait(event)
        # The hook marked backward as running: the compute stream must not wait until FSDP2 finalizes.
        with pytest.raises(StreamOrderError, match="compute stream during backward"):
            streams.wait(event)
        with streams.use("dmuon"):
            streams.wait(event)
        raised.append(True)
        return grad

    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(in_a_backward_pass)
    y.sum().backward()
    assert raised == [True]


def test_a_reduction_called_by_hand_may_order_the_compute_stream(streams):
    # Pipeline schedules call FSDP2's post_backward outside autograd (REDUCE_GRAD): no backward compute
    # is queued for a wait on the compute stream to hold up, and the caller scales the gradients there.
    event = streams.record()
    with streams.fsdp2_hook():
        with pytest.raises(StreamOrderError, match="FSDP2's post-reduce stream"):
            streams.wait(event)
        with streams.use("compute", fork=False):
            streams.wait(event)


def test_a_storage_made_before_start_is_ordered_like_any_other():
    # FSDP2's sharded parameters exist before the runtime starts the checker: a read of one on dmuon's
    # stream and a write over it on the compute stream with no event between is the race it catches.
    weight = torch.ones(4)
    checker = CheckedStreams().start()
    try:
        with checker.use("dmuon"):
            weight.sum()
        with pytest.raises(StreamOrderError, match=r"made before the checker started.*written on stream 'compute'"
                                                   r".*'dmuon' may still be reading"):
            weight.mul_(2)
        with checker.use("dmuon"):
            weight.sum()
            read = checker.record()
        checker.wait(read)
        weight.mul_(2)  # ordered after the read
        with checker.use("dmuon", fork=False):
            with pytest.raises(StreamOrderError, match=r"written on stream 'compute'.*read on stream 'dmuon'"):
                weight.sum()
    finally:
        checker.stop()


def test_a_storage_made_before_start_is_not_tracked_for_reuse():
    # Which stream's pool it came from is unknown: its release frees nothing a stream's next allocation
    # could get back early (and its entry goes with it: a new storage at the same address starts clean).
    weight = torch.ones(4)
    checker = CheckedStreams().start()
    try:
        with checker.use("dmuon"):
            weight.sum()
        key = id(weight.untyped_storage())
        assert "made before the checker started" in checker._buffers[key].name
        del weight
        gc.collect()
        assert key not in checker._buffers
        torch.ones(4).mul_(2)  # no "freed while stream 'dmuon' may still use it"
    finally:
        checker.stop()


class _Done:
    def wait(self):
        return True


def _flight(streams, send, recv):
    # A collective as the checker sees one: the send read and the receive written on its own stream.
    return streams.issue(lambda: _Done(), reads=(send,), writes=(recv,))


def test_a_send_buffer_freed_before_its_stream_waited_is_caught_at_the_next_allocation(streams):
    with streams.use("dmuon"):
        send, recv = torch.ones(8) * 1, torch.empty(8)
        flight = _flight(streams, send, recv)
    flight.buffers = ()  # what NCCL holds after its first wait(): nothing
    with streams.use("ns", fork=False):
        streams.land(flight)  # lands on another stream, and keeps nothing for it
    del send
    gc.collect()
    with streams.use("dmuon"):
        with pytest.raises(StreamOrderError, match=r"freed while stream 'collective#\d+' may still use it"):
            torch.empty(8) * 1


def test_a_buffer_dropped_with_its_collective_never_landed_raises(streams):
    with streams.use("dmuon"):
        send = torch.ones(8) * 1
        _flight(streams, send, torch.empty(8))  # dropped: no stream ever waits for it
        del send
        gc.collect()
        with pytest.raises(StreamOrderError, match=r"collective#\d+, which uses it, was never landed"):
            torch.ones(1) + 1


def test_a_flight_keeps_its_buffers_for_the_landing_stream(streams):
    with streams.use("dmuon"):
        send = torch.ones(8) * 1
        recv = torch.empty(8)
        flight = _flight(streams, send, recv)
        del send, recv
        gc.collect()
    with streams.use("ns", fork=False):
        flight.wait()  # held by the flight until here, then kept for "ns"
    gc.collect()
    with streams.use("dmuon"):
        torch.empty(8) * 1  # may reuse the block: "ns" has waited for the collective


def test_a_thread_that_never_entered_the_device_raises(streams):
    errors = []

    def work():
        try:
            streams.record()
        except StreamOrderError as e:
            errors.append(str(e))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert errors and "without entering the device" in errors[0]

    def entered():
        streams.enter()
        with streams.use("ns", fork=False):
            streams.record()

    thread = threading.Thread(target=entered)
    thread.start()
    thread.join()


def test_a_collective_reads_what_its_issuing_stream_ordered(streams):
    with streams.use("ns"):
        produced = torch.ones(4) * 5
    # Issued from "dmuon" with no event from "ns": NCCL's stream would read the send early.
    with streams.use("dmuon", fork=False):
        with pytest.raises(StreamOrderError, match=r"written on stream 'ns'.*read on stream 'collective#"):
            _flight(streams, produced, torch.empty(4))


def test_gloo_all_reduce_through_the_checker():
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from support.spawn import run_distributed

    assert run_distributed(_all_reduce_worker, 2, timeout_s=60) == [[3.0, 3.0], [3.0, 3.0]]


def _all_reduce_worker(rank: int, world_size: int):
    streams = CheckedStreams().start()
    x = torch.full((2,), float(rank + 1))
    with streams.use("dmuon"):
        flight = streams.issue(lambda: dist.all_reduce(x, async_op=True), reads=(x,), writes=(x,))
        flight.wait()
        return x.tolist()


@pytest.fixture
def active_checker(streams):
    """``streams`` as the process's active streams (what Pending and the coalesced all-to-alls use)."""
    from dmuon.comm import device_streams

    with device_streams.installed(streams):
        yield streams


def test_a_pending_result_reaches_a_second_stream_behind_its_event_and_kept(active_checker):
    """Pending.wait on a second stream: it waits for the event recorded where the result was computed (a
    read before it would be unordered), and keeps the result for that stream (its release would otherwise
    give the memory back to the computing stream while the second still reads it)."""
    from dmuon.comm.pending import Pending
    from dmuon.comm.stats import CommStats

    streams = active_checker
    with streams.use("dmuon"):
        pending = Pending([], lambda: {0: torch.ones(8) * 3}, CommStats())
        computed = pending.wait()  # landed and computed on "dmuon"
    del computed
    with streams.use("ns", fork=False):  # ordered after "dmuon" only by the result's event
        assert pending.wait()[0].sum().item() == 24
    del pending
    gc.collect()
    with streams.use("dmuon", fork=False):
        # Reuses the result's memory with no wait for "ns": safe only because the result was kept for "ns"
        # (CUDA's record_stream: the allocator holds the block until "ns"'s work so far has run).
        torch.empty(8) * 1


def test_a_pending_lands_after_what_its_creator_made(active_checker):
    """Pending lands on the stream that first waits for it after that stream waited for the creator's
    stream as it was when the exchange was made: ``finish`` reads the creator's buffers (a local exchange
    has no collective to order them)."""
    from dmuon.comm.pending import Pending
    from dmuon.comm.stats import CommStats

    streams = active_checker
    with streams.use("dmuon"):
        made = torch.ones(8) * 2
        pending = Pending([], lambda: {0: made + 1}, CommStats())
    with streams.use("ns", fork=False):
        assert pending.wait()[0].sum().item() == 24


def test_a_coalesced_part_reaches_a_later_waiter_behind_the_copies_and_kept(active_checker):
    """The joined all-to-all lands once, on its first waiter's stream, which copies every part's bytes out;
    a part waited for on another stream waits for the event after the copies and keeps the parts' buffers
    for that stream."""
    from dmuon.comm.coalesce import _JoinedWork, _Part, _Queued

    streams = active_checker
    with streams.use("dmuon"):
        # The receive buffer as the collective leaves it (a loopback: the bytes sent), 4 float32 as bytes.
        send = torch.arange(4.0) * 1
        recv = send.clone().view(torch.uint8)
        flight = _flight(streams, send, recv)
        out = torch.empty(4)
        joined = _JoinedWork(flight, recv, [_Part(out, send, [4], [4], _Queued())], [[0]])
        del send, recv
        joined.wait()  # lands the collective and copies the part out, on "dmuon"
    with streams.use("ns", fork=False):
        joined.wait()
        assert (out * 1).tolist() == [0.0, 1.0, 2.0, 3.0]
    del out, joined, flight
    gc.collect()
    with streams.use("dmuon", fork=False):
        torch.empty(4) * 1  # may reuse the part's memory: it was kept for "ns"
