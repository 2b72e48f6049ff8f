"""The parameter store from inside: reads issued ahead in the recorded order, and writes of one weight
kept in order (what offload_parameters does as users see it is tested in test_params)."""

from __future__ import annotations

import torch
from helpers import Net, loss_of
from torch import nn

from offload import offload_parameters
from offload.params import materialized, offloaded, store_of


def test_prefetch_uses_the_recorded_order(nvme, closing):
    """From the second step on, fetches find their reads already issued (prefetch hits)."""
    torch.manual_seed(6)
    off = closing(offload_parameters(Net(), nvme, max_in_cpu=0, buffer_count=4, buffer_size=8192, prefetch=3))
    store = offloaded(off).store
    loss_of(off, 0).backward()
    assert store.prefetch_hits == 0
    loss_of(off, 1).backward()
    assert store.prefetch_hits > 0


class _LazyFuture:
    """Reports not-done until waited on, so a write left un-waited stays 'in flight' for the test."""

    def __init__(self, fut):
        self.fut, self.waited = fut, False

    def wait(self):
        self.waited = True
        return self.fut.wait()

    def done(self):
        return self.waited

    def digest(self):
        return self.fut.digest()


def test_a_weight_is_never_written_while_an_earlier_write_of_it_is_in_flight(nvme, closing, monkeypatch):
    """Writes of one weight's extent are ordered: requests complete in any order, so a new write is
    only issued once every earlier write of that extent has landed (else stale bytes could land last)."""
    torch.manual_seed(0)
    model = closing(offload_parameters(nn.Linear(256, 256), nvme_path=nvme, max_in_cpu=0))
    store = store_of(model.weight)
    issued: dict[int, list] = {}
    real_write = store.space.write

    def write(extent, buffer, **kw):
        earlier = issued.setdefault(extent.offset, [])
        assert all(f.waited for f in earlier), f"extent at {extent.offset} rewritten with a write in flight"
        fut = _LazyFuture(real_write(extent, buffer, **kw))
        earlier.append(fut)
        return fut

    monkeypatch.setattr(store.space, "write", write)
    for value in (1.0, 2.0):
        store.fetch(model.weight, read=False)
        model.weight.data.fill_(value)
        store.release(model.weight, dirty=True)
    monkeypatch.undo()
    with materialized(model):
        assert torch.equal(model.weight, torch.full((256, 256), 2.0))


def test_a_prefetched_parameter_is_read_from_disk_once(tmp_path):
    """prefetch then fetch of a weight spanning several pool buffers reads each block once: the blocks the
    prefetch read are used, and only the rest are read by the fetch (they were read twice, the prefetch's
    work thrown away)."""
    from offload import restore_parameters

    m = torch.nn.Linear(512, 512, bias=False).to(torch.bfloat16)
    offload_parameters(m, nvme_path=str(tmp_path), max_in_cpu=0, buffer_size=65536, buffer_count=3)
    try:
        store = offloaded(m).store
        before = store.bytes_read
        store.prefetch(m.weight)
        store.fetch(m.weight)
        store.release(m.weight)
        assert store.prefetch_hits == 1
        assert store.bytes_read - before == m.weight.numel() * m.weight.element_size()
    finally:
        restore_parameters(m)
