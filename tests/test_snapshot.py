"""Instant snapshots: on XFS (reflink), state.bin is made by cloning the swap file's extents, metadata only,
while checksums are still written and verified. Runs on a loop-mounted XFS image made here; skipped with
the reason where mkfs.xfs or loop mounts are not available."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import time

import pytest
import torch
from helpers import assert_same_state, ckpt_file

from offload import OffloadedAdamW
from offload import checkpoint as ckpt
from offload.units import GIB, MIB


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
def test_a_512_mib_state_snapshot_on_xfs_clones_extents_and_loads_bit_for_bit(xfs):
    """An asynchronous save of 512 MiB of state on the swap file's XFS clones every unit: the call takes
    no data space (blocks are shared), the manifest says "clone", training goes on, and the checkpoint
    verifies and loads to the state of the call."""
    params = [torch.nn.Parameter(torch.zeros(16 << 20)) for _ in range(4)]  # 64M fp32: 512 MiB of state
    opt = OffloadedAdamW(params, lr=1e-3, nvme_path=str(xfs / "nvme"), buffer_size=64 * MIB, buffer_count=3)
    try:
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        assert opt.offloaded_state_bytes == GIB // 2
        expected = copy.deepcopy(opt.state_dict()["state"][0])
        free = free_bytes(xfs)
        t = time.perf_counter()
        handle = ckpt.save_checkpoint(opt, xfs / "c", blocking=False, snapshot="reflink")
        took = time.perf_counter() - t
        assert free - free_bytes(xfs) < 16 * MIB  # no copy of the 512 MiB was written
        print(f"snapshot of 512 MiB: {took:.3f} s")
        handle.wait()
        opt.step()  # overwrites the swap extents the checkpoint shares
        manifest = ckpt.read_manifest(xfs / "c")  # the load below checks every checksum
        assert manifest["snapshot"] == {"method": "clone", "cloned_bytes": GIB // 2, "streamed_bytes": 0,
                                        "asynchronous": True}
        ckpt.load_checkpoint(opt, xfs / "c")
        got = opt.state_dict()["state"][0]
        assert_same_state({"state": {0: got}, "param_groups": []}, {"state": {0: expected}, "param_groups": []})
    finally:
        opt.close()


def test_a_clone_equals_a_streamed_save_byte_for_byte(xfs):
    """On XFS a cloned state.bin (padding zeroed as a copy pads) is byte for byte the streamed one, and a
    host-cache unit (not on disk) is streamed beside the clones."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (70_000, 300_001, 5000)]
    opt = OffloadedAdamW(params, lr=1e-3, nvme_path=str(xfs / "nvme"), buffer_size=256 * 1024, buffer_count=3,
                         small_param_threshold=64, host_cache=256 * 1024)
    try:
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        ckpt.save_checkpoint(opt, xfs / "cloned")
        ckpt.save_checkpoint(opt, xfs / "streamed", snapshot="stream")
        a, b = ckpt.read_manifest(xfs / "cloned"), ckpt.read_manifest(xfs / "streamed")
        assert a["snapshot"]["method"] == "clone+stream" and b["snapshot"]["method"] == "stream"
        assert open(ckpt_file(xfs / "cloned", "state.bin"), "rb").read() == \
            open(ckpt_file(xfs / "streamed", "state.bin"), "rb").read()
        assert a["units"] == b["units"]
    finally:
        opt.close()
