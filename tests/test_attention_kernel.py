"""The C++ paged attention kernel (fp16 KV cache read in place): against SDPA on the same values,
and a row's result independent of its batch mates, row index, rows per sequence and threads."""
from __future__ import annotations

import pytest
import torch

from ssd.layers.attention import AttentionMetadata, paged_attention

H, HKV, D = 6, 2, 64


REGION = 256      # sequence `seed` owns slots [seed * REGION, (seed + 1) * REGION), shuffled


def make_cache(num_slots=8 * REGION, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(num_slots, HKV, D, generator=g) * 2).half()
    v = torch.randn(num_slots, HKV, D, generator=g).half()
    return k, v


def random_slots(n, seed=0):
    return torch.randperm(REGION, generator=torch.Generator().manual_seed(seed))[:n] + seed * REGION


def run(qlens, ctxs, q, k_new, v_new, kc, vc, kernel, seeds=None):
    slots = [random_slots(c, seed=(seeds[i] if seeds else i)) for i, c in enumerate(ctxs)]
    meta = AttentionMetadata.build(qlens, slots, torch.device("cpu"), kernel=kernel)
    return paged_attention(q, k_new, v_new, kc.clone(), vc.clone(), meta, D ** -0.5)


def inputs(qlens, seed=1):
    g = torch.Generator().manual_seed(seed)
    T = sum(qlens)
    return (torch.randn(T, H, D, generator=g), torch.randn(T, HKV, D, generator=g).half().float(),
            torch.randn(T, HKV, D, generator=g).half().float())


@pytest.mark.parametrize("isa", ["", "avx2", "portable"])
def test_kernel_matches_sdpa_on_the_same_cache(isa, monkeypatch):
    monkeypatch.setenv("SSD_QGEMM_ISA", isa)
    kc, vc = make_cache()
    qlens, ctxs = [1, 5, 3, 40], [17, 100, 3, 60]        # a 40-token prompt chunk too
    q, k, v = inputs(qlens)
    got = run(qlens, ctxs, q, k, v, kc, vc, kernel=True)
    ref = run(qlens, ctxs, q, k, v, kc.float(), vc.float(), kernel=False)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_row_result_is_independent_of_batch_mates_and_position():
    kc, vc = make_cache()
    q, k, v = inputs([5])
    alone = run([5], [80], q, k, v, kc, vc, kernel=True, seeds=[7])
    # the same sequence (same slots, seed 7) behind other sequences, as row 2 of 3
    qa, ka, va = inputs([3, 1], seed=3)
    qq, kk, vv = (torch.cat([qa[:3], q, qa[3:]]) for qa, q in ((qa, q), (ka, k), (va, v)))
    mixed = run([3, 5, 1], [30, 80, 200], qq, kk, vv, kc, vc, kernel=True, seeds=[1, 7, 2])
    assert torch.equal(mixed[3:8], alone)
    # its last row decoded alone (1 query row, same context) equals its row in the 5-row verify
    last = run([1], [80], q[4:], k[4:], v[4:], kc_with(kc, k[:4], 7, 80), vc_with(vc, v[:4], 7, 80),
               kernel=True, seeds=[7])
    assert torch.equal(last, alone[4:])
    torch.set_num_threads(1)
    try:
        assert torch.equal(run([5], [80], q, k, v, kc, vc, kernel=True, seeds=[7]), alone)
    finally:
        torch.set_num_threads(2)


def kc_with(cache, new, seed, ctx):
    """The cache after the first len(new) query tokens of a sequence were written."""
    c = cache.clone()
    slots = random_slots(ctx, seed=seed)
    n = new.shape[0]
    c[slots[ctx - 5: ctx - 5 + n]] = new.half()
    return c


vc_with = kc_with


@pytest.mark.parametrize("kernel", [True, False])
def test_a_prompt_chunk_does_not_depend_on_its_batch_mates_or_its_split(kernel, monkeypatch):
    """A 100-token prompt prefilled alone, beside a 300-token one, and in two chunks (the first 16
    tokens cached, as on a prefix-cache hit): bitwise the same rows through the kernel. The control
    is SDPA over the padded batch (the path of prompt chunks over 16 tokens until 2026-12-03), whose
    rows changed in the last bits here (AVX-512 host, torch 2.13); where it happens not to, the
    control is skipped, not passed."""
    import sys

    monkeypatch.setattr(sys.modules[__name__], "REGION", 1024)
    kc, vc = make_cache(num_slots=8 * 1024)
    kc, vc = (kc, vc) if kernel else (kc.float(), vc.float())
    n, m = 100, 300
    q, k, v = inputs([n], seed=5)
    alone = run([n], [n], q, k, v, kc, vc, kernel=kernel, seeds=[3])
    qm, km, vm = inputs([m], seed=6)
    mixed = run([m, n], [m, n], *(torch.cat([a, x]) for a, x in ((qm, q), (km, k), (vm, v))), kc, vc,
                kernel=kernel, seeds=[4, 3])[m:]
    # the first 16 tokens as one chunk, then the others over the cache they left
    slots = random_slots(n, seed=3)
    kc2, vc2 = kc.clone(), vc.clone()
    first = AttentionMetadata.build([16], [slots[:16]], torch.device("cpu"), kernel=kernel)
    head = paged_attention(q[:16], k[:16], v[:16], kc2, vc2, first, D ** -0.5)
    rest = AttentionMetadata.build([n - 16], [slots], torch.device("cpu"), kernel=kernel)
    split = torch.cat([head, paged_attention(q[16:], k[16:], v[16:], kc2, vc2, rest, D ** -0.5)])
    torch.testing.assert_close(mixed, alone, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(split, alone, rtol=1e-4, atol=1e-5)
    same = torch.equal(mixed, alone) and torch.equal(split, alone)
    if not kernel and same:
        pytest.skip("SDPA gave bitwise-equal rows for these shapes on this host: no control here")
    assert same == kernel
