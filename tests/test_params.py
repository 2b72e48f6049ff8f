"""Parameter offload: training and inference parity with the in-memory model, hooks, prefetch, undo, errors.

Pools are tiny (a few 8 KiB buffers) so that every weight is larger than the pool and moves in units,
and max_in_cpu is 0 unless a test is about the host cache, so that every weight goes through the disk.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from helpers import OPT, TINY, Net, assert_same_weights, batch, loss_of, run_code
from torch import nn

from offload import ConfigError, OffloadedAdamW, offload_parameters, restore_parameters
from offload.params import clip_grad_norm_, load_grad, materialized, offloaded, store_of
from offload.sizes import MIB


def make_pair(seed=0, dtype=torch.float32, **kw):
    torch.manual_seed(seed)
    ref = Net(**kw).to(dtype)
    return ref, copy.deepcopy(ref)


def assert_same_grads(ref, off):
    for (name, p), q in zip(ref.named_parameters(), off.parameters()):
        g = load_grad(q)
        assert (p.grad is None) == (g is None), f"{name}: grad presence differs"
        assert p.grad is None or torch.equal(p.grad, g), f"{name}: grad differs"


def train_side_by_side(ref, off, nvme, steps=4, dtype=torch.float32, micro=1, before_step=None, clip=None,
                       set_to_none=True):
    """Train both models in lockstep; ``clip``: max norm for torch's clip (ref) and ours (off)."""
    opt_ref = OffloadedAdamW(ref.parameters(), nvme_path=nvme, **OPT)
    opt_off = OffloadedAdamW(off.parameters(), nvme_path=nvme, **OPT)
    try:
        for step in range(steps):
            if before_step:
                before_step(step, ref, off)
            for m in range(micro):
                la, lb = loss_of(ref, step * micro + m, dtype), loss_of(off, step * micro + m, dtype)
                assert torch.equal(la, lb), f"step {step}: loss {la.item()} != {lb.item()}"
                la.backward()
                lb.backward()
            assert_same_grads(ref, off)
            if clip is not None:
                na = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
                nb = clip_grad_norm_(off, clip)
                assert torch.equal(na, nb), f"step {step}: norm {na.item()} != {nb.item()}"
                assert_same_grads(ref, off)
            opt_ref.step()
            opt_off.step()
            opt_ref.zero_grad(set_to_none=set_to_none)
            opt_off.zero_grad(set_to_none=set_to_none)
        assert_same_weights(ref, off)
    finally:
        opt_ref.close()
        opt_off.close()


def model_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


# -- training and inference parity ----------------------------------------------------------------


def test_training_matches_in_memory_model_bitwise(nvme, closing):
    """A model far larger than the pool trains to the same losses, grads and weights, bit for bit."""
    ref, off = make_pair()
    closing(offload_parameters(off, nvme, **TINY))
    store = offloaded(off).store
    assert model_bytes(off) > 4 * store.pool.nbytes
    assert store.resident_bytes == 0
    train_side_by_side(ref, off, nvme, steps=5)
    assert store.bytes_read > 0 and store.bytes_written > model_bytes(off)


def test_training_matches_torch_fused_adamw(nvme, closing):
    """OffloadedAdamW over offloaded weights equals torch.optim.AdamW(fused=True) over in-memory ones."""
    ref, off = make_pair(seed=1)
    closing(offload_parameters(off, nvme, **TINY))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt_off = closing(OffloadedAdamW(off.parameters(), nvme_path=nvme, **OPT))
    for step in range(4):
        for model, opt in ((ref, opt_ref), (off, opt_off)):
            loss_of(model, step).backward()
            opt.step()
            opt.zero_grad()
    assert_same_weights(ref, off)


def test_bf16_training_writes_weights_from_the_fp32_master(nvme, closing):
    """bf16 weights on NVMe, updated from the fp32 master copy, match the in-memory bf16 model bitwise."""
    ref, off = make_pair(seed=2, dtype=torch.bfloat16)
    closing(offload_parameters(off, nvme, **TINY))
    train_side_by_side(ref, off, nvme, steps=3, dtype=torch.bfloat16)


def test_gradient_accumulation_over_micro_batches(nvme, closing):
    """Two forward/backward passes per step accumulate the same grads as the in-memory model."""
    ref, off = make_pair(seed=3)
    closing(offload_parameters(off, nvme, **TINY))
    train_side_by_side(ref, off, nvme, steps=2, micro=2)


def test_inference_output_is_identical(nvme, closing):
    """model.eval() under torch.no_grad() gives the same output, and no parameter stays resident."""
    ref, off = make_pair(seed=4)
    closing(offload_parameters(off, nvme, **TINY))
    ref.eval()
    off.eval()
    with torch.no_grad():
        for step in range(3):
            x, _ = batch(step)
            assert torch.equal(ref(x), off(x))
    assert offloaded(off).store.resident_bytes == 0


# -- execution order and prefetch --------------------------------------------------------------------


def test_changed_execution_order_falls_back_and_rerecords(nvme, closing):
    """Reordering blocks between steps keeps results exact, is detected, re-recorded and prefetched again."""
    ref, off = make_pair(seed=5)
    closing(offload_parameters(off, nvme, **TINY))
    sched, store = offloaded(off).scheduler, offloaded(off).store
    orders = [None, None, [3, 1, 0, 2], [3, 1, 0, 2], [2, 0], None]

    def reorder(step, a, b):
        a.order = b.order = orders[step]

    train_side_by_side(ref, off, nvme, steps=len(orders), before_step=reorder)
    assert sched.order_changes >= 3
    assert store.prefetch_hits > 0


# -- sharing, reuse, checkpointing ---------------------------------------------------------------------


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.mid = nn.Linear(32, 32)
        self.lm_head = nn.Linear(32, 64, bias=False)
        self.lm_head.weight = self.embed.weight  # the same Parameter in two modules

    def forward(self, idx):
        h = self.embed(idx)
        h = self.mid(torch.tanh(self.mid(h)))  # a submodule called twice in one forward
        return self.lm_head(h)


def test_tied_weights_and_a_submodule_called_twice(nvme, closing):
    """A Parameter shared by two modules is fetched once and released when unused; reuse is exact."""
    torch.manual_seed(7)
    ref = Tied()
    off = copy.deepcopy(ref)
    closing(offload_parameters(off, nvme, **TINY))
    store = offloaded(off).store
    n_records = len(store.records)
    assert n_records == 3  # the embed/lm_head weight once, mid's weight and bias
    opt_ref = closing(OffloadedAdamW(ref.parameters(), nvme_path=nvme, **OPT))
    opt_off = closing(OffloadedAdamW(off.parameters(), nvme_path=nvme, **OPT))
    idx = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for model, opt in ((ref, opt_ref), (off, opt_off)):
            nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
            opt.step()
            opt.zero_grad()
        assert all(store.users(p) == 0 for p in store.records)
        assert store.resident_bytes == 0
    assert off.lm_head.weight is off.embed.weight
    assert_same_weights(ref, off)


def test_activation_checkpointing_recomputes_with_fetched_weights(nvme, closing):
    """torch.utils.checkpoint (use_reentrant=False) over offloaded blocks gives the in-memory grads."""
    ref, off = make_pair(seed=8, ckpt=True)
    closing(offload_parameters(off, nvme, **TINY))
    train_side_by_side(ref, off, nvme, steps=3)
    assert offloaded(off).store.resident_bytes == 0
    assert offloaded(off).scheduler.turn.taken > 0  # kept at the recomputations, taken by their backward


def test_resident_parameter_bytes_stay_bounded(nvme, closing):
    """Over forward, backward and the step, resident weights stay near one block's, not the model's."""
    torch.manual_seed(9)
    off = Net(layers=8)
    closing(offload_parameters(off, nvme, **TINY))
    store = offloaded(off).store
    unit = 32 * 1024  # the optimizer's unit: 4096 fp32 weights' state (exp_avg, exp_avg_sq)
    opt = closing(OffloadedAdamW(off.parameters(), nvme_path=nvme, **{**OPT, "buffer_size": unit}))
    largest = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in off.modules())
    turn = offloaded(off).scheduler.turn
    for step in range(2):
        taken = turn.taken
        loss_of(off, step).backward()
        # Forward and backward: one module in use, and the last modules' weights kept into backward
        # (params/turn.py), at most the parameter pool's bytes.
        assert store.resident_bytes_max <= store.pool.nbytes + largest
        opt.step()
        opt.zero_grad()
    assert turn.taken - taken >= 2  # several modules kept
    # The step holds the weights of the optimizer unit in hand (one parameter may span several units).
    assert store.resident_bytes_max <= 2 * largest + unit // 2
    assert store.resident_bytes_max < model_bytes(off) / 4
    assert store.resident_bytes == 0


def test_released_weights_are_reported_to_the_heap_outside_the_store_lock(nvme, closing, monkeypatch):
    """Where no mapping can be made for a weight's pages (its storage is then shrunk to free it), every weight
    freed at its release (forward, backward, the step) is reported to offload._proc.heap_freed, which may trim
    the C heap for milliseconds: never while the store's lock is held (the backward hooks and the overlap
    worker wait on it)."""
    from offload.params import mapped
    from offload.params import store as store_module

    monkeypatch.setattr(mapped.MappedMemory, "region", lambda self, nbytes: None)
    torch.manual_seed(9)
    model = Net(layers=2)
    closing(offload_parameters(model, nvme, **TINY))
    opt = closing(OffloadedAdamW(model.parameters(), nvme_path=nvme, **OPT))
    store = offloaded(model).store
    reports = []
    monkeypatch.setattr(store_module, "heap_freed", lambda n: reports.append((n, store._lock._is_owned())))
    loss_of(model, 0).backward()
    opt.step()
    opt.zero_grad()
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p in store.records)
    assert sum(n for n, _ in reports) >= 3 * weights  # freed after forward, backward and the step
    assert not any(locked for _, locked in reports)


def test_heap_freed_trims_once_per_bound_of_frees_and_gives_pages_back(monkeypatch):
    """heap_freed trims the heap once every ``every`` bytes reported freed, and only while more than that lies
    free (a fragmented heap keeps counting its free bytes after a trim, so that alone would trim at every
    release). A real trim gives free pages back: RSS drops by most of the freed chunks (64 KiB each, below
    mmap's threshold, every other one freed so they cannot merge)."""
    import ctypes
    import types

    from helpers import proc_status

    from offload import _proc

    if _proc._malloc_trim is None or _proc._mallinfo2 is None:
        pytest.skip("needs glibc's malloc_trim and mallinfo2")
    trims, free = [], [1000 * MIB]
    real_trim, real_info = _proc._malloc_trim, _proc._mallinfo2
    monkeypatch.setattr(_proc, "_malloc_trim", lambda pad: trims.append(pad))
    monkeypatch.setattr(_proc, "_mallinfo2", lambda: types.SimpleNamespace(fordblks=free[0]))
    monkeypatch.setattr(_proc, "_freed", 0)
    for _ in range(10):
        _proc.heap_freed(100 * MIB, every=256 * MIB)
    assert len(trims) == 3  # at 300, 600 and 900 MiB reported
    free[0] = 200 * MIB  # little free: nothing to give back
    for _ in range(10):
        _proc.heap_freed(100 * MIB, every=256 * MIB)
    assert len(trims) == 3

    monkeypatch.setattr(_proc, "_malloc_trim", real_trim)
    monkeypatch.setattr(_proc, "_mallinfo2", real_info)
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    chunk, count = 64 << 10, 3000
    ptrs = [libc.malloc(chunk) for _ in range(count)]
    try:
        for p in ptrs:
            ctypes.memset(p, 1, chunk)
        for p in ptrs[::2]:
            libc.free(p)
        freed = count // 2 * chunk
        assert _proc._mallinfo2().fordblks >= freed
        monkeypatch.setattr(_proc, "_freed", 0)
        before = proc_status("VmRSS")
        _proc.heap_freed(freed // 4, every=freed // 2)  # not yet the bound's worth of frees: kept
        assert proc_status("VmRSS") > before - freed // 4
        _proc.heap_freed(freed // 4, every=freed // 2)
        assert proc_status("VmRSS") < before - freed // 2
    finally:
        for p in ptrs[1::2]:
            libc.free(p)


# -- what users see ---------------------------------------------------------------------------------


def test_released_parameters_keep_their_metadata(nvme, closing):
    """Printing the model, shapes, dtypes, requires_grad and named_parameters work while weights are out."""
    ref, off = make_pair(seed=10)
    off.blocks[0].up.weight.requires_grad_(False)
    before = [(n, p.shape, p.dtype, p.device, p.requires_grad) for n, p in off.named_parameters()]
    closing(offload_parameters(off, nvme, **TINY))
    assert repr(off) == repr(ref)
    assert [(n, p.shape, p.dtype, p.device, p.requires_grad) for n, p in off.named_parameters()] == before
    assert not any(p._nvme_is_resident() for p in off.parameters()) and offloaded(off).store.resident_bytes == 0
    assert torch.equal(off.scale, ref.scale)  # buffers stay in memory


def test_state_dict_and_load_state_dict_materialise_one_module_at_a_time(nvme, closing):
    """state_dict() holds real copies of the weights; load_state_dict() writes new weights to NVMe."""
    ref, off = make_pair(seed=11)
    closing(offload_parameters(off, nvme, **TINY))
    store = offloaded(off).store
    sd = off.state_dict()
    for key, value in ref.state_dict().items():
        assert torch.equal(sd[key], value), key
    assert store.resident_bytes == 0
    other = Net()
    off.load_state_dict(other.state_dict())
    assert store.resident_bytes == 0
    x, _ = batch(0)
    with torch.no_grad():
        assert torch.equal(off(x), other(x))


def test_restore_brings_back_identical_weights_and_removes_swap_files(nvme, closing):
    """restore_parameters gives ordinary parameters with the latest values, no hooks and no swap file."""
    ref, off = make_pair(seed=12)
    closing(offload_parameters(off, nvme, **TINY))
    files = offloaded(off).store.space.files
    assert all(os.path.exists(f) for f in files)
    train_side_by_side(ref, off, nvme, steps=2)
    params = list(off.parameters())
    assert restore_parameters(off) is off
    assert not any(os.path.exists(f) for f in files)
    assert offloaded(off) is None and all(store_of(p) is None for p in params)
    assert list(off.parameters()) == params  # the same Parameter objects
    for p, q in zip(ref.parameters(), off.parameters()):
        assert torch.equal(p, q)
    assert not off._forward_pre_hooks and not off.blocks[0].up._forward_hooks
    x, _ = batch(0)
    assert torch.equal(ref(x), off(x))
    closing(offload_parameters(off, nvme, **TINY))  # and it can be offloaded again


def test_host_cache_keeps_small_parameters_off_the_disk(nvme, closing):
    """With max_in_cpu, the smallest parameters stay in memory and are never read from the swap space."""
    ref, off = make_pair(seed=13)
    biases = sum(m.bias.numel() for m in off.modules() if isinstance(m, (nn.Linear, nn.LayerNorm)))
    norms = sum(m.weight.numel() for m in off.modules() if isinstance(m, nn.LayerNorm))
    closing(offload_parameters(off, nvme, max_in_cpu=biases + norms, buffer_count=3, buffer_size=2048))
    store = offloaded(off).store
    assert all(p.dim() == 2 for p in store.records)  # only the weight matrices are on NVMe
    assert all(store_of(m.bias) is None for m in off.modules() if isinstance(m, nn.Linear))
    train_side_by_side(ref, off, nvme, steps=2)


def test_a_read_error_surfaces_as_oserror_naming_the_swap_file(nvme, closing):
    """A failed read during a forward raises OSError with the swap file's path; the pool stays usable."""
    _, off = make_pair(seed=14)
    closing(offload_parameters(off, nvme, **TINY))
    store = offloaded(off).store
    store.space.inject_fault("error", op="read")
    with pytest.raises(OSError) as info:
        loss_of(off, 0)
    assert info.value.filename in store.space.files
    store.space.inject_fault("none")
    loss_of(off, 0).backward()


def test_bad_input_gives_clear_errors(tmp_path, nvme, closing):
    """No path, a non-module, a missing parent directory, offloading twice and undoing nothing are named."""
    with pytest.raises(ConfigError, match="nvme_path is required"):
        offload_parameters(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        offload_parameters([nn.Parameter(torch.zeros(3))], nvme)
    with pytest.raises(FileNotFoundError):
        offload_parameters(nn.Linear(2, 2), str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(ValueError, match="prefetch"):
        offload_parameters(nn.Linear(2, 2), nvme, prefetch=-1)
    with pytest.raises(ValueError, match="not offloaded"):
        restore_parameters(nn.Linear(2, 2))
    m = closing(offload_parameters(nn.Linear(2, 2), nvme))
    with pytest.raises(ValueError, match="offloaded already"):
        offload_parameters(m, nvme)


def test_config_block_and_deepspeed_layout_are_accepted(nvme, closing):
    """A bare offload_param dict and a ds_config-style document both configure the pool."""
    m = closing(offload_parameters(nn.Linear(64, 64), config={"nvme_path": nvme, "buffer_count": 4,
                                                              "buffer_size": 1024, "max_in_cpu": 0}))
    assert len(offloaded(m).store.pool) == 4 and offloaded(m).store.pool.buffer_size == 4096
    restore_parameters(m)
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme,
                                                              "buffer_count": 6, "max_in_cpu": 0}}}
    m = closing(offload_parameters(nn.Linear(64, 64), config=ds, buffer_size=1000))
    assert len(offloaded(m).store.pool) == 6


# -- guarded parameters --------------------------------------------------------------------------------

GUARD_SCRIPT = r"""
import sys
import torch
from torch import nn
from offload import offload_parameters, restore_parameters
from offload.params import OffloadedParameter, materialized

class Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.child = nn.Linear(8, 8)
    def forward(self, x):
        return nn.functional.linear(x, self.child.weight)  # a weight it does not own

model = Parent()
offload_parameters(model, sys.argv[1], max_in_cpu=0, buffer_count=3, buffer_size=2048)
p = model.child.weight
assert isinstance(p, nn.Parameter) and type(p) is OffloadedParameter
assert p.shape == (8, 8) and p.dtype == torch.float32 and p.device.type == "cpu" and p.requires_grad
print(repr(p))
print(f"{p}")
attempts = {
    "print": lambda: print(p.data),
    "sum": lambda: p.sum(),
    "parent": lambda: model(torch.randn(2, 8)),
    "torch.equal": lambda: torch.equal(p, p),
    "dict": lambda: print(torch.stack(list(dict(model.named_parameters()).values()))),
}
for name, attempt in attempts.items():
    try:
        attempt()
    except RuntimeError as err:
        assert "offloaded to NVMe and not resident" in str(err), err
        assert "'child.weight'" in str(err) and "materialized" in str(err), err
        print("refused", name)
    else:
        raise SystemExit(f"{name} was not refused")
with materialized(model):
    print(float(p.sum()))
restore_parameters(model)
assert type(p) is nn.Parameter
print(float(model.child.weight.sum()))
"""


def test_touching_a_released_parameter_raises_a_clear_error_instead_of_crashing(tmp_path, nvme):
    """Printing, p.sum(), torch.equal and a parent using a child's weight raise a RuntimeError naming
    the parameter and the fix; the process exits normally (run apart, so a crash fails only this test)."""
    proc = run_code(GUARD_SCRIPT, nvme)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("print", "sum", "parent", "torch.equal", "dict"):
        assert f"refused {name}" in proc.stdout
    assert "OffloadedParameter('child.weight'" in proc.stdout and "not resident" in proc.stdout


VIEW_SCRIPT = r"""
import copy, io, pickle, sys
import torch
from torch import nn
from offload import offload_parameters, restore_parameters
from offload.params import OffloadedView, materialized

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
offload_parameters(model, sys.argv[1], max_in_cpu=0, buffer_count=3, buffer_size=2048)
w = model[0].weight
kept, shapes = {}, {}

def keep(module, args):
    kept.update({
        "index": w[0], "t": w.t(), "T": w.T, "detach": w.detach(), "data": w.data, "view": w.view(-1),
        "split": torch.split(w, 4)[1], "view of a view": w.detach().view(-1)[:3], "narrow": w.narrow(0, 1, 2),
        "dtype view": w.view(torch.int32), "detached dtype view": w.detach().view(torch.uint8),
    })
    kept["clone"] = w.clone()
    kept["sums"] = {k: float(v.sum()) for k, v in kept.items() if k != "sums"}
    shapes.update({k: v.shape for k, v in kept.items() if k != "sums"})

model[0].register_forward_pre_hook(keep)
out = model(torch.randn(2, 8))
assert type(out) is torch.Tensor
out.sum().backward()
clone, sums = kept.pop("clone"), kept.pop("sums")
assert type(clone) is torch.Tensor and float(clone.sum()) == sums["clone"]
for name, v in kept.items():
    assert type(v) is OffloadedView, (name, type(v))
    assert v.shape == shapes[name] and "not resident" in repr(v) and "not resident" in f"{v}", repr(v)
    attempts = {
        "sum": lambda: v.sum(), "equal": lambda: torch.equal(v, v), "add_": lambda: v.add_(1),
        "zero_": lambda: v.zero_(), "deepcopy": lambda: copy.deepcopy(v), "save": lambda: torch.save(v, io.BytesIO()),
        "item": lambda: float(v.flatten()[0]), "print": lambda: print(v.tolist()),
        "pickle": lambda: pickle.dumps(v),
    }
    for what, attempt in attempts.items():
        try:
            attempt()
        except RuntimeError as err:
            assert "shares the memory of parameter '0.weight'" in str(err), err
            assert "clone()" in str(err) and "materialized" in str(err), err
        else:
            raise SystemExit(f"{name}: {what} was not refused")
    print("refused", name)
with materialized(model):  # the same storage, fetched again: every view reads the weight's bytes
    for name, v in kept.items():
        assert float(v.sum()) == sums[name], name
        v = v.detach()  # torch deep-copies and pickles graph leaves only
        for copied in (copy.deepcopy(v), pickle.loads(pickle.dumps(v))):
            assert type(copied) is torch.Tensor and torch.equal(copied, v), name
    for copied in (copy.deepcopy(w), pickle.loads(pickle.dumps(w))):  # the parameter itself: a Parameter
        assert type(copied) is nn.Parameter and torch.equal(copied, w)
print("readable again")
restore_parameters(model)
assert all(float(v.sum()) == sums[name] for name, v in kept.items())
print("restored")
"""


def test_views_of_a_parameter_read_after_its_release_raise_instead_of_crashing(nvme):
    """Views, ``detach()`` and ``.data`` of an offloaded weight taken while it is resident (in a forward
    pre-hook) share its memory, which its release frees: reading one afterwards raises a RuntimeError naming
    the parameter and the fix (it read freed memory and crashed the process before); printing one says it is
    not resident; inside ``materialized`` and after ``restore_parameters`` they read the weight's bytes
    again; copies are plain tensors. Run apart, so a crash fails only this test."""
    proc = run_code(VIEW_SCRIPT, nvme)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("index", "t", "T", "detach", "data", "view", "split", "view of a view", "narrow", "dtype view",
                 "detached dtype view"):
        assert f"refused {name}" in proc.stdout, proc.stdout
    assert "readable again" in proc.stdout and "restored" in proc.stdout


ALIAS_SCRIPT = r"""
import sys
import numpy as np
import torch
from torch import nn
from offload import offload_parameters
from offload.params import OffloadedView, materialized

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
offload_parameters(model, sys.argv[1], max_in_cpu=0, buffer_count=3, buffer_size=8192)
w = model[0].weight
with materialized(model):
    values = w.detach().clone()
n = w.numel()
guarded, unseen = {}, {}

def keep(module, args):
    for name, make in {
        "aten.view": lambda: torch.ops.aten.view(w, [-1]),
        "aten.view.default": lambda: torch.ops.aten.view.default(w, [-1]),
        "aten.alias": lambda: torch.ops.aten.alias(w), "aten.detach": lambda: torch.ops.aten.detach.default(w),
        "aten.t": lambda: torch.ops.aten.t(w), "aten.set_": lambda: torch.ops.aten.set_(torch.empty(0), w.detach()),
    }.items():
        guarded[name] = make()
    for name, make in {  # aliases the guard cannot see: the pages stay mapped, reading zeros once released
        "to_dlpack": lambda: torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(w.detach())),
        "set_ of its untyped_storage": lambda: torch.empty(0).set_(w.untyped_storage(), 0, (n,)),
        "set_ of its storage": lambda: torch.empty(0).set_(w.detach().storage()._untyped_storage, 0, (n,)),
        "_make_subclass": lambda: torch.Tensor._make_subclass(torch.Tensor, w.detach()),
        "set_ onto it": lambda: torch.empty(0).set_(w.detach()),
        "numpy": lambda: torch.from_numpy(w.detach().numpy()),
    }.items():
        unseen[name] = make()
    for what, export in {"from_dlpack": lambda: torch.from_dlpack(w.detach()),
                         "__dlpack__": lambda: w.detach().__dlpack__()}.items():
        try:
            export()
        except RuntimeError as err:
            assert "offloaded to NVMe" in str(err), err
            print("refused", what, flush=True)

model[0].register_forward_pre_hook(keep)
model(torch.randn(2, 64)).sum().backward()
junk = [torch.randn(1 << 16) for _ in range(64)]  # memory reused after a free would be filled now
for name, v in guarded.items():
    assert type(v) is OffloadedView, (name, type(v))
    try:
        v.sum()
    except RuntimeError as err:
        assert "shares the memory of parameter '0.weight'" in str(err), err
        print("guarded", name, flush=True)
for name, v in unseen.items():
    assert not v.reshape(-1).any(), name  # zeros, not freed or reused memory
    print("zeros", name, flush=True)
with materialized(model):  # fetched again into the same pages: every alias sees the weight
    for name, v in {**guarded, **unseen}.items():
        assert torch.equal(v.reshape(-1).sort().values, values.reshape(-1).sort().values), name  # (t(): permuted)
print("readable again", flush=True)
other = model[1].weight
try:  # set_() on the weight itself reaches no guard (torch dispatches nothing for it): the store refuses it
    with torch.no_grad(), materialized(model):
        other.set_(torch.zeros(3))
except Exception as err:
    assert "was given another storage" in str(err), err
    print("refused set_ of the weight", flush=True)
"""


def test_no_alias_of_an_offloaded_weight_reads_freed_memory(nvme):
    """Every way to alias a weight while it is resident: aten ops called directly (aten.set_ onto it too) give
    OffloadedViews the guard refuses once it is released; a DLPack export of it is refused; aliases the guard
    cannot see (torch.utils.dlpack.to_dlpack, Tensor.set_ onto it or onto its untyped_storage,
    Tensor._make_subclass, NumPy) read zeros after the release, never freed or reused memory (they read freed
    memory or killed the process with SIGSEGV before); fetched again, every alias sees the weight's bytes; set_()
    of the weight itself is refused by the store. Run apart, so a crash fails only this test."""
    proc = run_code(ALIAS_SCRIPT, nvme)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in ("refused from_dlpack", "refused __dlpack__", "guarded aten.view", "guarded aten.view.default",
                 "guarded aten.alias", "guarded aten.detach", "guarded aten.t", "guarded aten.set_", "zeros to_dlpack",
                 "zeros set_ of its untyped_storage", "zeros set_ of its storage", "zeros _make_subclass",
                 "zeros set_ onto it", "zeros numpy", "readable again", "refused set_ of the weight"):
        assert line in proc.stdout.splitlines(), (line, proc.stdout, proc.stderr)


def test_guard_keeps_parameter_identity_and_undo_restores_the_class(nvme, closing):
    """Offloaded parameters stay Parameters (same objects, named_parameters, optimizers accept them);
    restore_parameters gives back plain nn.Parameter objects."""
    _, off = make_pair(seed=20)
    params = list(off.parameters())
    closing(offload_parameters(off, nvme, **TINY))
    assert list(off.parameters()) == params
    assert all(isinstance(p, nn.Parameter) for p in params)
    assert next(off.parameters()).device == torch.device("cpu")
    torch.optim.SGD(off.parameters(), lr=0.1)  # construction reads only metadata
    restore_parameters(off)
    assert all(type(p) is nn.Parameter for p in params)


class UsesChildWeight(nn.Module):
    """A parent whose forward uses its child's weight directly (DeepSpeed's "external parameter")."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(32, 32)
        self.proj = nn.Linear(32, 8)

    def forward(self, x):
        h = torch.tanh(self.inner(x))
        return self.proj(nn.functional.linear(h, self.inner.weight))


@pytest.mark.parametrize("before", [False, True], ids=["after-offload", "before-offload"])
def test_registered_external_parameter_is_fetched_for_the_parent(nvme, closing, before):
    """After register_external_parameter, a parent using its child's weight trains exactly as in memory."""
    from offload.params import register_external_parameter

    torch.manual_seed(21)
    ref = UsesChildWeight()
    off = copy.deepcopy(ref)
    if before:
        register_external_parameter(off, off.inner.weight)
    closing(offload_parameters(off, nvme, **TINY))
    if not before:
        register_external_parameter(off, off.inner.weight)
    opt_ref = closing(OffloadedAdamW(ref.parameters(), nvme_path=nvme, **OPT))
    opt_off = closing(OffloadedAdamW(off.parameters(), nvme_path=nvme, **OPT))
    for step in range(3):
        x, _ = batch(step)
        for model in (ref, off):
            model(x).square().mean().backward()
        assert_same_grads(ref, off)
        for opt in (opt_ref, opt_off):
            opt.step()
            opt.zero_grad()
    assert offloaded(off).store.resident_bytes == 0
    assert_same_weights(ref, off)


# -- offloaded gradients --------------------------------------------------------------------------------


@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("grads_in", ["nvme", "host", "both"])
def test_offloaded_grads_train_bitwise_like_the_in_memory_model(nvme, closing, micro, clip, grads_in):
    """With grads in the grad store (on NVMe, kept in host memory by max_grad_in_cpu, or some of each),
    training (accumulating over micro-batches, clipping with our clip_grad_norm_ against torch's) gives the
    in-memory model's grads, norms and weights bit for bit; grads kept in host memory never touch the disk."""
    ref, off = make_pair(seed=22)
    for m in (ref, off):
        m.blocks[1].up.weight.requires_grad_(False)  # a frozen parameter: no grad, not stepped
    budget = {"nvme": 0, "host": 10**9, "both": 4096}[grads_in]
    closing(offload_parameters(off, nvme, **{**TINY, "max_grad_in_cpu": budget}))
    store = offloaded(off).store
    train_side_by_side(ref, off, nvme, steps=3, micro=micro, clip=clip)
    if grads_in == "host":
        assert store.grad_bytes_written == 0 and store.grad_bytes_read == 0 and store.grad_swap_bytes == 0
    else:
        assert store.grad_bytes_written > 0 and store.grad_bytes_read > 0
    if grads_in == "both":
        assert 0 < store.grad_swap_bytes
    assert off.blocks[1].up.weight.grad is None


@pytest.mark.parametrize("how", ["optimizer-zero", "optimizer-none", "model-zero", "model-none", "assigned"])
@pytest.mark.parametrize("grad_budget", [0, 10**9], ids=["grads-on-nvme", "grads-in-host"])
def test_zero_grad_variants_start_the_grad_store_fresh(nvme, closing, how, grad_budget):
    """zero_grad(set_to_none=True/False) from the optimizer or the model, or a user-assigned grad,
    leave the stored grads in the state torch's would be in, so accumulation goes on exactly."""
    ref, off = make_pair(seed=23)
    closing(offload_parameters(off, nvme, **{**TINY, "max_grad_in_cpu": grad_budget}))
    opt_ref = closing(OffloadedAdamW(ref.parameters(), nvme_path=nvme, **OPT))
    opt_off = closing(OffloadedAdamW(off.parameters(), nvme_path=nvme, **OPT))
    for step in range(3):
        for m in (ref, off):
            loss_of(m, 2 * step).backward()
            loss_of(m, 2 * step + 1).backward()
        assert_same_grads(ref, off)
        for model, opt in ((ref, opt_ref), (off, opt_off)):
            opt.step()
            if how == "optimizer-zero":
                opt.zero_grad(set_to_none=False)
            elif how == "optimizer-none":
                opt.zero_grad(set_to_none=True)
            elif how == "model-zero":
                model.zero_grad(set_to_none=False)
            elif how == "model-none":
                model.zero_grad()
            else:
                for p in model.parameters():
                    p.grad = torch.full_like(p, 0.01) if p.dim() == 2 else None
    if how.endswith("zero"):
        assert all(torch.equal(load_grad(q), torch.zeros_like(q)) for q in off.parameters())
    elif how.endswith("none"):
        assert all(q.grad is None for q in off.parameters())
    assert_same_weights(ref, off)


def test_resident_grad_bytes_stay_below_the_largest_module(nvme, closing):
    """While a model 5x the pool trains, gradient bytes resident at once stay within one module's grads."""
    torch.manual_seed(24)
    off = Net(layers=8)
    closing(offload_parameters(off, nvme, **TINY))
    store = offloaded(off).store
    assert model_bytes(off) > 5 * store.pool.nbytes
    largest = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in off.modules())
    opt = closing(OffloadedAdamW(off.parameters(), nvme_path=nvme, **OPT))
    for step in range(3):
        for micro in range(2):
            loss_of(off, 2 * step + micro).backward()
        clip_grad_norm_(off, 1.0)
        opt.step()
        opt.zero_grad()
    assert 0 < store.grad_resident_bytes_max <= largest
    assert store.grad_resident_bytes == 0
    assert all(q.grad is None for q in off.parameters())


def test_torch_utilities_that_would_misread_offloaded_grads_raise_clearly(nvme, closing):
    """torch's clip_grad_norm_, GradScaler.unscale_ and plain tensor math on an offloaded grad raise a
    RuntimeError pointing to our helpers; offload_grads=False keeps ordinary grads for them."""
    _, off = make_pair(seed=25)
    closing(offload_parameters(off, nvme, **TINY))
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    scaler.scale(loss_of(off, 0)).backward()
    g = off.head.weight.grad
    assert g.shape == off.head.weight.shape and g.dtype == torch.float32
    with pytest.raises(RuntimeError, match="offloaded to NVMe.*load_grad"):
        torch.nn.utils.clip_grad_norm_(off.parameters(), 1.0)
    opt = torch.optim.SGD(off.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="clip_grad_norm_"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="offload_grads=False"):
        g.sum()
    assert "OffloadedGrad" in repr(g)
    restore_parameters(off)
    assert type(off.head.weight.grad) is torch.Tensor  # undo brings the grads back as tensors

    _, plain = make_pair(seed=25)
    closing(offload_parameters(plain, nvme, offload_grads=False, **TINY))
    loss_of(plain, 0).backward()
    assert torch.equal(plain.head.weight.grad, off.head.weight.grad)
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)


# -- CUDA ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("pin", [False, True])
def test_cuda_training_matches_in_memory_model(nvme, closing, pin):
    """On a GPU, weights come through the (pinned) pool into device memory; training matches bitwise."""
    ref, off = make_pair(seed=15)
    ref, off = ref.cuda(), off.cuda()
    closing(offload_parameters(off, nvme, max_in_cpu=0, buffer_count=3, buffer_size=2048, pin_memory=pin))
    assert all(p.is_cuda for p in off.parameters())
    opt_ref = closing(OffloadedAdamW(ref.parameters(), nvme_path=nvme, **OPT))
    opt_off = closing(OffloadedAdamW(off.parameters(), nvme_path=nvme, **OPT))
    for step in range(3):
        for model, opt in ((ref, opt_ref), (off, opt_off)):
            x, y = (t.cuda() for t in batch(step))
            (model(x) - y).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert_same_weights(ref, off)


@pytest.mark.gpu
def test_cuda_host_cache_and_inference(nvme, closing):
    """A GPU model with its small parameters in the host cache infers exactly like the in-memory one."""
    ref, off = make_pair(seed=16)
    ref, off = ref.cuda().eval(), off.cuda().eval()
    closing(offload_parameters(off, nvme, max_in_cpu=2000, buffer_count=3, buffer_size=2048))
    assert offloaded(off).store.host_cache_bytes > 0
    with torch.no_grad():
        x = batch(0)[0].cuda()
        assert torch.equal(ref(x), off(x))
    assert offloaded(off).store.cache_hits > 0


def test_weights_shared_with_numpy_are_released_and_the_array_never_reads_freed_memory(nvme):
    """A weight whose memory NumPy shares (param.detach().numpy() while resident) is released all the same: its
    pages go back to the system and the array reads zeros (never freed memory) while it is out; inside
    materialized, and after restore_parameters, the array sees the weight's bytes again, intact."""
    import numpy as np

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    before = [p.detach().clone() for p in m.parameters()]
    offload_parameters(m, nvme_path=nvme, max_in_cpu=0, buffer_count=3, buffer_size=4096)
    with materialized(m):
        shared = m[0].weight.detach().numpy()
        assert np.array_equal(shared, before[0].numpy())
    store = offloaded(m).store
    assert not any(store.records[p].resident for p in m.parameters())
    assert shared.shape == (64, 64) and not shared.any()
    with materialized(m):
        assert np.array_equal(shared, before[0].numpy())
    restore_parameters(m)
    for p, q in zip(m.parameters(), before):
        assert torch.equal(p, q)
    assert np.array_equal(shared, before[0].numpy())


def test_offloaded_is_importable_from_the_package_as_the_readme_uses_it(tmp_path):
    """``from offload import offloaded`` works (the README's counters are read as ``offloaded(model).store``), and it
    is the same function as ``offload.params.offloaded``."""
    import offload
    from offload import offloaded

    assert offloaded is offload.params.offloaded and "offloaded" in offload.__all__
    model = torch.nn.Linear(64, 64)
    assert offloaded(model) is None
    offload_parameters(model, nvme_path=str(tmp_path), max_in_cpu=0)
    try:
        assert offloaded(model).store.swap_bytes > 0
    finally:
        restore_parameters(model)


def test_the_weights_pool_follows_what_is_on_nvme(tmp_path):
    """The parameter pool holds buffer_count buffers no larger than the largest weight or gradient on NVMe (whole
    MiB), at most buffer_size elements each; a model kept in host memory (DeepSpeed's default max_in_cpu) has no
    pool at all, where it used to take 5 x 1e8 elements whatever the model."""

    def pool_of(model, **kw):
        offload_parameters(model, nvme_path=str(tmp_path / "w"), **kw)
        try:
            store = offloaded(model).store
            return len(store.pool), store.pool.nbytes
        finally:
            restore_parameters(model)

    assert pool_of(nn.Linear(64, 64)) == (0, 0)  # within max_in_cpu: nothing on NVMe, no pool
    assert pool_of(nn.Linear(64, 64), max_in_cpu=0) == (5, 5 * MIB)  # 16 KiB weight: 1 MiB buffers
    big = nn.Sequential(nn.Linear(1024, 3000), nn.Linear(3000, 8))  # a 3072000-element fp32 weight: 11.7 MiB
    assert pool_of(big, max_in_cpu=0) == (5, 5 * 12 * MIB)
    assert pool_of(big, max_in_cpu=0, buffer_size=1 << 20, buffer_count=3) == (3, 3 * 4 * MIB)  # buffer_size caps it
    # The small tensors kept in memory (max_in_cpu), the big weight and its grad on NVMe: the big one sizes it.
    assert pool_of(big, max_in_cpu=30_000, max_grad_in_cpu=0) == (5, 5 * 12 * MIB)
