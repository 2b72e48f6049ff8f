"""offload-bench plan: its sizes and bytes per step are what the optimizer and the parameter store reserve and
move, for small models; the command prints a plan, says what does not fit and writes a config that loads."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import REPO, TINY, Net, loss_of

from offload import OffloadedAdamW, materialized, offload_parameters
from offload.config import load_config
from offload.params import offloaded
from offload.tools.cli import main
from offload.tools.plan import model_params, plan


def _moved_per_step(opt, params, steps: int) -> list:
    """(bytes read, bytes written) of the optimizer's state in each of ``steps`` steps on random grads."""
    moved = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        before = opt.io_bytes()
        opt.step()
        moved.append([b - a for a, b in zip(before, opt.io_bytes())])
    return moved


def _within(predicted: int, measured: int, share: float = 0.01) -> bool:
    return abs(predicted - measured) <= share * measured


@pytest.mark.parametrize("dtype, state_dtype, master", [(torch.float32, "fp32", True), (torch.bfloat16, "fp32", True),
                                                        (torch.bfloat16, "bf16", True), (torch.bfloat16, "int8", True),
                                                        (torch.bfloat16, "int8", False)])
def test_the_plan_equals_what_the_optimizer_reserves_and_moves(nvme, closing, dtype, state_dtype, master):
    """For 14M parameters in a few hundred units: the state's bytes and the bytes written per steady step equal the
    optimizer's, the bytes read are within one unit (the pool cache's hits vary by one), the swap space within
    1%, small parameters' state is counted in memory; in every state mode."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in [1_200_128] * 12 + [100, 3000]]
    config = load_config({"offload_optimizer": {"buffer_count": 4, "buffer_size": 256 << 10, "nvme_path": nvme,
                                                "state_dtype": state_dtype, "master_weights": master}})
    predicted = plan([p.detach().to("meta") for p in params], config, nvme_paths=[nvme])
    opt = closing(OffloadedAdamW(params, config=config))
    moved = _moved_per_step(opt, params, 3)
    assert predicted.state_bytes == opt.offloaded_state_bytes
    assert _within(predicted.optimizer_nvme_bytes, opt.swap_space.capacity)
    reads, writes = zip(*moved[1:])  # the first step reads nothing: no state yet
    assert all(w == predicted.write_bytes for w in writes)
    # Reads: less the units still in pool buffers from the step before, which vary by one with the order.
    assert all(abs(r - predicted.read_bytes) <= predicted.unit_bytes for r in reads)
    assert predicted.state_in_memory_bytes == 3100 * (8 + (4 if dtype == torch.bfloat16 and master else 0))


@pytest.mark.parametrize("dtype, master", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_the_plan_of_offloaded_weights_equals_the_parameter_store(nvme, closing, dtype, master):
    """With offload_parameters (weights and grads on NVMe): the plan's weight and grad bytes on NVMe and per step
    equal the parameter store's counters: weights read for forward and backward, those without a master copy
    (fp32, or bf16 with master_weights off) a third time by the step, written once; grads written in backward
    and read by the optimizer."""
    torch.manual_seed(0)
    model = Net(h=4096, layers=4).to(dtype)
    params = [p.detach().to("meta") for p in model.parameters()]
    closing(offload_parameters(model, nvme_path=nvme + "-p", **TINY))
    config = load_config({"offload_param": TINY, "offload_optimizer": {"nvme_path": nvme, "master_weights": master,
                                                                       "overlap_backward": False}})
    predicted = plan(params, config, offload_params=True, nvme_paths=[nvme])
    store = offloaded(model).store
    assert predicted.host_bytes["parameter pool"] == store.pool.nbytes > 0  # sized to what is on NVMe
    # The weights forward keeps resident for backward: at most the turn's budget (the pool's bytes).
    turn = offloaded(model).scheduler.turn
    assert predicted.host_bytes["weights kept for backward"] == min(turn.budget, predicted.weights_nvme_bytes) > 0
    unkept = plan(params, config, offload_params=True, nvme_paths=[nvme], keep_for_backward=False)
    assert "weights kept for backward" not in unkept.host_bytes  # offload_parameters(keep_for_backward=False)
    opt = closing(OffloadedAdamW(model.parameters(), config=config))
    for step in range(2):
        before = (store.bytes_read, store.bytes_written, store.grad_bytes_read, store.grad_bytes_written)
        dropped = store.prefetches_dropped
        loss_of(model, step, dtype).backward()
        opt.step()
        opt.zero_grad()
        after = (store.bytes_read, store.bytes_written, store.grad_bytes_read, store.grad_bytes_written)
    read, written, grads_read, grads_written = (b - a for a, b in zip(before, after))
    assert predicted.weights_nvme_bytes == written  # every weight written once
    assert predicted.grads_nvme_bytes == grads_written
    # Read once, but where an optimizer unit ends inside a parameter, the page holding the boundary is read for
    # both units (bf16: 12 bytes of state per element put the boundaries off the grads' pages).
    units = -(-predicted.state_bytes // predicted.unit_bytes)
    if dtype == torch.float32:
        assert grads_read == grads_written  # 8 bytes of state per element: the boundaries fall on pages
    assert 0 <= grads_read - grads_written <= store.space.alignment * units
    with materialized(model):
        assert all(torch.isfinite(p).all() for p in model.parameters())
    reads = 3 if dtype == torch.float32 or not master else 2
    planned = predicted.read_bytes - predicted.grads_nvme_bytes - plan(params, config, nvme_paths=[nvme]).read_bytes
    assert planned == reads * predicted.weights_nvme_bytes
    # A prefetch dropped when the pool is full is read again (how many depends on timing: counted), and the turn
    # into backward saves reading up to the parameter pool's bytes (forward's last weights, params/turn.py).
    largest = max(r.nbytes for r in store.records.values())
    assert -store.pool.nbytes <= read - planned <= (store.prefetches_dropped - dropped) * largest


def test_the_plan_of_the_update_inside_backward_counts_no_grad_round_trip_and_no_step_read(nvme, closing):
    """With overlap_backward the update takes each offloaded weight as backward leaves it: the plan's bytes of
    weights and grads per step (read twice, written once, no grads) are what the parameter store moves, and
    the modes comparison lists the leanest mode below the plain one."""
    from offload.tools.plan import modes

    torch.manual_seed(0)
    model = Net(h=4096, layers=4).to(torch.bfloat16)
    params = [p.detach().to("meta") for p in model.parameters()]
    closing(offload_parameters(model, nvme_path=nvme + "-p", **TINY))
    config = load_config({"offload_param": TINY, "offload_optimizer": {"nvme_path": nvme, "overlap_backward": True}})
    with_weights = plan(params, config, offload_params=True, nvme_paths=[nvme])
    alone = plan(params, config, nvme_paths=[nvme])
    store = offloaded(model).store
    opt = closing(OffloadedAdamW(model.parameters(), config=config))
    for step in range(3):
        before = (store.bytes_read, store.bytes_written, store.grad_bytes_read, store.grad_bytes_written)
        loss_of(model, step, torch.bfloat16).backward()
        opt.step()
        opt.zero_grad()
        after = (store.bytes_read, store.bytes_written, store.grad_bytes_read, store.grad_bytes_written)
    read, written, grads_read, grads_written = (b - a for a, b in zip(before, after))
    assert grads_read == grads_written == 0
    assert written == with_weights.write_bytes - alone.write_bytes == with_weights.weights_nvme_bytes
    # The plan does not model the turn into backward (forward's last modules keep their weights for backward, no
    # read), which may save up to the parameter pool's bytes; otherwise reads are the plan's within 3%.
    assert -store.pool.nbytes <= read - (with_weights.read_bytes - alone.read_bytes) <= 0.03 * read
    table = dict(modes(params, config, offload_params=True, nvme_paths=[nvme]))
    moved = {label: p.read_bytes + p.write_bytes for label, p in table.items()}
    # Each row is its own mode, whatever the config says (here: overlap on): the leaner, the fewer bytes, and
    # the update inside backward saves the int8 row its grads' round trip.
    assert (moved["fp32 state (torch's results)"] > moved["bf16 state"] > moved["int8 state"]
            > moved["int8 state, update inside backward"] > moved["int8 state, no master, inside backward"])
    assert moved["int8 state"] - moved["int8 state, update inside backward"] == 2 * with_weights.grads_nvme_bytes
    assert moved["int8 state, no master, inside backward"] < moved["fp32 state (torch's results)"] / 2


def test_a_host_cache_is_planned_as_the_optimizer_keeps_it(nvme, closing):
    """With a host cache of 40 units the plan's bytes written per step are the optimizer's within one unit and
    read within the pool's hits (fewer by the cached units, each way: a plan that ignored the cache would be 40
    units off); "auto" is the share of the memory planned for that the optimizer would take."""
    import psutil

    from offload.bytes import auto_cache_bytes
    from offload.bytes.tier import AUTO_MARGIN_FRACTION, AUTO_MARGIN_MIN

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(1_200_000)) for _ in range(12)]
    config = load_config({"offload_optimizer": {"buffer_count": 4, "buffer_size": 256 << 10, "nvme_path": nvme,
                                                "host_cache": 40 * (256 << 10)}})
    predicted = plan([p.detach().to("meta") for p in params], config, nvme_paths=[nvme])
    assert predicted.host_cache_bytes == 40 * (256 << 10)
    opt = closing(OffloadedAdamW(params, config=config))
    moved = _moved_per_step(opt, params, 3)
    # Which units the cache holds turns with the snake order (the last, shorter unit in it or not): one unit.
    assert all(abs(w - predicted.write_bytes) <= predicted.unit_bytes for _, w in moved[1:])
    # Beside a host cache the pool cache's hits vary from none to the pool, step to step.
    assert all(abs(r - predicted.read_bytes) <= 5 * predicted.unit_bytes for r, _ in moved[1:])
    auto = load_config({"offload_optimizer": {"host_cache": "auto", "buffer_size": 256 << 10}})
    margin = max(AUTO_MARGIN_MIN, int(psutil.virtual_memory().total * AUTO_MARGIN_FRACTION))
    available = margin + 4 * (256 << 10) + predicted.state_bytes  # room for the whole state: auto takes a share
    small = plan([p.detach().to("meta") for p in params], auto, available_host_bytes=available)
    expected = auto_cache_bytes(pools=4 * (256 << 10), state=small.state_bytes, available=available, quiet=True)
    assert 0 < small.host_cache_bytes == expected // small.unit_bytes * small.unit_bytes < small.state_bytes


def test_the_command_prints_the_plan_says_what_does_not_fit_and_emits_a_config(tmp_path, capsys):
    """`offload-bench plan` prints where state lives, the pools, bytes per step, the step time and drive writes
    from given bandwidths; a host memory too small is named with what to change, and exits 1; --emit-config
    writes a config that loads and --json the same figures, each said with its file."""
    out_cfg, out_json = tmp_path / "planned.json", tmp_path / "plan.json"
    assert main(["plan", "--params", "1B", "--dtype", "bf16", "--path", str(tmp_path / "nvme"), "--read-gib-s",
                 "1.5", "--write-gib-s", "2", "--emit-config", str(out_cfg), "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "optimizer state: 11.18 GiB" in text and "disk-bound step:" in text and "TB per day" in text
    assert "pools: optimizer 4 x 64.00 MiB" in text and "fits: yes" in text
    assert f"wrote {out_cfg}: the configuration planned for (aio, offload_optimizer;" in text
    assert f"wrote {out_json}" in text
    assert load_config(str(out_cfg)).offload_optimizer.nvme_path == (str(tmp_path / "nvme"),)
    assert load_config(str(out_cfg)).given == {"aio", "offload_optimizer"}  # no weights planned: none emitted
    doc = json.loads(out_json.read_text())
    assert doc["write_bytes"] > 11 << 30 and doc["problems"] == []
    assert main(["plan", "--params", "1B", "--offload-params", "--host-memory", "1GiB"]) == 1
    text = capsys.readouterr().out
    assert "fits: NO" in text and "max_in_cpu" in text


def test_a_config_s_offload_param_plans_the_weights_on_nvme_and_a_sweep_s_settings_are_emitted(tmp_path, capsys):
    """A config whose offload_param has device nvme plans the weights on NVMe without --offload-params (the seed's
    70B config among them); a sweep result gives the plan its bandwidths and its best aio settings, which
    --emit-config writes along with the offload_param block planned."""
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "s")},
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "w"), "max_in_cpu": 0}}}))
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"config": {"backend": "auto"}, "best": {
        "block_size": 262144, "queue_depth": 16, "threads": 2, "read_gib_s": 3.0, "write_gib_s": 2.0}}))
    out = tmp_path / "planned.json"
    assert main(["plan", "--params", "100M", "--config", str(cfg), "--sweep", str(sweep), "--emit-config",
                 str(out)]) == 0
    text = capsys.readouterr().out
    assert "weights" in text.split("NVMe:")[1].splitlines()[0]  # on NVMe, from the config's offload_param
    assert "pools: optimizer" in text and "; weights 5 x" in text
    assert "aio from" in text and "block_size 262144, queue_depth 16, thread_count 2" in text
    assert "at 3.00 GiB/s read, 2.00 GiB/s write" in text
    emitted = load_config(str(out))
    assert (emitted.aio.block_size, emitted.aio.queue_depth, emitted.aio.thread_count) == (256 << 10, 16, 2)
    assert emitted.offload_param.max_in_cpu == 0 and "offload_param" in emitted.given
    assert emitted.offload_param.nvme_path == (str(tmp_path / "s"), str(tmp_path / "w"))
    # The seed's 70B config, planned for 7B parameters (planning 70B takes seconds, the same rules): bf16 weights
    # of 13.04 GiB on NVMe but for the 1e9 elements (1.86 GiB) its max_in_cpu keeps in memory.
    seed = main(["plan", "--params", "7B", "--config", os.path.join(REPO, "configs", "ds_config_70b.json"),
                 "--path", str(tmp_path)])
    assert "weights 11.18 GiB" in capsys.readouterr().out and seed in (0, 1)


def test_a_hugging_face_config_is_planned_on_meta_with_tied_weights_once(tmp_path):
    """A config.json is built on the meta device (no memory) with its real shapes; tied embeddings count once."""
    transformers = pytest.importorskip("transformers")
    for tied in (True, False):
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, vocab_size=1000, tie_word_embeddings=tied)
        cfg.save_pretrained(tmp_path / str(tied))
        params = model_params(hf_config=str(tmp_path / str(tied)), dtype="bf16")
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        assert sum(p.numel() for p in params) == sum(p.numel() for p in model.parameters())
        assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in params)


def test_the_planned_weights_pool_is_what_the_parameter_store_allocates(nvme, closing):
    """The plan's parameter pool is the store's: none for a model kept in host memory by max_in_cpu (DeepSpeed's
    default 1e9), buffer_count buffers of the largest weight (whole MiB) when it is on NVMe."""
    for kw in ({}, {"max_in_cpu": 0}):
        model = Net(h=256, layers=2)
        params = [p.detach().to("meta") for p in model.parameters()]
        config = load_config({"offload_param": {"nvme_path": nvme, **kw}})
        predicted = plan(params, config, offload_params=True, nvme_paths=[nvme])
        offload_parameters(model, config=config)
        try:
            assert predicted.host_bytes.get("parameter pool", 0) == offloaded(model).store.pool.nbytes
        finally:
            closing(model)
