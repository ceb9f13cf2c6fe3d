// The 16-lane trait of the decode tile loop (decode_cpu_tiles.h) on AVX-512 (F/BW/VL/DQ): vectors, the softmax's
// exp, the transpose-tree reduction of partial scores, and how K/V elements of each format are widened or
// dequantized in registers. Shared by decode_cpu_avx512.cpp (whose trait adds the dot-product scores of bf16 and
// int8) and decode_cpu_amx.cpp (the softmax between its tile products).
//
// Include only after `#pragma GCC target` has switched AVX-512 on and after decode_cpu_tiles.h: like that file,
// everything here has internal linkage, so each file compiles its own copy for its own ISA.
#pragma once
#include <immintrin.h>

#include "kernels/decode_cpu_tiles.h"

namespace vpaged {
namespace kernels {
namespace cpu_decode {
namespace {

struct Avx512Vec {
  using Vec = __m512;
  using Mask = __mmask16;
  static constexpr int kLanes = 16;
  static constexpr int kPvVecs = 4;  // P.V tiles of 64 dims: 4 heads x 4 vectors = 16 accumulator registers
  template <int KT>
  static constexpr PrefetchPlan kPrefetch = PrefetchPlan::kHeadSlices;
  template <int KT>
  static constexpr bool kPermutedPv = KT == kBFloat16;

  static VP_INLINE Vec zero() { return _mm512_setzero_ps(); }
  static VP_INLINE Vec set1(float x) { return _mm512_set1_ps(x); }
  static VP_INLINE Vec loadu(const float* p) { return _mm512_loadu_ps(p); }
  static VP_INLINE void storeu(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static VP_INLINE Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static VP_INLINE Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
  static VP_INLINE Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  static VP_INLINE Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
  static VP_INLINE Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static VP_INLINE float hsum(Vec v) { return _mm512_reduce_add_ps(v); }
  static VP_INLINE float hmax(Vec v) { return _mm512_reduce_max_ps(v); }
  static VP_INLINE Mask first(int base, int n) {
    const int k = n - base;
    return k >= 16 ? Mask(0xffff) : k <= 0 ? Mask(0) : Mask((1u << k) - 1);
  }
  static VP_INLINE Vec select(Mask m, Vec v, Vec fallback) { return _mm512_mask_blend_ps(m, fallback, v); }
  static VP_INLINE Vec zero_unless(Mask m, Vec v) { return _mm512_maskz_mov_ps(m, v); }

  // fast_exp of 16 lanes (the polynomial of cpu_math.h's exp8; 2^n applied by vscalefps).
  static VP_INLINE Vec exp(Vec x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 e = _mm512_set1_ps(1.0f / 720.0f);
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 120.0f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 24.0f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 6.0f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(0.5f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(e, n);
  }

  // Lane j of the result = the sum of the 16 floats of row j (rows 16 floats apart).
  static VP_INLINE Vec reduce_rows(const float* rows) {
    __m512 t[8];  // per 128-bit block: row 2j at positions 0 and 2, row 2j+1 at 1 and 3
    for (int j = 0; j < 8; ++j) {
      const __m512 a = _mm512_loadu_ps(rows + 32 * j), b = _mm512_loadu_ps(rows + 32 * j + 16);
      t[j] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    __m512 u[4];  // block k: partial sums (elements 4k..4k+3) of rows 4j..4j+3
    for (int j = 0; j < 4; ++j) {
      const __m512d a = _mm512_castps_pd(t[2 * j]), b = _mm512_castps_pd(t[2 * j + 1]);
      u[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    // Sum the four 128-bit blocks of each u[j] into block j of the result.
    const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
  }

  // 16 elements at src as floats: bf16 widened by a shift, fp16 by vcvtph2ps, the 1-byte formats dequantized as
  // the AVX2 build does (int8: the integer; e4m3: 2^-8 of its value, by fp16 bits: sign-extended, shifted by 7,
  // bit 14 cleared; e5m2: the byte as an fp16's high byte), 16 bytes per load instead of 8.
  template <int KT>
  static VP_INLINE Vec load(const Stored<KT>* src) {
    if constexpr (KT == kFloat32) {
      return _mm512_loadu_ps(src);
    } else if constexpr (KT == kBFloat16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else if constexpr (KT == kFloat16) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    } else if constexpr (KT == kInt8) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
    } else if constexpr (KT == kFloat8E5M2) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(x), 8));
    } else {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      return _mm512_cvtph_ps(
          _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(x), 7), _mm256_set1_epi16(-16385)));
    }
  }

  // 64 dims of a V row. bf16: each 32-bit lane holds dims 2j (low half) and 2j+1 (high half); shifted up and
  // masked, each is an fp32, so each 32 dims come as the 16 even ones, then the 16 odd ones (kPermutedPv).
  template <int KT>
  static VP_INLINE void load_pv(const Stored<KT>* src, Vec* v) {
    if constexpr (KT == kBFloat16) {
      const __m512i x = _mm512_loadu_si512(src), y = _mm512_loadu_si512(src + 32);
      const __m512i high = _mm512_set1_epi32(int(0xffff0000u));
      v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      v[1] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
      v[2] = _mm512_castsi512_ps(_mm512_slli_epi32(y, 16));
      v[3] = _mm512_castsi512_ps(_mm512_and_si512(y, high));
    } else {
      for (int j = 0; j < 4; ++j) v[j] = load<KT>(src + 16 * j);
    }
  }

  // A row of D floats whose every 32 hold 16 even dims then 16 odd ones, back in dim order.
  static VP_INLINE void unpermute(float* row, int D) {
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int d = 0; d < D; d += 32) {
      const __m512 e = _mm512_loadu_ps(row + d), o = _mm512_loadu_ps(row + d + 16);
      _mm512_storeu_ps(row + d, _mm512_permutex2var_ps(e, lo, o));
      _mm512_storeu_ps(row + d + 16, _mm512_permutex2var_ps(e, hi, o));
    }
  }
};

}  // namespace
}  // namespace cpu_decode
}  // namespace kernels
}  // namespace vpaged
