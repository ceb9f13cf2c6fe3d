// The CPU decode tile loop, written once over a vector-width trait W and compiled per ISA: decode_cpu_avx2.cpp
// (8 lanes) and decode_cpu_avx512.cpp (16 lanes) each define their trait, switch their ISA on with
// `#pragma GCC target` and then include this file.
//
// Why a tile loop beside the generic one (decode_cpu.cpp): the generic loop widens or dequantizes rows into a
// buffer and reads them back, and ends every score in a horizontal sum of a vector (at head_dim 128 as many
// shuffle/add steps as FMAs). Below 4 bytes per element that work, not the memory traffic, bounded it (int8 /
// fp8 ran 0.85-0.95x the time of bf16 on the 2-core AMD EPYC dev box, bf16 1.07x vLLM's CPU kernel). Here:
//   * K and V elements are widened (bf16: a shift; fp16: vcvtph2ps) or dequantized (int8, fp8) in registers as
//     they are loaded, W::kLanes per load;
//   * each (head, token) score keeps a kLanes-wide partial sum, and kLanes tokens' partials are reduced
//     together (W::reduce_rows: a transpose tree of ~1-3 operations per score instead of ~8);
//   * scores go 2 tokens x up to 4 heads of the GQA group at a time (8 independent FMA chains, each K vector
//     feeds up to 4 FMAs); P.V keeps a 4-head x (W::kPvVecs x kLanes)-dim tile of accumulators in registers
//     across the chunk's tokens;
//   * per-row work leaves the element loops: the fp8 k_scale is folded into q and v_scale into the output, an
//     int8 row's scale multiplies its token's score (K) or probability (V).
// Compiled for head dims 64/64, 128/128, 256/256 and 192/128 (K with a rotary part beside a 128-wide V).
//
// What the trait gives (all static, always inlined, compiled for its ISA):
//   Vec, Mask; kLanes; kPvVecs (vectors per P.V tile row); kPrefetch<KT> (the prefetch plan, below);
//   zero, set1, loadu, storeu, add, sub, mul, max, fma(a, b, c) = a * b + c; exp (the softmax's, x <= 0);
//   hsum, hmax (horizontal); reduce_rows(r): lane j = the sum of the kLanes floats of row j (rows kLanes apart);
//   first(base, n): the mask of lanes with base + lane < n; select(m, v, fallback); zero_unless(m, v);
//   load<KT>(src): kLanes stored elements as floats; load_pv<KT>(src, v): one P.V tile row (kPvVecs vectors);
//   kPermutedPv<KT>: load_pv gives dims out of order and unpermute(row, dim) puts an accumulator row back;
//   scores_bf16dp<D, GB>(...) (only where bf16 dot products are compiled: DP below); where int8 integer products
//   are (IDP below): kInt16Query (the query's format, below; where true, quantize_query16<D>(x, out)),
//   scores_int8dp<D, GB>(...) and pv_int8dp<DV, GB>(...).
//
// INT8 SCORES BY DOT PRODUCTS (IDP; AVX-512 VNNI). The query, already scaled by the softmax scale, is quantized per
// head in two bytes per dim: a high part with a power-of-two step, s_q = 2^ceil(log2(max|q| / 127)) (< 2 max|q| /
// 127), hi = round(q / s_q) in [-127, 127], and the remainder in steps of s_q / kLowSteps, lo = round((q / s_q - hi)
// * kLowSteps) in [-127, 127]. vpdpbusd multiplies unsigned by signed bytes, so the K row goes in as k + 128 (its
// sign bit flipped), once against each part, and the score is s_q * ((sum hi (k + 128) - 128 sum hi) + (sum lo (k +
// 128) - 128 sum lo) / kLowSteps) * the row's scale. The integer sums are exact (at head dim 256 they stay below
// 2^24), and a query whose values are multiples of s_q scores exactly. The one approximation is the query's
// rounding, which moves a score by at most
//   0.5 * (s_q / kLowSteps) * sum_i |k_i| * row scale                                 (the accuracy contract)
// (one high part alone, 0.5 * s_q * ..., measured 1-1.4 % off the output's mean magnitude on random data).
// One instruction does 64 products (16 per lane), where dequantizing K and FMAs took ~6 instructions per 16.
// P.V likewise (W::pv_int8dp): per chunk of kChunk tokens and head, the probabilities times their V row's scale,
// p'_t, are quantized to unsigned bytes with a power-of-two step, s_p = 2^ceil(log2(max p' / 255)) (< 2 max p' /
// 255; a lone token's probability 1 is exact), pu = round(p' / s_p), and vpdpbusd sums pu * v over four tokens per
// lane. That rounding moves an output dim by at most
//   0.5 * s_p * sum_t |v_t| / l  <  (max_t p'_t / 255) * sum_t |v_t| / l   (l the softmax's sum; p' in the final
//                                                                          max's terms, v as stored integers)
// Both bounds together are the contract tests/int8_contract_helpers.py states and the int8 decode tests check
// against the fp64 reference (with scores off by at most delta, the output moves by at most (e^(2 delta) - 1)
// max|v|).
//
// INT8 BY INTEGER PRODUCTS ON AVX2 (IDP with W::kInt16Query; no VNNI): vpmaddwd multiplies 16-bit pairs and adds
// each pair into a 32-bit lane, 16 products per instruction where an FMA does 8, and runs at the FMA's rate (2 per
// cycle on Zen 3). So the K and V bytes are sign-extended to 16 bits (one vpmovsxbw per 16, shared by the GQA
// group) and the other factor is 16-bit:
//   * scores: the query in one 16-bit value per dim on the finer of the steps above, q16 = round(q / s_q *
//     kLowSteps) (|q16| <= 127 * 254; W::quantize_query16), scaled by s_q / kLowSteps after the reduction: at most
//     half a step of s_q / kLowSteps per dim, so the same bound on a score. The sums are exact in 32 bits; turned
//     into floats per lane (above 2^24 they round, by far less than the query's rounding: the contract's slack
//     covers it);
//   * P.V: per chunk and head, p' quantized to 15 bits with a power-of-two step s_p = 2^ceil(log2(max p' /
//     32767)), two tokens per 32-bit lane (their V bytes interleaved), so the bound above holds with 32767 in
//     place of 255 (a lone token's probability 1 is still exact).
// (vpmaddubsw, the byte form, would saturate its 16-bit pair sums at these magnitudes.)
//
// Each file's instantiations must keep internal linkage (this file's anonymous namespace): two files compile
// the same template names for different ISAs, and a merged copy would run one file's ISA on the other's CPUs.
#pragma once
#include <algorithm>
#include <limits>
#include <type_traits>

#include "kernels/decode_cpu_item.h"

namespace vpaged {
namespace kernels {
namespace cpu_decode {
namespace {

// How an item's K/V rows are prefetched (into L2), each plan measured on its ISA (benchmarks/NOTES.md):
//   kLinesSpread: the lines of every kv head's K and V rows of the next chunk, walked a few lines at a time (LineWalk)
//                 from every token step of every kv head's scores pass, so that the next chunk streams in evenly
//                 over the whole chunk. AVX2, every format: from memory 6-29 % less time than prefetching a
//                 token's rows at once (a burst of 17-64 prefetches every few tokens), on a Zen 3 with 2 cores.
//   kHeadSlices:  each kv head's K and V slices of the token a chunk on, in the scores pass over that head.
//                 AVX-512, every format.
enum class PrefetchPlan { kLinesSpread, kHeadSlices };

// Stored element type of K/V format KT: float, uint16_t for the 16-bit types, a byte for the 1-byte formats.
template <int KT>
using Stored = std::conditional_t<KT == kFloat32, float, std::conditional_t<is_quantized(KT), uint8_t, uint16_t>>;

// What a scores tile prefetches while it passes the current tokens (token(j) for each token j it takes): the next
// lines of `lines` (kLinesSpread), or (kHeadSlices) per token of the chunk the byte offsets of rows further on (or
// -1), one head's slice from head_k / head_v on (bytes) with the given footprints.
struct Ahead {
  LineWalk* lines;
  const uint8_t *K, *V;
  const int64_t *k_off, *v_off;
  int64_t HS, VHS;  // bytes between heads
  int k_foot, v_foot;
  int64_t head_k = 0, head_v = 0;
  VP_INLINE void token(int j) const {
    if (lines) {
      lines->issue();
    } else if (k_off[j] >= 0) {
      prefetch_token(K, V, k_off[j] + head_k, v_off[j] + head_v, 1, HS, VHS, k_foot, v_foot);
    }
  }
};

// Steps of a query's low byte per step of its high byte (int8 scores by dot products, below).
constexpr float kLowSteps = 254.0f;

// The smallest power of two s with x / s <= top (x >= 0; 0 for 0): the quantization step of IDP's query and
// probabilities, exact to scale by.
VP_INLINE float power_of_two_step(float x, float top) {
  if (!(x > 0.0f)) return 0.0f;
  const float r = x / top;
  float s;
  const uint32_t b = f_bits(r);
  if (r >= 0x1p-126f && r < 0x1p126f) {
    // By the exponent bits, not frexp / ldexp: those are library calls, and this runs per head and chunk (P.V).
    // r itself where it is a power of two (no mantissa bits), else the next power of two above it.
    s = bits_f(((b >> 23) + ((b & 0x7fffffu) != 0 ? 1u : 0u)) << 23);
  } else {
    int e = 0;
    const float f = std::frexp(r, &e);  // r = f * 2^e, f in [0.5, 1)
    s = std::ldexp(1.0f, f == 0.5f ? e - 1 : e);
  }
  while (x / s > top) s *= 2.0f;  // x / top rounded down above: never past top
  return s;
}

// A power of two to scale a query head by before dividing by its step sq, so that 1 / sq stays finite for the
// tiniest queries (sq below 2^-64, down to the subnormals: 1 / sq would be inf from 2^-128 on). Exact either way.
VP_INLINE float query_prescale(float sq) { return sq > 0.0f && sq < 0x1p-64f ? 0x1p64f : 1.0f; }

// The walk of the scores tiles: step(i, i1, row i, row i1) for the n rows at off[] + hoff, two tokens at a time (an
// odd last token pairs with itself: i1 == i), after asking ahead (or null) for those tokens' rows further on. Only
// for callers compiled under their file's ISA pragma: a lambda does not take a function's own target attribute.
template <typename T, typename Step>
VP_INLINE void for_row_pairs(const T* K, const int64_t* off, int64_t hoff, int n, const Ahead* ahead, Step&& step) {
  for (int i = 0; i < n; i += 2) {
    const int i1 = i + 1 < n ? i + 1 : i;
    if (ahead)
      for (int j = i; j <= i1; ++j) ahead->token(j);
    step(i, i1, K + off[i] + hoff, K + off[i1] + hoff);
  }
}

// Partial score vectors of GB query heads (q rows D apart) against the n K rows at off[] + hoff, into
// red[g][i][kLanes]; two tokens at a time (for_row_pairs). ahead (or null): rows to prefetch meanwhile.
template <typename W, int KT, int D, int GB>
VP_INLINE void scores_tile(const float* __restrict q, const Stored<KT>* K, const int64_t* off, int64_t hoff, int n,
                           float* __restrict red, const Ahead* ahead) {
  using Vec = typename W::Vec;
  constexpr int L = W::kLanes;
  static_assert(D % L == 0, "scores take kLanes dims at a time");
  for_row_pairs(K, off, hoff, n, ahead,
                [&](int i, int i1, const Stored<KT>* k0, const Stored<KT>* k1) __attribute__((always_inline)) {
                  Vec a[GB], b[GB];
                  for (int g = 0; g < GB; ++g) a[g] = b[g] = W::zero();
#pragma GCC unroll 8
                  for (int c = 0; c < D; c += L) {
                    const Vec x = W::template load<KT>(k0 + c), y = W::template load<KT>(k1 + c);
                    for (int g = 0; g < GB; ++g) {
                      Vec qv = W::loadu(q + g * D + c);
                      // Held in a register for both tokens: GCC otherwise folds the load into each FMA, and loads,
                      // not FMAs, bound this step (AVX2 int8: 10 loads per 2 x 8 elements, 6 this way).
                      __asm__("" : "+v"(qv));
                      a[g] = W::fma(qv, x, a[g]);
                      b[g] = W::fma(qv, y, b[g]);
                    }
                  }
                  for (int g = 0; g < GB; ++g) {
                    W::storeu(red + (g * kChunk + i) * L, a[g]);
                    W::storeu(red + (g * kChunk + i1) * L, b[g]);
                  }
                });
}

// acc[g] (rows DV apart) += sum_i ps[g][i] * V row i, for GB heads, kPvVecs x kLanes dims at a time held in
// registers across the n tokens (in load_pv's order of dims).
template <typename W, int KT, int DV, int GB>
VP_INLINE void pv_tile(float* __restrict acc, const Stored<KT>* V, const int64_t* off, int64_t hoff, int n,
                       const float* __restrict ps) {
  using Vec = typename W::Vec;
  constexpr int L = W::kLanes, NV = W::kPvVecs;
  static_assert(DV % (NV * L) == 0, "P.V tiles are kPvVecs x kLanes dims wide");
  for (int d0 = 0; d0 < DV; d0 += NV * L) {
    Vec a[GB][NV];
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < NV; ++j) a[g][j] = W::loadu(acc + g * DV + d0 + L * j);
    for (int i = 0; i < n; ++i) {
      Vec v[NV];
      W::template load_pv<KT>(V + off[i] + hoff + d0, v);
      for (int g = 0; g < GB; ++g) {
        const Vec pg = W::set1(ps[g * kChunk + i]);
        for (int j = 0; j < NV; ++j) a[g][j] = W::fma(pg, v[j], a[g][j]);
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < NV; ++j) W::storeu(acc + g * DV + d0 + L * j, a[g][j]);
  }
}

// The online softmax of one chunk, once per head, kLanes tokens per vector: sc [H][kChunk] scores in, probabilities
// e^(score - new max) out; m / l (running max and sum) updated, and each head's row of acc (DV floats, any order of
// dims) rescaled where its max grew. Lanes past n are masked (what they held, even inf or NaN, becomes -inf for the
// max and 0 for the sum and the probabilities).
template <typename W>
VP_INLINE void chunk_softmax(float* __restrict sc, float* __restrict m, float* __restrict l, float* __restrict acc,
                             int H, int DV, int n) {
  using Vec = typename W::Vec;
  using Mask = typename W::Mask;
  constexpr int L = W::kLanes;
  constexpr int NC = kChunk / L;
  Mask valid[NC];
  for (int j = 0; j < NC; ++j) valid[j] = W::first(L * j, n);
  const Vec ninf = W::set1(-std::numeric_limits<float>::infinity());
  for (int h = 0; h < H; ++h) {
    float* s = sc + h * kChunk;
    Vec v[NC];
    Vec vmx = ninf;
    for (int j = 0; j < NC; ++j) {
      v[j] = W::loadu(s + L * j);
      vmx = W::max(vmx, W::select(valid[j], v[j], ninf));
    }
    const float mx = W::hmax(vmx);
    const float mn = mx > m[h] ? mx : m[h];
    const float alpha = m[h] == -std::numeric_limits<float>::infinity() ? 0.0f : fast_exp(m[h] - mn);
    const Vec vmn = W::set1(mn);
    Vec vsum = W::zero();
    for (int j = 0; j < NC; ++j) {
      const Vec e = W::zero_unless(valid[j], W::exp(W::sub(v[j], vmn)));
      W::storeu(s + L * j, e);
      vsum = W::add(vsum, e);
    }
    l[h] = l[h] * alpha + W::hsum(vsum);
    m[h] = mn;
    if (alpha != 1.0f) {
      float* a = acc + h * DV;
      const Vec va = W::set1(alpha);
      for (int d = 0; d < DV; d += L) W::storeu(a + d, W::mul(W::loadu(a + d), va));
    }
  }
}

// One item. DT: q and out; KT: K/V as stored (DT, or a 1-byte format with DT == kFloat32). DP: bf16 scores by
// W::scores_bf16dp of the raw (unscaled) bf16 query, scaled after the reduction. IDP: int8 scores by
// W::scores_int8dp of the query quantized per head (see "Int8 scores by dot products" above).
//
// Prefetch: by the trait's plan for KT (PrefetchPlan above). Whatever the plan, the first rows of an item are
// asked for up front, so that they arrive in parallel instead of as one demand miss after another.
template <typename W, int DT, int KT, int D, int DV, bool DP, bool IDP = false>
void run_item_tiles(const DecodeParams& p, const Item& it, float* ws, float* part_acc, float* part_ml) {
  static_assert(is_quantized(KT) ? DT == kFloat32 : KT == DT, "quantized K/V come with fp32 q/out");
  static_assert(!DP || DT == kBFloat16, "dot products of bf16 pairs need bf16 data");
  static_assert(!IDP || KT == kInt8, "int8 dot products need int8 K");
  using Vec = typename W::Vec;
  using ET = Stored<KT>;
  constexpr int L = W::kLanes;
  constexpr int kBytes = int(sizeof(ET));
  constexpr bool kRowScale = KT == kInt8;
  constexpr bool kTensorScale = KT == kFloat8E4M3 || KT == kFloat8E5M2;
  constexpr int kFoot = D + (kRowScale ? 4 : 0), kVFoot = DV + (kRowScale ? 4 : 0);  // elements of a head row
  constexpr int DR = D > DV ? D : DV;
  constexpr bool kWalk = W::template kPrefetch<KT> == PrefetchPlan::kLinesSpread;
  const int H = p.num_heads, HKV = p.num_kv_heads, G = H / HKV;
  float* __restrict qf = ws;                              // [H][D] query, pre-scaled (fp8: by k_scale too)
  float* __restrict acc = qf + H * D;                     // [H][DV] unnormalised output
  float* __restrict red = acc + H * DV;                   // [4][kChunk][kLanes] partial score vectors (<= kChunk * DR)
  float* __restrict sc = red + kChunk * DR;               // [H][kChunk] scores, then probabilities
  float* __restrict m = sc + H * kChunk;                  // [H] running max
  float* __restrict l = m + H;                            // [H] running sum of exp(score - max)
  float* __restrict q8_scale = l + H;                     // IDP: [H] the step of a head's sums (16-bit: s_q / 254)
  float* __restrict q8_bias = q8_scale + H;               // IDP: [H] the k + 128 correction, 128 * sum q8 (16-bit: 0)
  int8_t* __restrict q8 = reinterpret_cast<int8_t*>(qf);  // IDP: [H][2 D bytes] quantized query, over qf (below)
  alignas(64) float rs[kChunk];                           // int8: the chunk's row scales of one kv head (0 past n)
  alignas(64) float pr[4 * kChunk];                       // int8: probabilities times their V row's scale
  static_assert(4 * L <= DR, "the partial score vectors fit the row buffer");

  const typename Elem<DT>::T* q = static_cast<const typename Elem<DT>::T*>(p.q) + int64_t(it.b) * H * D;
  const float qs = p.scale * (kTensorScale ? tensor_factor<KT>(p.k_scale) : 1.0f);
  for (int i = 0; i < H * D; ++i) qf[i] = Elem<DT>::load(q[i]) * qs;
  if constexpr (IDP) {
    // Head h's 2 D bytes land on floats h * D / 2 .., which (h >= 1) belong to heads already quantized; head 0 goes
    // through a row of its own first.
    alignas(64) int8_t row8[2 * D];
    for (int h = 0; h < H; ++h) {
      const float* x = qf + h * D;
      if constexpr (W::kInt16Query) {  // sum q16 * k with k signed: no correction, scaled in low-part steps
        const float sq = W::template quantize_query16<D>(x, reinterpret_cast<int16_t*>(row8));
        std::memcpy(q8 + 2 * h * D, row8, 2 * D);
        q8_scale[h] = sq / kLowSteps;
        q8_bias[h] = 0.0f;
        continue;
      }
      float amax = 0.0f;
      for (int d = 0; d < D; ++d) amax = std::max(amax, x[d] < 0.0f ? -x[d] : x[d]);
      const float sq = power_of_two_step(amax, 127.0f), pre = query_prescale(sq);
      const float inv = sq > 0.0f ? 1.0f / (sq * pre) : 0.0f;
      int32_t sum_hi = 0, sum_lo = 0;
      for (int d = 0; d < D; ++d) {
        const float y = x[d] * pre * inv;  // exact: pre and inv are powers of two
        const int hi = std::max(-127, std::min(127, int(std::nearbyint(y))));
        const int lo = std::max(-127, std::min(127, int(std::nearbyint((y - float(hi)) * kLowSteps))));
        row8[d] = int8_t(hi);
        row8[D + d] = int8_t(lo);
        sum_hi += hi;
        sum_lo += lo;
      }
      std::memcpy(q8 + 2 * h * D, row8, 2 * D);
      q8_scale[h] = sq;
      q8_bias[h] = 128.0f * (float(sum_hi) + float(sum_lo) / kLowSteps);
    }
  }
  std::fill(acc, acc + H * DV, 0.0f);
  std::fill(red, red + 4 * kChunk * L, 0.0f);  // rows past a short chunk's end are summed, never used
  std::fill(m, m + H, -std::numeric_limits<float>::infinity());
  std::fill(l, l + H, 0.0f);
  std::fill(rs, rs + kChunk, 0.0f);

  const ET* K = static_cast<const ET*>(p.k);
  const ET* V = static_cast<const ET*>(p.v);
  const uint8_t* KB = reinterpret_cast<const uint8_t*>(K);  // for prefetches and row scales, which count bytes
  const uint8_t* VB = reinterpret_cast<const uint8_t*>(V);
  const RowFinder row(p, it.b);
  const int64_t HS = p.head_stride, VHS = p.v_head_stride;
  int64_t off[kChunk], voff[kChunk], aoff[kChunk], avoff[kChunk];  // aoff / avoff: a chunk on (bytes, or -1)
  LineWalk walk{{KB, VB}, {aoff, avoff}, {HS * kBytes, VHS * kBytes}, {kFoot * kBytes, kVFoot * kBytes}, HKV};
  Ahead ahead{kWalk ? &walk : nullptr, KB, VB, aoff, avoff, HS * kBytes, VHS * kBytes, kFoot * kBytes, kVFoot * kBytes};
  prefetch_rows(row, it.t0, std::min(it.t1, it.t0 + kChunk), kBytes, KB, VB, HKV, HS * kBytes, VHS * kBytes,
                kFoot * kBytes, kVFoot * kBytes);

  for (int c0 = it.t0; c0 < it.t1; c0 += kChunk) {
    const int n = std::min(kChunk, it.t1 - c0);
    for (int i = 0; i < n; ++i) row(c0 + i, off[i], voff[i]);
    rows_ahead(row, c0 + kChunk, it.t1, n, kBytes, aoff, avoff);
    // kLinesSpread: the scores passes take a token step n times per kv head (in the first query group's pass).
    if constexpr (kWalk) walk.start(n, HKV * n);

    for (int kh = 0; kh < HKV; ++kh) {
      ahead.head_k = kh * HS * kBytes;  // kHeadSlices: this head's slices
      ahead.head_v = kh * VHS * kBytes;
      const Ahead* pf = &ahead;  // in the first query group's pass over the head
      if constexpr (kRowScale)
        for (int i = 0; i < n; ++i) rs[i] = row_factor<KT>(KB + off[i] + kh * HS, D, 1.0f);
      for (int g0 = 0; g0 < G; g0 += 4, pf = nullptr) {
        const int gb = std::min(4, G - g0);
        const float* qg = qf + (kh * G + g0) * D;
        if constexpr (IDP) {
          const int8_t* qr = q8 + 2 * (kh * G + g0) * D;
          switch (gb) {
            case 4:
              W::template scores_int8dp<D, 4>(qr, K, off, kh * HS, n, red, pf);
              break;
            case 3:
              W::template scores_int8dp<D, 3>(qr, K, off, kh * HS, n, red, pf);
              break;
            case 2:
              W::template scores_int8dp<D, 2>(qr, K, off, kh * HS, n, red, pf);
              break;
            default:
              W::template scores_int8dp<D, 1>(qr, K, off, kh * HS, n, red, pf);
          }
        } else if constexpr (DP) {
          const uint16_t* qr = q + (kh * G + g0) * D;
          switch (gb) {
            case 4:
              W::template scores_bf16dp<D, 4>(qr, K, off, kh * HS, n, red, pf);
              break;
            case 3:
              W::template scores_bf16dp<D, 3>(qr, K, off, kh * HS, n, red, pf);
              break;
            case 2:
              W::template scores_bf16dp<D, 2>(qr, K, off, kh * HS, n, red, pf);
              break;
            default:
              W::template scores_bf16dp<D, 1>(qr, K, off, kh * HS, n, red, pf);
          }
        } else {
          switch (gb) {
            case 4:
              scores_tile<W, KT, D, 4>(qg, K, off, kh * HS, n, red, pf);
              break;
            case 3:
              scores_tile<W, KT, D, 3>(qg, K, off, kh * HS, n, red, pf);
              break;
            case 2:
              scores_tile<W, KT, D, 2>(qg, K, off, kh * HS, n, red, pf);
              break;
            default:
              scores_tile<W, KT, D, 1>(qg, K, off, kh * HS, n, red, pf);
          }
        }
        for (int g = 0; g < gb; ++g) {
          for (int i = 0; i < n; i += L) {
            Vec s = W::reduce_rows(red + (g * kChunk + i) * L);
            if constexpr (DP) s = W::mul(s, W::set1(p.scale));  // the raw query's scores, scaled here
            if constexpr (IDP) {  // exact integers so far: the k + 128 correction, then the query's scale
              const int h = kh * G + g0 + g;
              s = W::mul(W::sub(s, W::set1(q8_bias[h])), W::set1(q8_scale[h]));
            }
            if constexpr (kRowScale) s = W::mul(s, W::loadu(rs + i));
            W::storeu(sc + (kh * G + g0 + g) * kChunk + i, s);
          }
        }
      }
    }

    chunk_softmax<W>(sc, m, l, acc, H, DV, n);

    for (int kh = 0; kh < HKV; ++kh) {
      if constexpr (kRowScale)
        for (int i = 0; i < n; ++i) rs[i] = row_factor<KT>(VB + voff[i] + kh * VHS, DV, 1.0f);
      for (int g0 = 0; g0 < G; g0 += 4) {
        const int gb = std::min(4, G - g0);
        float* a = acc + (kh * G + g0) * DV;
        const float* ps = sc + (kh * G + g0) * kChunk;
        if constexpr (kRowScale) {
          for (int g = 0; g < gb; ++g)
            for (int i = 0; i < n; ++i) pr[g * kChunk + i] = ps[g * kChunk + i] * rs[i];
          ps = pr;
        }
        if constexpr (IDP) {
          switch (gb) {
            case 4:
              W::template pv_int8dp<DV, 4>(a, V, voff, kh * VHS, n, pr);
              break;
            case 3:
              W::template pv_int8dp<DV, 3>(a, V, voff, kh * VHS, n, pr);
              break;
            case 2:
              W::template pv_int8dp<DV, 2>(a, V, voff, kh * VHS, n, pr);
              break;
            default:
              W::template pv_int8dp<DV, 1>(a, V, voff, kh * VHS, n, pr);
          }
          continue;
        }
        switch (gb) {
          case 4:
            pv_tile<W, KT, DV, 4>(a, V, voff, kh * VHS, n, ps);
            break;
          case 3:
            pv_tile<W, KT, DV, 3>(a, V, voff, kh * VHS, n, ps);
            break;
          case 2:
            pv_tile<W, KT, DV, 2>(a, V, voff, kh * VHS, n, ps);
            break;
          default:
            pv_tile<W, KT, DV, 1>(a, V, voff, kh * VHS, n, ps);
        }
      }
    }
  }
  if constexpr (W::template kPermutedPv<KT>)
    for (int h = 0; h < H; ++h) W::unpermute(acc + h * DV, DV);
  if constexpr (kTensorScale) {
    const float vf = tensor_factor<KT>(p.v_scale);  // fp8: v_scale (e4m3: times 2^8) on the whole output
    for (int i = 0; i < H * DV; ++i) acc[i] *= vf;
  }
  finish_item<DT>(p, it, acc, m, l, part_acc, part_ml);
}

// The item function of the compiled head dims (see decode_cpu_item.h), or nullptr.
template <typename W, int DT, int KT, bool DP = false, bool IDP = false>
ItemFn tile_item_for_dims(int D, int DV) {
  if (D == DV) {
    switch (D) {
      case 64:
        return run_item_tiles<W, DT, KT, 64, 64, DP, IDP>;
      case 128:
        return run_item_tiles<W, DT, KT, 128, 128, DP, IDP>;
      case 256:
        return run_item_tiles<W, DT, KT, 256, 256, DP, IDP>;
      default:
        return nullptr;
    }
  }
  if (D == 192 && DV == 128) return run_item_tiles<W, DT, KT, 192, 128, DP, IDP>;
  return nullptr;
}

// The item function of a 1-byte K/V format (fp32 q and out) at the compiled head dims, or nullptr (other formats,
// other head dims).
template <typename W>
ItemFn quantized_tile_item(int kv_dtype, int D, int DV) {
  switch (kv_dtype) {
    case kInt8:
      return tile_item_for_dims<W, kFloat32, kInt8>(D, DV);
    case kFloat8E4M3:
      return tile_item_for_dims<W, kFloat32, kFloat8E4M3>(D, DV);
    case kFloat8E5M2:
      return tile_item_for_dims<W, kFloat32, kFloat8E5M2>(D, DV);
    default:
      return nullptr;
  }
}

}  // namespace
}  // namespace cpu_decode
}  // namespace kernels
}  // namespace vpaged
