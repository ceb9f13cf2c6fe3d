// Decode attention on the CPU (contiguous and block-table K/V; see decode.h).
//
// Work is cut into items (sequence, token range) that cover all heads of the sequence, so an item reads
// whole token rows ([kv_heads, head_dim], dense in both caches) front to back instead of one strided
// head_dim slice per head. Long sequences are split into several items (split-context) so that a batch of
// one still keeps every thread busy; the pieces' partial results (max, sum, unnormalised output) are
// merged afterwards.
//
// Inside an item, tokens go in chunks of kChunk: scores of the chunk for every head, one online-softmax
// rescale per chunk and head (not per token), then P·V. The inner loops run over head_dim on contiguous
// fp32 rows (K/V rows of 16-bit types are widened into a small buffer first), written as `omp simd`
// loops so GCC vectorises them, reductions included, without -ffast-math. GQA: each widened K row is
// dotted with the 4 query heads sharing it at a time, and each V row feeds all its heads.
//
// Rows of K and V are prefetched in software, kAhead tokens ahead, into L2: hardware prefetchers stop at
// 4 KiB pages, which is one fp32 row of 8 heads x 128, and rows of a block table or of the interleaved
// layout are not adjacent anyway. Prefetching into L1 instead stalled on L1 miss buffers (measured on
// the dev box: bf16 from DRAM 4.5 -> 6.7 GB/s per core with L2 hints). The lines go out a few at a time from
// every (token pair, kv head) step (LineWalk, decode_cpu_item.h) over the chunk of tokens kAhead on: asked for
// a pair's rows at once (256 lines in fp32), memory and compute added up; spread, fp32 from memory took 8-15 %
// less time on a Zen 3 (in cache 1-3 % more at 1K tokens, 7 % at 64). A whole chunk ahead was slower: two
// chunks of fp32 rows (512 KiB) fill that core's L2.
//
// Quantized K/V (1-byte int8 / fp8 elements, fp32 q and out) take the same item loop: per chunk and kv head
// the chunk's rows are dequantized into the fp32 row buffer (scale applied), by AVX2 + F16C code in the AVX2
// build, and the next chunk's rows are prefetched a chunk ahead. At a byte per element the conversion, not
// only the memory traffic, bounds the loop, which is why it is done 16 elements per step with intrinsics.
//
// Every helper is always_inline and the generic loop's per-item entry points are compiled twice, for the
// baseline x86-64 ISA and for AVX2+FMA, and picked at run time: the extension must run on any x86-64 (no
// -march), yet decode at long contexts is bound by how fast rows are consumed, so 256-bit FMAs matter.
//
// The files: this one checks parameters, holds the generic loop and picks an item function per call
// (select_item_fn); decode_cpu_tiles.h is the tile loop (rows widened in registers, partial score vectors
// reduced together), written once over a vector-width trait and compiled at 8 lanes in decode_cpu_avx2.cpp and at
// 16 lanes in decode_cpu_avx512.cpp; decode_cpu_item.h is what they share (items, row offsets, prefetches).
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "core/errors.h"
#include "kernels/cpu_math.h"
#include "kernels/decode.h"
#include "kernels/decode_cpu_item.h"

namespace vpaged {
namespace kernels {

DecodeParams resolve_params(const DecodeParams& in) {
  DecodeParams p = in;
  if (p.kv_dtype == -1) p.kv_dtype = p.dtype;
  // int8 rows carry their float32 scale after the values: a dense head is 4 bytes wider than its head dim.
  const int extra = p.kv_dtype == kInt8 ? 4 : 0;
  if (p.head_stride == 0) p.head_stride = p.head_dim + extra;
  if (p.v_head_dim == 0) p.v_head_dim = p.head_dim;
  if (p.v_token_stride == 0) p.v_token_stride = p.token_stride;
  if (p.v_head_stride == 0) p.v_head_stride = p.v_head_dim == p.head_dim ? p.head_stride : p.v_head_dim + extra;
  if (p.v_slot_stride == -1) p.v_slot_stride = p.slot_stride;
  return p;
}

void check_params(const DecodeParams& in) {
  const DecodeParams p = resolve_params(in);
  auto fail = [](const std::string& m) { throw InvalidArgument("decode attention: " + m); };
  if (p.dtype != kFloat32 && p.dtype != kFloat16 && p.dtype != kBFloat16)
    fail("unsupported dtype code " + std::to_string(p.dtype));
  if (p.kv_dtype != p.dtype) {
    if (!is_quantized(p.kv_dtype))
      fail("unsupported kv_dtype code " + std::to_string(p.kv_dtype) + " (-1 or dtype " + std::to_string(p.dtype) +
           ", or 3 int8, 4 float8_e4m3fn, 5 float8_e5m2)");
    if (p.dtype != kFloat32)
      fail("quantized K/V (kv_dtype " + std::to_string(p.kv_dtype) + ") need float32 q and out (dtype 0), got dtype " +
           std::to_string(p.dtype));
    if (!std::isfinite(p.k_scale) || !std::isfinite(p.v_scale)) fail("k_scale and v_scale must be finite");
  }
  if (p.num_seqs < 0) fail("num_seqs < 0");
  if (p.num_heads <= 0 || p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0)
    fail("num_heads (" + std::to_string(p.num_heads) + ") must be a positive multiple of num_kv_heads (" +
         std::to_string(p.num_kv_heads) + ")");
  if (p.head_dim <= 0 || p.head_dim > 256) fail("head_dim must be in 1..256, got " + std::to_string(p.head_dim));
  if (p.v_head_dim <= 0 || p.v_head_dim > 256)
    fail("v_head_dim must be in 1..256, got " + std::to_string(p.v_head_dim));
  // Each of K and V: a head's row (int8: its values and their 4-byte scale) fits its head stride, and tokens
  // do not overlap.
  const int extra = p.kv_dtype == kInt8 ? 4 : 0;
  auto check_strides = [&](const char* name, int dim, int64_t hs, int64_t ts, int64_t ss) {
    const int row = dim + extra;
    if (hs < row)
      fail(std::string(name) + " head_stride " + std::to_string(hs) + " is smaller than its head dim" +
           (extra ? " + 4 (the int8 row's float32 scale)" : ""));
    if (hs == row ? ts < int64_t(p.num_kv_heads) * row : ts < row)
      fail(std::string(name) + " token_stride " + std::to_string(ts) + " overlaps the tokens' heads");
    if (!p.paged && ss < 0) fail(std::string(name) + " slot_stride is negative");
  };
  check_strides("K", p.head_dim, p.head_stride, p.token_stride, p.slot_stride);
  check_strides("V", p.v_head_dim, p.v_head_stride, p.v_token_stride, p.v_slot_stride);
  if (p.max_tokens < 0) fail("max_tokens < 0");
  if (p.num_seqs == 0) return;
  if (!p.q || !p.out || !p.k || !p.v || !p.lengths) fail("null tensor pointer");
  if (p.paged) {
    if (p.block_size <= 0 || (p.block_size & (p.block_size - 1)) != 0)
      fail("block_size must be a power of two, got " + std::to_string(p.block_size));
    if (!p.block_tables || p.num_blocks <= 0) fail("block tables missing or no blocks");
    if (int64_t(p.max_tokens) > p.bt_stride * p.block_size)
      fail("max_tokens exceeds what a block-table row can address");
  } else {
    if (!p.slots) fail("slots missing");
  }
}

namespace {

using namespace cpu_decode;

// ------------------------------------------------------------------------------------ row kernels
// DC: head_dim as a compile-time constant (fully unrolled loops), or 0 for any head_dim at run time.
template <int DT, int DC>
VP_INLINE const float* widen(const typename Elem<DT>::T* __restrict src, float* __restrict buf, int D) {
  if constexpr (DT == kFloat32) {
    return src;  // already fp32: use the row in place
  } else {
    const int n = DC ? DC : D;
#pragma omp simd
    for (int d = 0; d < n; ++d) buf[d] = Elem<DT>::load(src[d]);
    return buf;
  }
}

template <int DC>
VP_INLINE float dot1(const float* __restrict q, const float* __restrict k, int D) {
  const int n = DC ? DC : D;
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int d = 0; d < n; ++d) s += q[d] * k[d];
  return s;
}

// Four query heads (rows qs apart) against two K rows: eight independent FMA chains keep both FMA pipes
// busy through the 4-cycle FMA latency, each K and q load feeds 4 and 2 FMAs, and each of the 8 results
// costs one horizontal sum (the part of a dot product that does not vectorise).
template <int DC>
VP_INLINE void dot4x2(const float* __restrict q, int qs, const float* __restrict k0, const float* __restrict k1, int D,
                      float* __restrict s, int ss) {
  const int n = DC ? DC : D;
  const float* __restrict q0 = q;
  const float* __restrict q1 = q + qs;
  const float* __restrict q2 = q + 2 * qs;
  const float* __restrict q3 = q + 3 * qs;
  float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f, b0 = 0.0f, b1 = 0.0f, b2 = 0.0f, b3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3, b0, b1, b2, b3)
  for (int d = 0; d < n; ++d) {
    const float ka = k0[d], kb = k1[d];
    a0 += q0[d] * ka;
    b0 += q0[d] * kb;
    a1 += q1[d] * ka;
    b1 += q1[d] * kb;
    a2 += q2[d] * ka;
    b2 += q2[d] * kb;
    a3 += q3[d] * ka;
    b3 += q3[d] * kb;
  }
  s[0] = a0;
  s[1] = b0;
  s[ss] = a1;
  s[ss + 1] = b1;
  s[2 * ss] = a2;
  s[2 * ss + 1] = b2;
  s[3 * ss] = a3;
  s[3 * ss + 1] = b3;
}

// acc += p0 v0 + p1 v1 + p2 v2 + p3 v3: four tokens per pass, so the accumulator row is loaded and stored
// once per four FMAs.
template <int DC>
VP_INLINE void axpy4(float* __restrict acc, const float* __restrict v0, const float* __restrict v1,
                     const float* __restrict v2, const float* __restrict v3, const float* p, int D) {
  const int n = DC ? DC : D;
  const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
#pragma omp simd
  for (int d = 0; d < n; ++d) acc[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
}

// Four heads' accumulators += P·V over the n rows of a chunk, 16 dims at a time held in registers across
// all n tokens: 8 independent FMA chains, 2 row loads + 4 broadcasts per 8 FMAs and no store inside the
// token loop (axpy4 above stores the accumulator once per 4 FMAs, and stores were the bound). GCC vector
// types spell the register tile out; the baseline ISA lowers each 8-wide operation to two SSE ones.
typedef float vf8 __attribute__((vector_size(32)));
// GCC warns that returning a 32-byte vector without AVX changes the ABI; these helpers are always inlined,
// so no call ever passes one.
#pragma GCC diagnostic ignored "-Wpsabi"
VP_INLINE vf8 load8(const float* p) {
  vf8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
VP_INLINE void store8(float* p, vf8 v) { std::memcpy(p, &v, sizeof v); }

VP_INLINE void pv4x16(float* __restrict acc, const float* const* vr, const float* __restrict ps, int n, int D) {
  float* __restrict a0 = acc;
  float* __restrict a1 = acc + D;
  float* __restrict a2 = acc + 2 * D;
  float* __restrict a3 = acc + 3 * D;
  const float* __restrict p0 = ps;
  const float* __restrict p1 = ps + kChunk;
  const float* __restrict p2 = ps + 2 * kChunk;
  const float* __restrict p3 = ps + 3 * kChunk;
  for (int d = 0; d < D; d += 16) {
    vf8 x0 = load8(a0 + d), y0 = load8(a0 + d + 8), x1 = load8(a1 + d), y1 = load8(a1 + d + 8);
    vf8 x2 = load8(a2 + d), y2 = load8(a2 + d + 8), x3 = load8(a3 + d), y3 = load8(a3 + d + 8);
    for (int i = 0; i < n; ++i) {
      const vf8 v = load8(vr[i] + d), w = load8(vr[i] + d + 8);
      x0 += p0[i] * v;
      y0 += p0[i] * w;
      x1 += p1[i] * v;
      y1 += p1[i] * w;
      x2 += p2[i] * v;
      y2 += p2[i] * w;
      x3 += p3[i] * v;
      y3 += p3[i] * w;
    }
    store8(a0 + d, x0);
    store8(a0 + d + 8, y0);
    store8(a1 + d, x1);
    store8(a1 + d + 8, y1);
    store8(a2 + d, x2);
    store8(a2 + d + 8, y2);
    store8(a3 + d, x3);
    store8(a3 + d + 8, y3);
  }
}

template <int DC>
VP_INLINE void axpy1(float* __restrict acc, const float* __restrict v, float p, int D) {
  const int n = DC ? DC : D;
#pragma omp simd
  for (int d = 0; d < n; ++d) acc[d] += p * v[d];
}

// ------------------------------------------------------------------------------------ quantized K/V
// The 1-byte formats (decode.h) are dequantized a chunk's rows of one kv head at a time into the fp32 row
// buffer, the row's scale applied there (int8: the float32 after the row; fp8: k_scale / v_scale), so the
// dot products and P.V run on fp32 rows exactly as for 16-bit types (quant_value: decode_cpu_item.h).
// Rows base + off[i] + hoff (i < n) of `dim` 1-byte elements into buf (rows `dim` floats apart). Portable.
template <int KT, int DC>
VP_INLINE void dequant_rows(const uint8_t* base, const int64_t* off, int64_t hoff, int n, int D, float tf,
                            float* __restrict buf) {
  const int dim = DC ? DC : D;
  for (int i = 0; i < n; ++i) {
    const uint8_t* __restrict r = base + off[i] + hoff;
    const float s = row_factor<KT>(r, dim, tf);
    float* __restrict o = buf + i * dim;
#pragma omp simd
    for (int d = 0; d < dim; ++d) o[d] = quant_value(KT, r[d]) * s;
  }
}

// The same with AVX2 + F16C, 16 elements per step: int8 sign-extended to int32 and converted; fp8 made fp16
// bits in 16-bit lanes (e5m2: the byte as high byte; e4m3: sign-extended, shifted by 7, bit 14 cleared) and
// widened by vcvtph2ps (exact, also for fp16 subnormals). Out of line: the item function that calls it is
// shared with the portable build, which cannot inline F16C code (one call per chunk and kv head).
template <int KT>
__attribute__((noinline, target("avx2,fma,f16c"))) void dequant_rows_avx2(const uint8_t* base, const int64_t* off,
                                                                          int64_t hoff, int n, int dim, float tf,
                                                                          float* __restrict buf) {
  for (int i = 0; i < n; ++i) {
    const uint8_t* r = base + off[i] + hoff;
    const float s = row_factor<KT>(r, dim, tf);
    const __m256 vs = _mm256_set1_ps(s);
    float* o = buf + i * dim;
    int d = 0;
    for (; d + 16 <= dim; d += 16) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + d));
      __m256 a, b;
      if constexpr (KT == kInt8) {
        a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
        b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(x, 8)));
      } else if constexpr (KT == kFloat8E5M2) {
        a = _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), x));
        b = _mm256_cvtph_ps(_mm_unpackhi_epi8(_mm_setzero_si128(), x));
      } else {
        const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(x), 7), _mm256_set1_epi16(-16385));
        a = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        b = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
      }
      _mm256_storeu_ps(o + d, _mm256_mul_ps(a, vs));
      _mm256_storeu_ps(o + d + 8, _mm256_mul_ps(b, vs));
    }
    for (; d < dim; ++d) o[d] = quant_value(KT, r[d]) * s;
  }
}

// ------------------------------------------------------------------------------------ the generic loop
// DT: type of q and out; KT: of K and V (DT, or a quantized format with DT == kFloat32). DC, DVC: head_dim and
// v_head_dim as compile-time constants, or 0 for run-time dims. V3: compiled for AVX2 (quantized rows are then
// dequantized by dequant_rows_avx2).
template <int DT, int KT, int DC, int DVC, bool V3>
VP_INLINE void run_item_impl(const DecodeParams& p, const Item& it, float* ws, float* part_acc, float* part_ml) {
  using T = typename Elem<DT>::T;
  constexpr bool kQuant = is_quantized(KT);
  static_assert(kQuant ? DT == kFloat32 : KT == DT, "quantized K/V come with fp32 q/out, others with their own");
  const int D = DC ? DC : p.head_dim;
  const int DV = DVC ? DVC : p.v_head_dim;
  const int H = p.num_heads, HKV = p.num_kv_heads, G = H / HKV;
  const int DR = std::max(D, DV);
  float* __restrict qf = ws;                  // [H][D] query, pre-scaled
  float* __restrict acc = qf + H * D;         // [H][DV] unnormalised output
  float* __restrict rows = acc + H * DV;      // [kChunk][max(D, DV)] widened K or V rows of one kv head
  float* __restrict sc = rows + kChunk * DR;  // [H][kChunk] scores, then probabilities
  float* __restrict m = sc + H * kChunk;      // [H] running max
  float* __restrict l = m + H;                // [H] running sum of exp(score - max)

  const T* q = static_cast<const T*>(p.q) + int64_t(it.b) * H * D;
  for (int i = 0; i < H * D; ++i) qf[i] = Elem<DT>::load(q[i]) * p.scale;
  std::fill(acc, acc + H * DV, 0.0f);
  std::fill(m, m + H, -std::numeric_limits<float>::infinity());
  std::fill(l, l + H, 0.0f);

  using KV = std::conditional_t<kQuant, uint8_t, T>;
  const KV* K = static_cast<const KV*>(p.k);
  const KV* V = static_cast<const KV*>(p.v);
  const RowFinder row(p, it.b);
  const int64_t HS = p.head_stride, VHS = p.v_head_stride;  // elements between kv heads of a token
  int64_t off[kChunk], voff[kChunk];
  const float* vr[kChunk];
  // Bytes of a head's row (int8: with its scale) and between kv heads; the per-tensor factors (fp8).
  const uint8_t* KB = reinterpret_cast<const uint8_t*>(K);
  const uint8_t* VB = reinterpret_cast<const uint8_t*>(V);
  const int k_foot = (D + (KT == kInt8 ? 4 : 0)) * int(sizeof(KV)),
            v_foot = (DV + (KT == kInt8 ? 4 : 0)) * int(sizeof(KV));
  const int64_t HSB = HS * int64_t(sizeof(KV)), VHSB = VHS * int64_t(sizeof(KV));
  const float ktf = tensor_factor<KT>(p.k_scale), vtf = tensor_factor<KT>(p.v_scale);
  // The first rows, asked for together: the first chunk's for the 1-byte formats (later chunks are prefetched a
  // chunk ahead, below), kAhead tokens' for the others (then the walk's window, below).
  prefetch_rows(row, it.t0, std::min(it.t1, it.t0 + (kQuant ? kChunk : kAhead)), int64_t(sizeof(KV)), KB, VB, HKV, HSB,
                VHSB, k_foot, v_foot);

  // 16-bit and fp32 rows: the lines of the tokens kAhead..kAhead + n on, a few from every (token pair, kv head) step
  // (the 1-byte formats ask for the next chunk's rows at its start instead, below).
  int64_t aoff[kChunk], avoff[kChunk];  // bytes, or -1
  LineWalk walk{{KB, VB}, {aoff, avoff}, {HSB, VHSB}, {k_foot, v_foot}, HKV};
  for (int c0 = it.t0; c0 < it.t1; c0 += kChunk) {
    const int n = std::min(kChunk, it.t1 - c0);
    for (int i = 0; i < n; ++i) row(c0 + i, off[i], voff[i]);
    if constexpr (!kQuant) {
      rows_ahead(row, c0 + kAhead, it.t1, n, sizeof(KV), aoff, avoff);
      walk.start(n, ((n + 1) / 2) * HKV);
    }
    if constexpr (kQuant) {
      // Scores: the next chunk's rows are prefetched (a whole chunk's time before they are read), then per kv
      // head the chunk's K rows are dequantized into the row buffer and dotted two at a time.
      for (int t = c0 + kChunk; t < std::min(it.t1, c0 + 2 * kChunk); ++t) {
        int64_t ko, vo;
        row(t, ko, vo);
        prefetch_token(KB, VB, ko, vo, HKV, HSB, VHSB, k_foot, v_foot);  // 1-byte elements: offsets are bytes
      }
      for (int kh = 0; kh < HKV; ++kh) {
        if constexpr (V3) {
          dequant_rows_avx2<KT>(K, off, kh * HS, n, D, ktf, rows);
        } else {
          dequant_rows<KT, DC>(K, off, kh * HS, n, D, ktf, rows);
        }
        const float* qg = qf + kh * G * D;
        for (int i = 0; i < n; i += 2) {
          const int i1 = i + 1 < n ? i + 1 : i;
          const float* k0 = rows + i * D;
          const float* k1 = rows + i1 * D;
          float* sg = sc + kh * G * kChunk + i;
          int g = 0;
          for (; g + 4 <= G; g += 4) dot4x2<DC>(qg + g * D, D, k0, k1, D, sg + g * kChunk, kChunk);
          for (; g < G; ++g) {
            sg[g * kChunk] = dot1<DC>(qg + g * D, k0, D);
            sg[g * kChunk + 1] = dot1<DC>(qg + g * D, k1, D);
          }
        }
      }
    } else {
      // Scores of the chunk, all heads, two tokens at a time (an odd last token is paired with itself; the
      // spare score lands in an unused column), the prefetch walk going on meanwhile.
      for (int i = 0; i < n; i += 2) {
        const int i1 = i + 1 < n ? i + 1 : i;
        for (int kh = 0; kh < HKV; ++kh) {
          walk.issue();
          const float* k0 = widen<DT, DC>(K + off[i] + kh * HS, rows, D);
          const float* k1 = widen<DT, DC>(K + off[i1] + kh * HS, rows + D, D);
          const float* qg = qf + kh * G * D;
          float* sg = sc + kh * G * kChunk + i;
          int g = 0;
          for (; g + 4 <= G; g += 4) dot4x2<DC>(qg + g * D, D, k0, k1, D, sg + g * kChunk, kChunk);
          for (; g < G; ++g) {
            sg[g * kChunk] = dot1<DC>(qg + g * D, k0, D);
            sg[g * kChunk + 1] = dot1<DC>(qg + g * D, k1, D);
          }
        }
      }
    }

    // Online softmax, once per chunk: rescale what came before by exp(old max - new max).
    for (int h = 0; h < H; ++h) {
      float* s = sc + h * kChunk;
      float mx = s[0];
      for (int i = 1; i < n; ++i) mx = s[i] > mx ? s[i] : mx;
      const float mn = mx > m[h] ? mx : m[h];
      const float alpha = m[h] == -std::numeric_limits<float>::infinity() ? 0.0f : fast_exp(m[h] - mn);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int i = 0; i < n; ++i) {
        const float e = fast_exp(s[i] - mn);
        s[i] = e;
        sum += e;
      }
      l[h] = l[h] * alpha + sum;
      m[h] = mn;
      if (alpha != 1.0f) {
        float* a = acc + h * DV;
#pragma omp simd
        for (int d = 0; d < DV; ++d) a[d] *= alpha;
      }
    }

    // P·V: widen each V row of the chunk once, use it for the G heads that share it.
    for (int kh = 0; kh < HKV; ++kh) {
      if constexpr (kQuant) {
        if constexpr (V3) {
          dequant_rows_avx2<KT>(V, voff, kh * VHS, n, DV, vtf, rows);
        } else {
          dequant_rows<KT, DVC>(V, voff, kh * VHS, n, DV, vtf, rows);
        }
        for (int i = 0; i < n; ++i) vr[i] = rows + i * DV;
      } else {
        for (int i = 0; i < n; ++i) vr[i] = widen<DT, DVC>(V + voff[i] + kh * VHS, rows + i * DV, DV);
      }
      int g = 0;
      if (DV % 16 == 0) {
        for (; g + 4 <= G; g += 4) pv4x16(acc + (kh * G + g) * DV, vr, sc + (kh * G + g) * kChunk, n, DV);
      }
      for (; g < G; ++g) {
        const int h = kh * G + g;
        float* a = acc + h * DV;
        const float* ps = sc + h * kChunk;
        int i = 0;
        for (; i + 4 <= n; i += 4) axpy4<DVC>(a, vr[i], vr[i + 1], vr[i + 2], vr[i + 3], ps + i, DV);
        for (; i < n; ++i) axpy1<DVC>(a, vr[i], ps[i], DV);
      }
    }
  }

  finish_item<DT>(p, it, acc, m, l, part_acc, part_ml);
}

template <int DT, int DC, int DVC, int KT = DT>
void run_item_base(const DecodeParams& p, const Item& it, float* ws, float* pa, float* pm) {
  run_item_impl<DT, KT, DC, DVC, false>(p, it, ws, pa, pm);
}

template <int DT, int DC, int DVC, int KT = DT>
__attribute__((target("avx2,fma"))) void run_item_avx2(const DecodeParams& p, const Item& it, float* ws, float* pa,
                                                       float* pm) {
  run_item_impl<DT, KT, DC, DVC, true>(p, it, ws, pa, pm);
}

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

bool cpu_has_f16c() {
  static const bool has = __builtin_cpu_supports("f16c");
  return has;
}

bool cpu_has_avx512() {
  // libgcc's cpu model also checks that the OS saves the zmm registers (XCR0).
  static const bool has = cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
}

bool cpu_has_avx512_bf16() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return has;
}

// Every CPU with AVX512_BF16 so far has AVX512_VNNI too (Cooper Lake, Sapphire Rapids and later, Zen 4 and later);
// checked all the same.
bool cpu_has_avx512_vnni() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
  return has;
}

// AMX tiles for bf16 (decode_cpu_amx.cpp). The tile state is an extended state Linux saves only for a process that
// asked for it (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); until then a tile instruction faults (SIGILL).
// Asked once; a refusal (an old kernel, a seccomp policy) leaves the path unavailable.
bool request_amx_tile_state() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kReqXcompPerm = 0x1023, kGetXcompPerm = 0x1022;
  constexpr int kXtileData = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) != 0) return false;
  unsigned long granted = 0;
  if (syscall(SYS_arch_prctl, kGetXcompPerm, &granted) != 0) return false;
  return (granted >> kXtileData) & 1u;
#else
  return false;
#endif
}

bool cpu_has_amx() {
  static const bool has = cpu_has_avx512_bf16() && __builtin_cpu_supports("amx-tile") &&
                          __builtin_cpu_supports("amx-bf16") && request_amx_tile_state();
  return has;
}

template <int DT>
ItemFn select_dim(int D, int DV, int isa) {
  const bool avx2 = isa >= kIsaAvx2;
  if (isa >= kIsaAvx512) {
    // Head dims the AVX-512 tile loop is compiled for; other head dims run the AVX2 build.
    if (const ItemFn fn = avx512_tile_item(DT, DT, D, DV, isa >= kIsaAvx512Bf16)) return fn;
  }
  // 16-bit K/V on AVX2: the tile loop (widened in registers; 0.5-0.85x the generic loop's time on the EPYC dev
  // box). fp32 keeps the generic loop, which reads its rows as they are and measured 1.0-1.17x faster there.
  if (DT != kFloat32 && avx2 && cpu_has_f16c()) {
    if (const ItemFn fn = avx2_tile_item(DT, DT, D, DV)) return fn;
  }
  if (D == DV) {
    switch (D) {
      case 64:
        return avx2 ? run_item_avx2<DT, 64, 64> : run_item_base<DT, 64, 64>;
      case 128:
        return avx2 ? run_item_avx2<DT, 128, 128> : run_item_base<DT, 128, 128>;
      case 256:
        return avx2 ? run_item_avx2<DT, 256, 256> : run_item_base<DT, 256, 256>;
      default:
        break;
    }
  }
  return avx2 ? run_item_avx2<DT, 0, 0> : run_item_base<DT, 0, 0>;
}

// Quantized K/V (fp32 q/out): the AVX-512 tile loop (16 elements dequantized per load) where the path is AVX-512,
// with int8 scores by VNNI dot products on the avx512bf16 path (decode_cpu_tiles.h: the query quantized per head,
// within a stated bound; the avx512 path keeps an fp32 query), the AVX2 one (AVX2 + F16C; int8 by 16-bit integer
// products within the same bound) from AVX2 up, else portable.
template <int KT>
ItemFn select_quant(int D, int DV, int isa) {
  if (isa >= kIsaAvx512) {
    const bool int8_dot = KT == kInt8 && isa >= kIsaAvx512Bf16 && cpu_has_avx512_vnni();  // as cpu_int8_dot
    if (const ItemFn fn = avx512_tile_item(kFloat32, KT, D, DV, false, int8_dot)) return fn;
  }
  const bool v3 = isa >= kIsaAvx2 && cpu_has_f16c();  // every AVX2 CPU has F16C; checked all the same
  if (v3) {
    if (const ItemFn fn = avx2_tile_item(kFloat32, KT, D, DV)) return fn;  // else the generic loop's AVX2 build
  }
  if (D == DV) {
    switch (D) {
      case 64:
        return v3 ? run_item_avx2<kFloat32, 64, 64, KT> : run_item_base<kFloat32, 64, 64, KT>;
      case 128:
        return v3 ? run_item_avx2<kFloat32, 128, 128, KT> : run_item_base<kFloat32, 128, 128, KT>;
      case 256:
        return v3 ? run_item_avx2<kFloat32, 256, 256, KT> : run_item_base<kFloat32, 256, 256, KT>;
      default:
        break;
    }
  }
  return v3 ? run_item_avx2<kFloat32, 0, 0, KT> : run_item_base<kFloat32, 0, 0, KT>;
}

ItemFn select_item_fn(int dtype, int kv_dtype, int D, int DV, int isa) {
  switch (kv_dtype) {
    case kInt8:
      return select_quant<kInt8>(D, DV, isa);
    case kFloat8E4M3:
      return select_quant<kFloat8E4M3>(D, DV, isa);
    case kFloat8E5M2:
      return select_quant<kFloat8E5M2>(D, DV, isa);
    default:
      break;
  }
  switch (dtype) {
    case kFloat32:
      return select_dim<kFloat32>(D, DV, isa);
    case kFloat16:
      return select_dim<kFloat16>(D, DV, isa);
    default:
      return select_dim<kBFloat16>(D, DV, isa);
  }
}

// Merge the partial results of one sequence's splits: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
template <int DT>
void merge_seq(const DecodeParams& p, int b, int64_t first, int count, const float* part_acc, const float* part_ml,
               float* tmp) {
  using T = typename Elem<DT>::T;
  const int H = p.num_heads, D = p.v_head_dim;
  T* out = static_cast<T*>(p.out) + int64_t(b) * H * D;
  for (int h = 0; h < H; ++h) {
    float M = -std::numeric_limits<float>::infinity();
    for (int s = 0; s < count; ++s) M = std::max(M, part_ml[((first + s) * H + h) * 2]);
    float L = 0.0f;
    std::fill(tmp, tmp + D, 0.0f);
    for (int s = 0; s < count; ++s) {
      const float ms = part_ml[((first + s) * H + h) * 2];
      if (ms == -std::numeric_limits<float>::infinity()) continue;  // an empty piece adds nothing
      const float w = std::exp(ms - M);
      L += w * part_ml[((first + s) * H + h) * 2 + 1];
      const float* a = part_acc + ((first + s) * H + h) * D;
      for (int d = 0; d < D; ++d) tmp[d] += w * a[d];
    }
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
    for (int d = 0; d < D; ++d) out[h * D + d] = Elem<DT>::store(tmp[d] * inv);
  }
}

}  // namespace

int cpu_best_isa() {
  return cpu_has_amx()           ? kIsaAmx
         : cpu_has_avx512_bf16() ? kIsaAvx512Bf16
         : cpu_has_avx512()      ? kIsaAvx512
         : cpu_has_avx2()        ? kIsaAvx2
                                 : kIsaBaseline;
}

namespace {
const char* const kIsaNames[] = {"baseline", "avx2", "avx512", "avx512bf16", "amx"};  // by code, kIsaBaseline first
}  // namespace

const char* cpu_isa_name(int isa) { return isa >= kIsaBaseline && isa <= kIsaAmx ? kIsaNames[isa] : "auto"; }

int cpu_isa_from_name(const std::string& name) {
  if (name == "auto") return kIsaAuto;
  for (int i = kIsaBaseline; i <= kIsaAmx; ++i)
    if (name == kIsaNames[i]) return i;
  return -2;
}

int cpu_auto_isa() {
  // -2: VPAGED_CPU_ISA names no path (reported on every use, not at load time, where nothing can catch it).
  static const int cap = [] {
    const char* v = std::getenv("VPAGED_CPU_ISA");
    if (v == nullptr || *v == '\0') return int(kIsaAmx);
    const int code = cpu_isa_from_name(v);
    return code == kIsaAuto ? int(kIsaAmx) : code;
  }();
  if (cap == -2)
    throw InvalidArgument(std::string("VPAGED_CPU_ISA must be auto, baseline, avx2, avx512, avx512bf16 or amx, got '") +
                          std::getenv("VPAGED_CPU_ISA") + "'");
  return std::min(cap, cpu_best_isa());
}

int cpu_int8_dot_prob_steps(int isa) {
  isa = resolve_cpu_isa("decode attention", isa);
  if (isa >= kIsaAvx512Bf16 && cpu_has_avx512_vnni()) return 255;  // as select_quant
  if (isa == kIsaAvx2 && cpu_has_f16c()) return 32767;
  return 0;
}

bool cpu_int8_dot(int isa) { return cpu_int8_dot_prob_steps(isa) != 0; }

int resolve_cpu_isa(const char* op, int isa) {
  if (isa == kIsaAuto) return cpu_auto_isa();
  if (isa < kIsaBaseline || isa > kIsaAmx)
    throw InvalidArgument(std::string(op) + ": unknown CPU code path " + std::to_string(isa));
  if (isa > cpu_best_isa())
    throw InvalidArgument(std::string(op) + ": this CPU cannot run the requested code path (" +
                          std::string(isa == kIsaAmx          ? "AMX-BF16, with the tile state granted by the OS"
                                      : isa == kIsaAvx512Bf16 ? "AVX512_BF16"
                                      : isa == kIsaAvx512     ? "AVX-512"
                                                              : "AVX2") +
                          ")");
  return isa;
}

void decode_cpu(const DecodeParams& params, int num_threads, int isa) {
  check_params(params);
  const DecodeParams p = resolve_params(params);
  isa = resolve_cpu_isa("decode attention", isa);
  if (p.num_seqs == 0) return;
  int nt = num_threads > 0 ? num_threads : omp_get_max_threads();
  const int B = p.num_seqs, H = p.num_heads, D = p.head_dim, DV = p.v_head_dim;

  std::vector<int> len(B);
  int64_t total = 0;
  for (int b = 0; b < B; ++b) {
    len[b] = std::clamp(p.lengths[b], 0, p.max_tokens);
    total += len[b];
  }
  // Small calls (a few short sequences) run on the calling thread: waking a team costs more than their
  // memory traffic (~256 KiB of K/V is ~20 us of one core), and on a busy machine far more.
  const int elem = p.kv_dtype == kFloat32 ? 4 : is_quantized(p.kv_dtype) ? 1 : 2;
  const int row_extra = p.kv_dtype == kInt8 ? 8 : 0;  // int8: a float32 scale per K and per V row
  const int64_t kv_bytes = total * int64_t(p.num_kv_heads) * ((D + DV) * elem + row_extra);
  if (kv_bytes < (int64_t(1) << 18)) nt = 1;
  // Aim at >= 4 items per thread (dynamic scheduling evens out mixed lengths), but never below kMinSplit
  // tokens per item, where merging would cost more than it balances. Multiple of kChunk: full chunks.
  int64_t per_item = std::max<int64_t>(kMinSplit, (total + 4 * nt - 1) / (4 * nt));
  if (nt == 1) per_item = std::max<int64_t>(per_item, p.max_tokens);  // one thread: nothing to balance
  per_item = (per_item + kChunk - 1) / kChunk * kChunk;

  std::vector<Item> items;
  std::vector<int64_t> first_partial(B, -1);
  std::vector<int> num_pieces(B, 1);
  int64_t partials = 0;
  for (int b = 0; b < B; ++b) {
    const int pieces = std::max<int64_t>(1, (len[b] + per_item - 1) / per_item);
    num_pieces[b] = pieces;
    if (pieces == 1) {
      items.push_back({b, 0, len[b], -1});
      continue;
    }
    first_partial[b] = partials;
    for (int s = 0; s < pieces; ++s) {
      const int t0 = int(s * per_item);
      items.push_back({b, t0, int(std::min<int64_t>(len[b], t0 + per_item)), partials++});
    }
  }
  std::vector<float> part_acc(size_t(partials) * H * DV), part_ml(size_t(partials) * H * 2);

  ItemFn fn = select_item_fn(p.dtype, p.kv_dtype, D, DV, isa);
  if (isa >= kIsaAmx)
    if (const ItemFn tiles = amx_item(p)) fn = tiles;
  const size_t ws_floats = workspace_floats(p);
  const int64_t n_items = int64_t(items.size());
  if (nt == 1 || n_items == 1) {
    std::vector<float> ws(ws_floats);
    for (int64_t i = 0; i < n_items; ++i) fn(p, items[i], ws.data(), part_acc.data(), part_ml.data());
  } else {
#pragma omp parallel num_threads(int(std::min<int64_t>(nt, n_items)))
    {
      std::vector<float> ws(ws_floats);
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < n_items; ++i) fn(p, items[i], ws.data(), part_acc.data(), part_ml.data());
    }
  }
  if (partials == 0) return;
#pragma omp parallel num_threads(nt) if (nt > 1 && B > 1)
  {
    std::vector<float> tmp(DV);
#pragma omp for schedule(dynamic, 1)
    for (int b = 0; b < B; ++b) {
      if (first_partial[b] < 0) continue;
      switch (p.dtype) {
        case kFloat32:
          merge_seq<kFloat32>(p, b, first_partial[b], num_pieces[b], part_acc.data(), part_ml.data(), tmp.data());
          break;
        case kFloat16:
          merge_seq<kFloat16>(p, b, first_partial[b], num_pieces[b], part_acc.data(), part_ml.data(), tmp.data());
          break;
        default:
          merge_seq<kBFloat16>(p, b, first_partial[b], num_pieces[b], part_acc.data(), part_ml.data(), tmp.data());
      }
    }
  }
}

#ifndef VPAGED_WITH_CUDA
// No CUDA toolkit at build time: the CUDA entry points exist but say why they cannot run.
bool kernels_built_with_cuda() { return false; }
void decode_cuda(const DecodeParams&, const CudaLaunch&) {
  throw BackendUnavailable(
      "vpaged was built without CUDA: the CUDA decode kernels are not in this build "
      "(rebuild where a CUDA toolkit with bin/nvcc and include/cuda.h is found)");
}
#endif

}  // namespace kernels
}  // namespace vpaged
