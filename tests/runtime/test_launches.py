"""DMuon in one process: launches from backward, their check in step(), hook lifetime (the runtime with the real rule; runtime/tests/ drives it with a fake one)."""

from __future__ import annotations

import gc
import weakref

import torch

import dmuon

from support.models import OddNet, lm_loss, odd_batch

KW = dict(lr=0.02, adamw=dmuon.AdamWConfig(lr=3e-3), ns=dmuon.NSConfig(method="standard", dtype=torch.float32))


def _trained(overlap: bool, backwards_per_step: int, clip: float | None = None, clipped_overlap: bool = True):
    torch.manual_seed(0)
    model = OddNet()
    opt = dmuon.DMuon(model, execution=dmuon.ExecutionConfig(overlap=overlap, clipped_overlap=clipped_overlap),
                      **KW)
    kept = []
    for step in range(2):
        for k in range(backwards_per_step):
            lm_loss(model, odd_batch(step, k)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        kept.append(opt.last_step_stats()["blocks_exchanged_in_backward"])
    return {n: p.detach().clone() for n, p in model.named_parameters()}, kept


def test_a_launch_stands_only_for_the_gradients_step_uses():
    plain, kept = _trained(overlap=True, backwards_per_step=1)
    assert kept == [1, 1]  # one block in a single process, launched from backward and kept
    for backwards, clip, clipped_overlap in ((2, None, True), (1, 0.1, False)):
        # A second backward (accumulating without FSDP2's no-sync), or a clip without the owners'
        # momentum copies, changes the gradients after the launch: step() exchanges again, and the
        # result is exact.
        on, kept = _trained(overlap=True, backwards_per_step=backwards, clip=clip, clipped_overlap=clipped_overlap)
        off, _ = _trained(overlap=False, backwards_per_step=backwards, clip=clip)
        assert kept == [0, 0]
        assert all(torch.equal(on[n], off[n]) for n in on)
        assert any(not torch.equal(on[n], plain[n]) for n in on)
    # In one process the default (clipped_overlap=True) is clipped_overlap=False: a rescaled launch would
    # save no transfer there and cost the bits, so a clipped step forms its directions again, exactly
    # (several ranks, and loopback collectives, keep the rescaled launches: tests/conventions/test_clip.py, test_loopback.py).
    on, kept = _trained(overlap=True, backwards_per_step=1, clip=0.1)
    off, _ = _trained(overlap=False, backwards_per_step=1, clip=0.1)
    assert kept == [0, 0]
    assert all(torch.equal(on[n], off[n]) for n in on)


def _replaced_after_one_step():
    """A model trained one step by a DMuon, and a second DMuon loaded from the first's state."""
    torch.manual_seed(0)
    model = OddNet()
    first = dmuon.DMuon(model, **KW)
    lm_loss(model, odd_batch(0, 0)).backward()
    first.step()
    first.zero_grad()
    second = dmuon.DMuon(model, **KW)
    second.load_state_dict(first.state_dict())
    return model, first, second


def test_a_replaced_optimizer_leaves_no_hooks_behind():
    model, first, second = _replaced_after_one_step()
    runtime = weakref.ref(first.runtime)
    del first
    gc.collect()
    assert runtime() is None
    assert len(model.layers[0].up.weight._post_accumulate_grad_hooks) == 1
    lm_loss(model, odd_batch(1, 0)).backward()
    second.step()
    assert second.last_step_stats()["blocks_exchanged_in_backward"] == 1


def test_a_newer_optimizer_takes_the_hooks_even_while_the_old_one_lives():
    """A second DMuon on the same model (a resume that keeps the old optimizer referenced, or one not yet
    garbage-collected: on several ranks that moment differs) takes the parameters' hooks: the old one's
    launch nothing, so every rank issues the same collectives whatever its garbage collector does."""
    model, first, second = _replaced_after_one_step()
    lm_loss(model, odd_batch(1, 0)).backward()
    assert not first.runtime.backward._launches  # the old optimizer's hooks did nothing
    assert second.runtime.backward._launches
    second.step()
    assert second.last_step_stats()["blocks_exchanged_in_backward"] == 1
