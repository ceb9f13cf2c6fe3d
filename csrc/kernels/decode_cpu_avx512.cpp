// The decode tile loop (decode_cpu_tiles.h) at 16 lanes, AVX-512 (F/BW/VL/DQ): fp32 and 16-bit K/V, bf16 also
// with scores by vdpbf16ps where the CPU has AVX512_BF16, and the 1-byte formats (int8, fp8 e4m3 / e5m2 with
// fp32 q and out), dequantized 16 elements per load: half the AVX2 build's instructions per byte of K/V, which
// is what bounded those formats (they read half of bf16's bytes but ran at 0.7-0.9x its time).
//
// bf16 takes fewer instructions per element here, which matters because at half the bytes per token the widening
// and FMAs no longer hide behind the memory traffic: V rows are widened 32 elements per load by a shift and a mask
// (even and odd dims of each 32-bit lane, no shuffle), the P.V accumulators hold dims in that even/odd order and
// are put back in order once per item; where the CPU has AVX512_BF16, scores are vdpbf16ps of the raw bf16 query
// and K rows (two products per lane and instruction, no widening; products of bf16 values are exact in fp32),
// scaled after the reduction.
#include <immintrin.h>

#include "kernels/decode_cpu_item.h"

// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized and -Wuninitialized on their own _mm512_undefined_* helpers.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// Everything from here to pop_options is compiled for AVX-512; decode_cpu.cpp calls it only where the CPU has it.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#include "kernels/decode_cpu_avx512_lanes.h"
#include "kernels/decode_cpu_tiles.h"

namespace vpaged {
namespace kernels {
namespace cpu_decode {
namespace {

// Partial score vectors of GB heads against the n bf16 K rows by vdpbf16ps, into red[g][i][16]: q is the raw
// (unscaled) bf16 query, rows D apart; lane j of a partial vector sums the products of dims 2j and 2j+1. Not
// inlined: it needs AVX512_BF16, which the item function that calls it (shared with CPUs without it) is not
// compiled for.
template <int D, int GB>
__attribute__((noinline, target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512bf16"))) void scores_tile_bf16dp(
    const uint16_t* __restrict q, const uint16_t* K, const int64_t* off, int64_t hoff, int n, float* __restrict red,
    const Ahead* ahead) {
  static_assert(D % 32 == 0, "bf16 dot products take 32 dims at a time");
  for (int i = 0; i < n; i += 2) {
    const int i1 = i + 1 < n ? i + 1 : i;
    if (ahead)
      for (int j = i; j <= i1; ++j) ahead->token(j);
    const uint16_t* k0 = K + off[i] + hoff;
    const uint16_t* k1 = K + off[i1] + hoff;
    __m512 a[GB], b[GB];
    for (int g = 0; g < GB; ++g) a[g] = b[g] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < D; c += 32) {
      const __m512bh x = (__m512bh)_mm512_loadu_si512(k0 + c), y = (__m512bh)_mm512_loadu_si512(k1 + c);
      for (int g = 0; g < GB; ++g) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + g * D + c);
        a[g] = _mm512_dpbf16_ps(a[g], qv, x);
        b[g] = _mm512_dpbf16_ps(b[g], qv, y);
      }
    }
    for (int g = 0; g < GB; ++g) {
      _mm512_storeu_ps(red + (g * kChunk + i) * 16, a[g]);
      _mm512_storeu_ps(red + (g * kChunk + i1) * 16, b[g]);
    }
  }
}

// Partial score vectors of GB heads against the n int8 K rows by vpdpbusd, into red[g][i][16] as floats: q is the
// query quantized per head in two bytes per dim (run_item_tiles: rows of D high parts, then D low parts, 2 D apart),
// each K byte goes in with its sign bit flipped (k + 128, unsigned); lane j sums 4 products per 64 dims, high part
// + low part / kLowSteps. The integer sums are exact (run_item_tiles corrects for the + 128 and scales). Not inlined:
// it needs AVX512_VNNI, which the item function that calls it is not compiled for.
template <int D, int GB>
__attribute__((noinline, target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512vnni"))) void scores_tile_int8dp(
    const int8_t* __restrict q, const uint8_t* K, const int64_t* off, int64_t hoff, int n, float* __restrict red,
    const Ahead* ahead) {
  static_assert(D % 64 == 0, "int8 dot products take 64 dims at a time");
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int i = 0; i < n; i += 2) {
    const int i1 = i + 1 < n ? i + 1 : i;
    if (ahead)
      for (int j = i; j <= i1; ++j) ahead->token(j);
    const uint8_t* k0 = K + off[i] + hoff;
    const uint8_t* k1 = K + off[i1] + hoff;
    __m512i a[GB], b[GB], a_lo[GB], b_lo[GB];
    for (int g = 0; g < GB; ++g) a[g] = b[g] = a_lo[g] = b_lo[g] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < D; c += 64) {
      const __m512i x = _mm512_xor_si512(_mm512_loadu_si512(k0 + c), flip);
      const __m512i y = _mm512_xor_si512(_mm512_loadu_si512(k1 + c), flip);
      for (int g = 0; g < GB; ++g) {
        const __m512i hi = _mm512_loadu_si512(q + 2 * g * D + c), lo = _mm512_loadu_si512(q + 2 * g * D + D + c);
        a[g] = _mm512_dpbusd_epi32(a[g], x, hi);
        b[g] = _mm512_dpbusd_epi32(b[g], y, hi);
        a_lo[g] = _mm512_dpbusd_epi32(a_lo[g], x, lo);
        b_lo[g] = _mm512_dpbusd_epi32(b_lo[g], y, lo);
      }
    }
    const __m512 low = _mm512_set1_ps(1.0f / kLowSteps);
    for (int g = 0; g < GB; ++g) {
      _mm512_storeu_ps(red + (g * kChunk + i) * 16,
                       _mm512_fmadd_ps(_mm512_cvtepi32_ps(a_lo[g]), low, _mm512_cvtepi32_ps(a[g])));
      _mm512_storeu_ps(red + (g * kChunk + i1) * 16,
                       _mm512_fmadd_ps(_mm512_cvtepi32_ps(b_lo[g]), low, _mm512_cvtepi32_ps(b[g])));
    }
  }
}

// acc[g] (rows DV apart, dims in order) += sum_i pr[g][i] * V row i, for GB heads, by vpdpbusd: pr (kChunk per
// head, the probabilities times their V row's scale; lanes from n on are ignored) quantized to unsigned bytes pu
// with a power-of-two step per head (decode_cpu_tiles.h, "Int8 scores by dot products"), zero from n on. Four V rows at
// a time are interleaved byte by byte (two rounds of unpacks) so that each 32-bit lane holds one dim of four tokens,
// which vpdpbusd multiplies by the four tokens' pu at once; the int32 sums (exact: 32 tokens x 255 x 127 < 2^31) are
// put back in dim order once per chunk and scaled into acc.
template <int DV, int GB>
__attribute__((noinline, target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512vnni"))) void pv_tile_int8dp(
    float* __restrict acc, const uint8_t* V, const int64_t* off, int64_t hoff, int n, const float* __restrict pr) {
  static_assert(DV % 64 == 0, "int8 P.V takes 64 dims at a time");
  static_assert(kChunk == 32, "a head's chunk of probabilities is two vectors");
  alignas(64) uint8_t pu[GB * kChunk];
  float p_scale[GB];
  const __mmask16 m0 = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
  const __mmask16 m1 = n >= 32 ? __mmask16(0xffff) : n <= 16 ? __mmask16(0) : __mmask16((1u << (n - 16)) - 1);
  for (int g = 0; g < GB; ++g) {
    const __m512 x0 = _mm512_maskz_loadu_ps(m0, pr + g * kChunk), x1 = _mm512_maskz_loadu_ps(m1, pr + g * kChunk + 16);
    const float step = power_of_two_step(_mm512_reduce_max_ps(_mm512_max_ps(x0, x1)), 255.0f);
    const __m512 inv = _mm512_set1_ps(step > 0.0f ? 1.0f / step : 0.0f);
    p_scale[g] = step;
    // Round to nearest (the default rounding mode), then saturate to unsigned bytes: never past 255 by the step.
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pu + g * kChunk),
                     _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x0, inv))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pu + g * kChunk + 16),
                     _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x1, inv))));
  }
  for (int d0 = 0; d0 < DV; d0 += 64) {
    __m512i a[GB][4];
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < 4; ++j) a[g][j] = _mm512_setzero_si512();
    for (int i = 0; i < n; i += 4) {
      __m512i r[4];
      for (int j = 0; j < 4; ++j) {
        const int t = i + j < n ? i + j : n - 1;  // past n: a real row, times a zero probability
        r[j] = _mm512_loadu_si512(V + off[t] + hoff + d0);
      }
      // Per 128-bit block k (dims 16k..16k+15): u[j] lane 4k + m = dim 16k + 4j + m, bytes = tokens i..i+3.
      const __m512i t0 = _mm512_unpacklo_epi8(r[0], r[1]), t1 = _mm512_unpackhi_epi8(r[0], r[1]);
      const __m512i t2 = _mm512_unpacklo_epi8(r[2], r[3]), t3 = _mm512_unpackhi_epi8(r[2], r[3]);
      const __m512i u[4] = {_mm512_unpacklo_epi16(t0, t2), _mm512_unpackhi_epi16(t0, t2), _mm512_unpacklo_epi16(t1, t3),
                            _mm512_unpackhi_epi16(t1, t3)};
      for (int g = 0; g < GB; ++g) {
        int32_t four;
        std::memcpy(&four, pu + g * kChunk + i, 4);
        const __m512i w = _mm512_set1_epi32(four);
        for (int j = 0; j < 4; ++j) a[g][j] = _mm512_dpbusd_epi32(a[g][j], w, u[j]);
      }
    }
    for (int g = 0; g < GB; ++g) {
      // Back in dim order: vector c = block c of a[g][0..3] (a 4 x 4 transpose of 128-bit blocks).
      const __m512i lo01 = _mm512_shuffle_i32x4(a[g][0], a[g][1], 0x44),
                    lo23 = _mm512_shuffle_i32x4(a[g][2], a[g][3], 0x44);
      const __m512i hi01 = _mm512_shuffle_i32x4(a[g][0], a[g][1], 0xEE),
                    hi23 = _mm512_shuffle_i32x4(a[g][2], a[g][3], 0xEE);
      const __m512i ordered[4] = {_mm512_shuffle_i32x4(lo01, lo23, 0x88), _mm512_shuffle_i32x4(lo01, lo23, 0xDD),
                                  _mm512_shuffle_i32x4(hi01, hi23, 0x88), _mm512_shuffle_i32x4(hi01, hi23, 0xDD)};
      const __m512 s = _mm512_set1_ps(p_scale[g]);
      float* out = acc + g * DV + d0;
      for (int c = 0; c < 4; ++c)
        _mm512_storeu_ps(out + 16 * c,
                         _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(ordered[c]), _mm512_loadu_ps(out + 16 * c)));
    }
  }
}

struct Avx512Lanes : Avx512Vec {
  static constexpr bool kInt16Query = false;  // vpdpbusd takes the query as two bytes per dim

  template <int D, int GB>
  static VP_INLINE void scores_bf16dp(const uint16_t* q, const uint16_t* K, const int64_t* off, int64_t hoff, int n,
                                      float* red, const Ahead* ahead) {
    scores_tile_bf16dp<D, GB>(q, K, off, hoff, n, red, ahead);
  }

  template <int D, int GB>
  static VP_INLINE void scores_int8dp(const int8_t* q, const uint8_t* K, const int64_t* off, int64_t hoff, int n,
                                      float* red, const Ahead* ahead) {
    scores_tile_int8dp<D, GB>(q, K, off, hoff, n, red, ahead);
  }

  template <int DV, int GB>
  static VP_INLINE void pv_int8dp(float* acc, const uint8_t* V, const int64_t* off, int64_t hoff, int n,
                                  const float* pr) {
    pv_tile_int8dp<DV, GB>(acc, V, off, hoff, n, pr);
  }
};

}  // namespace
}  // namespace cpu_decode
}  // namespace kernels
}  // namespace vpaged
#pragma GCC pop_options
#pragma GCC diagnostic pop

namespace vpaged {
namespace kernels {
namespace cpu_decode {

ItemFn avx512_tile_item(int dtype, int kv_dtype, int D, int DV, bool bf16_dot, bool int8_dot) {
  if (dtype == kFloat32 && kv_dtype == kInt8 && int8_dot)
    return tile_item_for_dims<Avx512Lanes, kFloat32, kInt8, false, true>(D, DV);
  if (dtype == kFloat32 && is_quantized(kv_dtype)) return quantized_tile_item<Avx512Lanes>(kv_dtype, D, DV);
  if (kv_dtype != dtype) return nullptr;
  switch (dtype) {
    case kFloat32:
      return tile_item_for_dims<Avx512Lanes, kFloat32, kFloat32>(D, DV);
    case kFloat16:
      return tile_item_for_dims<Avx512Lanes, kFloat16, kFloat16>(D, DV);
    case kBFloat16:
      return bf16_dot ? tile_item_for_dims<Avx512Lanes, kBFloat16, kBFloat16, true>(D, DV)
                      : tile_item_for_dims<Avx512Lanes, kBFloat16, kBFloat16>(D, DV);
    default:
      return nullptr;
  }
}

}  // namespace cpu_decode
}  // namespace kernels
}  // namespace vpaged
