// Low-bit GEMM for GGUF weights on CPU: y[M,N] = x[M,K] @ W^T (+ bias).
//
// Weights stay in their stored quantization: every 32 (or 16) weights of a column share
// w = (dS * sc) * q + (dO * mn), with q an unsigned code, dS/dO fp16 per super-block and sc/mn
// small integers per sub-block (GGUF's Q4_K, Q6_K, Q5_0, Q8_0 all fit; see ssd/kernels/gguf_pack.py).
// Symmetric formats (w = S * (code - c): Q8_0, Q5_0, Q4_0, Q6_K) subtract c * sum(x) in integers.
// Columns are interleaved in tiles of 16 so that one int8 dot-product instruction serves 16
// columns; a decoded tile is applied to every row of x, so the cost grows slowly with M.
//
// Activations are quantized per row and per 32 values to int8 (scale = amax/127, round to nearest
// even), the approximation llama.cpp makes (it uses 256-value blocks for K-quants). Every row is
// computed by the same sequence of operations whatever M, the other rows or the thread count, and
// the three code paths (AVX-512 VNNI, AVX2, portable) perform the same float operations in the
// same order: their results are bitwise identical. Build with -ffp-contract=off.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common.h"

namespace {

using ssd_kernels::half_to_float;

constexpr int TILE = 16;   // columns per interleaved tile
constexpr int BLK = 32;    // activation quantization block (and code block) along K

struct Params {
  const uint8_t* codes;    // [NT, K/32, 512] (8-bit), [NT, K/32, 384] (6-bit) or [NT, K/32, 256] (4-bit)
  const uint16_t* dS;      // [NT, K/SB, 16] fp16 bits
  const uint16_t* dO;      // [NT, K/SB, 16]
  const int8_t* sc;        // [NT, K/SUB, 16] or null (then 1)
  const int8_t* mn;        // [NT, K/SUB, 16] or null (then 1)
  const float* bias;       // [N] or null
  int64_t N, K, SB, SUB, bits;
  int64_t sym;             // > 0: w = S * (code - sym) (O = -sym * S): the offset is applied in integers
};

struct Acts {                // activations of M rows, quantized
  const int8_t* xq;        // [M, K]
  const float* dx;         // [M, K/32]
  const float* xsd;        // [M, K/SUB]  dx * sum of the sub-block's codes
  const int32_t* xs;       // [M, K/SUB]  sum of the sub-block's codes
};

// Per row and 32-block: dx = amax/127, q = nearbyint(x * (127/amax)), and per sub-block
// xsd = dx * sum(q). Shared by every code path, so all of them see the same integers.
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t SUB, int8_t* xq, float* dx, float* xsd,
                   int32_t* xs) {
  const int64_t nb = K / BLK, per = BLK / SUB;
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = x + r * K;
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = xr + b * BLK;
      float amax = 0.f;
      for (int i = 0; i < BLK; ++i) amax = std::fmax(amax, std::fabs(v[i]));
      float d = amax / 127.f;
      float id = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* q = xq + r * K + b * BLK;
      for (int i = 0; i < BLK; ++i) {
        float t = std::nearbyint(v[i] * id);
        t = std::fmin(127.f, std::fmax(-127.f, t));
        q[i] = (int8_t)t;
      }
      dx[r * nb + b] = d;
      for (int s = 0; s < per; ++s) {
        int sum = 0;
        for (int i = 0; i < SUB; ++i) sum += q[s * SUB + i];
        xsd[r * (K / SUB) + b * per + s] = d * (float)sum;
        xs[r * (K / SUB) + b * per + s] = sum;
      }
    }
  }
}

// Code of column c at position k (0..31) of a block, from the interleaved layout:
// code vector g = k/4 holds 16 columns x 4 consecutive codes; 4-bit codes keep vectors g and g+4
// in the low and high nibbles of one 64-byte vector.
// 6-bit codes add a plane of 2 x 64 bytes after the nibbles: byte p of plane h holds bits 4..5 of
// vectors 4h..4h+3 at bit pairs 0..3.
inline int code_at(const uint8_t* blk, int bits, int c, int k) {
  int g = k >> 2, p = c * 4 + (k & 3);
  if (bits == 8) return blk[g * 64 + p];
  uint8_t byte = blk[(g & 3) * 64 + p];
  int lo = g < 4 ? (byte & 0xf) : (byte >> 4);
  if (bits == 4) return lo;
  int hi = (blk[256 + (g >> 2) * 64 + p] >> (2 * (g & 3))) & 3;
  return lo | (hi << 4);
}

inline int64_t block_bytes(int64_t bits) { return bits == 8 ? 512 : bits == 6 ? 384 : 256; }

// Codes are prefetched this many bytes ahead of the block being decoded (0: not at all). Each tile's
// blocks, and the tiles a thread takes, lie one after another, so this runs ahead along the stream.
// Measured on a 2-core AVX-512 EPYC VM (`ssd bench --kernels`, the 1.5B target's linear layers, on and
// off interleaved): M = 1 7% faster on 1 thread and unchanged on 2, M = 5 / 8 17-23% faster on 1 and 2
// threads; the hardware prefetcher alone fell behind the decode work. Changes no result (tested bitwise).
int64_t g_prefetch = 1024;

inline void prefetch_codes(const uint8_t* blk, int64_t bytes) {
  const int64_t pf = g_prefetch;
  if (pf <= 0) return;
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(blk + pf + o, 0, 3);
}

// ---------------------------------------------------------------- portable path
#define SSD_GENERIC_TILE_BODY                                                                    \
  {                                                                                              \
    const int64_t nb = p.K / BLK, nsb = p.K / p.SB, nsub = p.K / p.SUB;                          \
    const int per = (int)(BLK / p.SUB), sublen = (int)p.SUB;                                     \
    const int64_t cbytes = block_bytes(p.bits);                                                  \
    float acc[TILE];                                                                             \
    for (int64_t r = 0; r < M; ++r) {                                                            \
      for (int c = 0; c < TILE; ++c) acc[c] = 0.f;                                               \
      const int8_t* xr = a.xq + r * p.K;                                                         \
      for (int64_t b = 0; b < nb; ++b) {                                                         \
        const uint8_t* blk = p.codes + (t * nb + b) * cbytes;                                    \
        const int64_t sbi = (b * BLK) / p.SB;                                                    \
        float dS[TILE], dO[TILE];                                                                \
        for (int c = 0; c < TILE; ++c) {                                                         \
          dS[c] = half_to_float(p.dS[(t * nsb + sbi) * TILE + c]);                               \
          dO[c] = half_to_float(p.dO[(t * nsb + sbi) * TILE + c]);                               \
        }                                                                                        \
        const float dxb = a.dx[r * nb + b];                                                      \
        for (int s = 0; s < per; ++s) {                                                          \
          const int64_t si = b * per + s;                                                        \
          int32_t idot[TILE];                                                                    \
          const int32_t init = -(int32_t)p.sym * a.xs[r * nsub + si];                            \
          for (int c = 0; c < TILE; ++c) idot[c] = init;                                         \
          for (int k = s * sublen; k < (s + 1) * sublen; ++k) {                                  \
            const int xv = xr[b * BLK + k];                                                      \
            for (int c = 0; c < TILE; ++c) idot[c] += code_at(blk, (int)p.bits, c, k) * xv;      \
          }                                                                                      \
          const float xs = a.xsd[r * nsub + si];                                                 \
          for (int c = 0; c < TILE; ++c) {                                                       \
            float S = p.sc ? dS[c] * (float)p.sc[(t * nsub + si) * TILE + c] : dS[c];            \
            float O = p.mn ? dO[c] * (float)p.mn[(t * nsub + si) * TILE + c] : dO[c];            \
            acc[c] = std::fma((float)idot[c], S * dxb, acc[c]);                                  \
            if (!p.sym) acc[c] = std::fma(O, xs, acc[c]);                                        \
          }                                                                                      \
        }                                                                                        \
      }                                                                                          \
      for (int c = 0; c < TILE; ++c) {                                                           \
        const int64_t col = t * TILE + c;                                                        \
        if (col < p.N) y[r * p.N + col] = p.bias ? acc[c] + p.bias[col] : acc[c];                \
      }                                                                                          \
    }                                                                                            \
  }

void tile_portable(const Params& p, const Acts& a, int64_t t, int64_t M, float* y) SSD_GENERIC_TILE_BODY

// ---------------------------------------------------------------- AVX2 path
// The same layout read as two halves of 8 columns (32 of each 64-byte code vector). AVX2 has no
// u8 x s8 dot into int32: vpmaddubsw sums code pairs into int16 and vpmaddwd widens. The int16 sums
// stay in range: a 4-bit pair is at most 2*15*127, so 8 of them fit; a 6-bit pair 2*63*127, so 2;
// 8-bit codes (Q8_0: code - 128 in [-128, 127]) use the sign trick, |code - 128| * (x * sign), one
// pair at most 2*128*127, and the 128 * sum(x) they leave out goes into the integer start value.
// The integers are exact, so every float operation sees the same values as on the other paths.
#define SSD_AVX2 __attribute__((target("avx2,fma,f16c")))

SSD_AVX2 inline __m256 load_scales8(const uint16_t* d) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)d));
}

SSD_AVX2 inline __m256 load_int8_as_float8(const int8_t* v) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)v)));
}

// The 8 code vectors (8 columns x 4 codes, one byte each) of one half of a block; 8-bit codes
// come back as code - 128 (signed).
template <int BITS>
SSD_AVX2 inline void decode_half(const uint8_t* bh, __m256i cv[8]) {
  const __m256i lo4 = _mm256_set1_epi8(0x0f), hi2 = _mm256_set1_epi8(0x30), flip = _mm256_set1_epi8((char)0x80);
  if (BITS == 8) {
    for (int g = 0; g < 8; ++g) cv[g] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(bh + g * 64)), flip);
    return;
  }
  for (int g = 0; g < 4; ++g) {
    __m256i v = _mm256_loadu_si256((const __m256i*)(bh + g * 64));
    cv[g] = _mm256_and_si256(v, lo4);
    cv[g + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
  }
  if (BITS == 6) {             // bits 4..5: vector 4h+i sits at bit pair i of plane h
    for (int h = 0; h < 2; ++h) {
      __m256i v = _mm256_loadu_si256((const __m256i*)(bh + 256 + h * 64));
      cv[4 * h + 0] = _mm256_or_si256(cv[4 * h + 0], _mm256_and_si256(_mm256_slli_epi16(v, 4), hi2));
      cv[4 * h + 1] = _mm256_or_si256(cv[4 * h + 1], _mm256_and_si256(_mm256_slli_epi16(v, 2), hi2));
      cv[4 * h + 2] = _mm256_or_si256(cv[4 * h + 2], _mm256_and_si256(v, hi2));
      cv[4 * h + 3] = _mm256_or_si256(cv[4 * h + 3], _mm256_and_si256(_mm256_srli_epi16(v, 2), hi2));
    }
  }
}

// R rows with their codes in registers (tile_avx2 uses it for a single row).
template <int SUB, int BITS, bool SYM, int R = 1>
SSD_AVX2 void row_avx2(const Params& p, const Acts& a, int64_t t, int half, int64_t r0, float* y) {
  constexpr int PER = BLK / SUB, GPS = SUB / 4;
  constexpr int64_t CB = BITS == 8 ? 512 : BITS == 6 ? 384 : 256;
  constexpr int CHUNK = BITS == 4 ? 8 : BITS == 6 ? 2 : 1;     // int16 pair sums before widening
  const int64_t nb = p.K / BLK, nsb = p.K / p.SB, nsub = p.K / SUB;
  const int off = half * 32, col_off = half * 8;
  const __m256i ones = _mm256_set1_epi16(1);
  const int32_t start = BITS == 8 ? 128 - (int32_t)p.sym : -(int32_t)p.sym;
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  __m256 dS = _mm256_setzero_ps(), dO = _mm256_setzero_ps();
  int64_t cur_sb = -1;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = p.codes + (t * nb + b) * CB + off;
    if (half == 0) prefetch_codes(blk, CB);       // the second half reads the same lines
    __m256i cv[8];
    decode_half<BITS>(blk, cv);
    const int64_t sbi = (b * BLK) / p.SB;
    if (sbi != cur_sb) {
      dS = load_scales8(p.dS + (t * nsb + sbi) * TILE + col_off);
      dO = load_scales8(p.dO + (t * nsb + sbi) * TILE + col_off);
      cur_sb = sbi;
    }
    for (int s = 0; s < PER; ++s) {
      const int64_t si = b * PER + s;
      const __m256 S = p.sc ? _mm256_mul_ps(dS, load_int8_as_float8(p.sc + (t * nsub + si) * TILE + col_off)) : dS;
      const __m256 O = p.mn ? _mm256_mul_ps(dO, load_int8_as_float8(p.mn + (t * nsub + si) * TILE + col_off)) : dO;
      for (int i = 0; i < R; ++i) {
        const int64_t r = r0 + i;
        const int8_t* xp = a.xq + r * p.K + b * BLK + s * SUB;
        __m256i idot = SYM || BITS == 8 ? _mm256_set1_epi32(start * a.xs[r * nsub + si]) : _mm256_setzero_si256();
        for (int g0 = 0; g0 < GPS; g0 += CHUNK) {
          __m256i s16 = _mm256_setzero_si256();
          for (int g = g0; g < g0 + CHUNK && g < GPS; ++g) {
            int32_t x4;
            std::memcpy(&x4, xp + g * 4, 4);
            const __m256i xb = _mm256_set1_epi32(x4);
            const __m256i w = cv[s * GPS + g];
            const __m256i pr = BITS == 8 ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xb, w))
                                         : _mm256_maddubs_epi16(w, xb);
            s16 = _mm256_add_epi16(s16, pr);
          }
          idot = _mm256_add_epi32(idot, _mm256_madd_epi16(s16, ones));
        }
        const __m256 f = _mm256_mul_ps(S, _mm256_set1_ps(a.dx[r * nb + b]));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot), f, acc[i]);
        if (!SYM) acc[i] = _mm256_fmadd_ps(O, _mm256_set1_ps(a.xsd[r * nsub + si]), acc[i]);
      }
    }
  }
  const int64_t col0 = t * TILE + col_off;
  const int ncol = (int)std::min<int64_t>(8, p.N - col0);
  for (int i = 0; i < R; ++i) {
    float out[8];
    _mm256_storeu_ps(out, acc[i]);
    float* yr = y + (r0 + i) * p.N + col0;
    for (int c = 0; c < ncol; ++c) yr[c] = p.bias ? out[c] + p.bias[col0 + c] : out[c];
  }
}

// Both halves of a tile for every row: the block's codes are decoded once into a small buffer
// (for all M rows), and a row's broadcast activations and float work serve 16 columns.
template <int SUB, int BITS, bool SYM>
SSD_AVX2 void tile_avx2_all(const Params& p, const Acts& a, int64_t t, int64_t M, float* y) {
  constexpr int PER = BLK / SUB, GPS = SUB / 4;
  constexpr int64_t CB = BITS == 8 ? 512 : BITS == 6 ? 384 : 256;
  constexpr int CHUNK = BITS == 4 ? 8 : BITS == 6 ? 2 : 1;
  const int64_t nb = p.K / BLK, nsb = p.K / p.SB, nsub = p.K / SUB;
  const __m256i ones = _mm256_set1_epi16(1);
  const int32_t start = BITS == 8 ? 128 - (int32_t)p.sym : -(int32_t)p.sym;
  alignas(32) float acc_small[16 * TILE];
  std::vector<float> acc_big;
  float* acc = acc_small;
  if (M > 16) {
    acc_big.resize(M * TILE);
    acc = acc_big.data();
  }
  for (int64_t i = 0; i < M * TILE; ++i) acc[i] = 0.f;
  alignas(32) uint8_t dec[8][64];
  __m256 dS[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, dO[2] = {dS[0], dS[0]};
  int64_t cur_sb = -1;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = p.codes + (t * nb + b) * CB;
    prefetch_codes(blk, CB);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* bh = blk + h * 32;
      __m256i cv[8];
      decode_half<BITS>(bh, cv);
      for (int g = 0; g < 8; ++g) _mm256_store_si256((__m256i*)(dec[g] + h * 32), cv[g]);
    }
    const int64_t sbi = (b * BLK) / p.SB;
    if (sbi != cur_sb) {
      for (int h = 0; h < 2; ++h) {
        dS[h] = load_scales8(p.dS + (t * nsb + sbi) * TILE + h * 8);
        dO[h] = load_scales8(p.dO + (t * nsb + sbi) * TILE + h * 8);
      }
      cur_sb = sbi;
    }
    for (int s = 0; s < PER; ++s) {
      const int64_t si = b * PER + s;
      __m256 S[2], O[2];
      for (int h = 0; h < 2; ++h) {
        S[h] = p.sc ? _mm256_mul_ps(dS[h], load_int8_as_float8(p.sc + (t * nsub + si) * TILE + h * 8)) : dS[h];
        O[h] = p.mn ? _mm256_mul_ps(dO[h], load_int8_as_float8(p.mn + (t * nsub + si) * TILE + h * 8)) : dO[h];
      }
      const int8_t* xp = a.xq + b * BLK + s * SUB;
      for (int64_t r = 0; r < M; ++r, xp += p.K) {
        __m256i i0 = SYM || BITS == 8 ? _mm256_set1_epi32(start * a.xs[r * nsub + si]) : _mm256_setzero_si256();
        __m256i i1 = i0;
        for (int g0 = 0; g0 < GPS; g0 += CHUNK) {
          __m256i s0 = _mm256_setzero_si256(), s1 = s0;
          for (int g = g0; g < g0 + CHUNK && g < GPS; ++g) {
            int32_t x4;
            std::memcpy(&x4, xp + g * 4, 4);
            const __m256i xb = _mm256_set1_epi32(x4);
            const __m256i w0 = _mm256_load_si256((const __m256i*)dec[s * GPS + g]);
            const __m256i w1 = _mm256_load_si256((const __m256i*)(dec[s * GPS + g] + 32));
            if (BITS == 8) {
              s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(xb, w0)));
              s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(xb, w1)));
            } else {
              s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w0, xb));
              s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w1, xb));
            }
          }
          i0 = _mm256_add_epi32(i0, _mm256_madd_epi16(s0, ones));
          i1 = _mm256_add_epi32(i1, _mm256_madd_epi16(s1, ones));
        }
        const __m256 dxv = _mm256_set1_ps(a.dx[r * nb + b]);
        float* ar = acc + r * TILE;
        __m256 a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(S[0], dxv), _mm256_loadu_ps(ar));
        __m256 a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(S[1], dxv), _mm256_loadu_ps(ar + 8));
        if (!SYM) {
          const __m256 xs = _mm256_set1_ps(a.xsd[r * nsub + si]);
          a0 = _mm256_fmadd_ps(O[0], xs, a0);
          a1 = _mm256_fmadd_ps(O[1], xs, a1);
        }
        _mm256_storeu_ps(ar, a0);       // acc may be a std::vector: unaligned
        _mm256_storeu_ps(ar + 8, a1);
      }
    }
  }
  const int64_t col0 = t * TILE;
  const int ncol = (int)std::min<int64_t>(TILE, p.N - col0);
  for (int64_t r = 0; r < M; ++r)
    for (int c = 0; c < ncol; ++c)
      y[r * p.N + col0 + c] = p.bias ? acc[r * TILE + c] + p.bias[col0 + c] : acc[r * TILE + c];
}

template <int SUB, int BITS, bool SYM>
SSD_AVX2 void tile_avx2(const Params& p, const Acts& a, int64_t t, int64_t M, float* y) {
  if (M > 1) return tile_avx2_all<SUB, BITS, SYM>(p, a, t, M, y);     // ~20% faster from 2 rows on
  for (int half = 0; half < 2; ++half)       // one row: the codes stay in registers (~5% faster)
    if (t * TILE + half * 8 < p.N) row_avx2<SUB, BITS, SYM>(p, a, t, half, 0, y);
}

// ---------------------------------------------------------------- AVX-512 VNNI path
#define SSD_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))

constexpr int RB = 8;   // rows whose accumulators live in registers at once

SSD_AVX512 inline __m512 load_scales(const uint16_t* d) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)d));
}

SSD_AVX512 inline __m512 load_int8_as_float(const int8_t* v) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)v)));
}

// R rows at once: their accumulators and partial dot products stay in registers, and the R
// independent dot-product chains hide the instruction latency.
// acc += dot4(w bytes (unsigned), the 4 signed bytes at x broadcast to all lanes): the broadcast is
// folded into the instruction's memory operand (compilers do not fold it from the intrinsic).
SSD_AVX512 inline void dpbusd_bcast(__m512i& acc, __m512i w, const int8_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t*)x));
}

template <int SUB, int BITS, int R>
SSD_AVX512 void rows_avx512(const Params& p, const Acts& a, int64_t t, int64_t r0, float* y) {
  constexpr int PER = BLK / SUB, GPS = SUB / 4;       // sub-blocks per block, code vectors per sub-block
  constexpr int64_t CB = BITS == 8 ? 512 : BITS == 6 ? 384 : 256;
  const int64_t nb = p.K / BLK, nsb = p.K / p.SB, nsub = p.K / SUB;
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  const __m512i hi2 = _mm512_set1_epi8(0x30);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  __m512 dS = _mm512_setzero_ps(), dO = _mm512_setzero_ps();
  int64_t cur_sb = -1;
  const int8_t* xrow[R];
  for (int i = 0; i < R; ++i) xrow[i] = a.xq + (r0 + i) * p.K;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = p.codes + (t * nb + b) * CB;
    prefetch_codes(blk, CB);
    __m512i cv[8];
    if (BITS == 8) {
      for (int g = 0; g < 8; ++g) cv[g] = _mm512_loadu_si512((const void*)(blk + g * 64));
    } else {
      for (int g = 0; g < 4; ++g) {
        __m512i v = _mm512_loadu_si512((const void*)(blk + g * 64));
        cv[g] = _mm512_and_si512(v, lo4);
        cv[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
      }
      if (BITS == 6) {             // bits 4..5: vector 4h+i sits at bit pair i of plane h
        for (int h = 0; h < 2; ++h) {
          __m512i v = _mm512_loadu_si512((const void*)(blk + 256 + h * 64));
          cv[4 * h + 0] = _mm512_or_si512(cv[4 * h + 0], _mm512_and_si512(_mm512_slli_epi16(v, 4), hi2));
          cv[4 * h + 1] = _mm512_or_si512(cv[4 * h + 1], _mm512_and_si512(_mm512_slli_epi16(v, 2), hi2));
          cv[4 * h + 2] = _mm512_or_si512(cv[4 * h + 2], _mm512_and_si512(v, hi2));
          cv[4 * h + 3] = _mm512_or_si512(cv[4 * h + 3], _mm512_and_si512(_mm512_srli_epi16(v, 2), hi2));
        }
      }
    }
    const int64_t sbi = (b * BLK) / p.SB;
    if (sbi != cur_sb) {
      dS = load_scales(p.dS + (t * nsb + sbi) * TILE);
      dO = load_scales(p.dO + (t * nsb + sbi) * TILE);
      cur_sb = sbi;
    }
    for (int s = 0; s < PER; ++s) {
      const int64_t si = b * PER + s;
      const __m512 S = p.sc ? _mm512_mul_ps(dS, load_int8_as_float(p.sc + (t * nsub + si) * TILE)) : dS;
      const __m512 O = p.mn ? _mm512_mul_ps(dO, load_int8_as_float(p.mn + (t * nsub + si) * TILE)) : dO;
      __m512i idot[R];
      for (int i = 0; i < R; ++i) idot[i] = _mm512_set1_epi32(-(int32_t)p.sym * a.xs[(r0 + i) * nsub + si]);
      for (int g = 0; g < GPS; ++g)
        for (int i = 0; i < R; ++i) dpbusd_bcast(idot[i], cv[s * GPS + g], xrow[i] + b * BLK + s * SUB + g * 4);
      for (int i = 0; i < R; ++i) {
        const int64_t r = r0 + i;
        const __m512 f = _mm512_mul_ps(S, _mm512_set1_ps(a.dx[r * nb + b]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(idot[i]), f, acc[i]);
        if (!p.sym) acc[i] = _mm512_fmadd_ps(O, _mm512_set1_ps(a.xsd[r * nsub + si]), acc[i]);
      }
    }
  }
  const int64_t col0 = t * TILE;
  const int ncol = (int)std::min<int64_t>(TILE, p.N - col0);
  const __mmask16 m = (__mmask16)((1u << ncol) - 1);
  __m512 bv = p.bias ? _mm512_maskz_loadu_ps(m, p.bias + col0) : _mm512_setzero_ps();
  for (int i = 0; i < R; ++i) {
    __m512 out = p.bias ? _mm512_add_ps(acc[i], bv) : acc[i];
    _mm512_mask_storeu_ps(y + (r0 + i) * p.N + col0, m, out);
  }
}

template <int SUB, int BITS>
SSD_AVX512 void tile_avx512(const Params& p, const Acts& a, int64_t t, int64_t M, float* y) {
  int64_t r0 = 0;
  for (; r0 + RB <= M; r0 += RB) rows_avx512<SUB, BITS, RB>(p, a, t, r0, y);
  switch (M - r0) {
    case 1: rows_avx512<SUB, BITS, 1>(p, a, t, r0, y); break;
    case 2: rows_avx512<SUB, BITS, 2>(p, a, t, r0, y); break;
    case 3: rows_avx512<SUB, BITS, 3>(p, a, t, r0, y); break;
    case 4: rows_avx512<SUB, BITS, 4>(p, a, t, r0, y); break;
    case 5: rows_avx512<SUB, BITS, 5>(p, a, t, r0, y); break;
    case 6: rows_avx512<SUB, BITS, 6>(p, a, t, r0, y); break;
    case 7: rows_avx512<SUB, BITS, 7>(p, a, t, r0, y); break;
    default: break;
  }
}

enum Isa { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

int best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return ISA_AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return ISA_AVX2;         // its path converts the fp16 scales with F16C
  return ISA_PORTABLE;
}

using TileFn = void (*)(const Params&, const Acts&, int64_t, int64_t, float*);

TileFn pick(int isa, int64_t SUB, int64_t bits, int64_t sym) {
  if (isa == ISA_AVX512) {
    if (SUB == 32 && bits == 6) return tile_avx512<32, 6>;
    if (SUB == 16 && bits == 6) return tile_avx512<16, 6>;
    if (SUB == 32 && bits == 4) return tile_avx512<32, 4>;
    if (SUB == 32 && bits == 8) return tile_avx512<32, 8>;
    if (SUB == 16 && bits == 4) return tile_avx512<16, 4>;
    if (SUB == 16 && bits == 8) return tile_avx512<16, 8>;
  }
  if (isa == ISA_AVX2) {     // sym > 0: no min term; sym == 0: no integer offset
    if (SUB == 32 && bits == 6) return sym ? tile_avx2<32, 6, true> : tile_avx2<32, 6, false>;
    if (SUB == 16 && bits == 6) return sym ? tile_avx2<16, 6, true> : tile_avx2<16, 6, false>;
    if (SUB == 32 && bits == 4) return sym ? tile_avx2<32, 4, true> : tile_avx2<32, 4, false>;
    if (SUB == 32 && bits == 8) return sym ? tile_avx2<32, 8, true> : tile_avx2<32, 8, false>;
    if (SUB == 16 && bits == 4) return sym ? tile_avx2<16, 4, true> : tile_avx2<16, 4, false>;
    if (SUB == 16 && bits == 8) return sym ? tile_avx2<16, 8, true> : tile_avx2<16, 8, false>;
  }
  return tile_portable;
}

}  // namespace

int64_t qgemm_best_isa() { return best_isa(); }

int64_t qgemm_set_prefetch(int64_t bytes) {
  const int64_t old = g_prefetch;
  g_prefetch = bytes < 0 ? 0 : bytes;
  return old;
}

// x: [M, K] float32 contiguous. Returns [M, N] float32.
torch::Tensor qgemm(torch::Tensor x, torch::Tensor codes, torch::Tensor dS, torch::Tensor dO,
                    c10::optional<torch::Tensor> sc, c10::optional<torch::Tensor> mn,
                    c10::optional<torch::Tensor> bias, int64_t N, int64_t SB, int64_t SUB, int64_t bits,
                    int64_t sym, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "qgemm: x must be 2-D float32");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "qgemm: bits must be 4, 6 or 8");
  TORCH_CHECK(SUB == 16 || SUB == 32, "qgemm: SUB must be 16 or 32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % BLK == 0 && K % SB == 0 && SB % SUB == 0, "qgemm: K=", K, " is not a multiple of the block");
  const int64_t NT = (N + TILE - 1) / TILE;
  TORCH_CHECK(codes.numel() == NT * (K / BLK) * block_bytes(bits), "qgemm: codes size mismatch");
  TORCH_CHECK(dS.numel() == NT * (K / SB) * TILE && dO.numel() == dS.numel(), "qgemm: scale size mismatch");
  Params p{codes.data_ptr<uint8_t>(),
           (const uint16_t*)dS.data_ptr(),
           (const uint16_t*)dO.data_ptr(),
           sc.has_value() ? sc->data_ptr<int8_t>() : nullptr,
           mn.has_value() ? mn->data_ptr<int8_t>() : nullptr,
           bias.has_value() ? bias->data_ptr<float>() : nullptr,
           N, K, SB, SUB, bits, sym};
  if (sc.has_value()) TORCH_CHECK(sc->numel() == NT * (K / SUB) * TILE, "qgemm: sc size mismatch");
  if (mn.has_value()) TORCH_CHECK(mn->numel() == NT * (K / SUB) * TILE, "qgemm: mn size mismatch");
  if (bias.has_value()) TORCH_CHECK(bias->numel() == N && bias->scalar_type() == torch::kFloat32, "qgemm: bias");

  auto xq = torch::empty({M, K}, torch::kInt8);
  auto dx = torch::empty({M, K / BLK}, torch::kFloat32);
  auto xsd = torch::empty({M, K / SUB}, torch::kFloat32);
  auto xs = torch::empty({M, K / SUB}, torch::kInt32);
  auto y = torch::empty({M, N}, torch::kFloat32);
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* dxp = dx.data_ptr<float>();
  float* xsdp = xsd.data_ptr<float>();
  int32_t* xsp = xs.data_ptr<int32_t>();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    quantize_rows(xp + r0 * K, r1 - r0, K, SUB, xqp + r0 * K, dxp + r0 * (K / BLK), xsdp + r0 * (K / SUB),
                  xsp + r0 * (K / SUB));
  });
  Acts a{xqp, dxp, xsdp, xsp};
  if (isa < 0 || isa > best_isa()) isa = best_isa();
  TileFn fn = pick((int)isa, SUB, bits, sym);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, NT, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) fn(p, a, t, M, yp);
  });
  return y;
}

// attention.cpp
void paged_attention_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                          torch::Tensor rows, torch::Tensor seq, torch::Tensor nkeys, torch::Tensor out,
                          double scale, int64_t isa);

// fused.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
std::vector<torch::Tensor> qkv_rope(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                                    int64_t H, int64_t Hkv, int64_t D, torch::Tensor q_norm, torch::Tensor k_norm,
                                    double eps);
torch::Tensor silu_mul(torch::Tensor gu, int64_t isa);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "row-wise RMSNorm (float32)");
  m.def("qkv_rope", &qkv_rope, "split q/k/v, optional q/k RMSNorm, rotary embedding");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("qgemm", &qgemm, "low-bit GGUF GEMM");
  m.def("paged_attention_rows", &paged_attention_rows, "batch-invariant attention over a paged fp16 KV cache");
  m.def("best_isa", &qgemm_best_isa, "0 portable, 1 avx2, 2 avx512-vnni");
  m.def("set_prefetch", &qgemm_set_prefetch, "bytes of codes prefetched ahead by the AVX-512 and AVX2 paths (0: none); returns the previous value");
}
