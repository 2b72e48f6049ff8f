"""``offload-bench`` run as a user runs it, on tiny sizes, JSON output checked: once in a subprocess (the
``python -m offload.tools`` entry point), otherwise through ``main(argv)`` in this process."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import tempfile

import pytest
import torch
from helpers import REPO, run_python
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.aio import gds_status
from offload.config import AioConfig, config_to_dict, load_config
from offload.tools import checkpoint as checkpoint_bench
from offload.tools.cli import main

TINY = ["--size", "8MiB", "--block-size", "64KiB", "--runs", "2"]


def bench(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return run_python("-m", "offload.tools", *args, env=env, timeout=timeout, cwd=REPO)


def bench_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """main() in this process (what a subprocess would add is the interpreter's start): exit code, stdout,
    stderr."""
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def bench_ok(capsys, *args: str) -> tuple[str, str]:
    """main() in this process, which must exit 0: stdout, stderr."""
    code, out, err = bench_in_process(capsys, *args)
    assert code == 0, out + err
    return out, err


def check_result(r: dict) -> None:
    assert r["op"] in ("write", "read")
    assert r["gib_s"] > 0
    assert len(r["gib_s_runs"]) == 2 and all(x > 0 for x in r["gib_s_runs"])
    assert min(r["gib_s_runs"]) <= r["gib_s"] <= max(r["gib_s_runs"])


def test_io_verifies_and_writes_a_json_report(tmp_path):
    """`io --verify --json` succeeds, reads back what it wrote, and reports positive GiB/s per run."""
    out = tmp_path / "io.json"
    p = bench("io", "--path", str(tmp_path / "swap"), *TINY, "--verify", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "verify: every byte read back equals the byte written" in p.stdout
    doc = json.loads(out.read_text())
    assert doc["config"]["size"] == 8 << 20 and doc["config"]["block_size"] == 64 << 10
    assert doc["config"]["runs"] == 2 and doc["config"]["verify"] is True
    assert doc["machine"]["cpu_count"] >= 1 and doc["machine"]["kernel"]
    assert [r["op"] for r in doc["results"]] == ["write", "read"]
    for r in doc["results"]:
        check_result(r)
        assert r["verified"] is True
        assert r["fio_gib_s"] is None and r["ratio_to_fio"] is None
    assert not (tmp_path / "swap").exists(), "the directory the benchmark created is removed"


def test_io_stripes_over_two_paths(tmp_path, capsys):
    """Two paths give a striped swap space whose data reads back intact."""
    out, _ = bench_ok(capsys, "io", "--path", str(tmp_path / "a"), str(tmp_path / "b"), *TINY, "--verify")
    assert "over 2 paths" in out


def test_sweep_ranks_a_grid_and_emits_a_config_the_loader_reads_back(tmp_path, capsys, monkeypatch):
    """A 2x2 sweep reports every point, its best is the top mean, and --emit-config loads back unchanged."""
    out, cfg = tmp_path / "sweep.json", tmp_path / "aio.json"
    monkeypatch.setenv("OFFLOAD_PROGRESS", "1")
    _, err = bench_ok(capsys, "sweep", "--path", str(tmp_path), "--size", "8MiB", "--runs", "1", "--block-sizes",
                      "64KiB,256KiB", "--queue-depths", "4,16", "--threads", "1", "--json", str(out),
                      "--emit-config", str(cfg))
    assert "8/8" in err, "the progress bar (a write and a read per point) reaches the end"
    doc = json.loads(out.read_text())
    points = {(r["block_size"], r["queue_depth"], r["threads"]) for r in doc["results"]}
    assert points == {(b, q, 1) for b in (64 << 10, 256 << 10) for q in (4, 16)}
    assert len(doc["results"]) == 8
    for r in doc["results"]:
        assert r["gib_s"] > 0 and r["op"] in ("write", "read")
    best = doc["best"]
    means = {}
    for r in doc["results"]:
        means.setdefault((r["block_size"], r["queue_depth"], r["threads"]), []).append(r["gib_s"])
    top = max(means, key=lambda k: sum(means[k]) / 2)
    assert (best["block_size"], best["queue_depth"], best["threads"]) == top
    emitted = json.loads(cfg.read_text())
    loaded = load_config(str(cfg))
    assert config_to_dict(loaded) == emitted, "the loader reads the emitted block back unchanged"
    assert (loaded.aio.block_size, loaded.aio.queue_depth, loaded.aio.thread_count) == top
    assert emitted["aio"]["single_submit"] is False and emitted["aio"]["overlap_events"] is True


def test_verification_catches_a_chunk_read_from_the_wrong_place():
    """Stamps make every 4 KiB block distinct, so a chunk landing in another chunk's place fails."""
    from offload.buffers import BufferPool
    from offload.tools.io import Data, VerifyError

    with BufferPool(2, 64 << 10) as pool:
        data = Data(pool, 64 << 10)
        data.fill()
        data.new_pass()
        data.stamp(1, pool[0], 64 << 10)
        data.check(1, pool[0], 64 << 10)  # intact: passes (and restores the reference bytes)
        data.stamp(1, pool[0], 64 << 10)
        with pytest.raises(VerifyError, match="chunk 2"):
            data.check(2, pool[0], 64 << 10)
        data.stamp(3, pool[1], 64 << 10)
        pool[1].numpy()[5000] ^= 0xFF
        with pytest.raises(VerifyError, match="differ"):
            data.check(3, pool[1], 64 << 10)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--size", "lots"], "invalid size 'lots'"),
        (["--block-size", "5000"], "not a multiple of 4096"),
        (["--size", "64KiB", "--block-size", "1MiB"], "smaller than the block size"),
        (["--size", "1000000"], "not a multiple of 4096"),
        (["--queue-depth", "0"], "must be between 1 and 4096"),
        (["--path", "/nonexistent-parent-dir/swap"], "parent directory /nonexistent-parent-dir does not exist"),
        (["--backend", "spdk"], "invalid choice: 'spdk'"),
        (["--json", "/nonexistent-dir/out.json"], "directory /nonexistent-dir does not exist"),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(tmp_path, capsys, args, message):
    """Each bad argument stops the run before any I/O with exit code 2 and a message naming it."""
    if "--path" not in args:
        args = [*args, "--path", str(tmp_path)]
    code, out, err = bench_in_process(capsys, "io", *args)
    assert code == 2, (out, err)
    assert message in err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_sweep_rejects_a_bad_list(tmp_path, capsys):
    """A malformed comma-separated list is an argument error (exit code 2)."""
    code, _, err = bench_in_process(capsys, "sweep", "--path", str(tmp_path), "--queue-depths", "8,,32")
    assert code == 2 and "comma-separated" in err


def test_default_scratch_directory_is_removed_after_the_run(tmp_path, capsys, monkeypatch):
    """Without --path the benchmark works in a scratch directory under TMPDIR and removes it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # as in a fresh process: gettempdir() reads TMPDIR again
    out, _ = bench_ok(capsys, "io", *TINY)
    assert f"scratch directory: {tmp}" in out
    assert list(tmp.iterdir()) == []


def test_io_error_is_one_clean_line_and_exit_1(tmp_path, capsys):
    """A failing run (no room for the swap file) exits 1 with the error on one line, no traceback."""
    if shutil.disk_usage(tmp_path).free > 1 << 50:
        pytest.skip("needs a file system smaller than 1024 TiB")
    code, _, err = bench_in_process(capsys, "io", "--path", str(tmp_path), "--size", "1024TiB", "--block-size", "1MiB")
    assert code == 1
    assert "offload-bench: error:" in err and "needs" in err
    assert "Traceback" not in err


def test_missing_fio_is_explained_and_fails(tmp_path, capsys, monkeypatch):
    """--fio without fio on PATH says how to install it and exits non-zero before any I/O."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    code, _, err = bench_in_process(capsys, "io", "--path", str(tmp_path), *TINY, "--fio")
    assert code != 0
    assert "fio is not installed" in err and "apt-get install fio" in err


@pytest.mark.parametrize("command", [["adam", "--params", "300K", "--hidden", "64", "--steps", "3"],
                                     ["params", "--layers", "2", "--hidden", "64", "--steps", "2"]],
                         ids=["adam", "params"])
def test_overlap_benchmark_reports_every_variant_and_the_bytes_saved(tmp_path, capsys, command):
    """``--overlap`` times the iteration with and without overlap_backward, with nothing overlapped, compute
    alone and I/O alone; with offloaded weights the overlapped iteration moves no gradient; it cleans up."""
    out = tmp_path / "overlap.json"
    bench_ok(capsys, *command, "--overlap", "--rounds", "1", "--batch", "4", "--path", str(tmp_path / "scratch"),
             "--json", str(out))
    doc = json.loads(out.read_text())
    assert set(doc["iteration_s_median"]) == {"overlap", "plain", "serial", "compute_only"}
    assert all(v > 0 for v in doc["iteration_s_median"].values()) and doc["io_only_s"] > 0
    assert doc["compute_beside_io_s"] > 0
    assert doc["batch"] == 4
    moved = doc["bytes_per_iteration"]
    if command[0] == "params":
        assert moved["plain"]["grad_write"] > 0 and moved["overlap"]["grad_write"] == 0
        assert moved["overlap"]["read"] < moved["plain"]["read"]
    else:
        # Both write all of the state; both read it back but for the units still in their pools' buffers,
        # which the plain step (snake order) visits first.
        assert moved["overlap"]["write"] == moved["plain"]["write"] > 0
        assert moved["plain"]["read"] <= moved["overlap"]["read"] <= moved["overlap"]["write"]
    assert not (tmp_path / "scratch").exists()


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_fio_comparison_gives_ratios(tmp_path, capsys):
    """With --fio each operation gets fio's GiB/s and our/fio ratio, and fio's files are removed."""
    out = tmp_path / "io.json"
    swap = tmp_path / "swap"
    swap.mkdir()
    bench_ok(capsys, "io", "--path", str(swap), *TINY, "--fio", "--json", str(out))
    for r in json.loads(out.read_text())["results"]:
        check_result(r)
        assert r["fio_gib_s"] > 0 and r["ratio_to_fio"] > 0
        assert len(r["fio_gib_s_runs"]) == 2
    assert list(swap.iterdir()) == [], "neither swap nor fio files are left behind"


ADAM_KEYS = {"params", "step_s_median", "bytes_read_per_step", "bytes_written_per_step", "peak_rss_bytes",
             "host_pool_bytes", "torch_step_s_median", "torch_peak_rss_bytes"}


def test_adam_reports_step_time_io_and_memory_against_torch(tmp_path, capsys):
    """`adam` on a tiny model writes the issue's JSON keys with consistent values, and cleans its path."""
    out = tmp_path / "adam.json"
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"offload_optimizer": {"buffer_count": 3, "buffer_size": "1MiB"},
                               "aio": {"block_size": "256KiB", "queue_depth": 8}}))
    nvme = tmp_path / "nvme"
    bench_ok(capsys, "adam", "--params", "1M", "--steps", "3", "--no-fio", "--config", str(cfg), "--path", str(nvme),
             "--json", str(out))
    r = json.loads(out.read_text())
    assert ADAM_KEYS <= r.keys()
    assert r["params"] == 1_000_000
    assert r["host_pool_bytes"] == 3 << 20
    # fp32 moments: 8 bytes per parameter written by every step after the first, and read back but for
    # the units still in the pool's buffers from the step before.
    assert r["bytes_written_per_step"] >= 8 * r["params"]
    assert 8 * r["params"] - r["host_pool_bytes"] <= r["bytes_read_per_step"] < 8 * r["params"]
    assert r["step_s_median"] > 0 and r["torch_step_s_median"] > 0
    assert not nvme.exists() or not os.listdir(nvme)


def test_adam_rejects_a_bad_parameter_count(tmp_path, capsys):
    """A count that is not a number exits 2 and names the problem."""
    code, _, err = bench_in_process(capsys, "adam", "--params", "lots", "--path", str(tmp_path))
    assert code == 2
    assert "lots" in err


def test_checkpoint_benchmark_reports_save_and_load_rates(tmp_path, capsys):
    """`checkpoint` on a tiny state writes the issue's JSON keys with positive rates, and cleans up (a --ckpt-dir
    that did not exist is made, then removed)."""
    out = tmp_path / "ckpt.json"
    nvme = tmp_path / "nvme"
    ckpt_dir = tmp_path / "ckpts"
    bench_ok(capsys, "checkpoint", "--params", "1M", "--repeat", "1", "--no-fio", "--path", str(nvme),
             "--ckpt-dir", str(ckpt_dir), "--json", str(out))
    assert not ckpt_dir.exists(), "a --ckpt-dir the run made is removed again"
    r = json.loads(out.read_text())
    assert set(checkpoint_bench.JSON_KEYS) <= r.keys()
    for key in ("state_bytes", "save_gib_s", "load_gib_s", "torch_save_gib_s", "torch_load_gib_s"):
        assert r[key] > 0, key
    assert r["state_bytes"] >= 8 * 1_000_000
    assert not nvme.exists() or not os.listdir(nvme)


def test_checkpoint_async_benchmark_times_the_loop_three_ways_and_makes_then_removes_its_ckpt_dir(tmp_path,
                                                                                                 capsys):
    """`checkpoint --async` on a tiny state reports the loop's iteration without a save, with an asynchronous
    save in flight and with a blocking save, the window of iterations from each call on, the save alone, and
    the snapshot; a --ckpt-dir that did not exist is made and removed again."""
    out = tmp_path / "async.json"
    ckpt_dir = tmp_path / "ckpts"
    bench_ok(capsys, "checkpoint", "--async", "--params", "1M", "--repeat", "1", "--iterations", "2", "--compute-ms",
             "0", "--path", str(tmp_path / "nvme"), "--ckpt-dir", str(ckpt_dir), "--json", str(out))
    r = json.loads(out.read_text())
    assert set(checkpoint_bench.ASYNC_JSON_KEYS) <= r.keys()
    for key in ("iteration_s", "iteration_async_save_s", "iteration_blocking_save_s", "snapshot_s",
                "iteration_window_s", "async_save_alone_s"):
        assert r[key] > 0, key
    assert len(r["iteration_window_s_runs"]) == 1 * 2  # --repeat x --iterations: the call's and the next ones
    assert r["window_vs_none"] == pytest.approx(r["iteration_window_s"] / r["iteration_s"])
    assert r["snapshot_method"] == "stream" and r["state_bytes"] >= 8 * 1_000_000
    assert not ckpt_dir.exists()


def test_bench_params_runs_and_writes_the_documented_json(tmp_path, capsys):
    """``offload-bench params`` on a tiny model exits 0 and writes every documented key."""
    out = tmp_path / "params.json"
    bench_ok(capsys, "params", "--layers", "2", "--hidden", "64", "--steps", "2", "--path", str(tmp_path / "scratch"),
             "--json", str(out))
    doc = json.loads(out.read_text())
    keys = {"params", "step_s_median", "fetch_bytes_per_step", "write_bytes_per_step", "io_only_s",
            "compute_only_s", "peak_rss_bytes", "resident_param_bytes_max", "grad_bytes_resident_max"}
    assert keys <= doc.keys()
    assert doc["params"] == 2 * (8 * 64 * 64 + 4 * 64 + 64 + 2 * 64)
    assert doc["fetch_bytes_per_step"] > 0 and doc["write_bytes_per_step"] > 0
    # "grads on NVMe": every offloaded grad is written in backward and read by the step, none kept in memory.
    grads = 2 * (8 * 64 * 64) * 2  # the up and down weights of each block, bf16; norms and biases stay in memory
    assert doc["grad_write_bytes_per_step"] >= grads and doc["grad_read_bytes_per_step"] >= grads
    assert not (tmp_path / "scratch").exists()


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_engine_vs_fio_script_reports_ratios_and_removes_its_file(tmp_path):
    """bench/engine_vs_fio.py on a tiny file gives positive rates and ratios and leaves nothing behind."""
    out = tmp_path / "evf.json"
    data = tmp_path / "data"
    data.mkdir()
    p = run_python(os.path.join(REPO, "bench", "engine_vs_fio.py"), "--path", str(data),
                   "--size", "8MiB", "--chunk", "1MiB", "--rounds", "2", "--json", str(out))
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    for op in ("write", "read"):
        assert r[op]["ours_gib_s"] > 0 and r[op]["fio_gib_s"] > 0 and len(r[op]["ratio_runs"]) == 2
    assert os.listdir(data) == []


@pytest.mark.parametrize("command", ["adam", "checkpoint", "params"])
def test_a_bad_config_file_is_an_argument_error(tmp_path, capsys, command):
    """A --config with an unknown key exits 2 before any work, naming the key and a correction."""
    cfg = tmp_path / "bad.json"
    cfg.write_text('{"aio": {"queue_depht": 8}}')
    code, _, err = bench_in_process(capsys, command, "--config", str(cfg), "--path", str(tmp_path / "nvme"))
    assert code == 2
    assert "queue_depht" in err and "queue_depth" in err
    assert not (tmp_path / "nvme").exists()


# -- the GPU path ------------------------------------------------------------------------------------

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")


@no_cuda
@pytest.mark.parametrize("command", [["gpu"], ["adam", "--device", "cuda"], ["params", "--device", "cuda"],
                                     ["params", "--device", "cuda", "--overlap"]],
                         ids=["copy-bench", "adam", "params", "params-overlap"])
def test_gpu_commands_without_cuda_fail_in_one_line_before_any_work(tmp_path, capsys, command):
    """Without a CUDA device, ``gpu`` and ``--device cuda`` exit 1 with one line saying a CUDA device is needed,
    no traceback, and leave no directory behind."""
    args = [*command, "--path", str(tmp_path / "nvme")] if command[0] != "gpu" else command
    code, out, err = bench_in_process(capsys, *args)
    assert code == 1, out + err
    assert "needs a CUDA device" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "nvme").exists()


@pytest.mark.skipif(importlib.util.find_spec("kvikio") is not None and torch.cuda.is_available(),
                    reason="kvikio and a GPU are present: --gds runs")
def test_io_gds_without_kvikio_or_a_gpu_gives_the_reason_and_fails(tmp_path, capsys):
    """``io --gds`` where kvikio or a GPU is missing exits 1 naming why (offload.aio.gds_status's reason) and what
    to run instead, before any I/O; its --path is removed."""
    code, out, err = bench_in_process(capsys, "io", "--gds", "--path", str(tmp_path / "nvme"), *TINY)
    assert code == 1, out + err
    assert gds_status()[1] in err and "without --gds" in err
    assert "Traceback" not in err
    assert not (tmp_path / "nvme").exists()


@pytest.mark.gpu
def test_gpu_command_reports_copy_rates_pinned_and_pageable(tmp_path):
    """``gpu`` prints and writes GB/s for each direction and both at once, pinned and pageable, every run
    positive, the median within the runs."""
    out = tmp_path / "gpu.json"
    p = bench("gpu", "--size", "64MiB", "--buffer-size", "8MiB", "--buffers", "4", "--rounds", "2",
              "--json", str(out), timeout=120)
    assert p.returncode == 0, p.stderr
    assert "pinned/pageable" in p.stdout
    r = json.loads(out.read_text())
    assert len(r["gb_s_median"]) == 6
    for name, med in r["gb_s_median"].items():
        runs = r["gb_s_runs"][name]
        assert len(runs) == 2 and all(x > 0 for x in runs) and min(runs) <= med <= max(runs), name


@pytest.mark.gpu
@pytest.mark.parametrize("command", [["adam", "--params", "8M", "--dtype", "bf16", "--steps", "3", "--no-fio"],
                                     ["params", "--layers", "2", "--hidden", "256", "--steps", "3", "--no-fio"]],
                         ids=["adam", "params"])
def test_device_cuda_reports_gpu_peaks_and_a_pinned_pool(tmp_path, command):
    """``--device cuda`` trains on the GPU and reports our GPU memory peak beside torch's resident one, and a
    pool pinned by pin_memory "auto"."""
    out = tmp_path / "r.json"
    p = bench(*command, "--device", "cuda", "--path", str(tmp_path / "nvme"), "--json", str(out), timeout=300)
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert r["gpu_peak_bytes"] > 0 and r["torch_gpu_peak_bytes"] > 0
    assert r["step_s_median"] > 0
    assert r.get("pool_pinned", r.get("optimizer_pool_pinned")) is True
    assert "pinned: yes (pin_memory auto)" in p.stdout
    assert not (tmp_path / "nvme").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not gds_status()[0], reason=f"no GPUDirect Storage here: {gds_status()[1]}")
def test_io_gds_reports_kvikio_beside_the_pinned_pool(tmp_path):
    """With kvikio and GDS, ``io --gds`` reads and writes the same region both ways, checks every read, and
    reports both rates and their ratio; its --path is removed."""
    out = tmp_path / "gds.json"
    p = bench("io", "--gds", "--path", str(tmp_path / "nvme"), *TINY, "--json", str(out), timeout=120)
    assert p.returncode == 0, p.stderr
    assert "kvikio CuFile (GDS)" in p.stdout
    results = json.loads(out.read_text())["results"]
    assert {(r["path"], r["op"]) for r in results} == {(w, op) for w in ("ours", "kvikio") for op in ("write", "read")}
    assert all(r["gib_s"] > 0 for r in results)
    assert not (tmp_path / "nvme").exists()


def test_overlap_calibration_finds_the_batch_whose_compute_matches_the_io():
    """The batch search doubles until compute reaches the target and interpolates between the last two;
    noise (time that does not grow with the batch) never sends it to an absurd batch."""
    from offload.tools.overlap import CALIBRATION_BATCH, _calibrate

    assert _calibrate(lambda b: 0.05 + 0.01 * b, 0.5) == 45  # 0.05 + 0.01 * 45 = 0.5
    assert _calibrate(lambda b: 1.0, 0.5) == CALIBRATION_BATCH  # already slower than the I/O
    flat = _calibrate(lambda b: 0.2 if b < 64 else 0.19, 0.5)  # time falls as the batch grows: noise
    assert CALIBRATION_BATCH <= flat <= 1 << 16
    assert _calibrate(lambda b: 1e-6 * b, 10.0) == 1 << 16  # never beyond the largest batch tried


def test_compute_beside_io_times_the_work_while_reads_and_writes_run_and_cleans_up(tmp_path, monkeypatch):
    """compute_beside_io returns what the work says it took, runs rounds of reads and writes on another thread
    for as long as the work runs (not merely before or after it), and leaves nothing in the directory."""
    import threading
    import time

    from offload.config import AioConfig
    from offload.tools import workload

    rounds, during = [], threading.Event()
    real = workload._run_ops

    def counted(sp, pool, extent, ops):
        if any(op == "r" for op, _, _ in ops):  # a round of reads and writes (laying the bytes down has none)
            rounds.append(during.is_set())
        return real(sp, pool, extent, ops)

    monkeypatch.setattr(workload, "_run_ops", counted)

    def work() -> float:
        during.set()
        time.sleep(0.3)
        during.clear()
        return 1.25

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    assert workload.compute_beside_io([str(scratch)], AioConfig(), work, buffers=2, piece=64 << 10) == 1.25
    assert rounds and any(rounds), rounds  # rounds ran while the work did
    assert os.listdir(scratch) == []


@settings(max_examples=12, deadline=None)
@given(read_bytes=st.integers(0, 300_000), write_bytes=st.integers(0, 300_000))
def test_io_only_moves_any_byte_counts_in_aligned_requests(tmp_path_factory, read_bytes, write_bytes):
    """io_only reads and writes any byte counts (not only multiples of the alignment: a step's are not): every
    request starts aligned, reads and writes cover exactly the counts asked for, and no swap file is left."""
    from offload.tools import workload

    scratch = tmp_path_factory.mktemp("io")
    seen = []
    real = workload._run_ops

    def recorded(sp, pool, extent, ops):
        seen.append(list(ops))
        return real(sp, pool, extent, ops)

    workload._run_ops = recorded
    try:
        assert workload.io_only([str(scratch)], AioConfig(), read_bytes, write_bytes, buffers=2, piece=64 << 10) >= 0
    finally:
        workload._run_ops = real
    timed = seen[-1]
    assert all(off % 4096 == 0 and 0 < n <= 64 << 10 for _, off, n in timed)
    assert sum(n for op, _, n in timed if op == "r") == read_bytes
    assert sum(n for op, _, n in timed if op == "w") == write_bytes
    assert os.listdir(scratch) == []


@pytest.mark.parametrize("release", ["25.04", "24.02"])
def test_kvikio_gets_our_parallelism_and_registered_buffers_and_is_put_back(release):
    """io --gds gives kvikio as many threads as the engine has requests in flight and registers the GPU buffers
    with cuFile, through the interface of its release (defaults.set/get and kvikio.buffer from 25.04;
    num_threads_reset and kvikio.memory_register before), and undoes both when the passes close."""
    import types

    from offload.tools.gds import tune_kvikio

    calls = []
    kvikio = types.SimpleNamespace(defaults=types.SimpleNamespace())
    if release == "25.04":
        state = {"num_threads": 1}
        kvikio.defaults.get = state.__getitem__
        kvikio.defaults.set = lambda k, v: (calls.append(("set", k, v)), state.__setitem__(k, v))
        kvikio.buffer = types.SimpleNamespace(memory_register=lambda b: calls.append(("register", b)),
                                              memory_deregister=lambda b: calls.append(("deregister", b)))
    else:
        kvikio.defaults.get_num_threads = lambda: 1
        kvikio.defaults.num_threads_reset = lambda n: calls.append(("reset", n))
        kvikio.memory_register = lambda b: calls.append(("register", b))
        kvikio.memory_deregister = lambda b: calls.append(("deregister", b))
    undo = []
    text = tune_kvikio(kvikio, 32, ["src", "dst"], undo)
    assert text == "32 threads, buffers registered with cuFile"
    assert calls[0] in (("set", "num_threads", 32), ("reset", 32))
    assert ("register", "src") in calls and ("register", "dst") in calls
    calls.clear()
    for u in reversed(undo):
        u()
    assert calls[-1] in (("set", "num_threads", 1), ("reset", 1))
    assert {c for c in calls if c[0] == "deregister"} == {("deregister", "src"), ("deregister", "dst")}


def test_compare_without_deepspeed_times_ours_and_says_why_not(tmp_path, monkeypatch, capsys):
    """offload-bench compare where DeepSpeed is not importable: ours runs (in a process of its own), with and
    without checksums, the report names why DeepSpeed did not and what checksums cost, the JSON holds every run
    with iterations, step(), bytes moved and peak RSS, and the scratch directories are gone."""
    from offload.tools import compare

    monkeypatch.setattr(compare, "_DEFAULT_PEER", str(tmp_path / "no-python"))
    out = tmp_path / "compare.json"
    mine = tmp_path / "d" / "compare-ours"  # a user's directory with a name like a run's: left alone
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    assert main(["compare", "--params", "4M", "--rounds", "1", "--iterations", "3", "--path", str(tmp_path / "d"),
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "DeepSpeed is not importable here" in text and "ours" in text
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]["ours"]
    assert run["system"] == "nvme-offload" and len(run["iteration_s"]) == 2 and run["peak_rss_bytes"] > 0
    assert run["bytes_per_iteration"] > 0 and doc["medians"]["ours"]["speedup_vs_deepspeed"] is None
    assert run["checksum"] == "on" and doc["runs"][compare.UNCHECKED][0]["checksum"] == "off"
    assert "checksums (on by default) cost" in text and isinstance(doc["checksum_cost"], float)
    assert os.listdir(tmp_path / "d") == ["compare-ours"] and (mine / "notes.txt").read_text() == "mine"
    # The compute alone (torch in memory) is run beside, and every variant's iteration is split into its phases.
    (floor,) = doc["runs"][compare.TORCH]
    assert floor["system"] == "torch (in memory)" and floor["bytes_per_iteration"] is None
    assert doc["medians"]["ours"]["vs_compute_alone"] > 0 and "where an iteration's time goes" in text
    for name in ("ours", compare.TORCH):
        phases = doc["medians"][name]["phases_s"]
        assert set(phases) == set(compare.PHASES) and all(v >= 0 for v in phases.values())
        assert sum(phases.values()) == pytest.approx(doc["medians"][name]["iteration_s"], rel=0.5)
    # The ledger: ours by kind (fp32 weights in memory, so state alone: 8 bytes each way less the pool's hits),
    # every process's disk bytes beside it.
    ledger = doc["ledger"]["ours"]
    kinds = ledger["bytes_per_param_iteration"]
    assert kinds["state written"] == pytest.approx(8.0, rel=0.01) and 0 <= kinds["state read"] <= 8.0
    assert kinds["weights read in forward"] == kinds["grads written"] == 0
    assert ledger["total"] == pytest.approx(run["bytes_per_iteration"] / doc["runs"]["ours"][0]["params"], rel=0.2)
    assert doc["ledger"][compare.TORCH]["total"] == 0 and "bytes per parameter per iteration" in text


def test_compare_keeps_figures_a_peer_reported_before_dying_on_exit(tmp_path, capsys):
    """A peer run that printed its figures and then died at interpreter exit (DeepSpeed's aio threads can abort
    there) counts, with the exit recorded and said; one that died before reporting (a JSON line that is not a
    report does not count) fails the benchmark."""
    import argparse

    from offload.tools import compare
    from offload.tools.cli import BenchError

    args = argparse.Namespace(params=4_000_000, iterations=3, params_nvme=False, bf16=False, device="cpu")
    reported = tmp_path / "reported"
    report = '{"iteration_s_median": 1.0, "step_s_median": 0.5, "peak_rss_bytes": 7, "phases_s_median": {}}'
    reported.write_text(f"#!/bin/sh\necho '{report}'\necho \"terminate called\" >&2\nexit 134\n")
    silent = tmp_path / "silent"
    silent.write_text('#!/bin/sh\necho \'{"iteration_s_median": NaN, "loss": 1.0}\'\necho "Segmentation fault" >&2\n'
                      'exit 139\n')
    for f in (reported, silent):
        f.chmod(0o755)
    result = compare._run(str(reported), compare.DEEPSPEED, str(tmp_path), args)
    assert result == dict(json.loads(report), exit_after_report=134)
    assert "exited with 134 after reporting" in capsys.readouterr().out
    with pytest.raises(BenchError, match="exit 139.*Segmentation fault"):
        compare._run(str(silent), compare.DEEPSPEED, str(tmp_path), args)
    assert sorted(os.listdir(tmp_path)) == ["reported", "silent"]  # each run's scratch directory removed


def test_bench_scale_runs_checks_its_export_and_removes_every_file(tmp_path, capsys):
    """``offload-bench scale`` on a tiny Llama writes, loads, trains, exports and checks a checkpoint, reports
    peak RSS against the pools and the step's bytes, and leaves nothing in its directory."""
    pytest.importorskip("transformers")
    out = tmp_path / "scale.json"
    stdout, _ = bench_ok(capsys, "scale", "--params", "400K", "--hidden", "64", "--vocab", "512", "--steps", "1",
                         "--seq", "8", "--no-fio", "--path", str(tmp_path / "scratch"), "--json", str(out))
    doc = json.loads(out.read_text())
    assert doc["layers"] >= 2 and doc["params"] > 300_000
    assert doc["read_bytes_per_step"] > 0 and doc["write_bytes_per_step"] >= doc["optimizer_state_bytes"]
    assert 0 < doc["pool_bytes"] and doc["peak_rss_growth_bytes"] > 0
    assert "equal, loaded by from_pretrained" in stdout and doc["export_checked"] == "loaded by from_pretrained"
    assert not (tmp_path / "scratch").exists()


def test_scale_compares_each_phase_with_the_fio_runs_around_it(monkeypatch, capsys):
    """offload-bench scale's bound of a phase is the mean of the bounds at the fio runs named before and after
    it; a fio that fails stops later runs but keeps the earlier ones, and a bound missing a run is None."""
    import types

    from offload.tools import scale

    rates = iter([(2.0, 1.0), (4.0, 2.0), None])  # (write, read) GiB/s per run; the third run fails

    def fio_run(paths, size, block, depth, threads):
        r = next(rates)
        return (None, None) if r is None else r

    monkeypatch.setattr(scale, "write_read_gib_s", fio_run)
    fio = scale._Fio(types.SimpleNamespace(no_fio=False), ["/nowhere"], 1 << 30)
    for when in (scale.WRITE_BEFORE, scale.LOADED, scale.EXPORT_BEFORE, scale.EXPORT_AFTER):
        fio(when)
    assert [r["when"] for r in fio.runs] == [scale.WRITE_BEFORE, scale.LOADED]
    gib = 1 << 30
    # 1 GiB read and written: 1/1 + 1/2 = 1.5 s at the first run's rates, 1/2 + 1/4 = 0.75 s at the second's.
    assert fio.bound(gib, gib, scale.WRITE_BEFORE, scale.LOADED) == pytest.approx((1.5 + 0.75) / 2)
    assert fio.bound(gib, gib, scale.EXPORT_BEFORE, scale.EXPORT_AFTER) is None
    assert fio.median() == (1.5, 3.0)


def test_checksum_cost_switches_the_byte_stores_checksums(tmp_path, capsys, monkeypatch):
    """The checksum-cost measurements really switch checksums off and on: the byte store records digests for
    the steps "on" and none for the steps "off" (a switch on an attribute nobody reads measured on against on)."""
    import importlib.util

    from offload.bytes import core

    seen = []
    real = core.ByteStore.write

    def write(self, *args, **kwargs):
        seen.append(self.checksum)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(core.ByteStore, "write", write)
    spec = importlib.util.spec_from_file_location("checksum_cost", os.path.join(REPO, "bench", "checksum_cost.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--params", "1M", "--iterations", "8", "--path", str(tmp_path)]) in (0, None)
    assert True in seen and False in seen
    assert "iteration with checksums" in capsys.readouterr().out
    seen.clear()
    code, out, err = bench_in_process(capsys, "adam", "--params", "1M", "--steps", "6", "--no-fio", "--no-torch",
                                      "--no-baseline", "--checksum-cost", "--path", str(tmp_path / "adam"))
    assert code == 0, out + err
    assert True in seen and False in seen


def test_adam_with_state_in_host_memory_beside_a_baseline_that_moved_nothing(tmp_path, capsys):
    """``adam --offload-device cpu`` at a size whose baseline state fits the pool (the pool as a cache: the
    baseline reads nothing back) reports its bytes instead of failing on a ratio it cannot form."""
    code, out, err = bench_in_process(capsys, "adam", "--params", "2M", "--dtype", "bf16", "--offload-device", "cpu",
                                      "--steps", "3", "--no-fio", "--no-torch", "--path", str(tmp_path),
                                      "--json", str(tmp_path / "r.json"))
    assert code == 0, out + err
    assert "without host cache: read / written" in out
    r = json.loads((tmp_path / "r.json").read_text())
    # Ours moves nothing (state in memory); the baseline reads nothing back but writes its state each step.
    assert r["baseline_bytes_read_per_step"] == 0 < r["baseline_bytes_written_per_step"]
    assert r["bytes_read_per_step"] == r["bytes_written_per_step"] == 0 and r["bytes_vs_baseline"] == 0
    assert "(0.00x)" in next(line for line in out.splitlines() if "without host cache: read / written" in line)


def test_compare_goes_on_without_a_deepspeed_run_that_fails(tmp_path, capsys):
    """A Python that imports deepspeed but whose run fails (its ops failing to build, say) is reported with the
    reason and left out of the later rounds; ours are still measured and written."""
    peer = tmp_path / "peer"
    peer.write_text('#!/bin/sh\nif [ "$1" = "-c" ]; then echo 0.0-test; exit 0; fi\n'
                    'echo "ValueError: cannot build the ops" >&2\nexit 1\n')
    peer.chmod(0o755)
    out = tmp_path / "compare.json"
    (tmp_path / "d").mkdir()
    assert main(["compare", "--params", "4M", "--rounds", "2", "--iterations", "3", "--no-extras", "--peer-python",
                 str(peer), "--path", str(tmp_path / "d"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("cannot build the ops") == 1 and "DeepSpeed is left out" in text
    doc = json.loads(out.read_text())
    assert sorted(doc["runs"]) == ["ours"] and len(doc["runs"]["ours"]) == 2
    assert "its run failed" in doc["deepspeed"] and "cannot build the ops" in doc["deepspeed"]


def test_compare_drops_the_rounds_of_a_deepspeed_that_fails_later(tmp_path, capsys):
    """DeepSpeed reporting in the first round and failing in the second: its first round is not a comparison,
    so no DeepSpeed figure is reported (no run, no median, no ratio), and ours are."""
    calls = tmp_path / "calls"
    report = '{"iteration_s_median": 1.0, "step_s_median": 0.5, "peak_rss_bytes": 7, ' \
             '"phases_s_median": {"forward": 0.1, "backward": 0.2, "step": 0.5, "zero_grad": 0.0}}'
    peer = tmp_path / "peer"
    peer.write_text('#!/bin/sh\nif [ "$1" = "-c" ]; then echo 0.0-test; exit 0; fi\n'
                    f'if [ -e {calls} ]; then echo "RuntimeError: lost the GPU" >&2; exit 1; fi\n'
                    f"touch {calls}\necho '{report}'\n")
    peer.chmod(0o755)
    out = tmp_path / "compare.json"
    (tmp_path / "d").mkdir()
    assert main(["compare", "--params", "4M", "--rounds", "2", "--iterations", "3", "--no-extras", "--peer-python",
                 str(peer), "--path", str(tmp_path / "d"), "--json", str(out)]) == 0
    assert "lost the GPU" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert sorted(doc["runs"]) == ["ours"] and sorted(doc["medians"]) == ["ours"]
    assert doc["medians"]["ours"]["speedup_vs_deepspeed"] is None and "its run failed" in doc["deepspeed"]


def test_the_ledger_gives_each_phase_what_moved_in_it_per_parameter_and_iteration():
    """What the counters moved between phase boundaries is the phase's: weights read in forward and backward
    apart, the rest wherever it moved; divided by parameters and iterations."""
    from offload.tools.ledger import Meter, render

    now = {"weights_read": 0, "state_read": 0, "state_written": 0, "grads_written": 0}
    meter = Meter(10, lambda: dict(now))
    for _ in range(2):
        meter.start()
        now["weights_read"] += 20
        meter.phase("forward")
        now["weights_read"] += 30
        now["grads_written"] += 20
        meter.phase("backward")
        now["state_read"] += 40
        now["state_written"] += 40
        now["weights_read"] += 5
        meter.phase("step")
        meter.end()
    ledger = meter.ledger()
    assert ledger.kinds["weights read in forward"] == 2.0 and ledger.kinds["weights read in backward"] == 3.0
    assert ledger.kinds["weights read by the step"] == 0.5 and ledger.kinds["grads written"] == 2.0
    assert ledger.kinds["state read"] == ledger.kinds["state written"] == 4.0 and ledger.total == 15.5
    rows = {row[0]: row[1] for row in render([("ours", ledger)])}
    assert rows["weights read in backward"] == "3.00" and rows["total (the stores' counters)"] == "15.50"
    assert "grads read" not in rows  # nothing moved of it


def test_quality_trains_each_mode_on_held_out_text_and_draws_the_curves(tmp_path, capsys):
    """offload-bench quality on a small corpus: the reference twice (two data orders) and the modes asked for,
    from the same initial weights, each judged by its held-out loss; the JSON holds every curve, the PNG is
    drawn, and the swap files are gone."""
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):  # about one in ten held out, by a hash of the path
        (corpus / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(40)))
    out, png = tmp_path / "q.json", tmp_path / "q.png"
    assert main(["quality", "--corpus", str(corpus), "--steps", "10", "--eval-every", "5", "--hidden", "64",
                 "--layers", "1", "--batch", "2", "--seq", "32", "--modes", "int8", "--path",
                 str(tmp_path / "swap"), "--json", str(out), "--png", str(png)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    from offload.tools import quality

    assert set(doc["runs"]) == {quality.REFERENCE, "int8", quality.REFERENCE_AGAIN}
    for run in doc["runs"].values():
        assert len(run["train"]) == 10 and [s for s, _ in run["held_out"]] == [0, 5, 10]
        assert run["held_out"][-1][1] < run["held_out"][0][1]  # it learns
    first = {name: run["held_out"][0][1] for name, run in doc["runs"].items()}
    # The same initial weights: the reference twice exactly, the bf16 mode their rounding.
    assert first[quality.REFERENCE] == first[quality.REFERENCE_AGAIN]
    assert abs(first["int8"] / first[quality.REFERENCE] - 1) < 0.01
    assert "vs torch AdamW" in text and doc["reference_spread"] >= 0 and png.stat().st_size > 1000
    swap = tmp_path / "swap"
    assert not swap.exists() or not [f for f in os.listdir(swap) if f.endswith(".swap")]


def test_every_command_line_in_pyproject_answers_version(capsys):
    """Each console script pyproject.toml installs takes ``--version``: it prints its name and nvme-offload's
    version and exits 0."""
    import importlib
    import re

    from offload import __version__

    with open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8") as f:  # tomllib is Python 3.11+
        section = f.read().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    scripts = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"$', section, re.M))
    assert len(scripts) >= 4
    for name, target in scripts.items():
        module, func = target.split(":")
        with pytest.raises(SystemExit) as exit_:
            getattr(importlib.import_module(module), func)(["--version"])
        assert exit_.value.code == 0, name
        assert capsys.readouterr().out.strip() == f"{name} (nvme-offload) {__version__}"


@pytest.mark.parametrize("command, label", [
    (["io", "--size", "4MiB", "--block-size", "64KiB", "--runs", "2"], "io: write and read passes"),
    (["adam", "--params", "300K", "--steps", "3", "--no-fio", "--no-torch"], "adam: our steps"),
    (["checkpoint", "--params", "300K", "--repeat", "2", "--no-fio", "--no-torch"], "checkpoint: saves"),
    (["params", "--layers", "1", "--hidden", "64", "--steps", "3", "--no-fio"], "params: offloaded steps"),
], ids=["io", "adam", "checkpoint", "params"])
def test_each_benchmark_shows_a_progress_bar_where_asked(tmp_path, capsys, monkeypatch, command, label):
    """With OFFLOAD_PROGRESS=1 (as into a log; on a terminal it is the default) a benchmark draws a tqdm bar on
    stderr, labelled with what it counts, up to its end; with OFFLOAD_PROGRESS=0 nothing."""
    monkeypatch.setenv("OFFLOAD_PROGRESS", "1")
    code, _, err = bench_in_process(capsys, *command, "--path", str(tmp_path / "a"))
    assert code == 0, err
    assert label in err and "100%" in err, err[-2000:]
    monkeypatch.setenv("OFFLOAD_PROGRESS", "0")
    code, _, err = bench_in_process(capsys, *command, "--path", str(tmp_path / "b"))
    assert code == 0 and label not in err
