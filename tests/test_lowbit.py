"""8-bit block-wise state and stochastic rounding: the code books, the native kernel against its torch-ops
reference and against torchao's AdamW8bit, the round trip of dequantized state, and the rounding stream."""

from __future__ import annotations

import pytest
import torch

from offload import codes
from offload.adam import lowbit

torchao_optim = pytest.importorskip("torchao.optim", reason="torchao (a test dependency) is not installed")


def group(*, adamw=True, amsgrad=False, maximize=False, wd=0.01, lr=1e-3):
    return dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, amsgrad=amsgrad, maximize=maximize,
                decoupled_weight_decay=adamw)


def int8_state(n, *, amsgrad=False):
    keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    st = {k: torch.zeros(n, dtype=torch.uint8) for k in keys}
    st.update({k + codes.ABSMAX: torch.zeros(codes.blocks(n)) for k in keys})
    return st


def chunks_of(n, size):
    return [(lo, min(n, lo + size)) for lo in range(0, n, size)]


def test_the_code_books_are_those_of_torchao_and_bitsandbytes():
    """Both books have torchao's 256 values exactly (bitsandbytes builds the same 8-bit ones), ascending."""
    from torchao.optim.quant_utils import create_dynamic_map

    for signed in (True, False):
        assert codes._book(signed) == tuple(create_dynamic_map(signed))
        q = codes.book(signed)
        assert q.numel() == 256 and bool((q[1:] > q[:-1]).all())


@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW8bit", "Adam8bit"])
def test_the_kernel_equals_torchaos_8bit_adam_bit_for_bit_chunk_by_chunk(monkeypatch, adamw):
    """Weights, codes and absmax after several steps equal torchao's (eager, TORCHDYNAMO_DISABLE=1) bit for
    bit, with the parameter updated in chunks of whole blocks as units hold it, and grads of every scale."""
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    torch.manual_seed(0)
    n = 5 * 4096 + 3 * 256
    ref = torch.nn.Parameter(torch.randn(n))
    cls = torchao_optim.AdamW8bit if adamw else torchao_optim.Adam8bit
    g = group(adamw=adamw, wd=0.01 if adamw else 0.1)
    opt = cls([ref], lr=g["lr"], weight_decay=g["weight_decay"])
    mine, st = ref.detach().clone(), int8_state(n)
    for step in range(1, 7):
        grad = torch.randn(n) * 10.0 ** (step % 4 - 2)
        ref.grad = grad.clone()
        opt.step()
        c = lowbit.constants(g, step)
        for lo, hi in chunks_of(n, 2048 if step % 2 else 8192):
            part = {k: v[lo:hi] if not k.endswith(codes.ABSMAX) else v[lo // 256:codes.blocks(hi)]
                    for k, v in st.items()}
            lowbit.native_step(c, mine[lo:hi], grad[lo:hi], part, first=lo)
        theirs = opt.state[ref]
        assert torch.equal(mine.view(torch.int32), ref.detach().view(torch.int32)), step
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key], theirs[key].codes), (step, key)
            assert torch.equal(st[key + codes.ABSMAX], theirs[key].scale), (step, key)


@pytest.mark.parametrize("case", ["amsgrad", "fp32 moments", "bf16 grads", "fp16 grads", "maximize", "adam"])
def test_the_kernel_equals_its_torch_reference_bit_for_bit(case):
    """Every option the kernel has (amsgrad, which torchao's 8-bit Adam cannot run; fp32 moments; half grads;
    maximize; Adam's coupled decay) gives the reference's bits, over steps, on a tensor whose last block is
    short."""
    torch.manual_seed(1)
    n = 3 * 4096 + 100
    amsgrad = case == "amsgrad"
    g = group(amsgrad=amsgrad, maximize=case == "maximize", adamw=case != "adam")
    p_native = torch.randn(n)
    p_ref = p_native.clone()
    if case == "fp32 moments":
        st = {"exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
    else:
        st = int8_state(n, amsgrad=amsgrad)
    st_ref = {k: v.clone() for k, v in st.items()}
    dtype = {"bf16 grads": torch.bfloat16, "fp16 grads": torch.float16}.get(case, torch.float32)
    for step in range(1, 5):
        grad = (torch.randn(n) * (step + 0.5)).to(dtype)
        c = lowbit.constants(g, step)
        lowbit.native_step(c, p_native, grad, st)
        lowbit.reference_step(c, p_ref, grad, st_ref)
        assert torch.equal(p_native.view(torch.int32), p_ref.view(torch.int32)), step
        for k in st:
            assert torch.equal(st[k].view(torch.uint8), st_ref[k].view(torch.uint8)), (step, k)


def test_bf16_weights_without_a_master_round_as_the_reference_draws_whatever_the_chunking():
    """bf16 weights updated with stochastic rounding: the kernel and the torch-ops reference draw the same
    stream, keyed by element index, so updating in other chunks gives the same bits."""
    torch.manual_seed(2)
    n = 4 * 4096
    g = group()
    w = torch.randn(n).bfloat16()
    a, b = w.clone(), w.clone()
    sa, sb = int8_state(n), int8_state(n)
    for step in range(1, 4):
        grad = torch.randn(n).bfloat16()
        c = lowbit.constants(g, step)
        key = lowbit.stream_key(7, 3, step)
        lowbit.native_step(c, a, grad, sa, key=key)
        for lo, hi in chunks_of(n, 1024):
            part = {k: v[lo:hi] if not k.endswith(codes.ABSMAX) else v[lo // 256:hi // 256] for k, v in sb.items()}
            lowbit.reference_step(c, b[lo:hi], grad[lo:hi], part, first=lo, key=key)
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), step


def test_stochastic_rounding_is_unbiased_and_matches_torchaos_rule_in_distribution():
    """Rounding a value between two bf16 neighbours goes up with the probability of its distance, as torchao's
    _fp32_to_bf16_sr does (its stream differs: compared in distribution), and never leaves the neighbours."""
    from torchao.optim.quant_utils import _fp32_to_bf16_sr

    lo, hi = 1.0, 1.0078125  # neighbouring bf16 values
    for frac in (0.1, 0.5, 0.9):
        x = torch.full((1 << 18,), lo + frac * (hi - lo))
        ours = lowbit.round_bf16(x, key=lowbit.stream_key(0, 1, 2)).float()
        theirs = _fp32_to_bf16_sr(x).float()
        assert set(ours.unique().tolist()) <= {lo, hi}
        up_ours, up_theirs = (ours == hi).float().mean().item(), (theirs == hi).float().mean().item()
        assert abs(up_ours - frac) < 0.01 and abs(up_theirs - frac) < 0.01


def test_the_stream_depends_on_seed_step_parameter_and_element_only():
    """Keys differ for each of seed, parameter and step; the native and torch-ops streams agree element by
    element, and are uniform over 16 bits."""
    keys = {lowbit.stream_key(s, p, t) for s in (0, 1) for p in (0, 1) for t in (1, 2)}
    assert len(keys) == 8
    key = lowbit.stream_key(0, 5, 9)
    index = torch.arange(1 << 20, (1 << 20) + 4096)
    bits = lowbit.random16(key, index)
    from offload._native import kernels_lib

    assert [kernels_lib.ofl_random16(key[0], key[1], int(i)) for i in index[:64]] == bits[:64].tolist()
    assert 0 <= int(bits.min()) and int(bits.max()) < 1 << 16
    assert abs(bits.float().mean().item() / (1 << 16) - 0.5) < 0.02


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_dequantized_state_encodes_back_to_the_same_codes_and_absmax(signed):
    """Values a dequantization made (what state_dict() gives) encode to the codes and absmax they came from,
    blocks with a negative extreme included; other values encode as quantize does."""
    torch.manual_seed(3)
    x = torch.randn(256 * 300 + 77) * torch.rand(256 * 300 + 77) ** 4
    if not signed:
        x = x.abs()
    q, absmax = codes.quantize(x, signed)
    back = codes.dequantize(q, absmax, signed)
    again, again_absmax = codes.encode(back, signed)
    assert torch.equal(again, q) and torch.equal(again_absmax, absmax)
    plain, plain_absmax = codes.encode(x, signed)
    assert torch.equal(plain, q) and torch.equal(plain_absmax, absmax)


def test_the_kernels_table_finds_the_reference_code_at_every_step_of_both_books():
    """The table the kernel encodes with gives the reference's code one float below, at and above each of the
    255 steps of each book, and for zeros, ends and NaN (an exhaustive run over [-1, 1] agreed once)."""
    for signed in (True, False):
        _, steps = lowbit._books()[0 if signed else 1]
        words = steps.long() & 0xFFFFFFFF
        q = codes.book(signed)
        mids = (q[1:] + q[:-1]) / 2
        probes = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, 2.0)),
                            torch.nextafter(mids, torch.full_like(mids, -2.0)), q,
                            torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, float("nan")])])
        probes = probes[(probes.abs() <= 1) | probes.isnan()]
        ref, _ = codes.quantize(probes, signed, absmax=torch.ones(codes.blocks(probes.numel())))
        bits = probes.view(torch.int32).long() & 0xFFFFFFFF
        s = torch.where(bits >= 1 << 31, ~bits & 0xFFFFFFFF, bits ^ 0x80000000)
        e = words[s >> 16]
        mine = (e & 0xFF) + ((s & 0xFFFF) >= (e >> 8)).long()
        assert torch.equal(mine, ref.long())


@pytest.mark.parametrize("first", [(1 << 32) - 37, (1 << 32) + 5], ids=["across 2**32", "above 2**32"])
def test_rounding_draws_the_same_stream_around_a_multiple_of_two_to_the_32_elements(first):
    """Elements whose index crosses or lies beyond 2**32 (a parameter of more than 4G elements) round with the
    stream the torch-ops reference draws: the kernel's scalar path across the boundary, its vector path (upper
    32 bits of the index set) above it."""
    key = lowbit.stream_key(3, 1, 2)
    x = torch.randn(100) * 3
    native = lowbit.round_bf16(x, first=first, key=key)
    bits = x.view(torch.int32).long() & 0xFFFFFFFF
    rand = lowbit.random16(key, torch.arange(first, first + 100))
    trunc = bits & 0xFFFF0000
    reference = lowbit._bf16_from_upper(torch.where(rand < (bits & 0xFFFF), trunc + 0x10000, trunc) & 0xFFFFFFFF)
    assert torch.equal(native.view(torch.int16), reference.view(torch.int16))
