"""Offloaded state changed on disk behind our back (bit flips, zeroed or overwritten ranges, truncated swap
files) is found at the next read, named, and never trained on or copied into a checkpoint."""

from __future__ import annotations

import copy
import errno
import os
import time

import pytest
import torch
from helpers import OPT, TINY, Net, assert_same, flip_bit, loss_of, restore, snapshot

from offload import OffloadedAdamW, StateError, offload_parameters, restore_parameters
from offload import checkpoint as ckpt
from offload.params import offloaded

SMALL = dict(buffer_size=256 * 1024, buffer_count=3, small_param_threshold=64, checksum=True)
CHECKED_TINY = {**TINY, "config": {"checksum": True}}
SIZES = (10, 5000, 70_000, 300_001)


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in SIZES]


def train(opt, params, steps):
    for s in steps:
        g = torch.Generator().manual_seed(s)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def unit_on_disk(opt, i: int) -> tuple[str, int, int]:
    """(swap file, file offset, bytes) of unit ``i`` (one nvme_path: logical offset = file offset), once the
    writes the last step left landing have landed (damage done while they land could be overwritten)."""
    store = opt.state_store
    store.drain()
    unit = store.layout.units[i]
    return store.space.files[0], unit.extent.offset, unit.nbytes


def zero_range(path, offset, nbytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(nbytes))


def overwrite_range(path, offset, nbytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(os.urandom(nbytes))


def test_with_default_settings_state_and_weights_overwritten_behind_our_back_are_found(nvme, closing):
    """Checksums are on by default: a unit of optimizer state, and offloaded weights, overwritten on disk
    between steps are named at the next read (StateError / a RuntimeError naming the parameter), never used."""
    params = make_params()
    opt = closing(OffloadedAdamW(params, lr=1e-2, nvme_path=nvme, buffer_size=256 * 1024, buffer_count=3,
                                 small_param_threshold=64))
    train(opt, params, [0, 1])
    middle = len(opt.state_store.layout.units) // 2  # not one a pool buffer still holds: it is read back
    path, offset, nbytes = unit_on_disk(opt, middle)
    overwrite_range(path, offset + 8192, 512)
    with pytest.raises(StateError, match="behind our back"):
        train(opt, params, [2])
    torch.manual_seed(0)
    model = Net()
    closing(offload_parameters(model, nvme_path=nvme + "-p", **TINY))
    loss_of(model, 0).backward()
    model.zero_grad()
    store = offloaded(model).store
    rec = store.records[model.blocks[0].up.weight]
    with open(store.space.files[0], "rb") as f:
        f.seek(rec.extent.offset)
        good = f.read(512)
    overwrite_range(store.space.files[0], rec.extent.offset, 512)
    with pytest.raises(StateError, match="behind our back") as info:
        loss_of(model, 1)
    assert "blocks.0.up.weight" in str(info.value)
    with open(store.space.files[0], "r+b") as f:  # put the bytes back, so the model can be restored at the end
        f.seek(rec.extent.offset)
        f.write(good)


@pytest.mark.parametrize("damage", ["flip", "zero", "overwrite"])
def test_changed_state_is_named_at_the_next_step_and_blocks_steps_until_restored(tmp_path, nvme, damage):
    """A unit's bytes changed on disk between steps: the next step raises StateError naming the swap file,
    the offset, the unit and the parameters, later steps and saves refuse, and loading the last good
    checkpoint brings training back bit for bit onto a run that was never damaged."""
    params, ref_params = make_params(), make_params()
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=nvme, **SMALL)
    ref = OffloadedAdamW(ref_params, lr=1e-2, nvme_path=str(tmp_path / "ref"), **SMALL)
    try:
        train(opt, params, [0, 1])
        train(ref, ref_params, [0, 1])
        opt.save_checkpoint(tmp_path / "good")
        good_weights = snapshot(params)
        path, offset, nbytes = unit_on_disk(opt, 1)
        if damage == "flip":
            flip_bit(path, offset + nbytes // 2, 0x10)
        elif damage == "zero":
            zero_range(path, offset, 4096)
        else:
            overwrite_range(path, offset + 8192, 512)
        before = snapshot(params)
        with pytest.raises(StateError) as info:
            train(opt, params, [2])
        msg = str(info.value)
        assert path in msg and "unit 1" in msg and "parameter 2" in msg and "load_checkpoint" in msg
        assert str(offset) in msg
        with pytest.raises(StateError):
            train(opt, params, [2])
        with pytest.raises(StateError):
            opt.save_checkpoint(tmp_path / "bad")
        assert not (tmp_path / "bad").exists()
        # The parameters the damaged unit holds were not changed by the refused step beyond what
        # earlier units' updates did; restoring the checkpoint restores everything.
        del before
        opt.load_checkpoint(tmp_path / "good")
        restore(params, good_weights)
        train(opt, params, [2, 3])
        train(ref, ref_params, [2, 3])
        assert_same(params, ref_params)
    finally:
        opt.close()
        ref.close()


def test_a_truncated_swap_file_is_an_io_error_naming_file_and_offset_and_blocks_steps(nvme):
    """A swap file cut short between steps: the next step's read returns fewer bytes than asked, which is
    an OSError naming the swap file and the offset, and the optimizer refuses to step after it."""
    params = make_params()
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=nvme, **SMALL)
    try:
        train(opt, params, [0])
        path, offset, _ = unit_on_disk(opt, 1)
        os.truncate(path, offset + 4096)
        with pytest.raises(OSError) as info:
            train(opt, params, [1])
        assert info.value.filename == path or path in str(info.value)
        with pytest.raises(StateError):
            train(opt, params, [2])
    finally:
        opt.close()


@pytest.mark.parametrize("cache", [0, 4 * 256 * 1024], ids=["pool-only", "host-cache"])
def test_a_swap_file_cut_anywhere_is_named_before_any_write_fills_the_cut_with_zeros(nvme, cache):
    """Without checksums, and whatever unit the cut falls in: units kept in host memory (a host cache's, or
    the pool's copies of the units written last) are written without being read first, which would leave
    holes that read back as zeros; the next step raises ENODATA naming the file, and refuses after."""
    for cut in (1, 4, 8):
        params = make_params()
        opt = OffloadedAdamW(params, lr=1e-2, nvme_path=nvme, host_cache=cache,
                             **{**SMALL, "checksum": False})
        try:
            train(opt, params, [0])  # the next step visits first the units at the end of the file
            assert len(opt.state_store.layout.units) > cut + 3
            path, offset, _ = unit_on_disk(opt, cut)
            os.truncate(path, offset + 4096)
            with pytest.raises(OSError) as info:
                train(opt, params, [1])
            assert info.value.errno == errno.ENODATA and info.value.filename == path, info.value
            with pytest.raises(StateError):
                train(opt, params, [2])
        finally:
            opt.close()


def test_a_swap_file_cut_while_a_step_runs_is_named_when_the_step_ends(nvme):
    """Without checksums: a cut made while the step runs (as it updates its last unit, every read done),
    which the step's own last write then papers over, is named when that step ends (ENODATA, the file),
    not a step later, and steps are refused after it."""
    params = make_params()
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=nvme, **{**SMALL, "checksum": False})
    try:
        train(opt, params, [0, 1])
        path, offset, _ = unit_on_disk(opt, 2)
        units, seen, cuts = len(opt.state_store.layout.units), [], []

        def cut_once(unit, buf):
            seen.append(unit)
            if len(seen) == units and not cuts:
                os.truncate(path, offset)
                cuts.append(offset)

        opt.state_store.add_change_guard(cut_once)
        with pytest.raises(OSError) as info:
            train(opt, params, [2])
        assert cuts and info.value.errno == errno.ENODATA and info.value.filename == path, info.value
        with pytest.raises(StateError):
            train(opt, params, [3])
    finally:
        opt.close()


@pytest.mark.parametrize("how", ["checkpoint", "state_dict"])
def test_after_a_cut_a_whole_load_restores_the_state_and_training_goes_on_bit_for_bit(tmp_path, nvme, how):
    """Once a cut swap file is named, loading the whole state (load_checkpoint or load_state_dict) gives
    the file its size back and training goes on exactly as it would have from the saved state."""
    params = make_params()
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=nvme, **{**SMALL, "checksum": False})
    try:
        train(opt, params, [0, 1])
        weights = snapshot(params)
        # (torch's state_dict() holds the small parameters' live state tensors: copy it)
        saved = copy.deepcopy(opt.state_dict()) if how == "state_dict" else opt.save_checkpoint(tmp_path / "c")
        train(opt, params, [2, 3])
        expected = snapshot(params)
        path, offset, _ = unit_on_disk(opt, 1)
        os.truncate(path, offset)
        with pytest.raises(OSError):
            train(opt, params, [4])
        restore(params, weights)
        if how == "state_dict":
            opt.load_state_dict(saved)
        else:
            ckpt.load_checkpoint(opt, tmp_path / "c")
        train(opt, params, [2, 3])
        assert_same(params, expected)
    finally:
        opt.close()


def test_growing_a_cut_swap_file_names_the_cut_instead_of_filling_it(nvme):
    """A parameter trained for the first time after a swap file was cut makes the file grow: the growth
    raises ENODATA naming the file rather than giving it its size back with zeros in the cut."""
    params = make_params()
    params[-1].requires_grad_(False)
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=nvme, **{**SMALL, "checksum": False})
    try:
        train(opt, params[:-1], [0, 1])
        path = opt.state_store.space.files[0]
        os.truncate(path, 4096)
        params[-1].requires_grad_(True)
        with pytest.raises(OSError) as info:
            train(opt, params, [2])
        assert info.value.errno == errno.ENODATA and info.value.filename == path, info.value
    finally:
        opt.close()


def test_a_checkpoint_never_copies_changed_state(tmp_path, nvme):
    """Saving right after the swap file was damaged (no step in between) refuses with StateError and
    leaves the previous checkpoint as it was."""
    params = make_params()
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=nvme, **SMALL)
    try:
        train(opt, params, [0])
        opt.save_checkpoint(tmp_path / "c")
        before = ckpt.read_manifest(tmp_path / "c")
        path, offset, nbytes = unit_on_disk(opt, 0)
        flip_bit(path, offset + 100)
        with pytest.raises(StateError, match="unit 0"):
            opt.save_checkpoint(tmp_path / "c")
        assert ckpt.read_manifest(tmp_path / "c") == before
        ckpt.verify_checkpoint(tmp_path / "c")
    finally:
        opt.close()


def test_changed_offloaded_weights_are_named_at_the_next_fetch_and_never_saved(tmp_path, nvme):
    """offload_parameters: a weight's bytes changed in the parameter swap file are found when it is next
    fetched (StateError naming the parameter) and when a checkpoint would copy them."""
    torch.manual_seed(0)
    model = offload_parameters(Net(), nvme_path=nvme, **CHECKED_TINY)
    try:
        with torch.no_grad():
            model(torch.randn(4, 32))
        store = offloaded(model).store
        rec = store.records[model.blocks[1].up.weight]
        path = store.space.files[0]
        flip_bit(path, rec.extent.offset + 64)
        with pytest.raises(StateError, match=r"blocks\.1\.up\.weight"):
            ckpt.save_parameters(model, tmp_path / "w")
        assert not (tmp_path / "w").exists()
        with pytest.raises(StateError, match=r"blocks\.1\.up\.weight.*changed behind our back"):
            with torch.no_grad():
                model(torch.randn(4, 32))
    finally:
        offloaded(model).scheduler.remove()
        offloaded(model).store.close()


def test_a_parameter_swap_file_cut_before_weights_are_written_back_is_named_not_filled_with_zeros(nvme):
    """offload_parameters, checksums off: bf16 weights with fp32 masters are written back by the step without
    being read first, so a write past a cut made between backward and step would fill it with a hole from
    which frozen weights read back as zeros. The write-back raises ENODATA naming the file instead, and
    writes nothing."""
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    model.blocks[0].requires_grad_(False)
    model = offload_parameters(model, nvme_path=nvme, max_in_cpu=0, buffer_count=3, buffer_size=2048)
    store = offloaded(model).store
    # Every trained parameter's state offloaded, with its fp32 master: the step reads no weight.
    opt = OffloadedAdamW([p for p in model.parameters() if p.requires_grad], nvme_path=os.path.join(nvme, "opt"),
                         **{**OPT, "small_param_threshold": 1})
    try:
        loss_of(model, 0, torch.bfloat16).backward()
        opt.step()
        opt.zero_grad()
        loss_of(model, 1, torch.bfloat16).backward()
        path = store.space.files[0]
        os.truncate(path, 0)
        with pytest.raises(OSError) as info:
            opt.step()  # writes the trained weights back, reading none of them
        assert info.value.errno == errno.ENODATA and info.value.filename == path, info.value
        assert os.path.getsize(path) == 0  # no write of ours filled the cut with holes
    finally:
        opt.close()
        offloaded(model).scheduler.remove()
        store.close()


def test_after_a_parameter_swap_file_is_cut_loading_the_saved_weights_lets_training_go_on(tmp_path, nvme):
    """load_parameters of every offloaded weight (what the errors tell users to do) gives a cut parameter
    swap file its size back: the weights are the saved ones and the next iteration's write-backs pass."""
    torch.manual_seed(0)
    model = offload_parameters(Net(), nvme_path=nvme, **TINY)
    store = offloaded(model).store
    opt = OffloadedAdamW(model.parameters(), nvme_path=os.path.join(nvme, "opt"), **OPT)
    try:
        loss_of(model, 0).backward()
        opt.step()
        opt.zero_grad()
        ckpt.save_parameters(model, tmp_path / "w")
        with torch.no_grad():
            before = loss_of(model, 5)
        os.truncate(store.space.files[0], 4096)
        ckpt.load_parameters(model, tmp_path / "w")
        with torch.no_grad():
            assert torch.equal(loss_of(model, 5), before)  # the saved weights, read back whole
        loss_of(model, 1).backward()
        opt.step()  # writes weights and grads back: the file is whole again
        store.space.check_intact()
    finally:
        opt.close()
        offloaded(model).scheduler.remove()
        store.close()


def test_a_failed_write_back_of_weights_loses_no_pool_buffer_and_is_reported(nvme):
    """An I/O error while the parameter store writes weights back is reported (the weights it carried are
    lost, so fetching them refuses until a checkpoint is loaded) and every pool buffer stays usable."""
    torch.manual_seed(0)
    model = offload_parameters(Net(), nvme_path=nvme, **CHECKED_TINY)
    store = offloaded(model).store
    try:
        opt = OffloadedAdamW(model.parameters(), nvme_path=os.path.join(nvme, "opt"), **OPT)
        loss_of(model, 0).backward()
        store.space.inject_fault("error", op="write", count=1)
        with pytest.raises(OSError):
            opt.step()
            # The failed write is found when its extent is next touched.
            loss_of(model, 1).backward()
        prefetching = sum(len(r.prefetched) for r in store.records.values())
        assert len(store.lender.free) + prefetching == len(store.pool), "a pool buffer was lost"
        opt.close()
    finally:
        offloaded(model).scheduler.remove()
        store.close()


def test_restore_parameters_after_damage_refuses_instead_of_restoring_garbage(nvme):
    """restore_parameters reads every weight back: damaged bytes are refused, not restored into the model."""
    torch.manual_seed(0)
    model = offload_parameters(Net(), nvme_path=nvme, **CHECKED_TINY)
    store = offloaded(model).store
    rec = store.records[model.head.weight]
    flip_bit(store.space.files[0], rec.extent.offset + 8)
    with pytest.raises(StateError, match="head.weight"):
        restore_parameters(model)
    offloaded(model).scheduler.remove()
    store.close()


def test_a_read_is_checked_against_the_write_before_it_however_often_it_is_waited_for(tmp_path):
    """A checked read issued before the extent's next write is checked against the write before it: waited
    for again after the next write landed (as an asynchronous save and a step's change guard both wait for
    the save's read), it neither raises nor fails the store. Before, each wait compared with the newest
    write's checksum: a false mismatch that stopped training."""
    from offload.buffers import HostBuffer
    from offload.bytes import ByteStore, Stored
    from offload.space import SwapSpace

    block = 64 * 1024
    space = SwapSpace(str(tmp_path), 0, name="checked")
    store = ByteStore(space, block, checksum=True, remedy="restore it", mismatch_fails=True)
    a, b, into = (HostBuffer(block) for _ in range(3))
    try:
        stored = Stored(extent=space.alloc(block), nbytes=block)
        a.tensor.copy_(torch.randint(0, 256, (block,), dtype=torch.uint8))
        b.tensor.copy_(torch.randint(0, 256, (block,), dtype=torch.uint8))
        store.write(stored, a)
        store.land(stored)
        read = store.read(stored, into)
        read.wait()  # the first wait: the guard's
        store.write(stored, b)
        store.land(stored)
        read.wait()  # the second: the save's walk, after the step's write
        assert store.usable and torch.equal(into.tensor, a.tensor)
        after = store.read(stored, into)
        after.wait()
        assert torch.equal(into.tensor, b.tensor)
        # Waited for the first time only after the next write landed: still the write before it.
        late = store.read(stored, into)
        deadline = time.monotonic() + 10
        while not late.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        store.write(stored, a)
        store.land(stored)
        late.wait()
        assert store.usable and torch.equal(into.tensor, b.tensor)
    finally:
        store.close()
        space.close()
        for buf in (a, b, into):
            buf.close()
