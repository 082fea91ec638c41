// Row-wise glue of a decoder layer in one call each (RMSNorm; q/k/v split + optional q/k norm +
// rotary embedding; SiLU(gate) * up), replacing a dozen small PyTorch ops per layer whose per-call
// overhead showed in the decode-step profile. Each row is computed on its own in a fixed order,
// so results do not depend on the other rows (batch invariance).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace {

inline void rms_row(const float* x, const float* w, float* y, int64_t D, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < D; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / (float)D + eps);
  for (int64_t i = 0; i < D; ++i) y[i] = w[i] * (x[i] * inv);
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32, "rms_norm: float32");
  x = x.contiguous();
  const int64_t D = x.size(-1), T = x.numel() / D;
  TORCH_CHECK(w.numel() == D, "rms_norm: weight size");
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) rms_row(xp + t * D, wp, yp + t * D, D, (float)eps);
  });
  return y;
}

// qkv [T, (H + 2 Hkv) D] -> q [T, H, D], k [T, Hkv, D] rotated (half-rotation layout), v [T, Hkv, D].
// q_norm / k_norm (Qwen3): per-head RMSNorm over D before the rotation (pass empty tensors to skip).
std::vector<torch::Tensor> qkv_rope(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                                    int64_t H, int64_t Hkv, int64_t D, torch::Tensor q_norm, torch::Tensor k_norm,
                                    double eps) {
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat32 && cos.scalar_type() == torch::kFloat32, "qkv_rope: float32");
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  positions = positions.contiguous();
  const int64_t T = qkv.size(0), W = (H + 2 * Hkv) * D, half = D / 2;
  TORCH_CHECK(qkv.size(1) == W && cos.size(1) == D, "qkv_rope: shapes");
  auto q = torch::empty({T, H, D}, qkv.options());
  auto k = torch::empty({T, Hkv, D}, qkv.options());
  auto v = torch::empty({T, Hkv, D}, qkv.options());
  const bool norm = q_norm.numel() > 0;
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* qn = norm ? q_norm.data_ptr<float>() : nullptr;
  const float* kn = norm ? k_norm.data_ptr<float>() : nullptr;
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const int64_t P = cos.size(0);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "qkv_rope: position ", pos[t], " out of range");
  at::parallel_for(0, T, 16, [&](int64_t a, int64_t b) {
    std::vector<float> tmp(D);
    for (int64_t t = a; t < b; ++t) {
      const float* row = src + t * W;
      const float* c = cp + pos[t] * D;
      const float* s = sp + pos[t] * D;
      for (int64_t h = 0; h < H + Hkv; ++h) {
        const float* x = row + h * D;
        float* out = h < H ? qp + (t * H + h) * D : kp + (t * Hkv + (h - H)) * D;
        if (norm) {
          rms_row(x, h < H ? qn : kn, tmp.data(), D, (float)eps);
          x = tmp.data();
        }
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          const float a1 = x1 * c[i], b1 = -x2 * s[i];
          const float a2 = x2 * c[i + half], b2 = x1 * s[i + half];
          out[i] = a1 + b1;
          out[i + half] = a2 + b2;
        }
      }
      std::memcpy(vp + t * Hkv * D, row + (H + Hkv) * D, sizeof(float) * Hkv * D);
    }
  });
  return {q, k, v};
}

namespace {

// silu(g) * u with sigma(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) for g < 0, e = exp(-|g|).
void silu_mul_portable(const float* g, const float* u, float* y, int64_t F) {
  for (int64_t i = 0; i < F; ++i) {
    const float e = ssd_kernels::exp_nonpos(-std::fabs(g[i]));
    const float sig = g[i] >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
    y[i] = (g[i] * sig) * u[i];
  }
}

__attribute__((target("avx512f,avx512dq,fma")))
void silu_mul_avx512(const float* g, const float* u, float* y, int64_t F) {
  int64_t i = 0;
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= F; i += 16) {
    __m512 gv = _mm512_loadu_ps(g + i);
    __m512 e = ssd_kernels::exp_nonpos16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gv)));
    __m512 den = _mm512_add_ps(one, e);
    __mmask16 pos = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_GE_OQ);
    __m512 num = _mm512_mask_mov_ps(e, pos, one);
    __m512 sig = _mm512_div_ps(num, den);
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(u + i)));
  }
  if (i < F) silu_mul_portable(g + i, u + i, y + i, F - i);
}

__attribute__((target("avx2,fma")))
void silu_mul_avx2(const float* g, const float* u, float* y, int64_t F) {
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (; i + 8 <= F; i += 8) {
    __m256 gv = _mm256_loadu_ps(g + i);
    __m256 e = ssd_kernels::exp_nonpos8(_mm256_sub_ps(zero, _mm256_andnot_ps(sign, gv)));
    __m256 den = _mm256_add_ps(one, e);
    __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(gv, zero, _CMP_GE_OQ));
    __m256 sig = _mm256_div_ps(num, den);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
  }
  if (i < F) silu_mul_portable(g + i, u + i, y + i, F - i);
}

bool fused_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool fused_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
}

}  // namespace

// gu [T, 2F] (gate | up) -> [T, F]
torch::Tensor silu_mul(torch::Tensor gu, int64_t isa) {
  TORCH_CHECK(gu.scalar_type() == torch::kFloat32 && gu.dim() == 2 && gu.size(1) % 2 == 0, "silu_mul: [T, 2F] float32");
  gu = gu.contiguous();
  const int64_t T = gu.size(0), F = gu.size(1) / 2;
  auto y = torch::empty({T, F}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool fast = isa != 0 && isa != 1 && fused_avx512();
  const bool avx2 = !fast && isa != 0 && fused_avx2();
  at::parallel_for(0, T, 4, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      if (fast) silu_mul_avx512(gp + t * 2 * F, gp + t * 2 * F + F, yp + t * F, F);
      else if (avx2) silu_mul_avx2(gp + t * 2 * F, gp + t * 2 * F + F, yp + t * F, F);
      else silu_mul_portable(gp + t * 2 * F, gp + t * 2 * F + F, yp + t * F, F);
    }
  });
  return y;
}
