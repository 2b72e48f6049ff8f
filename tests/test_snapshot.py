"""Instant snapshots: on XFS (reflink), state.bin is made by cloning the swap file's extents, metadata only,
while checksums are still written and verified. Runs on a loop-mounted XFS image made here; skipped with
the reason where mkfs.xfs or loop mounts are not available."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import threading
import time

import pytest
import torch
from helpers import assert_same_state, ckpt_file, flip_bit

from offload import OffloadedAdamW
from offload import checkpoint as ckpt
from offload.aio import Engine, PieceDigest
from offload.checkpoint import Storage
from offload.checkpoint import snapshot as snapshot_module
from offload.sizes import GIB, MIB
from offload.tools.ckpt_cli import main as ckpt_main


@pytest.fixture
def xfs(tmp_path):
    """A fresh XFS (reflink on, its default) in a sparse image file, loop-mounted; unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a loop device needs root")
    if shutil.which("mkfs.xfs") is None:
        pytest.skip("no mkfs.xfs (xfsprogs; scripts/install-deps.sh installs it)")
    image, where = tmp_path / "xfs.img", tmp_path / "xfs"
    where.mkdir()
    with open(image, "wb") as f:
        f.truncate(6 * GIB)  # sparse: room for the swap files and what a clone needs once training overwrites it
    made = subprocess.run(["mkfs.xfs", "-q", str(image)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"mkfs.xfs failed: {made.stderr.strip()}")
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(where)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount an XFS image here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)
        image.unlink()


def free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.mark.slow
def test_a_128_mib_state_snapshot_on_xfs_clones_extents_and_loads_bit_for_bit(xfs):
    """An asynchronous save of 128 MiB of state (8 units of 16 MiB over 4 parameters) on the swap file's XFS
    clones every unit: the call takes no data space (blocks are shared), the manifest says "clone", training
    goes on, and the checkpoint verifies and loads to the state of the call. (The size keeps the suite's scratch
    disk low: the image holds the swap file and, once training overwrites the shared extents, the clone.)"""
    params = [torch.nn.Parameter(torch.zeros(4 << 20)) for _ in range(4)]  # 16M fp32: 128 MiB of state
    opt = OffloadedAdamW(params, lr=1e-3, nvme_path=str(xfs / "nvme"), buffer_size=16 * MIB, buffer_count=3)
    try:
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        assert opt.offloaded_state_bytes == 128 * MIB
        assert len(opt.state_store.layout.units) == 8
        expected = copy.deepcopy(opt.state_dict()["state"][0])
        free = free_bytes(xfs)
        t = time.perf_counter()
        handle = ckpt.save_checkpoint(opt, xfs / "c", blocking=False, snapshot="reflink")
        took = time.perf_counter() - t
        assert free - free_bytes(xfs) < 16 * MIB  # no copy of the 128 MiB was written
        print(f"snapshot of 128 MiB: {took:.3f} s")
        handle.wait()
        opt.step()  # overwrites the swap extents the checkpoint shares
        manifest = ckpt.read_manifest(xfs / "c")  # the load below checks every checksum
        assert manifest["snapshot"] == {"method": "clone", "cloned_bytes": 128 * MIB, "streamed_bytes": 0,
                                        "asynchronous": True}
        ckpt.load_checkpoint(opt, xfs / "c")
        got = opt.state_dict()["state"][0]
        assert_same_state({"state": {0: got}, "param_groups": []}, {"state": {0: expected}, "param_groups": []})
    finally:
        opt.close()


@pytest.mark.parametrize("host_cache", [256 * 1024, 0])
def test_a_clone_equals_a_streamed_save_byte_for_byte(xfs, host_cache):
    """On XFS a cloned state.bin is byte for byte the streamed one: the store zeroes a unit's padding as it
    writes it, so a clone shares zeros where a copy pads with zeros, even for a unit whose first write came
    from a pool buffer that had held a larger unit. A host-cache unit (not on disk) is streamed beside the
    clones; cloned units carry the store's checksums."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (70_000, 70_000, 5000)]
    opt = OffloadedAdamW(params, lr=1e-3, nvme_path=str(xfs / "nvme"), buffer_size=256 * 1024, buffer_count=3,
                         small_param_threshold=64, host_cache=host_cache)
    try:
        for _ in range(2):
            step(opt, params)
        ckpt.save_checkpoint(opt, xfs / "cloned")
        ckpt.save_checkpoint(opt, xfs / "streamed", snapshot="stream")
        a, b = ckpt.read_manifest(xfs / "cloned"), ckpt.read_manifest(xfs / "streamed")
        assert a["snapshot"]["method"] == ("clone+stream" if host_cache else "clone")
        assert b["snapshot"]["method"] == "stream"
        assert open(ckpt_file(xfs / "cloned", "state.bin"), "rb").read() == \
            open(ckpt_file(xfs / "streamed", "state.bin"), "rb").read()
        where = [{k: u[k] for k in ("offset", "length", "nbytes")} for u in a["units"]]
        assert where == [{k: u[k] for k in ("offset", "length", "nbytes")} for u in b["units"]]
        assert any(u["nbytes"] < u["length"] for u in a["units"])
        taken = sum(1 for u in a["units"] if "pieces" in u)
        assert (0 < taken < len(a["units"])) if host_cache else taken == len(a["units"])
        assert all("pieces" not in u for u in b["units"])
        ckpt.verify_checkpoint(xfs / "cloned")
    finally:
        opt.close()


class ReadCounting(Storage):
    """The save's own engine (the one that writes state.bin and would read it back), counting the bytes it
    is asked to read."""

    def __init__(self):
        self.read = 0

    def engine(self, aio):
        engine = Engine(aio)
        real = engine.read_async

        def read_async(file, buffer, offset, nbytes=None, **kw):
            self.read += buffer.nbytes if nbytes is None else nbytes
            return real(file, buffer, offset, nbytes, **kw)

        engine.read_async = read_async
        return engine


def trained(nvme, sizes=(70_000, 70_000, 5000), steps=2, **kw):
    """An optimizer over parameters of ``sizes`` (units of 256 KiB, the last of each parameter padded), stepped
    ``steps`` times."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    opt = OffloadedAdamW(params, lr=1e-3, nvme_path=nvme, buffer_size=256 * 1024, buffer_count=3,
                         small_param_threshold=64, **kw)
    for _ in range(steps):
        step(opt, params)
    return opt, params


def step(opt, params) -> None:
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()


def piece_digests(directory, units) -> list:
    """Each unit's checksum in the engine's form, computed here from state.bin's bytes."""
    data = open(ckpt_file(directory, "state.bin"), "rb").read()
    out = []
    for u in units:
        d = PieceDigest(u["pieces"])
        d.update(data[u["offset"]:u["offset"] + u["length"]])
        out.append(d.hexdigest())
    return out


def test_an_asynchronous_clone_takes_the_stores_checksums_at_the_call_and_reads_nothing_back(xfs, monkeypatch):
    """An asynchronous clone save records, per unit, the checksum the store kept of its last write, as it was
    at the call (a step taken before the save's thread runs changes the store's, not the checkpoint's): the
    save reads nothing back (neither state.bin nor the swap file), state.bin has no checksum of its own, each
    unit's checksum is the engine's form of its bytes in state.bin, and the checkpoint verifies and loads to
    the state of the call bit for bit."""
    opt, params = trained(str(xfs / "nvme"))
    try:
        store = opt.state_store
        store.drain()  # the step's last writes land (as the save lets them first)
        units = [u for u in store.layout.units if any(c.slot.initialized for c in u.chunks)]
        at_call = [f"{store.landed_digest(u)[0]:016x}" for u in units]
        expected = copy.deepcopy(opt.state_dict())
        go = threading.Event()
        real_run = snapshot_module.StateCopy.run
        monkeypatch.setattr(snapshot_module.StateCopy, "run",
                            lambda self, *a: (go.wait(30), real_run(self, *a))[1])
        from_store = []
        real_read_unit = store.read_unit
        monkeypatch.setattr(store, "read_unit", lambda *a: (from_store.append(a), real_read_unit(*a))[1])
        counting = ReadCounting()
        handle = ckpt.save_checkpoint(opt, xfs / "c", blocking=False, snapshot="reflink", storage=counting)
        step(opt, params)  # before the save's thread runs: overwrites the swap extents the clone shares
        store.drain()
        assert [f"{store.landed_digest(u)[0]:016x}" for u in units] != at_call
        go.set()
        handle.wait()
        assert counting.read == 0 and from_store == []
        manifest = ckpt.read_manifest(xfs / "c")
        assert manifest["snapshot"]["method"] == "clone"
        assert manifest["files"]["state.bin"]["xxh3_64"] is None and manifest["version"] == 2
        got = manifest["units"]
        assert [u["xxh3_64"] for u in got] == at_call == piece_digests(xfs / "c", got)
        assert {u["pieces"] for u in got} == {opt.config.aio.block_size}
        assert any(u["nbytes"] < u["length"] for u in got)  # a padded unit: the padding is in its checksum
        ckpt.verify_checkpoint(xfs / "c")
        ckpt.mirror_checkpoint(xfs / "c", xfs / "m")  # verified as it is copied, in the same form
        assert ckpt.read_manifest(xfs / "m")["units"] == got
        ckpt.load_checkpoint(opt, xfs / "m")
        assert_same_state(expected, opt.state_dict())
    finally:
        opt.close()


@pytest.mark.parametrize("where", ["state", "padding"])
def test_a_flipped_byte_in_a_cloned_unit_is_refused_by_load_and_verify(xfs, where, capsys):
    """A byte changed in a unit that a clone save took the store's checksum of (in its state, or in its
    padding, which the checksum covers too) is refused by verify_checkpoint, offload-ckpt verify,
    load_checkpoint and a mirror (nothing committed there) with a ChecksumError naming state.bin and the unit;
    put back, the checkpoint verifies."""
    opt, params = trained(str(xfs / "nvme"))
    try:
        ckpt.save_checkpoint(opt, xfs / "c", snapshot="reflink")
        units = ckpt.read_manifest(xfs / "c")["units"]
        i = next(k for k, u in enumerate(units) if u["nbytes"] < u["length"])  # a padded unit
        u = units[i]
        assert u.get("pieces")
        at = u["offset"] + (u["nbytes"] // 2 if where == "state" else u["nbytes"] + 1)
        path = ckpt_file(xfs / "c", "state.bin")
        fd = os.open(path, os.O_RDWR)
        try:
            old = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([old[0] ^ 0x10]), at)
            os.fsync(fd)
            message = rf"state\.[0-9a-f]+\.bin: bytes \[{u['offset']}, .*unit {i}"
            with pytest.raises(ckpt.ChecksumError, match=message):
                ckpt.verify_checkpoint(xfs / "c")
            assert ckpt_main(["verify", str(xfs / "c")]) == 1
            said = capsys.readouterr()
            assert f"unit {i}" in said.out + said.err
            with pytest.raises(ckpt.ChecksumError, match=message):
                ckpt.load_checkpoint(opt, xfs / "c")
            with pytest.raises(ckpt.ChecksumError, match=rf"unit {i}"):
                ckpt.mirror_checkpoint(xfs / "c", xfs / "m")
            assert not os.path.exists(xfs / "m" / "manifest.json")
            os.pwrite(fd, old, at)
            os.fsync(fd)
        finally:
            os.close(fd)
        ckpt.verify_checkpoint(xfs / "c")
    finally:
        opt.close()


def test_a_clone_without_the_stores_checksums_reads_state_bin_back_and_verifies(xfs):
    """With checksums off (nothing recorded to reuse), a clone save reads every unit back and hashes it as
    before: units without a piece size, state.bin's own checksum; it verifies, and a flipped byte is caught."""
    opt, params = trained(str(xfs / "nvme"), checksum=False)
    try:
        counting = ReadCounting()
        ckpt.save_checkpoint(opt, xfs / "c", snapshot="reflink", storage=counting)
        manifest = ckpt.read_manifest(xfs / "c")
        assert manifest["snapshot"]["method"] == "clone"
        assert counting.read == manifest["files"]["state.bin"]["bytes"]
        assert manifest["files"]["state.bin"]["xxh3_64"] is not None and manifest["version"] == 1
        assert all("pieces" not in u for u in manifest["units"])
        ckpt.verify_checkpoint(xfs / "c")
        flip_bit(ckpt_file(xfs / "c", "state.bin"), 100)
        with pytest.raises(ckpt.ChecksumError, match=r"unit 0"):
            ckpt.verify_checkpoint(xfs / "c")
    finally:
        opt.close()


def test_units_striped_over_two_swap_files_are_read_back_the_others_take_the_stores_checksums(xfs):
    """Swap files on two paths, striped in 128 KiB: a unit that lies on one file has one checksum from the
    store and is not read back; a unit striped over both (a checksum per file) is read back and hashed. The
    mixed checkpoint verifies and loads bit for bit."""
    nvme = [str(xfs / "n0"), str(xfs / "n1")]
    opt, params = trained(nvme, sizes=(70_000, 5000, 3000), config={"aio": {"block_size": "128KiB"}})
    try:
        expected = copy.deepcopy(opt.state_dict())
        counting = ReadCounting()
        ckpt.save_checkpoint(opt, xfs / "c", snapshot="reflink", storage=counting)
        manifest = ckpt.read_manifest(xfs / "c")
        units = manifest["units"]
        taken = [u for u in units if "pieces" in u]
        walked = [u for u in units if "pieces" not in u]
        assert taken and walked, units
        assert counting.read == sum(u["length"] for u in walked)
        assert manifest["files"]["state.bin"]["xxh3_64"] is None
        assert [u["xxh3_64"] for u in taken] == piece_digests(xfs / "c", taken)
        ckpt.verify_checkpoint(xfs / "c")
        ckpt.load_checkpoint(opt, xfs / "c")
        assert_same_state(expected, opt.state_dict())
    finally:
        opt.close()
