"""Scale-out on torch.distributed (CPU, gloo, 2 ranks; 4 for clipping and overlap under FSDP2, weights on NVMe and
2 nodes of 2): FSDP2 parity, max_grad_norm and overlap_backward with DTensor parameters (FSDP2, tensor
parallelism), FSDP2's local shards on NVMe, DCP resume, per-rank reservation and placement, DDP with offloaded
parameters, ZeRO's partitions offloaded.

The ranks are forked once per job (tests/dist_worker.py, with torchrun's variables; one process forks both jobs'
ranks), two for most of the module and four for SCENARIOS_4, and run every scenario in turn; each test reads its
own scenario's outcome on every rank. Pure helpers of offload.distributed are tested in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO, python_env

from offload.distributed import RankInfo, expand_placeholders, is_dtensor, like, local, rank_info, shard_like

WORLD = 2
SCENARIOS = ("fsdp2_parity", "fsdp2_bf16", "fsdp2_int8", "fsdp2_clip_overlap", "fsdp2_weights", "fsdp2_weights_rules",
             "tensor_parallel", "dcp_resume", "streamed_checkpoint", "reservation", "placement",
             "ddp_offload_parameters", "zero_redundancy")
SCENARIOS_4 = ("fsdp2_clip_overlap_4", "fsdp2_weights_4", "fsdp2_weights_nodes")  # on 4 ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def run_jobs(jobs: list[tuple]) -> list[tuple[dict, list]]:
    """Fork the ranks of each job ``(out, scenarios, world)`` in turn, from one process: for each job,
    ``({scenario: [each rank's record]}, swap files left)``."""
    argv = [str(a) for out, scenarios, world in jobs for a in (out, ",".join(scenarios), world)]
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "dist_worker.py"), *argv],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=python_env(),
                          cwd=jobs[0][0], timeout=300 * len(jobs))
    done = []
    for out, scenarios, world in jobs:
        records = {}
        for name in scenarios:
            records[name] = []
            for r in range(world):
                path = out / f"{name}.rank{r}.json"
                records[name].append(json.loads(path.read_text()) if path.exists() else
                                     {"ok": False, "error": proc.stdout})
        swaps = [os.path.join(d, f) for d, _, files in os.walk(out) for f in files if f.endswith(".swap")]
        done.append((records, swaps))
    return done


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The two jobs' outcomes, their ranks forked by one process (one import of torch): WORLD ranks running
    SCENARIOS, then 4 running SCENARIOS_4."""
    yield run_jobs([(tmp_path_factory.mktemp("dist"), SCENARIOS, WORLD),
                    (tmp_path_factory.mktemp("dist4"), SCENARIOS_4, 4)])


@pytest.fixture(scope="module")
def job(jobs):
    """The outcome of every scenario on every rank: ``{scenario: [rank 0's record, rank 1's record]}``."""
    yield jobs[0]


@pytest.fixture(scope="module")
def job4(jobs):
    """The outcome of SCENARIOS_4 on each of 4 ranks."""
    yield jobs[1]


def outcome(job, name: str) -> list[dict]:
    """``name``'s result on each rank; fails with the rank's traceback if it raised."""
    records, _ = job
    for r, rec in enumerate(records[name]):
        if not rec["ok"]:
            pytest.fail(f"rank {r} of {name}:\n{rec['error'][-6000:]}")
    return [rec["result"] for rec in records[name]]


def test_fsdp2_fp32_is_bitwise_torch_fused_adamw(job):
    """Under FSDP2 (fully_shard, DTensor parameters, one layer sharded unevenly) four steps of OffloadedAdamW,
    one with a parameter without grad, leave weights and state bit for bit those of torch's fused AdamW, the
    state as DTensors laid out as torch's; large shards offloaded in several units, small ones in memory."""
    for r, res in enumerate(outcome(job, "fsdp2_parity")):
        assert res["differences"] == [], f"rank {r}"
        assert res["offloaded"] >= 2 and res["in_memory"] >= 2 and res["units"] >= 2
    ranks = outcome(job, "fsdp2_parity")
    assert ranks[0]["offloaded"] != ranks[1]["offloaded"], "the unevenly sharded weight is offloaded on one rank only"


def test_fsdp2_bf16_mixed_precision_is_bitwise_torch(job):
    """With MixedPrecisionPolicy(param_dtype=bfloat16) the same holds bit for bit."""
    for r, res in enumerate(outcome(job, "fsdp2_bf16")):
        assert res["differences"] == [], f"rank {r}"


def test_fsdp2_with_int8_state_is_bitwise_torchaos_8bit_adamw(job):
    """With state_dtype="int8" each rank's shards (8-bit where a shard is in whole blocks, fp32 elsewhere) are
    updated as torchao's AdamW8bit updates the same FSDP2 model, bit for bit."""
    pytest.importorskip("torchao.optim")
    for r, res in enumerate(outcome(job, "fsdp2_int8")):
        assert res["differences"] == [], f"rank {r}"
        assert res["quantized"] >= 1


def assert_as_torch(runs: dict, names: tuple, rank: int) -> None:
    """Each run of ``names`` ended with torch's weights and state bit for bit; its total norms (last_grad_norm
    after each step) are those torch's clip_grad_norm_ returned (whole tensors), with some step clipped; with
    overlap_backward, backward fired every hook and ran the updates it could (see dist_worker.overlap_probe)."""
    for name in names:
        res = runs[name]
        assert res["differences"] == [], f"rank {rank}, {name}"
        assert res["norms"] == res["torch_norms"], f"rank {rank}, {name}"
        assert res["backward"] == [], f"rank {rank}, {name}"
        if name.endswith("clip"):
            assert res["clipped"] >= 1 and len(res["norms"]) >= 3, f"rank {rank}, {name}"


def test_fsdp2_max_grad_norm_is_bitwise_torch_clip_then_adamw(job, job4):
    """max_grad_norm with FSDP2's DTensor parameters takes the norm across ranks as torch's clip_grad_norm_
    does (the local shards' norms, one all-reduce): weights, state and last_grad_norm bit for bit those of
    torch's clip then fused AdamW, fp32 on 2 ranks, bf16 mixed precision on 4 (the last layer's 3 rows leave
    one of them an empty shard); no swap file of the 4 ranks is left behind."""
    for r, runs in enumerate(outcome(job, "fsdp2_clip_overlap")):
        assert_as_torch(runs, ("fp32_clip",), r)
    for r, runs in enumerate(outcome(job4, "fsdp2_clip_overlap_4")):
        assert_as_torch(runs, ("bf16_clip",), r)
    assert job4[1] == [], "a swap file of the 4 ranks was left behind"


def test_fsdp2_overlap_backward_updates_each_shard_after_its_reduce_scatter(job, job4):
    """overlap_backward under FSDP2: the hooks FSDP2 fires after its reduce-scatter start each shard's update
    inside backward (with max_grad_norm the norms are taken there and the updates wait for the global norm);
    bit for bit FSDP2 + torch's (clip and) fused AdamW, fp32 and bf16 mixed precision, on 2 and 4 ranks.
    Micro-batches FSDP2 accumulates unsharded (set_requires_gradient_sync(False)) fire no hook: the update runs
    in the last one's backward."""
    for r, runs in enumerate(outcome(job, "fsdp2_clip_overlap")):
        assert_as_torch(runs, ("fp32_overlap_clip", "bf16_overlap_accumulate"), r)
    for r, runs in enumerate(outcome(job4, "fsdp2_clip_overlap_4")):
        assert_as_torch(runs, ("bf16_overlap_clip", "fp32_overlap"), r)


def assert_weights_as_torch(runs: dict, rank: int) -> None:
    """Each run ended with torch's weights and state bit for bit (see assert_as_torch), its weights read from and
    written to the swap space, and none of them resident between iterations."""
    for name, res in runs.items():
        assert_as_torch(runs, (name,), rank)
        assert res["resident_after"] == 0 and res["weights_read"] > 0 and res["weights_written"] > 0, f"{name}"
        assert res["shards"] == 6 and len(res["swap_files"]) == 1, f"rank {rank}, {name}"


def test_fsdp2_weights_on_nvme_are_bitwise_fsdp2_with_torch_adamw(job, job4):
    """offload_parameters under FSDP2 keeps each rank's local shards on its drive, fetched ahead of FSDP2's
    all-gather and released after it; with OffloadedAdamW's state on NVMe too, 3 steps end with the weights and
    state of FSDP2 + torch's (clip and) fused AdamW with weights in memory, bit for bit: fp32 and bf16 mixed
    precision, with and without max_grad_norm and overlap_backward (updates inside backward checked by the
    probe), on 2 ranks and on 4 (where one rank's shard of the last layer is empty); and with FSDP2's other orders
    and layouts (reshard_after_forward=False and =1, explicit forward and backward prefetches)."""
    for r, runs in enumerate(outcome(job, "fsdp2_weights")):
        assert set(runs) == {"w_fp32", "w_bf16_clip", "w_bf16_overlap", "w_fp32_overlap_clip", "w_bf16_reordered"}
        assert_weights_as_torch(runs, r)
        # Groups FSDP2 keeps unsharded, or gathers from its own resharded copy, read no shard in backward.
        assert runs["w_bf16_reordered"]["weights_read"] < runs["w_fp32"]["weights_read"]
    for r, runs in enumerate(outcome(job4, "fsdp2_weights_4")):
        assert set(runs) == {"w_bf16", "w_fp32_clip", "w_fp32_overlap", "w_bf16_overlap_clip"}
        assert_weights_as_torch(runs, r)


def test_fsdp2_weights_on_node_local_drives_save_and_resume(job4):
    """4 ranks as 2 nodes of 2: each rank's weights and state go to its node's directory, under its local rank,
    and nowhere else; a checkpoint saved to node-local directories (each holding its node's two shards) resumes
    into a new model with its weights offloaded, bit for bit where the uninterrupted run goes."""
    ranks = outcome(job4, "fsdp2_weights_nodes")
    for r, res in enumerate(ranks):
        assert res["differences"] == [], f"rank {r}"
        assert (res["node"], res["local_rank"]) == (r // 2, r % 2)
        mine = [f for f in res["listing"] if f"_rank{r}-" in f]
        assert len(mine) == 6 and all(f.startswith(f"nvme{r % 2}/") for f in mine), f"rank {r}: {res['listing']}"
        node_ranks = {2 * res["node"], 2 * res["node"] + 1}
        assert all(any(f"_rank{n}-" in f for n in node_ranks) for f in res["listing"]), f"rank {r}"
        assert res["checkpoint_shards"] == [f"rank-{n:05d}" for n in sorted(node_ranks)]


def test_fsdp2_weights_state_dict_and_refusals(job):
    """state_dict() of a model whose shards are on NVMe is the in-memory model's, load_state_dict() puts new
    values on NVMe (the next all-gather uses them), neither leaves a shard resident, and restore_parameters
    brings them back; offloaded gradients, a module that is not FSDP2's root and tensor parallel DTensors are
    refused with what to do, and so is a step of torch's own AdamW over the shards (before it changes them); the
    module-level save_checkpoint and load_checkpoint round-trip the shards."""
    for res in outcome(job, "fsdp2_weights_rules"):
        assert res["state_dict_same"] and res["loaded_same"] and res["grads_same"] and res["restored_same"]
        assert res["resident_after_state_dict"] == res["resident_after_load"] == 0
        assert res["grads"].startswith("ConfigError") and "offload_grads=False" in res["grads"]
        assert res["default_grads"] == "offloaded"  # gradients stay FSDP2's unless asked otherwise
        assert res["device"].startswith("ValueError") and "leave device and init out" in res["device"]
        assert res["not_root"].startswith("ValueError") and "root module that fully_shard wrapped" in res["not_root"]
        assert "tensor parallelism" in res["tensor_parallel"] and "OffloadedAdamW" in res["tensor_parallel"]
        assert res["torch_step"].startswith("StateError") and "OffloadedAdamW" in res["torch_step"]
        assert res["unchanged_by_refused_step"] and res["module_level_round_trip"]


def test_tensor_parallel_clip_and_overlap_are_bitwise_torch(job):
    """Under tensor parallelism (column-wise, then row-wise with a replicated bias) max_grad_norm and
    overlap_backward are bit for bit torch's clip_grad_norm_ and fused AdamW."""
    for r, runs in enumerate(outcome(job, "tensor_parallel")):
        assert_as_torch(runs, ("tp_clip", "tp_overlap", "tp_overlap_clip"), r)


def test_what_dtensor_parameters_cannot_do_is_refused_with_what_to_do(job):
    """A gradient laid out unlike its parameter (SequenceParallel's partial sums) is refused by step(), or by
    backward with overlap_backward, naming both layouts and the redistribute that fixes it; max_grad_norm over
    DTensor and plain parameters together is refused when the optimizer is built, as torch's clip refuses it."""
    for res in outcome(job, "tensor_parallel"):
        for key in ("partial_overlap_False", "partial_overlap_True"):
            assert "(Partial(sum),)" in res[key] and "(Replicate(),)" in res[key] and "redistribute" in res[key]
        assert "mixed torch.Tensor and DTensor" in res["mixed"] and "every parameter a DTensor" in res["mixed"]


def test_dcp_save_and_load_resume_bit_for_bit(job):
    """get_optimizer_state_dict gives DTensor state; dcp.save of it, then dcp.load and set_optimizer_state_dict
    into a new model and optimizer, resumes exactly where the uninterrupted run goes (weights and state)."""
    for r, res in enumerate(outcome(job, "dcp_resume")):
        assert res["ours_kinds"] == ["DTensor"], f"rank {r}"
        assert res["ours_differences"] == [], f"rank {r}"


def test_dcp_checkpoint_of_torch_adamw_resumes_in_offloaded_adamw(job):
    """A DCP checkpoint of FSDP2 + torch's fused AdamW, loaded into OffloadedAdamW, goes on bit for bit as
    torch's optimizer would have."""
    for r, res in enumerate(outcome(job, "dcp_resume")):
        assert res["torch_kinds"] == ["DTensor"], f"rank {r}"
        assert res["torch_differences"] == [], f"rank {r}"


def test_streamed_checkpoint_of_every_rank_resumes_fsdp2_bit_for_bit(job):
    """save_checkpoint(dir, model=model) on every rank of an FSDP2 job, then load_checkpoint into a new model
    and optimizer, resumes exactly where the uninterrupted run goes."""
    for r, res in enumerate(outcome(job, "streamed_checkpoint")):
        assert res["differences"] == [], f"rank {r}"


def test_each_rank_reserves_its_local_state_bytes(job):
    """A rank's units and swap file hold its local shards' state, as for the same shards in one process:
    two fp32 moments per local element, each slice rounded to 64 bytes, the file to the 4 KiB block."""
    for r, res in enumerate(outcome(job, "reservation")):
        assert res["state_bytes"] == res["expected"], f"rank {r}"
        assert res["file_bytes"] == res["plain_file_bytes"] == [res["expected_file_bytes"]], f"rank {r}"
        assert res["state_bytes"] < res["whole_state_bytes"] * 0.6, f"rank {r}"
        assert res["pool_bytes"] == res["plain_pool_bytes"], f"rank {r}"


def test_nvme_path_placeholders_give_each_rank_its_directory(job):
    """``{rank}`` and ``{local_rank}`` in nvme_path (a list too) are expanded per rank; a typo is refused."""
    for r, res in enumerate(outcome(job, "placement")):
        assert res["rank"][0].startswith(f"drive{r}/") and res["rank_listing"] == [os.path.basename(res["rank"][0])]
        assert [os.path.dirname(f) for f in res["local_rank"]] == [f"a{r}", f"b{r}"]
        assert "{localrank}" in res["typo"] and "{local_rank}" in res["typo"]


def test_ranks_sharing_a_directory_have_files_named_by_rank(job):
    """In one directory the two ranks' swap files carry their ranks in their names and never collide."""
    ranks = outcome(job, "placement")
    for r, res in enumerate(ranks):
        for f in res["rank"] + res["local_rank"] + res["shared"]:
            assert f"-adam_rank{r}-" in os.path.basename(f)
    assert len(ranks[0]["shared_listing"]) == 2 and ranks[0]["shared_listing"] == ranks[1]["shared_listing"]


def test_ddp_with_offloaded_gradients_is_refused_with_what_to_do(job):
    """DDP over already offloaded weights, and DDP with offloaded gradients (at wrap time or at the first
    forward), are refused with an error that says to wrap first and pass offload_grads=False."""
    for res in outcome(job, "ddp_offload_parameters"):
        assert "Wrap the model first" in res["wrapped_after"] and "offload_grads=False" in res["wrapped_after"]
        for key in ("grads_at_forward", "grads_at_wrap"):
            assert "offload_grads=False" in res[key] and "DDP first" in res[key]


def test_ddp_wrapped_then_offloaded_is_bitwise_ddp_with_torch_adamw(job):
    """DDP, then offload_parameters(ddp.module, offload_grads=False), trained with OffloadedAdamW on different
    data per rank, ends bit for bit where DDP + torch's fused AdamW does, the same on both ranks; with
    overlap_backward, step() refuses what DDP's late all-reduce did and says that DDP is why."""
    for res in outcome(job, "ddp_offload_parameters"):
        assert res["same"] and res["ranks_agree"]
        assert "DistributedDataParallel all-reduces" in res["ddp_overlap"]  # overlap_backward under DDP, told why


def test_zero_redundancy_optimizer_offloads_each_ranks_partition(job):
    """ZeroRedundancyOptimizer(optimizer_class=OffloadedAdamW) steps bit for bit as with torch's fused AdamW;
    each rank offloads only its partition's state, and the consolidated state dict equals torch's;
    max_grad_norm, which would clip a partition by its own norm, is refused there."""
    ranks = outcome(job, "zero_redundancy")
    assert sum(res["mine"] for res in ranks) == ranks[0]["all"]
    for res in ranks:
        assert res["same"] and res["state_bytes"] == res["expected"]
        assert "max_grad_norm under ZeroRedundancyOptimizer" in res["clip_refused"]
    assert ranks[0]["state_same"]


def test_no_swap_file_is_left_behind(job):
    """Every optimizer closed by the scenarios removed its swap files, on every rank."""
    outcome(job, "reservation")
    assert job[1] == []


# -- offload.distributed, in one process ------------------------------------------------------------


def test_placeholders_expand_to_the_given_rank():
    """Every placeholder is replaced; braces that are not a name stay; a path without braces is unchanged."""
    info = RankInfo(rank=5, local_rank=1, world_size=8)
    assert expand_placeholders("/mnt/nvme{local_rank}/r{rank}of{world_size}", info) == "/mnt/nvme1/r5of8"
    assert expand_placeholders("/data/{a,b}/x", info) == "/data/{a,b}/x"
    assert expand_placeholders("/plain", info) == "/plain"
    with pytest.raises(ValueError, match=r"\{node\}.*\{local_rank\}"):
        expand_placeholders("/mnt/{node}", info)


def test_rank_comes_from_torchrun_variables(monkeypatch):
    """Without a process group the rank is read from RANK, LOCAL_RANK, WORLD_SIZE; a bad value is named."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert rank_info() == RankInfo(3, 1, 4) and rank_info().distributed
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x'"):
        rank_info()
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name)
    assert rank_info() == RankInfo(0, 0, 1) and not rank_info().distributed


def test_plain_tensors_pass_through_the_dtensor_helpers():
    """local, like and shard_like leave ordinary tensors as they are (single-process training is unchanged)."""
    t = torch.arange(6.0)
    assert not is_dtensor(t) and local(t) is t and like(t, t) is t and shard_like(t, t) is t


def test_placeholders_in_a_config_file_and_in_offload_parameters(tmp_path, monkeypatch, closing):
    """nvme_path from a DeepSpeed config, and offload_parameters' nvme_path, expand the placeholders from
    torchrun's variables; each swap file lands in its rank's directory, its name carrying the rank."""
    from offload import OffloadedAdamW, offload_parameters
    from offload.params import offloaded

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"zero_optimization": {"offload_optimizer": {
        "device": "nvme", "nvme_path": str(tmp_path / "nvme{local_rank}" / "state")}}}))
    (tmp_path / "nvme1").mkdir()
    model = torch.nn.Linear(100, 100)
    opt = closing(OffloadedAdamW(model.parameters(), config=str(config), small_param_threshold=64))
    closing(offload_parameters(model, nvme_path=str(tmp_path / "nvme{local_rank}" / "params{rank}"), max_in_cpu=0))
    files = opt.swap_space.files + offloaded(model).store.space.files
    assert [os.path.relpath(os.path.dirname(f), tmp_path) for f in files] == ["nvme1/state", "nvme1/params3"]
    assert all(os.path.basename(f).startswith(("nvme-offload-adam_rank3-", "nvme-offload-params_rank3-"))
               for f in files)
