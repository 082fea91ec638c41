// Attention of a few query rows per sequence (decode, verify, pre-drafted chains) over a paged
// fp16 KV cache, read in place through each sequence's slot table (no padded copy).
//
// Every (query row, KV head) is one task whose arithmetic depends only on that row, its context
// length and the cache contents: keys are visited in position order, scores and the softmax in
// fp32 with a fixed exp, so a row's output is bitwise the same whatever its batch mates, its row
// index, the number of rows of its sequence, or the thread count. Three code paths: AVX-512, AVX2
// and portable C++ (each batch-invariant; they may differ from each other in the last bits).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace {

struct Job {
  const float* q;          // [T, H, D]
  const uint16_t* kc;      // [S, Hkv, D] fp16 bits
  const uint16_t* vc;
  const int64_t* slots;    // [B, L]
  const int64_t* rows;     // [R] packed row index of each query row handled here
  const int64_t* seq;      // [R] sequence (row of slots) of each
  const int64_t* nkeys;    // [R] keys each row attends to (its position + 1)
  float* out;              // [T, H, D]
  int64_t H, Hkv, D, L;
  float scale;
};

void task_portable(const Job& j, int64_t i, int64_t kvh, std::vector<float>& sc) {
  const int64_t G = j.H / j.Hkv, D = j.D, n = j.nkeys[i], t = j.rows[i];
  const int64_t* sl = j.slots + j.seq[i] * j.L;
  sc.resize(G * n);
  for (int64_t g = 0; g < G; ++g) {
    const float* q = j.q + (t * j.H + kvh * G + g) * D;
    float mx = -INFINITY;
    for (int64_t k = 0; k < n; ++k) {
      const uint16_t* kp = j.kc + (sl[k] * j.Hkv + kvh) * D;
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s = std::fma(q[d], ssd_kernels::half_to_float(kp[d]), s);
      s *= j.scale;
      sc[g * n + k] = s;
      mx = std::fmax(mx, s);
    }
    float sum = 0.f;
    for (int64_t k = 0; k < n; ++k) {
      float e = ssd_kernels::exp_nonpos(sc[g * n + k] - mx);
      sc[g * n + k] = e;
      sum += e;
    }
    float* o = j.out + (t * j.H + kvh * G + g) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
    for (int64_t k = 0; k < n; ++k) {
      const uint16_t* vp = j.vc + (sl[k] * j.Hkv + kvh) * D;
      const float p = sc[g * n + k];
      for (int64_t d = 0; d < D; ++d) o[d] = std::fma(p, ssd_kernels::half_to_float(vp[d]), o[d]);
    }
    const float inv = 1.f / sum;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

#define SSD_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))

// D a multiple of 16 and at most 256.
SSD_AVX512 void task_avx512(const Job& j, int64_t i, int64_t kvh, std::vector<float>& sc) {
  const int64_t G = j.H / j.Hkv, D = j.D, n = j.nkeys[i], t = j.rows[i], DV = D / 16;
  const int64_t* sl = j.slots + j.seq[i] * j.L;
  const int64_t np = (n + 15) / 16 * 16;
  sc.resize(G * np);
  for (int64_t g = 0; g < G; ++g) {
    const float* q = j.q + (t * j.H + kvh * G + g) * D;
    __m512 qv[16];
    for (int64_t v = 0; v < DV; ++v) qv[v] = _mm512_loadu_ps(q + v * 16);
    float* s = sc.data() + g * np;
    int64_t k = 0;
    // four keys at a time: four independent chains hide the fma latency; each key's arithmetic is the
    // same as alone (the one-key loop below), so a score does not depend on where its key falls
    for (; k + 4 <= n; k += 4) {
      const uint16_t* k0 = j.kc + (sl[k] * j.Hkv + kvh) * D;
      const uint16_t* k1 = j.kc + (sl[k + 1] * j.Hkv + kvh) * D;
      const uint16_t* k2 = j.kc + (sl[k + 2] * j.Hkv + kvh) * D;
      const uint16_t* k3 = j.kc + (sl[k + 3] * j.Hkv + kvh) * D;
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
      for (int64_t v = 0; v < DV; ++v) {
        a0 = _mm512_fmadd_ps(qv[v], _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(k0 + v * 16))), a0);
        a1 = _mm512_fmadd_ps(qv[v], _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(k1 + v * 16))), a1);
        a2 = _mm512_fmadd_ps(qv[v], _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(k2 + v * 16))), a2);
        a3 = _mm512_fmadd_ps(qv[v], _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(k3 + v * 16))), a3);
      }
      s[k] = _mm512_reduce_add_ps(a0) * j.scale;
      s[k + 1] = _mm512_reduce_add_ps(a1) * j.scale;
      s[k + 2] = _mm512_reduce_add_ps(a2) * j.scale;
      s[k + 3] = _mm512_reduce_add_ps(a3) * j.scale;
    }
    for (; k < n; ++k) {
      const uint16_t* kp = j.kc + (sl[k] * j.Hkv + kvh) * D;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t v = 0; v < DV; ++v)
        acc = _mm512_fmadd_ps(qv[v], _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(kp + v * 16))), acc);
      s[k] = _mm512_reduce_add_ps(acc) * j.scale;
    }
    for (int64_t k = n; k < np; ++k) s[k] = -INFINITY;
    __m512 mxv = _mm512_set1_ps(-INFINITY);
    for (int64_t k = 0; k < np; k += 16) mxv = _mm512_max_ps(mxv, _mm512_loadu_ps(s + k));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mxv));
    __m512 sumv = _mm512_setzero_ps();
    for (int64_t k = 0; k < np; k += 16) {
      __m512 e = ssd_kernels::exp_nonpos16(_mm512_sub_ps(_mm512_loadu_ps(s + k), mx));
      e = _mm512_mask_mov_ps(_mm512_setzero_ps(), (__mmask16)(k + 16 <= n ? 0xffff : ((1u << (n - k)) - 1)), e);
      _mm512_storeu_ps(s + k, e);
      sumv = _mm512_add_ps(sumv, e);
    }
    const float inv = 1.f / _mm512_reduce_add_ps(sumv);
    __m512 o[16];
    for (int64_t v = 0; v < DV; ++v) o[v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; ++k) {
      const uint16_t* vp = j.vc + (sl[k] * j.Hkv + kvh) * D;
      const __m512 p = _mm512_set1_ps(s[k]);
      for (int64_t v = 0; v < DV; ++v)
        o[v] = _mm512_fmadd_ps(p, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(vp + v * 16))), o[v]);
    }
    float* out = j.out + (t * j.H + kvh * G + g) * D;
    for (int64_t v = 0; v < DV; ++v) _mm512_storeu_ps(out + v * 16, _mm512_mul_ps(o[v], _mm512_set1_ps(inv)));
  }
}

#define SSD_AVX2 __attribute__((target("avx2,f16c,fma")))

// The AVX-512 task on 8 lanes. D a multiple of 8 and at most 256.
SSD_AVX2 void task_avx2(const Job& j, int64_t i, int64_t kvh, std::vector<float>& sc) {
  const int64_t G = j.H / j.Hkv, D = j.D, n = j.nkeys[i], t = j.rows[i], DV = D / 8;
  const int64_t* sl = j.slots + j.seq[i] * j.L;
  const int64_t np = (n + 7) / 8 * 8;
  sc.resize(G * np);
  for (int64_t g = 0; g < G; ++g) {
    const float* q = j.q + (t * j.H + kvh * G + g) * D;
    __m256 qv[32];
    for (int64_t v = 0; v < DV; ++v) qv[v] = _mm256_loadu_ps(q + v * 8);
    float* s = sc.data() + g * np;
    int64_t k = 0;
    for (; k + 2 <= n; k += 2) {      // two keys at a time, each key's arithmetic as in the loop below
      const uint16_t* ka = j.kc + (sl[k] * j.Hkv + kvh) * D;
      const uint16_t* kb = j.kc + (sl[k + 1] * j.Hkv + kvh) * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
      int64_t v = 0;
      for (; v + 2 <= DV; v += 2) {
        a0 = _mm256_fmadd_ps(qv[v], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ka + v * 8))), a0);
        a1 = _mm256_fmadd_ps(qv[v + 1], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ka + v * 8 + 8))), a1);
        b0 = _mm256_fmadd_ps(qv[v], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(kb + v * 8))), b0);
        b1 = _mm256_fmadd_ps(qv[v + 1], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(kb + v * 8 + 8))), b1);
      }
      if (v < DV) {
        a0 = _mm256_fmadd_ps(qv[v], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ka + v * 8))), a0);
        b0 = _mm256_fmadd_ps(qv[v], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(kb + v * 8))), b0);
      }
      s[k] = ssd_kernels::hsum8(_mm256_add_ps(a0, a1)) * j.scale;
      s[k + 1] = ssd_kernels::hsum8(_mm256_add_ps(b0, b1)) * j.scale;
    }
    for (; k < n; ++k) {
      const uint16_t* kp = j.kc + (sl[k] * j.Hkv + kvh) * D;
      __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();     // two chains hide the fma latency
      int64_t v = 0;
      for (; v + 2 <= DV; v += 2) {
        acc0 = _mm256_fmadd_ps(qv[v], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(kp + v * 8))), acc0);
        acc1 = _mm256_fmadd_ps(qv[v + 1], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(kp + v * 8 + 8))), acc1);
      }
      if (v < DV) acc0 = _mm256_fmadd_ps(qv[v], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(kp + v * 8))), acc0);
      s[k] = ssd_kernels::hsum8(_mm256_add_ps(acc0, acc1)) * j.scale;
    }
    for (int64_t k = n; k < np; ++k) s[k] = -INFINITY;
    __m256 mxv = _mm256_set1_ps(-INFINITY);
    for (int64_t k = 0; k < np; k += 8) mxv = _mm256_max_ps(mxv, _mm256_loadu_ps(s + k));
    const __m256 mx = _mm256_set1_ps(ssd_kernels::hmax8(mxv));
    __m256 sumv = _mm256_setzero_ps();
    for (int64_t k = 0; k < np; k += 8) {
      __m256 e = ssd_kernels::exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(s + k), mx));
      if (k + 8 > n) {            // padding lanes (score -inf) contribute exactly 0
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, e);
        for (int64_t l = n - k; l < 8; ++l) tmp[l] = 0.f;
        e = _mm256_load_ps(tmp);
      }
      _mm256_storeu_ps(s + k, e);
      sumv = _mm256_add_ps(sumv, e);
    }
    const float inv = 1.f / ssd_kernels::hsum8(sumv);
    __m256 o[32];
    for (int64_t v = 0; v < DV; ++v) o[v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < n; ++k) {
      const uint16_t* vp = j.vc + (sl[k] * j.Hkv + kvh) * D;
      const __m256 p = _mm256_set1_ps(s[k]);
      for (int64_t v = 0; v < DV; ++v)
        o[v] = _mm256_fmadd_ps(p, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(vp + v * 8))), o[v]);
    }
    float* out = j.out + (t * j.H + kvh * G + g) * D;
    for (int64_t v = 0; v < DV; ++v) _mm256_storeu_ps(out + v * 8, _mm256_mul_ps(o[v], _mm256_set1_ps(inv)));
  }
}

bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

}  // namespace

// Fills out[rows[i]] for every listed query row. isa: -1 best, 0 portable, 1 AVX2, 2 AVX-512 (each if present).
void paged_attention_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                          torch::Tensor rows, torch::Tensor seq, torch::Tensor nkeys, torch::Tensor out,
                          double scale, int64_t isa) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.is_contiguous() && q.dim() == 3, "attention: q");
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.sizes() == q.sizes(), "attention: out");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat16 && v_cache.scalar_type() == torch::kFloat16 &&
              k_cache.is_contiguous() && v_cache.is_contiguous(), "attention: the KV cache must be contiguous fp16");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.dim() == 2, "attention: slots");
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(1), R = rows.numel();
  TORCH_CHECK(H % Hkv == 0 && k_cache.size(2) == D, "attention: head shapes");
  Job j{q.data_ptr<float>(), (const uint16_t*)k_cache.data_ptr(), (const uint16_t*)v_cache.data_ptr(),
        slots.data_ptr<int64_t>(), rows.data_ptr<int64_t>(), seq.data_ptr<int64_t>(), nkeys.data_ptr<int64_t>(),
        out.data_ptr<float>(), H, Hkv, D, slots.size(1), (float)scale};
  for (int64_t i = 0; i < R; ++i)
    TORCH_CHECK(j.nkeys[i] >= 1 && j.nkeys[i] <= j.L, "attention: row ", i, " attends to ", j.nkeys[i],
                " keys, the slot table has ", j.L);
  const bool fast = isa != 0 && isa != 1 && D % 16 == 0 && D <= 256 && has_avx512();
  const bool avx2 = !fast && isa != 0 && D % 8 == 0 && D <= 256 && has_avx2();
  at::parallel_for(0, R * Hkv, 1, [&](int64_t a, int64_t b) {
    std::vector<float> sc;
    for (int64_t w = a; w < b; ++w) {
      if (fast) task_avx512(j, w / Hkv, w % Hkv, sc);
      else if (avx2) task_avx2(j, w / Hkv, w % Hkv, sc);
      else task_portable(j, w / Hkv, w % Hkv, sc);
    }
  });
}
