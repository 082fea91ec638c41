"""The low-bit GGUF kernel: exact unpacking, results against fp32 references, bitwise equality of
its code paths, and a row's result independent of M and of its batch mates."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from ssd.kernels import gguf_pack as gp
from ssd.kernels.build import load_qgemm

FORMATS = ["Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]
_TYPE = {"Q8_0": T.Q8_0, "Q5_0": T.Q5_0, "Q4_0": T.Q4_0, "Q4_1": T.Q4_1, "Q4_K": T.Q4_K, "Q6_K": T.Q6_K}


@pytest.fixture(scope="module")
def ops():
    return load_qgemm()


def raw_blocks(fmt: str, N: int, K: int, seed: int = 0) -> np.ndarray:
    """Stored bytes of an N x K tensor: gguf's own quantizer where it has one, else random blocks
    (any bits are a valid K-quant block once the fp16 scales are finite)."""
    rng = np.random.default_rng(seed)
    if fmt in ("Q8_0", "Q5_0", "Q4_0", "Q4_1"):
        return gguf_quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.05, _TYPE[fmt])
    size = {"Q4_K": 144, "Q6_K": 210}[fmt]
    b = rng.integers(0, 256, size=(N, K // 256, size), dtype=np.uint8)
    d = (rng.random((N, K // 256, 2)) * 1e-3 + 1e-4).astype(np.float16).view(np.uint8)
    if fmt == "Q4_K":
        b[..., 0:4] = d.reshape(N, K // 256, 4)
    else:
        b[..., 208:210] = d.reshape(N, K // 256, 4)[..., :2]
    return b.reshape(N, -1)


def unpacked(fmt, N, K, seed=0):
    raw = raw_blocks(fmt, N, K, seed)
    return raw, gp.unpack(raw, int(_TYPE[fmt]), (N, K))


def run(ops, P, x, isa=-1, bias=None):
    return ops.qgemm(x, P.codes, P.dS, P.dO, P.sc, P.mn, bias, P.N, P.SB, P.SUB, P.bits, P.sym, isa)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """The kernel's activation rounding, in numpy float32: per 32 values d = amax/127,
    q = round-half-even(x * (127/amax)); returns q * d in float64."""
    a = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(a).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(a * inv), -127, 127)
    return torch.from_numpy((q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape))


@pytest.mark.parametrize("fmt", FORMATS)
def test_unpack_reproduces_gguf_dequantization(fmt):
    N, K = 24, 512
    raw, q = unpacked(fmt, N, K)
    ref = gguf_dequantize(raw, _TYPE[fmt]).reshape(N, K)
    assert np.array_equal(gp.dequantize(q), ref)      # equal values (gguf may write -0.0 where we write 0.0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_against_fp32_references(ops, fmt, threads):
    N, K = 37, 512                                     # N not a multiple of the 16-column tile
    raw, q = unpacked(fmt, N, K, seed=1)
    W = torch.from_numpy(gguf_dequantize(raw, _TYPE[fmt]).reshape(N, K)).double()
    P = gp.pack(q)
    bias = torch.randn(N)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for M in range(1, 21):
            x = torch.randn(M, K)
            y = run(ops, P, x, bias=bias).double()
            # 1) the integer/float work itself: against float64 on the kernel's rounded activations
            exact = quantized_activations(x) @ W.T + bias.double()
            torch.testing.assert_close(y, exact, rtol=2e-5, atol=2e-5 * exact.abs().max().item())
            # 2) against plain fp32 activations: only the per-32 int8 activation rounding differs
            plain = x.double() @ W.T + bias.double()
            rel = ((y - plain).norm() / plain.norm()).item()
            assert rel < 2e-2, rel
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("fmt", FORMATS)
def test_code_paths_are_bitwise_equal(ops, fmt):
    best = ops.best_isa()
    N, K = 40, 768
    _, q = unpacked(fmt, N, K, seed=2)
    P = gp.pack(q)
    for M in (1, 7, 20):                               # AVX2: one row, rows on the stack, rows on the heap
        x = torch.randn(M, K) * 3
        ref = run(ops, P, x, isa=0)                    # portable C++
        for isa in range(1, best + 1):
            assert torch.equal(run(ops, P, x, isa=isa), ref), f"isa {isa} differs from the portable path (M={M})"


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0"])
def test_prefetch_distance_changes_no_result(ops, fmt):
    """The codes' software prefetch (any distance, or none) leaves every path's results bitwise
    unchanged, including distances reaching past the end of the weights (a prefetch never faults)."""
    N, K = 40, 768
    _, q = unpacked(fmt, N, K, seed=4)
    P = gp.pack(q)
    default = ops.set_prefetch(0)
    try:
        assert default > 0
        for M in (1, 7, 20):
            x = torch.randn(M, K) * 3
            ops.set_prefetch(0)
            ref = {isa: run(ops, P, x, isa=isa) for isa in range(ops.best_isa() + 1)}
            for dist in (64, default, 1 << 20):
                ops.set_prefetch(dist)
                for isa, r in ref.items():
                    assert torch.equal(run(ops, P, x, isa=isa), r), (isa, dist, M)
    finally:
        ops.set_prefetch(default)


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0"])
def test_a_row_does_not_depend_on_M_or_batch_mates(ops, fmt):
    N, K = 64, 512
    _, q = unpacked(fmt, N, K, seed=3)
    P = gp.pack(q)
    x = torch.randn(20, K)
    alone = torch.cat([run(ops, P, x[i:i + 1]) for i in range(20)])
    for M in (2, 5, 8, 9, 16, 20):
        assert torch.equal(run(ops, P, x[:M]), alone[:M])
    perm = torch.randperm(20)
    assert torch.equal(run(ops, P, x[perm]), alone[perm])
    other = torch.cat([x[:1], torch.randn(6, K) * 10])      # different batch mates
    assert torch.equal(run(ops, P, other)[0], alone[0])
    torch.set_num_threads(1)
    try:
        assert torch.equal(run(ops, P, x), alone)
    finally:
        torch.set_num_threads(2)


def test_concat_and_quant_linear_match_separate_gemms(ops):
    from ssd.layers.qlinear import QuantLinear

    K = 256
    parts = [unpacked("Q4_K", 48, K, seed=s)[1] for s in (4, 5)] + [unpacked("Q6_K", 16, K, seed=6)[1]]
    bias = torch.randn(48 + 48 + 16)
    lin = QuantLinear(parts, bias)
    assert len(lin._packed) == 2                            # the two Q4_K parts share one GEMM
    x = torch.randn(3, K)
    ref = torch.cat([run(ops, gp.pack(p), x) for p in parts], dim=-1) + bias
    torch.testing.assert_close(lin(x), ref, rtol=0, atol=1e-5)


def test_quantize_q8_0_matches_gguf_quantizer():
    w = torch.randn(8, 64) * 0.1
    ours = gp.dequantize(gp.quantize_q8_0(w))
    ref = gguf_dequantize(gguf_quantize(w.numpy(), T.Q8_0), T.Q8_0).reshape(8, 64)
    assert np.array_equal(ours, ref)


def test_embedding_rows_are_gguf_values():
    from ssd.layers.qlinear import QuantEmbedding

    raw, q = unpacked("Q4_K", 30, 256, seed=7)
    emb = QuantEmbedding(q, torch.float32)
    tok = torch.tensor([3, 0, 29, 3])
    ref = gguf_dequantize(raw, T.Q4_K).reshape(30, 256)[tok.numpy()]
    assert np.array_equal(emb(tok).numpy(), ref)


def test_forced_isa_flag(monkeypatch):
    from ssd.kernels.build import forced_isa

    monkeypatch.setenv("SSD_QGEMM_ISA", "avx2")
    assert forced_isa() == 1
    monkeypatch.setenv("SSD_QGEMM_ISA", "sse9")
    with pytest.raises(ValueError, match="SSD_QGEMM_ISA"):
        forced_isa()


def test_quantize_q4_1_matches_gguf_quantizer():
    w = torch.randn(8, 64) * 0.1
    ours = gp.dequantize(gp.quantize_q4_1(w))
    ref = gguf_dequantize(gguf_quantize(w.numpy(), T.Q4_1), T.Q4_1).reshape(8, 64)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-3 * np.abs(ref).max())
    assert (ours == ref).mean() > 0.95      # same rule; gguf rounds d to fp16 before scaling


def test_to_4bit_keeps_4bit_tensors_and_requantizes_wider_ones():
    _, q4 = unpacked("Q4_K", 16, 256)
    assert gp.to_4bit(q4) is q4
    raw, q8 = unpacked("Q8_0", 16, 256)
    r = gp.to_4bit(q8)
    assert r.fmt == "Q4_1" and r.bits == 4
    ref = gguf_dequantize(raw, T.Q8_0).reshape(16, 256)
    err = np.abs(gp.dequantize(r) - ref).max() / np.abs(ref).max()
    assert 0 < err < 0.1
