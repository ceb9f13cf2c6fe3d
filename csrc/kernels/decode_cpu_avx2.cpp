// The decode tile loop (decode_cpu_tiles.h) at 8 lanes, AVX2 + FMA + F16C: 16-bit K/V (bf16, fp16) and the
// 1-byte formats (int8, fp8 e4m3 / e5m2, with fp32 q and out); AVX-512 CPUs run decode_cpu_avx512.cpp's
// 16-lane build of the same formats. fp32 K/V keep the generic loop (decode_cpu.cpp),
// which reads its rows as they are and measured 1.0-1.17x faster than this one on the EPYC dev box.
#include <immintrin.h>

#include "kernels/decode_cpu_item.h"

// Everything from here to pop_options is compiled for AVX2; decode_cpu.cpp calls it only where the CPU has it.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "kernels/decode_cpu_tiles.h"

namespace vpaged {
namespace kernels {
namespace cpu_decode {
namespace {

struct Avx2Lanes {
  using Vec = __m256;
  using Mask = __m256;  // all-ones lanes
  static constexpr int kLanes = 8;
  static constexpr int kPvVecs = 2;  // P.V tiles of 16 dims: 4 heads x 2 vectors of accumulators
  template <int KT>
  static constexpr PrefetchPlan kPrefetch = is_quantized(KT) ? PrefetchPlan::kRowsSpread : PrefetchPlan::kRowsAhead;
  template <int KT>
  static constexpr bool kPermutedPv = false;

  static VP_INLINE Vec zero() { return _mm256_setzero_ps(); }
  static VP_INLINE Vec set1(float x) { return _mm256_set1_ps(x); }
  static VP_INLINE Vec loadu(const float* p) { return _mm256_loadu_ps(p); }
  static VP_INLINE void storeu(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static VP_INLINE Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static VP_INLINE Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
  static VP_INLINE Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static VP_INLINE Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
  static VP_INLINE Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static VP_INLINE Vec exp(Vec x) { return exp8(x); }
  static VP_INLINE float hsum(Vec v) { return hsum8(v); }
  static VP_INLINE float hmax(Vec v) { return hmax8(v); }
  static VP_INLINE Mask first(int base, int n) {
    const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmp_ps(_mm256_add_ps(_mm256_set1_ps(float(base)), iota), _mm256_set1_ps(float(n)), _CMP_LT_OQ);
  }
  static VP_INLINE Vec select(Mask m, Vec v, Vec fallback) { return _mm256_blendv_ps(fallback, v, m); }
  static VP_INLINE Vec zero_unless(Mask m, Vec v) { return _mm256_and_ps(v, m); }  // bitwise: NaN becomes 0 too

  // Lane j of the result = the sum of the 8 floats of row j (rows 8 floats apart).
  static VP_INLINE Vec reduce_rows(const float* r) {
    const __m256 h01 = _mm256_hadd_ps(_mm256_loadu_ps(r), _mm256_loadu_ps(r + 8));
    const __m256 h23 = _mm256_hadd_ps(_mm256_loadu_ps(r + 16), _mm256_loadu_ps(r + 24));
    const __m256 h45 = _mm256_hadd_ps(_mm256_loadu_ps(r + 32), _mm256_loadu_ps(r + 40));
    const __m256 h67 = _mm256_hadd_ps(_mm256_loadu_ps(r + 48), _mm256_loadu_ps(r + 56));
    const __m256 a = _mm256_hadd_ps(h01, h23);  // per 128-bit half: rows 0..3, that half's dims
    const __m256 b = _mm256_hadd_ps(h45, h67);  // rows 4..7
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }

  // 8 elements at src as floats: bf16 widened by a shift, fp16 by vcvtph2ps, 1-byte formats dequantized (int8:
  // the integer; e4m3: 2^-8 of its value, by fp16 bits: sign-extended, shifted by 7, bit 14 cleared; e5m2: the
  // byte as an fp16's high byte).
  template <int KT>
  static VP_INLINE Vec load(const Stored<KT>* src) {
    if constexpr (KT == kFloat32) {
      return _mm256_loadu_ps(src);
    } else if constexpr (KT == kBFloat16) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else if constexpr (KT == kFloat16) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    } else if constexpr (KT == kInt8) {
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))));
    } else if constexpr (KT == kFloat8E5M2) {
      const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
      return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), x));
    } else {
      const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
      return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(x), 7), _mm_set1_epi16(-16385)));
    }
  }
  template <int KT>
  static VP_INLINE void load_pv(const Stored<KT>* src, Vec* v) {
    v[0] = load<KT>(src);
    v[1] = load<KT>(src + 8);
  }
  static VP_INLINE void unpermute(float*, int) {}
};

}  // namespace
}  // namespace cpu_decode
}  // namespace kernels
}  // namespace vpaged
#pragma GCC pop_options

namespace vpaged {
namespace kernels {
namespace cpu_decode {

ItemFn avx2_tile_item(int dtype, int kv_dtype, int D, int DV) {
  if (dtype == kFloat32) return quantized_tile_item<Avx2Lanes>(kv_dtype, D, DV);  // fp32 K/V: the generic loop
  if (kv_dtype != dtype) return nullptr;
  if (dtype == kFloat16) return tile_item_for_dims<Avx2Lanes, kFloat16, kFloat16>(D, DV);
  if (dtype == kBFloat16) return tile_item_for_dims<Avx2Lanes, kBFloat16, kBFloat16>(D, DV);
  return nullptr;
}

}  // namespace cpu_decode
}  // namespace kernels
}  // namespace vpaged
