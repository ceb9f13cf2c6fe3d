// Scalar and AVX2 helpers shared by the CPU kernels (decode_cpu.cpp, fused_ops_cpu.cpp): float bits, fp16 /
// bf16 conversions and the element types of the dtype codes, the 8-lane exp and horizontal reductions. Everything is
// always_inline, so each kernel's per-ISA entry points (compiled with their own target attribute) get their own copy in
// their own ISA.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/decode.h"

#define VP_INLINE inline __attribute__((always_inline))
#define VP_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define VP_AVX2 VP_AVX2_TARGET VP_INLINE

namespace vpaged {
namespace kernels {

VP_INLINE float bits_f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
VP_INLINE uint32_t f_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// fp32 -> bf16, round half to even (as torch's conversion); a NaN stays a NaN.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t x = f_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);  // keep NaN a NaN
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// fp16 -> fp32 without branches (so that loops over a row vectorise on ISAs without F16C): normal numbers
// re-bias the exponent, inf/NaN re-bias once more to exponent 255, subnormals are em * 2^-24 exactly.
VP_INLINE float f16_to_f32(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  const uint32_t inf_mask = 0u - uint32_t(em >= 0x7c00u);
  const uint32_t sub_mask = 0u - uint32_t(em < 0x400u);
  const uint32_t normal = (em << 13) + (112u << 23) + ((112u << 23) & inf_mask);
  const uint32_t sub = f_bits(float(int32_t(em)) * 0x1p-24f);
  return bits_f(((normal & ~sub_mask) | (sub & sub_mask)) | sign);
}

// fp32 -> fp16, round to nearest even (only for outputs, so scalar is fine).
inline uint16_t f32_to_f16(float f) {
  const uint32_t x = f_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
  if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (ax < 0x38800000u) {
    // Subnormal result: in [0.5, 1) a float's ulp is 2^-24, the fp16 subnormal step, so the hardware
    // addition rounds (to nearest even) exactly as fp16 would.
    return uint16_t(sign | (f_bits(bits_f(ax) + 0.5f) - 0x3f000000u));
  }
  ax += 0xc8000fffu + ((ax >> 13) & 1u);  // exponent 127 -> 15 bias, plus round-half-even into bit 13
  return uint16_t(sign | (ax >> 13));
}

// The element types of decode.h's dtype codes: storage type, widening to fp32, rounding back.
template <int DT>
struct Elem;
template <>
struct Elem<kFloat32> {
  using T = float;
  static VP_INLINE float load(float x) { return x; }
  static VP_INLINE float store(float x) { return x; }
};
template <>
struct Elem<kFloat16> {
  using T = uint16_t;
  static VP_INLINE float load(uint16_t x) { return f16_to_f32(x); }
  static VP_INLINE uint16_t store(float x) { return f32_to_f16(x); }
};
template <>
struct Elem<kBFloat16> {
  using T = uint16_t;
  static VP_INLINE float load(uint16_t x) { return bits_f(uint32_t(x) << 16); }
  static VP_INLINE uint16_t store(float x) { return f32_to_bf16(x); }
};

// 8 elements of dtype DT (float32 or bfloat16) as fp32 lanes, and back: bf16 rounded half to even, NaN kept NaN.
template <int DT>
VP_AVX2 __m256 load8(const typename Elem<DT>::T* p) {
  if constexpr (DT == kFloat32) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// The bf16 bits of v's lanes (round half to even; NaN stays NaN), in the high halves of 32-bit lanes.
VP_AVX2 __m256i bf16_high_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i hi = _mm256_set1_epi32(int32_t(0xffff0000u));
  const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), hi);
  const __m256i quiet = _mm256_or_si256(_mm256_and_si256(u, hi), _mm256_set1_epi32(0x00400000));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), nan));
}

template <int DT>
VP_AVX2 void store8(typename Elem<DT>::T* p, __m256 v) {
  if constexpr (DT == kFloat32) {
    _mm256_storeu_ps(p, v);
  } else {
    const __m256i b = _mm256_srli_epi32(bf16_high_bits(v), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
}

// fast_exp of 8 lanes for x <= 0 (the softmax's range): 2^n by exponent bits, e^r (|r| <= ln2/2) by its Taylor
// series to r^6 (relative error < 2e-7), ln2 split in two (Cody-Waite). Below -87 the result would leave the
// normal floats; x is clamped there (the result, ~1e-38, is nothing).
VP_AVX2 __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 e = _mm256_set1_ps(1.0f / 720.0f);
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 120.0f));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 24.0f));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 6.0f));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(0.5f));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e, _mm256_castsi256_ps(two_n));
}

VP_AVX2 float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

VP_AVX2 float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

}  // namespace kernels
}  // namespace vpaged
