"""The ranks of the distributed tests: forked from this process (torch imported once), each runs every
scenario named on the command line, in order, on gloo, with torchrun's variables (RANK, LOCAL_RANK,
WORLD_SIZE) set. Each scenario's outcome is written to OUT/<scenario>.rank<r>.json: ``{"ok": true,
"result": {...}}`` or ``{"ok": false, "error": "<traceback>"}``, so every test reads its own claim while the
ranks start once for all of them.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from ranks import fork_ranks
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from offload import OffloadedAdamW, offload_parameters, restore_parameters
from offload.distributed import is_dtensor, local
from offload.errors import ConfigError, StateError

LR = dict(lr=1e-2, weight_decay=0.1)
# State in units of 16 KiB: the 64x64 shard of the first layer spans several units. The last layer's weight
# (3x32) is sharded 2 rows and 1: its 64 elements are offloaded on rank 0, its 32 kept in memory on rank 1.
OFFLOAD = dict(small_param_threshold=50, buffer_size=16384, buffer_count=3)
STEPS = 4


def rank() -> int:
    return dist.get_rank()


def model(dtype=torch.float32) -> nn.Module:
    """The same model on every rank: its last layer has 3 rows, so FSDP2 shards it unevenly (2 and 1)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32), nn.ReLU(), nn.Linear(32, 3)).to(dtype)


def sharded(mp: MixedPrecisionPolicy | None = None) -> nn.Module:
    m = model()
    kw = {"mp_policy": mp} if mp is not None else {}
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kw)
    return fully_shard(m, **kw)


def batch(step: int, *, per_rank: bool = False) -> torch.Tensor:
    torch.manual_seed(1000 + step + (100 * rank() if per_rank else 0))
    return torch.randn(8, 64)


def train(m: nn.Module, opt, steps, *, per_rank: bool = False, drop_grad_at: int | None = None,
          clip: float | None = None, probe=None, micro: int = 1) -> list[float]:
    """``steps`` (a range) of training; at step ``drop_grad_at`` the middle layer's bias has no grad. ``clip``:
    torch's clip_grad_norm_ before each step; ``probe()`` is called between backward and step(); ``micro``
    micro-batches per step, FSDP2 reduce-scattering only the last's (set_requires_gradient_sync). Returns the
    total norms torch's clip returned (whole tensors), else the optimizer's ``last_grad_norm`` after each step."""
    norms = []
    for step in steps:
        for i in range(micro):
            if micro > 1:
                m.set_requires_gradient_sync(i == micro - 1)
            m(batch(step + 100 * i, per_rank=per_rank)).float().square().mean().backward()
        if step == drop_grad_at:
            m[2].bias.grad = None
        if probe is not None:
            probe()
        if clip is not None:
            total = torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            norms.append(total.full_tensor() if is_dtensor(total) else total)
        opt.step()
        if getattr(opt, "last_grad_norm", None) is not None:
            norms.append(opt.last_grad_norm)
        opt.zero_grad()
    return [n.item() for n in norms] if all(not is_dtensor(n) for n in norms) else ["a DTensor"]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def differences(ref: nn.Module, ours: nn.Module, ref_opt, opt) -> list[str]:
    """What differs between two models and their optimizers' state dicts (local shards compared bit for bit;
    a DTensor in one must be a DTensor laid out the same way in the other)."""
    out = []
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        if not same(local(p.detach()), local(q.detach())):
            out.append(f"weights of {name}")
    a, b = ref_opt.state_dict(), opt.state_dict()
    if sorted(a["state"]) != sorted(b["state"]):
        return out + [f"state keys {sorted(a['state'])} != {sorted(b['state'])}"]
    for i, entry in a["state"].items():
        for key, value in entry.items():
            other = b["state"][i].get(key)
            if other is None:
                out.append(f"state {i} lacks {key}")
            elif is_dtensor(value) != is_dtensor(other):
                out.append(f"state {i}.{key}: {type(value).__name__} in torch's, {type(other).__name__} in ours")
            elif is_dtensor(value) and (tuple(value.placements) != tuple(other.placements)
                                        or value.shape != other.shape):
                out.append(f"state {i}.{key}: laid out as {value.placements} {tuple(value.shape)} in torch's, "
                           f"{other.placements} {tuple(other.shape)} in ours")
            elif not same(local(value).float() if key == "step" else local(value),
                          local(other).float() if key == "step" else local(other)):
                out.append(f"state {i}.{key} values")
    return out


def swap_dir(out: str, name: str) -> str:
    path = os.path.join(out, "nvme", name)
    os.makedirs(path, exist_ok=True)
    return path


# -- scenarios ------------------------------------------------------------------------------------


def fsdp2_parity(out: str, mp: MixedPrecisionPolicy | None = None, name: str = "fsdp2_fp32") -> dict:
    ref, ours = sharded(mp), sharded(mp)
    ref_opt = torch.optim.AdamW(ref.parameters(), **LR, fused=True)
    opt = OffloadedAdamW(ours.parameters(), **LR, **OFFLOAD, nvme_path=swap_dir(out, name))
    try:
        for m, o in ((ref, ref_opt), (ours, opt)):
            train(m, o, range(STEPS), drop_grad_at=1)
        offloaded = sum(1 for p in ours.parameters() if opt.state_store.slot(p) is not None)
        return {"differences": differences(ref, ours, ref_opt, opt), "offloaded": offloaded,
                "in_memory": sum(1 for _ in ours.parameters()) - offloaded,
                "units": len(opt.state_store.layout.units)}
    finally:
        opt.close()


def fsdp2_bf16(out: str) -> dict:
    return fsdp2_parity(out, MixedPrecisionPolicy(param_dtype=torch.bfloat16), name="fsdp2_bf16")


def fsdp2_int8(out: str) -> dict:
    """8-bit state under FSDP2: each rank's shards updated as torchao's AdamW8bit updates the same DTensors
    (8-bit where a rank's local shard is in whole blocks of >= 4096 elements, fp32 moments elsewhere)."""
    import torchao.optim

    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # torchao's eager path
    ref, ours = sharded(), sharded()
    ref_opt = torchao.optim.AdamW8bit(ref.parameters(), **LR)
    opt = OffloadedAdamW(ours.parameters(), **LR, **OFFLOAD, nvme_path=swap_dir(out, "fsdp2_int8"), state_dtype="int8")
    try:
        for m, o in ((ref, ref_opt), (ours, opt)):
            train(m, o, range(STEPS))
        quantized = sum(1 for s in opt.state_store.layout.slots.values() if s.quantized)
        return {"differences": [name for (name, p), q in zip(ref.named_parameters(), ours.parameters())
                                if not same(local(p.detach()), local(q.detach()))], "quantized": quantized}
    finally:
        opt.close()


def overlap_probe(opt, params: list, *, clip: bool):
    """What backward left of the step under way, checked between backward and step(): FSDP2 (or autograd)
    fired every parameter's hook; without clipping every offloaded unit gets updated with no step() (waited
    for, as the worker runs on), with clipping none is (they wait for the global norm) and the norms of
    the local shards were taken as they arrived. Returns the probe and the list of what it found wrong."""
    seen: list[str] = []

    def probe() -> None:
        run = opt._overlap._run
        if run is None:
            seen.append("no update under way after backward")
            return
        with_grad = [p for p in params if p.grad is not None]
        if len(run.fired) != len(with_grad):
            seen.append(f"{len(run.fired)} hooks fired for {len(with_grad)} grads")
        if clip:
            time.sleep(0.02)
            if run.begun:
                seen.append(f"{run.begun} units updated before the norm was known")
            if len(run.norms) != len(with_grad):
                seen.append(f"{len(run.norms)} norms taken for {len(with_grad)} grads")
        else:
            deadline = time.monotonic() + 10
            while run.begun < len(run.order) and time.monotonic() < deadline:
                time.sleep(0.005)
            if run.begun != len(run.order):
                seen.append(f"{run.begun} of {len(run.order)} units updated during backward")
    return probe, seen


def against_torch(out: str, runs, *, max_norm: float, steps: int) -> dict:
    """Each of ``runs`` (name, make, overlap_backward, clip[, micro-batches]) of OffloadedAdamW on ``make()``
    against torch's fused AdamW on another, preceded by torch's clip_grad_norm_(max_norm) where ``clip``: the
    differences (weights, state), both sides' total norms, what the probe found during backward, the steps that
    clipped."""
    refs, result = {}, {}
    for name, make, overlap, clip, *more in runs:
        micro = more[0] if more else 1
        key = (make, clip, micro)
        if key not in refs:
            ref = make()
            ref_opt = torch.optim.AdamW(ref.parameters(), **LR, fused=True)
            refs[key] = (ref, ref_opt, train(ref, ref_opt, range(steps), clip=max_norm if clip else None, micro=micro))
        ours = make()
        opt = OffloadedAdamW(ours.parameters(), **LR, **OFFLOAD, nvme_path=swap_dir(out, name),
                             overlap_backward=overlap, max_grad_norm=max_norm if clip else None)
        try:
            probe, seen = overlap_probe(opt, list(ours.parameters()), clip=clip) if overlap else (None, [])
            norms = train(ours, opt, range(steps), probe=probe, micro=micro)
            ref, ref_opt, ref_norms = refs[key]
            result[name] = {"differences": differences(ref, ours, ref_opt, opt), "norms": norms,
                            "torch_norms": ref_norms, "backward": seen,
                            "clipped": sum(1 for n in ref_norms if n > max_norm),
                            "offloaded": sum(1 for p in ours.parameters() if opt.state_store.slot(p) is not None)}
        finally:
            opt.close()
    return result


def fsdp2_fp32() -> nn.Module:
    return sharded()


def fsdp2_bf16_mp() -> nn.Module:
    return sharded(MixedPrecisionPolicy(param_dtype=torch.bfloat16))


# Each combination of precision (fp32, bf16 mixed precision) and option (the clip alone, overlap alone, both)
# runs on 2 ranks or on 4; runs meant to end alike share torch's reference.
def fsdp2_clip_overlap(out: str) -> dict:
    """max_grad_norm and overlap_backward under FSDP2 against FSDP2 + torch's clip_grad_norm_ + fused AdamW, 4
    steps: the clip alone and with overlap in fp32; overlap alone in bf16 mixed precision, with two
    micro-batches a step, FSDP2 accumulating the first unsharded (no hook fires for it). The total norm starts
    near 0.42 and falls: most steps clip, not all."""
    return against_torch(out, [("fp32_clip", fsdp2_fp32, False, True), ("fp32_overlap_clip", fsdp2_fp32, True, True),
                               ("bf16_overlap_accumulate", fsdp2_bf16_mp, True, False, 2)],
                         max_norm=0.2, steps=STEPS)


def fsdp2_clip_overlap_4(out: str) -> dict:
    """The other combinations of :func:`fsdp2_clip_overlap`, run on 4 ranks, 3 steps: the clip alone and with
    overlap in bf16 mixed precision, overlap alone in fp32."""
    return against_torch(out, [("bf16_clip", fsdp2_bf16_mp, False, True),
                               ("bf16_overlap_clip", fsdp2_bf16_mp, True, True),
                               ("fp32_overlap", fsdp2_fp32, True, False)], max_norm=0.2, steps=3)


# -- weights on NVMe under FSDP2 --------------------------------------------------------------------

WEIGHTS = dict(max_in_cpu=0, offload_grads=False, buffer_count=4, buffer_size=4096)


def weights_against_torch(out: str, runs, *, max_norm: float, steps: int, path=None) -> dict:
    """Each of ``runs`` (name, make, overlap_backward, clip) of OffloadedAdamW on ``make()`` with its local shards on
    NVMe (offload_parameters) against FSDP2 + torch's (clip and) fused AdamW with weights in memory: the differences
    (weights, state), both sides' norms, the weights' bytes moved and what stayed resident between uses."""
    from offload.params import materialized, offloaded

    refs, result = {}, {}
    for name, make, overlap, clip in runs:
        key = (make, clip)
        if key not in refs:
            ref = make()
            ref_opt = torch.optim.AdamW(ref.parameters(), **LR, fused=True)
            refs[key] = (ref, ref_opt, train(ref, ref_opt, range(steps), clip=max_norm if clip else None))
        ours = make()
        offload_parameters(ours, nvme_path=path or swap_dir(out, name + "_weights"), **WEIGHTS)
        store = offloaded(ours).store
        opt = OffloadedAdamW(ours.parameters(), **LR, **OFFLOAD, nvme_path=swap_dir(out, name),
                             overlap_backward=overlap, max_grad_norm=max_norm if clip else None)
        try:
            probe, seen = overlap_probe(opt, list(ours.parameters()), clip=clip) if overlap else (None, [])
            norms = train(ours, opt, range(steps), probe=probe)
            ref, ref_opt, ref_norms = refs[key]
            resident_after = store.resident_bytes
            with materialized(ours):
                diffs = differences(ref, ours, ref_opt, opt)
            result[name] = {"differences": diffs, "norms": norms, "torch_norms": ref_norms, "backward": seen,
                            "clipped": sum(1 for n in ref_norms if n > max_norm),
                            "resident_after": resident_after, "weights_read": store.bytes_read,
                            "weights_written": store.bytes_written, "shards": len(store.records),
                            "swap_files": [os.path.relpath(f, out) for f in store.space.files]}
        finally:
            opt.close()
            restore_parameters(ours)
    return result


def fsdp2_bf16_reordered() -> nn.Module:
    """FSDP2's other orders and layouts: the first layer kept unsharded after forward, the second resharded to a
    mesh of 1 (``reshard_after_forward=1``: backward gathers FSDP2's own copy, not the shards), explicit forward and
    backward prefetches."""
    m = model()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard(m[0], mp_policy=mp, reshard_after_forward=False)
    fully_shard(m[2], mp_policy=mp, reshard_after_forward=1)
    fully_shard(m[4], mp_policy=mp)
    fully_shard(m, mp_policy=mp)
    m[0].set_modules_to_forward_prefetch([m[2]])
    m[4].set_modules_to_backward_prefetch([m[2]])
    return m


def fsdp2_weights(out: str) -> dict:
    """Weights on NVMe under FSDP2 on 2 ranks, 3 steps: fp32 and bf16 mixed precision, with and without the clip
    and overlap_backward, against FSDP2 + torch's (clip and) fused AdamW."""
    return weights_against_torch(out, [("w_fp32", fsdp2_fp32, False, False),
                                       ("w_bf16_clip", fsdp2_bf16_mp, False, True),
                                       ("w_bf16_overlap", fsdp2_bf16_mp, True, False),
                                       ("w_fp32_overlap_clip", fsdp2_fp32, True, True),
                                       ("w_bf16_reordered", fsdp2_bf16_reordered, False, False)], max_norm=0.2, steps=3)


def fsdp2_weights_4(out: str) -> dict:
    """The same on 4 ranks (the last layer's 3 rows leave one rank an empty shard), the combinations swapped."""
    return weights_against_torch(out, [("w_bf16", fsdp2_bf16_mp, False, False),
                                       ("w_fp32_clip", fsdp2_fp32, False, True),
                                       ("w_fp32_overlap", fsdp2_fp32, True, False),
                                       ("w_bf16_overlap_clip", fsdp2_bf16_mp, True, True)], max_norm=0.2, steps=3)


def fsdp2_weights_nodes(out: str) -> dict:
    """4 ranks as 2 nodes of 2 (LOCAL_RANK, LOCAL_WORLD_SIZE as torchrun sets them there): each node's drives are
    a directory of its own (out/node<n>, standing for the node's mount) that only its ranks use, each rank's files
    under ``nvme{local_rank}``; weights and state on NVMe, bf16 mixed precision, the clip. Saved after 2 steps to
    a node-local checkpoint directory, loaded into a new model (its weights offloaded) and optimizer, 2 more steps:
    compared with 4 uninterrupted steps. Returns the differences and what each node's directories hold."""
    from offload.params import materialized

    world, per_node = dist.get_world_size(), 2
    node, local_rank = rank() // per_node, rank() % per_node
    before = {k: os.environ.get(k) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    os.environ.update(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(per_node))
    base = os.path.join(out, f"node{node}")
    weights_path = os.path.join(base, "nvme{local_rank}", "weights")
    state_path = os.path.join(base, "nvme{local_rank}", "state")
    os.makedirs(os.path.join(base, f"nvme{local_rank}"), exist_ok=True)
    models, opts = [], []

    def make():
        m = fsdp2_bf16_mp()
        offload_parameters(m, nvme_path=weights_path, **WEIGHTS)
        models.append(m)
        opts.append(OffloadedAdamW(m.parameters(), **LR, **OFFLOAD, nvme_path=state_path, max_grad_norm=0.2))
        return m, opts[-1]

    try:
        (whole, whole_opt), (first, first_opt) = make(), make()
        train(whole, whole_opt, range(STEPS))
        train(first, first_opt, range(2))
        ckpt = os.path.join(base, "ckpt")
        first_opt.save_checkpoint(ckpt, model=first)
        resumed, resumed_opt = make()
        resumed_opt.load_checkpoint(ckpt, model=resumed)
        train(resumed, resumed_opt, range(2, STEPS))
        dist.barrier()  # every rank's files exist
        listing = sorted(os.path.relpath(os.path.join(d, f), base) for d, _, files in os.walk(base) for f in files
                         if f.endswith(".swap"))
        shards = sorted(d for d in os.listdir(ckpt) if d.startswith("rank"))
        with materialized(whole), materialized(resumed):
            diffs = differences(whole, resumed, whole_opt, resumed_opt)
        dist.barrier()
        return {"differences": diffs, "node": node, "local_rank": local_rank, "world": world, "listing": listing,
                "checkpoint_shards": shards}
    finally:
        for o in opts:
            o.close()
        for m in models:
            restore_parameters(m)
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def fsdp2_weights_other_paths(out: str) -> dict:
    """torch's own AdamW over shards on NVMe is refused before it changes anything (it would update released
    shards, zeros); the module-level save_checkpoint/load_checkpoint hold the shards as the methods do."""
    import offload
    from offload.params import materialized

    result = {}
    m = fsdp2_fp32()
    offload_parameters(m, nvme_path=swap_dir(out, "w_paths"), **WEIGHTS)
    try:
        with materialized(m):
            before = [local(p.detach()).clone() for p in m.parameters()]
        plain = torch.optim.AdamW(m.parameters(), **LR)
        m(batch(0)).square().mean().backward()
        try:
            plain.step()
            result["torch_step"] = "stepped"
        except StateError as err:
            result["torch_step"] = f"StateError: {err}"
        with materialized(m):
            result["unchanged_by_refused_step"] = all(same(b, local(p.detach()))
                                                      for b, p in zip(before, m.parameters()))
        m.zero_grad()
        opt = OffloadedAdamW(m.parameters(), **LR, **OFFLOAD, nvme_path=swap_dir(out, "w_paths_state"))
        train(m, opt, range(2))
        ckpt = os.path.join(out, "module_level_ckpt")
        offload.save_checkpoint(opt, ckpt, model=m)
        m2 = fsdp2_fp32()
        offload_parameters(m2, nvme_path=swap_dir(out, "w_paths2"), **WEIGHTS)
        opt2 = OffloadedAdamW(m2.parameters(), **LR, **OFFLOAD, nvme_path=swap_dir(out, "w_paths_state2"))
        try:
            offload.load_checkpoint(opt2, ckpt, model=m2)
            with materialized(m), materialized(m2):
                result["module_level_round_trip"] = all(same(local(p.detach()), local(q.detach()))
                                                        for p, q in zip(m.parameters(), m2.parameters()))
        finally:
            opt2.close()
            restore_parameters(m2)
        opt.close()
    finally:
        restore_parameters(m)
    return result


def fsdp2_weights_rules(out: str) -> dict:
    """state_dict() of a model whose shards are on NVMe equals the one in memory, load_state_dict() writes new
    values to NVMe; what cannot be offloaded under FSDP2 is refused with what to do."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from offload.params import materialized, offloaded

    result = {}
    ref, ours = fsdp2_fp32(), fsdp2_fp32()
    offload_parameters(ours, nvme_path=swap_dir(out, "w_rules"), **WEIGHTS)
    try:
        theirs, mine = ref.state_dict(), ours.state_dict()
        result["state_dict_same"] = sorted(theirs) == sorted(mine) and all(
            same(local(theirs[k]), local(mine[k])) for k in theirs)
        result["resident_after_state_dict"] = offloaded(ours).store.resident_bytes
        with torch.no_grad():
            for p in ref.parameters():
                local(p).mul_(2).add_(1)
        ours.load_state_dict(ref.state_dict())
        result["resident_after_load"] = offloaded(ours).store.resident_bytes
        with materialized(ours):
            result["loaded_same"] = all(same(local(p.detach()), local(q.detach()))
                                        for p, q in zip(ref.parameters(), ours.parameters()))
        ours(batch(0)).square().mean().backward()  # the loaded weights are the ones FSDP2 gathers
        ref(batch(0)).square().mean().backward()
        result["grads_same"] = all(same(local(p.grad), local(q.grad)) for p, q in zip(ref.parameters(),
                                                                                      ours.parameters()))
    finally:
        restore_parameters(ours)
    result["restored_same"] = all(same(local(p.detach()), local(q.detach()))
                                  for p, q in zip(ref.parameters(), ours.parameters()))
    result.update(fsdp2_weights_other_paths(out))
    for key, make, kw in (("grads", fsdp2_fp32, dict(max_in_cpu=0, offload_grads=True)),
                          ("default_grads", fsdp2_fp32, dict(max_in_cpu=0)),
                          ("device", fsdp2_fp32, dict(max_in_cpu=0, device="cpu")),
                          ("not_root", lambda: nn.Sequential(fsdp2_fp32()), WEIGHTS),
                          ("tensor_parallel", lambda: parallelize_module(
                              nn.Sequential(nn.Linear(8, 8)), init_device_mesh("cpu", (dist.get_world_size(),)),
                              {"0": ColwiseParallel()}), WEIGHTS)):
        m = make()
        try:
            offload_parameters(m, nvme_path=swap_dir(out, "w_refused"), **kw)
            restore_parameters(m)
            result[key] = "offloaded"
        except (ConfigError, ValueError) as err:
            result[key] = f"{type(err).__name__}: {err}"
    return result


def tensor_parallel(out: str) -> dict:
    """Tensor parallelism: a column-wise then a row-wise Linear (its bias replicated), max_grad_norm and
    overlap_backward against torch's clip and fused AdamW; with a LayerNorm under SequenceParallel, whose
    replicated weights get partial-sum gradients, refused (by step(), or by backward with overlap_backward);
    max_grad_norm over DTensor and plain parameters refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def tp(norm: bool = False) -> nn.Module:
        torch.manual_seed(0)
        layers = [nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)] + ([nn.LayerNorm(64)] if norm else [])
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel(**({"output_layouts": Shard(0)} if norm else {}))}
        if norm:
            plan["3"] = SequenceParallel(sequence_dim=0)
        return parallelize_module(nn.Sequential(*layers), mesh, plan)

    # The total norm is near 0.15: some steps clip, some do not.
    result = against_torch(out, [("tp_clip", tp, False, True), ("tp_overlap", tp, True, False),
                                 ("tp_overlap_clip", tp, True, True)], max_norm=0.14, steps=STEPS)
    for overlap in (False, True):
        m = tp(norm=True)
        opt = OffloadedAdamW(m.parameters(), **LR, nvme_path=swap_dir(out, "tp_partial"), overlap_backward=overlap)
        try:
            m(batch(0)).square().mean().backward()
            opt.step()
            result[f"partial_overlap_{overlap}"] = "stepped"
        except RuntimeError as err:
            result[f"partial_overlap_{overlap}"] = str(err)
        finally:
            opt.close()
    try:
        OffloadedAdamW([*tp().parameters(), nn.Parameter(torch.zeros(3))], nvme_path=swap_dir(out, "tp_mixed"),
                       max_grad_norm=1.0)
        result["mixed"] = "built"
    except ValueError as err:
        result["mixed"] = str(err)
    return result


def dcp_resume(out: str) -> dict:
    """Saved with dcp after 2 steps (from ours, and from torch's AdamW), loaded into a new OffloadedAdamW that
    runs 2 more: compared with 4 uninterrupted steps of the optimizer that saved."""
    path = swap_dir(out, "dcp_resume")
    result = {}
    for source in ("ours", "torch"):
        make = ((lambda m: OffloadedAdamW(m.parameters(), **LR, **OFFLOAD, nvme_path=path)) if source == "ours"
                else (lambda m: torch.optim.AdamW(m.parameters(), **LR, fused=True)))
        whole, first = sharded(), sharded()
        whole_opt, first_opt = make(whole), make(first)
        resumed_opt = None
        try:
            train(whole, whole_opt, range(STEPS))
            train(first, first_opt, range(2))
            ckpt = os.path.join(out, f"dcp_{source}")
            saved = save_dcp(first, first_opt, ckpt)
            result[f"{source}_kinds"] = sorted({type(v).__name__ for e in saved["state"].values()
                                                for k, v in e.items() if k != "step"})
            resumed = sharded()
            resumed_opt = OffloadedAdamW(resumed.parameters(), **LR, **OFFLOAD, nvme_path=path)
            load_dcp(resumed, resumed_opt, ckpt)
            train(resumed, resumed_opt, range(2, STEPS))
            result[f"{source}_differences"] = differences(whole, resumed, whole_opt, resumed_opt)
        finally:
            for o in (whole_opt, first_opt, resumed_opt):
                if isinstance(o, OffloadedAdamW):
                    o.close()
    return result


def save_dcp(m: nn.Module, opt, ckpt: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    saved = get_optimizer_state_dict(m, opt)
    dcp.save({"model": get_model_state_dict(m), "optim": saved}, checkpoint_id=ckpt)
    return saved


def load_dcp(m: nn.Module, opt, ckpt: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    sd = {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(m, sd["model"])
    set_optimizer_state_dict(m, opt, sd["optim"])


def streamed_checkpoint(out: str) -> dict:
    """save_checkpoint on every rank after 2 steps, load_checkpoint into a new model and optimizer, 2 more
    steps: compared with 4 uninterrupted steps."""
    path = swap_dir(out, "streamed")
    whole, first, resumed = sharded(), sharded(), sharded()
    opts = [OffloadedAdamW(m.parameters(), **LR, **OFFLOAD, nvme_path=path) for m in (whole, first, resumed)]
    try:
        train(whole, opts[0], range(STEPS))
        train(first, opts[1], range(2))
        ckpt = os.path.join(out, "streamed_ckpt")
        opts[1].save_checkpoint(ckpt, model=first)
        opts[2].load_checkpoint(ckpt, model=resumed)
        train(resumed, opts[2], range(2, STEPS))
        return {"differences": differences(whole, resumed, opts[0], opts[2])}
    finally:
        for o in opts:
            o.close()


def reservation(out: str) -> dict:
    """Bytes each rank reserves for an FSDP2 model, and for the same shards as plain tensors in one process."""
    from offload.sizes import round_up

    options = dict(small_param_threshold=100, config={"aio": {"block_size": 4096}})
    m = sharded()
    opt = OffloadedAdamW(m.parameters(), **LR, **options, nvme_path=swap_dir(out, "reservation"))
    plain = [nn.Parameter(torch.zeros(local(p).shape)) for p in m.parameters()]
    alone = OffloadedAdamW(plain, **LR, **options, nvme_path=swap_dir(out, "reservation_plain"))
    whole = OffloadedAdamW(model().parameters(), **LR, **options, nvme_path=swap_dir(out, "reservation_whole"))
    try:
        # Two fp32 moments per element, each slice on a 64-byte boundary.
        expected = sum(2 * round_up(local(p).numel() * 4, 64) for p in m.parameters() if local(p).numel() >= 100)
        return {"state_bytes": opt.offloaded_state_bytes, "expected": expected,
                "file_bytes": [os.path.getsize(f) for f in opt.swap_space.files],
                "plain_file_bytes": [os.path.getsize(f) for f in alone.swap_space.files],
                # The state's extents and the swap file's guard block after them.
                "expected_file_bytes": round_up(expected, 4096) + opt.swap_space.alignment,
                "whole_state_bytes": whole.offloaded_state_bytes,
                "pool_bytes": opt.host_pool_bytes, "plain_pool_bytes": alone.host_pool_bytes}
    finally:
        for o in (opt, alone, whole):
            o.close()


def placement(out: str) -> dict:
    """Swap files under ``{rank}``/``{local_rank}`` paths, and in one directory shared by the ranks."""
    base = os.path.join(out, "nvme", "placement")
    os.makedirs(base, exist_ok=True)
    params = [nn.Parameter(torch.zeros(5000))]
    result = {}
    for key, path in (("rank", os.path.join(base, "drive{rank}")),
                      ("local_rank", [os.path.join(base, "a{local_rank}"), os.path.join(base, "b{local_rank}")]),
                      ("shared", os.path.join(base, "shared"))):
        opt = OffloadedAdamW(params, nvme_path=path, small_param_threshold=100)
        try:
            result[key] = [os.path.relpath(f, base) for f in opt.swap_space.files]
            dist.barrier()  # both ranks' files exist at once
            result[key + "_listing"] = sorted(os.listdir(os.path.dirname(opt.swap_space.files[0])))
            dist.barrier()
        finally:
            opt.close()
    try:
        OffloadedAdamW(params, nvme_path=os.path.join(base, "drive{localrank}"))
    except ValueError as err:
        result["typo"] = str(err)
    return result


def ddp_offload_parameters(out: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from offload.params import materialized

    path = swap_dir(out, "ddp")
    opts = dict(nvme_path=path, max_in_cpu=0, buffer_count=3, buffer_size=2048)
    offloaded = []  # models to restore at the end (their swap files removed)

    def offload(m, **kw):
        offloaded.append(offload_parameters(m, **opts, **kw))
        return m

    result, opt = {}, None
    try:
        # Offloaded, then wrapped: DDP's constructor reads the weights.
        try:
            DistributedDataParallel(offload(model()))
        except RuntimeError as err:
            result["wrapped_after"] = str(err)
        # Wrapped, then offloaded with offloaded gradients: refused at the first forward, before any gradient.
        d = DistributedDataParallel(model())
        offload(d.module)
        try:
            d(batch(0))
        except ConfigError as err:
            result["grads_at_forward"] = str(err)
        try:
            offload(DistributedDataParallel(model()))
        except ConfigError as err:
            result["grads_at_wrap"] = str(err)
        # Wrapped, then offloaded with ordinary gradients: bit for bit DDP + torch's AdamW.
        ref = DistributedDataParallel(model())
        ref_opt = torch.optim.AdamW(ref.parameters(), **LR, fused=True)
        ours = DistributedDataParallel(model())
        offload(ours.module, offload_grads=False)
        opt = OffloadedAdamW(ours.parameters(), **LR, **OFFLOAD, nvme_path=path)
        for step in range(3):
            for m, o in ((ref, ref_opt), (ours, opt)):
                m(batch(step, per_rank=True)).square().mean().backward()
                o.step()
                o.zero_grad()
        with materialized(ours.module):
            result["same"] = all(same(p.detach(), q.detach()) for p, q in zip(ref.parameters(), ours.parameters()))
            mine = [q.detach().sum().item() for q in ours.parameters()]
        # Every rank ends with the same weights (DDP averaged the gradients).
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        result["ranks_agree"] = all(g == gathered[0] for g in gathered)
        # overlap_backward under DDP: its all-reduce changes the grads after the update began; step() says so.
        plain = DistributedDataParallel(model())
        late = OffloadedAdamW(plain.parameters(), **LR, **OFFLOAD, nvme_path=path, overlap_backward=True)
        try:
            plain(batch(0, per_rank=True)).square().mean().backward()
            late.step()
        except StateError as err:
            result["ddp_overlap"] = str(err)
        finally:
            late.close()
        return result
    finally:
        if opt is not None:
            opt.close()
        for m in offloaded:
            restore_parameters(m)


def zero_redundancy(out: str) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ref, ours = model(), model()
    try:  # a partition's norm is not the model's: refused before anything is made
        ZeroRedundancyOptimizer(ours.parameters(), optimizer_class=OffloadedAdamW, **LR, **OFFLOAD,
                                nvme_path=swap_dir(out, "zero"), max_grad_norm=1.0)
        clip_refused = ""
    except ValueError as err:
        clip_refused = str(err)
    ref_opt = ZeroRedundancyOptimizer(ref.parameters(), optimizer_class=torch.optim.AdamW, **LR, fused=True)
    opt = ZeroRedundancyOptimizer(ours.parameters(), optimizer_class=OffloadedAdamW, **LR, **OFFLOAD,
                                  nvme_path=swap_dir(out, "zero"))
    try:
        # Each rank's grads differ (no DDP): every rank steps its own partition and broadcasts it.
        train(ref, ref_opt, range(3), per_rank=True)
        train(ours, opt, range(3), per_rank=True)
        mine = [p for g in opt.optim.param_groups for p in g["params"]]
        offloaded = [p for p in mine if opt.optim.state_store.slot(p) is not None]
        result = {
            "same": all(same(p.detach(), q.detach()) for p, q in zip(ref.parameters(), ours.parameters())),
            "mine": len(mine), "all": len(list(ours.parameters())), "clip_refused": clip_refused,
            "state_bytes": opt.optim.offloaded_state_bytes,
            "expected": sum(2 * ((p.numel() * 4 + 63) // 64 * 64) for p in offloaded),
        }
        for o in (ref_opt, opt):
            o.consolidate_state_dict(to=0)
        if rank() == 0:
            a, b = ref_opt.state_dict(), opt.state_dict()
            result["state_same"] = sorted(a["state"]) == sorted(b["state"]) and all(
                same(v, b["state"][i][k]) for i, e in a["state"].items() for k, v in e.items() if k != "step")
        return result
    finally:
        opt.optim.close()


SCENARIOS = {f.__name__: f for f in (fsdp2_parity, fsdp2_bf16, fsdp2_int8, fsdp2_clip_overlap, fsdp2_clip_overlap_4,
                                      fsdp2_weights, fsdp2_weights_4, fsdp2_weights_nodes, fsdp2_weights_rules,
                                      tensor_parallel, dcp_resume, streamed_checkpoint,
                                      reservation, placement, ddp_offload_parameters, zero_redundancy)}


def rank_main(out: str, names: list[str], rank: int, world: int) -> None:
    """One rank: every scenario of ``names`` in turn, each outcome written to OUT/<scenario>.rank<r>.json."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # as torchrun sets them
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for name in names:
            try:
                record = {"ok": True, "result": SCENARIOS[name](out)}
            except Exception:  # recorded for the test that reads this scenario
                record = {"ok": False, "error": traceback.format_exc()}
            with open(os.path.join(out, f"{name}.rank{rank}.json"), "w") as f:
                json.dump(record, f)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> int:
    """``dist_worker.py OUT SCENARIO,... WORLD [OUT SCENARIO,... WORLD]...``: for each job in turn, fork WORLD
    ranks (torch imported once for all the jobs) and wait for them, killing any still running after 180 s;
    exits 0 when every rank of every job did."""
    ok = True
    for i in range(1, len(sys.argv), 3):
        out, names, world = sys.argv[i], sys.argv[i + 1].split(","), int(sys.argv[i + 2])
        codes = fork_ranks(world, lambda rank, out=out, names=names, world=world: rank_main(out, names, rank, world),
                           timeout=180)
        ok = ok and all(c == 0 for c in codes)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
