// The decode tile loop (decode_cpu_tiles.h) at 8 lanes, AVX2 + FMA + F16C: 16-bit K/V (bf16, fp16) and the
// 1-byte formats (int8 by 16-bit integer products, fp8 e4m3 / e5m2, with fp32 q and out); AVX-512 CPUs run
// decode_cpu_avx512.cpp's 16-lane build of the same formats. fp32 K/V keep the generic loop (decode_cpu.cpp), which
// reads its rows as they are and measured 1.0-1.17x faster than this one on the EPYC dev box.
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
  static constexpr bool kInt16Query = true;  // vpmaddwd takes the query as one 16-bit value per dim
  static constexpr int kPvVecs = 2;          // P.V tiles of 16 dims: 4 heads x 2 vectors of accumulators
  template <int KT>
  static constexpr PrefetchPlan kPrefetch = PrefetchPlan::kLinesSpread;
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

  // A query head's D floats as 16-bit values for scores_int8dp, q16 = round(x / s_q * kLowSteps) with s_q the
  // smallest power of two that keeps max |x| / s_q <= 127 (decode_cpu_tiles.h, "Int8 by integer products on AVX2");
  // returns s_q. Multiplying by kLowSteps / s_q rounds once, as x / s_q (exact) times kLowSteps would.
  template <int D>
  static VP_INLINE float quantize_query16(const float* __restrict x, int16_t* __restrict out) {
    static_assert(D % 16 == 0, "16 dims a step");
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(x + d), abs_mask));
    const float sq = power_of_two_step(hmax8(mx), 127.0f), pre = query_prescale(sq);
    const __m256 vpre = _mm256_set1_ps(pre), f = _mm256_set1_ps(sq > 0.0f ? kLowSteps / (sq * pre) : 0.0f);
    for (int d = 0; d < D; d += 16) {
      // Round to nearest (the default rounding mode); |q16| <= 127 * 254, so the packs never saturate.
      const __m256i r0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + d), vpre), f));
      const __m256i r1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + d + 8), vpre), f));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(r0, r1), 0xD8));
    }
    return sq;
  }

  // acc + vpmaddwd(a, b), the one product-accumulate of the integer paths. In one asm statement because integer adds
  // are associative: with intrinsics GCC makes every product of a loop first, spills them to the stack and adds
  // them up in a tree afterwards (so built, the scores ran no faster than the fp32 loop's).
  static VP_INLINE void madd_into(__m256i& acc, __m256i a, __m256i b) {
    __m256i t;
    __asm__("vpmaddwd %[b], %[a], %[t]\n\tvpaddd %[t], %[acc], %[acc]"
            : [acc] "+x"(acc), [t] "=&x"(t)
            : [a] "x"(a), [b] "x"(b));
  }

  // Partial score vectors of GB heads against the n int8 K rows by vpmaddwd, into red[g][i][8] as floats: q is the
  // query quantized per head to 16 bits per dim (run_item_tiles; rows 2 D bytes apart), each 16 K bytes
  // sign-extended to 16 bits once for the group; lane j sums the products of dims 2j, 2j + 1 of every 16. Two
  // tokens at a time (for_row_pairs).
  template <int D, int GB>
  static VP_INLINE void scores_int8dp(const int8_t* q8, const uint8_t* K, const int64_t* off, int64_t hoff, int n,
                                      float* __restrict red, const Ahead* ahead) {
    static_assert(D % 16 == 0, "16-bit products take 16 dims at a time");
    const int16_t* q = reinterpret_cast<const int16_t*>(q8);
    for_row_pairs(K, off, hoff, n, ahead,
                  [&](int i, int i1, const uint8_t* k0, const uint8_t* k1) __attribute__((always_inline)) {
                    __m256i a[GB], b[GB];
                    for (int g = 0; g < GB; ++g) a[g] = b[g] = _mm256_setzero_si256();
#pragma GCC unroll 16
                    for (int c = 0; c < D; c += 16) {
                      const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k0 + c)));
                      const __m256i y = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k1 + c)));
                      for (int g = 0; g < GB; ++g) {
                        __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * D + c));
                        __asm__("" : "+x"(qv));  // one load for both tokens (as in scores_tile)
                        madd_into(a[g], qv, x);
                        madd_into(b[g], qv, y);
                      }
                    }
                    for (int g = 0; g < GB; ++g) {
                      _mm256_storeu_ps(red + (g * kChunk + i) * 8, _mm256_cvtepi32_ps(a[g]));
                      _mm256_storeu_ps(red + (g * kChunk + i1) * 8, _mm256_cvtepi32_ps(b[g]));
                    }
                  });
  }

  // acc[g] (rows DV apart, dims in order) += sum_i pr[g][i] * V row i, for GB heads, by vpmaddwd: pr (kChunk per
  // head, the probabilities times their V row's scale; lanes from n on are ignored) quantized per head to 15 bits
  // with a power-of-two step (decode_cpu_tiles.h, "Int8 by integer products on AVX2"), zero from n on. Two V rows
  // at a time, sign-extended to 16 bits and interleaved, so that each 32-bit lane holds one dim of both tokens,
  // which vpmaddwd multiplies by their two probabilities at once; 16 dims a tile (4 heads x 2 accumulators in
  // registers across the chunk), the int32 sums (exact: 32 tokens x 32767 x 128 < 2^31) put back in dim order
  // and scaled into acc once per tile. Not inlined: inside run_item_tiles GCC kept the accumulators on the stack.
  template <int DV, int GB>
  __attribute__((noinline)) static void pv_int8dp(float* __restrict acc, const uint8_t* V, const int64_t* off,
                                                  int64_t hoff, int n, const float* __restrict pr) {
    static_assert(DV % 16 == 0, "int8 P.V takes 16 dims at a time");
    static_assert(kChunk == 32, "a head's chunk of probabilities is four vectors");
    alignas(32) int16_t pq[GB * kChunk];
    float p_scale[GB];
    __m256 valid[4];
    for (int j = 0; j < 4; ++j) valid[j] = first(8 * j, n);
    for (int g = 0; g < GB; ++g) {
      __m256 p[4], mx = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        p[j] = _mm256_and_ps(_mm256_loadu_ps(pr + g * kChunk + 8 * j), valid[j]);  // zero from n on
        mx = _mm256_max_ps(mx, p[j]);
      }
      const float step = power_of_two_step(hmax8(mx), 32767.0f);
      const __m256 inv = _mm256_set1_ps(step > 0.0f ? 1.0f / step : 0.0f);
      p_scale[g] = step;
      // Round to nearest (the default rounding mode); never past 32767 by the step, so the packs never saturate.
      __m256i r[4];
      for (int j = 0; j < 4; ++j) r[j] = _mm256_cvtps_epi32(_mm256_mul_ps(p[j], inv));
      // packs interleaves the 128-bit halves: (0-3, 8-11, 4-7, 12-15); the permute puts them in order.
      const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(r[0], r[1]), 0xD8);
      const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(r[2], r[3]), 0xD8);
      _mm256_store_si256(reinterpret_cast<__m256i*>(pq + g * kChunk), lo);
      _mm256_store_si256(reinterpret_cast<__m256i*>(pq + g * kChunk + 16), hi);
    }
    // The chunk's rows, the last one twice for an odd n (past n: a real row, times a zero probability).
    const uint8_t* rows[kChunk + 1];
    for (int i = 0; i < n; ++i) rows[i] = V + off[i] + hoff;
    rows[n] = rows[n - 1];
    for (int d0 = 0; d0 < DV; d0 += 16) {
      // Per head: dims 0-3 and 8-11, 4-7 and 12-15 (unpack's order). Every loop over g is unrolled so that these stay
      // in registers: one indexed by a loop counter would put the arrays on the stack.
      __m256i lo_acc[GB], hi_acc[GB];
#pragma GCC unroll 4
      for (int g = 0; g < GB; ++g) lo_acc[g] = hi_acc[g] = _mm256_setzero_si256();
      for (int i = 0; i < n; i += 2) {
        const __m256i r0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i] + d0)));
        const __m256i r1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i + 1] + d0)));
        // Per 128-bit half: lo lanes = dims 0-3 (8-11), hi lanes = dims 4-7 (12-15), each (token i, token i + 1).
        const __m256i lo = _mm256_unpacklo_epi16(r0, r1), hi = _mm256_unpackhi_epi16(r0, r1);
#pragma GCC unroll 4
        for (int g = 0; g < GB; ++g) {
          int32_t two;
          std::memcpy(&two, pq + g * kChunk + i, 4);
          const __m256i w = _mm256_set1_epi32(two);
          madd_into(lo_acc[g], w, lo);
          madd_into(hi_acc[g], w, hi);
        }
      }
#pragma GCC unroll 4
      for (int g = 0; g < GB; ++g) {
        const __m256 s = _mm256_set1_ps(p_scale[g]);
        float* o = acc + g * DV + d0;
        const __m256 dims0 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo_acc[g], hi_acc[g], 0x20));  // 0-7
        const __m256 dims8 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo_acc[g], hi_acc[g], 0x31));  // 8-15
        _mm256_storeu_ps(o, _mm256_fmadd_ps(dims0, s, _mm256_loadu_ps(o)));
        _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(dims8, s, _mm256_loadu_ps(o + 8)));
      }
    }
  }
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
  // int8 K/V: integer products (decode_cpu_tiles.h, "Int8 by integer products on AVX2"); the other 1-byte formats
  // in fp32. fp32 K/V: the generic loop.
  if (dtype == kFloat32 && kv_dtype == kInt8) return tile_item_for_dims<Avx2Lanes, kFloat32, kInt8, false, true>(D, DV);
  if (dtype == kFloat32) return quantized_tile_item<Avx2Lanes>(kv_dtype, D, DV);
  if (kv_dtype != dtype) return nullptr;
  if (dtype == kFloat16) return tile_item_for_dims<Avx2Lanes, kFloat16, kFloat16>(D, DV);
  if (dtype == kBFloat16) return tile_item_for_dims<Avx2Lanes, kBFloat16, kBFloat16>(D, DV);
  return nullptr;
}

}  // namespace cpu_decode
}  // namespace kernels
}  // namespace vpaged
