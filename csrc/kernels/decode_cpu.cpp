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
// the dev box: bf16 from DRAM 4.5 -> 6.7 GB/s per core with L2 hints).
//
// Quantized K/V (1-byte int8 / fp8 elements, fp32 q and out) take the same item loop: per chunk and kv head
// the chunk's rows are dequantized into the fp32 row buffer (scale applied), by AVX2 + F16C code in the AVX2
// build, and the next chunk's rows are prefetched a chunk ahead. At a byte per element the conversion, not
// only the memory traffic, bounds the loop, which is why it is done 16 elements per step with intrinsics.
//
// Every helper is always_inline and the per-item entry points are compiled twice, for the baseline
// x86-64 ISA and for AVX2+FMA, and picked at run time: the extension must run on any x86-64 (no -march),
// yet decode at long contexts is bound by how fast rows are consumed, so 256-bit FMAs matter.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "core/errors.h"
#include "kernels/cpu_math.h"
#include "kernels/decode.h"

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

constexpr int kChunk = 32;      // tokens per online-softmax step
constexpr int kMinSplit = 256;  // fewest tokens worth a separate item (merging costs ~ one head_dim pass)
constexpr int kAhead = 16;      // tokens of prefetch distance (4 was too close; 8..48 measured alike)

// e^x for x <= 0 in the softmax, vectorisable: 2^n by exponent bits, e^r (|r| <= ln2/2) by its Taylor
// series to r^6 (relative error < 2e-7). ln2 is split in two (Cody-Waite) so that r stays exact for large
// |x|. Below -87 the result would leave the normal floats; it is ~1e-38 there, i.e. nothing, so x is
// clamped (a plain select, which GCC if-converts; a two-sided clamp would not vectorise without -ffast-math).
VP_INLINE float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest integer
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float e = 1.0f / 720.0f;
  e = e * r + 1.0f / 120.0f;
  e = e * r + 1.0f / 24.0f;
  e = e * r + 1.0f / 6.0f;
  e = e * r + 0.5f;
  e = e * r + 1.0f;
  e = e * r + 1.0f;
  return e * bits_f(uint32_t(int32_t(n) + 127) << 23);
}

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

// Into L2 (locality hint 2 = prefetcht1): L2 tracks more outstanding misses than L1.
template <typename T>
VP_INLINE void prefetch_row(const T* row, int bytes) {
  const char* c = reinterpret_cast<const char*>(row);
  for (int b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, 2);
}

// ------------------------------------------------------------------------------------ quantized K/V
// The 1-byte formats (decode.h) are dequantized a chunk's rows of one kv head at a time into the fp32 row
// buffer, the row's scale applied there (int8: the float32 after the row; fp8: k_scale / v_scale), so the
// dot products and P.V run on fp32 rows exactly as for 16-bit types. fp8 goes through fp16 bits: an e5m2 byte
// is the high byte of an fp16; the 7 low bits of an e4m3 byte shifted up by 7 are an fp16 of 2^-8 times its
// value (normal and subnormal alike, both exponents' extra bias being 8), so e4m3 rows take scale * 2^8.
VP_INLINE float quant_value(int kt, uint32_t b) {
  if (kt == kInt8) return float(int8_t(uint8_t(b)));
  if (kt == kFloat8E5M2) return f16_to_f32(b << 8);
  return f16_to_f32(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));  // e4m3: 2^-8 of its value
}

// What every element of a row is multiplied by: the int8 row's own scale, or the per-tensor one (e4m3: * 2^8).
template <int KT>
VP_INLINE float row_factor(const uint8_t* row, int dim, float tensor_factor) {
  if constexpr (KT == kInt8) {
    float s;
    std::memcpy(&s, row + dim, 4);  // right after the row's values, not necessarily 4-byte aligned
    return s;
  } else {
    return tensor_factor;
  }
}

template <int KT>
VP_INLINE float tensor_factor(float scale) {
  return KT == kFloat8E4M3 ? scale * 256.0f : scale;
}

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

// Prefetch (into L2) the lines of [p, p + bytes).
VP_INLINE void prefetch_span(const uint8_t* p, int64_t bytes) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + uintptr_t(bytes);
  for (uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(63); a < end; a += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 2);
}

// ------------------------------------------------------------------------------------ items
struct Item {
  int b;
  int t0, t1;       // tokens [t0, t1) of sequence b
  int64_t partial;  // index of its partial result, or -1: the item covers the whole sequence
};

// Where token t's K row and V row start (elements from k / v; parameters resolved).
struct RowFinder {
  const DecodeParams& p;
  int b;
  int64_t slot_base = 0, v_slot_base = 0;
  int shift = 0;
  RowFinder(const DecodeParams& params, int seq) : p(params), b(seq) {
    if (p.paged) {
      while ((1 << shift) < p.block_size) ++shift;
    } else {
      slot_base = int64_t(p.slots[b]) * p.slot_stride;
      v_slot_base = int64_t(p.slots[b]) * p.v_slot_stride;
    }
  }
  VP_INLINE void operator()(int t, int64_t& k_off, int64_t& v_off) const {
    if (!p.paged) {
      k_off = slot_base + int64_t(t) * p.token_stride;
      v_off = v_slot_base + int64_t(t) * p.v_token_stride;
      return;
    }
    int32_t blk = p.block_tables[int64_t(b) * p.bt_stride + (t >> shift)];
    blk = blk < 0 ? 0 : (blk >= p.num_blocks ? p.num_blocks - 1 : blk);  // never read outside the pool
    const int64_t r = (int64_t(blk) << shift) + (t & (p.block_size - 1));
    k_off = r * p.token_stride;
    v_off = r * p.v_token_stride;
  }
};

// Floats of per-thread workspace an item needs.
size_t workspace_floats(const DecodeParams& p) {
  const size_t H = p.num_heads, D = p.head_dim, DV = p.v_head_dim;
  return H * D + H * DV + size_t(kChunk) * std::max<size_t>(std::max<size_t>(D, DV), 64) + H * kChunk + 2 * H;
}

// Write an item's result: the normalised output when it covers its whole sequence, else its partial state.
template <int DT>
VP_INLINE void finish_item(const DecodeParams& p, const Item& it, const float* acc, const float* m, const float* l,
                           float* part_acc, float* part_ml) {
  using T = typename Elem<DT>::T;
  const int H = p.num_heads, D = p.v_head_dim;
  if (it.partial < 0) {
    T* out = static_cast<T*>(p.out) + int64_t(it.b) * H * D;
    for (int h = 0; h < H; ++h) {
      const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;  // an empty sequence attends to nothing: zeros
      for (int d = 0; d < D; ++d) out[h * D + d] = Elem<DT>::store(acc[h * D + d] * inv);
    }
  } else {
    std::memcpy(part_acc + it.partial * H * D, acc, sizeof(float) * H * D);
    for (int h = 0; h < H; ++h) {
      part_ml[(it.partial * H + h) * 2] = m[h];
      part_ml[(it.partial * H + h) * 2 + 1] = l[h];
    }
  }
}

// Prefetch token rows at k_off / v_off: all heads when they are dense (head stride == footprint), else each
// head's footprint.
VP_INLINE void prefetch_token(const uint8_t* K, const uint8_t* V, int64_t k_off, int64_t v_off, int HKV, int64_t HS,
                              int64_t VHS, int k_foot, int v_foot) {
  if (HS == k_foot) {
    prefetch_span(K + k_off, HKV * HS);
  } else {
    for (int kh = 0; kh < HKV; ++kh) prefetch_span(K + k_off + kh * HS, k_foot);
  }
  if (VHS == v_foot) {
    prefetch_span(V + v_off, HKV * VHS);
  } else {
    for (int kh = 0; kh < HKV; ++kh) prefetch_span(V + v_off + kh * VHS, v_foot);
  }
}

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
  // Prefetch a token's whole row when its heads are dense, else the first head's slice.
  const int row_bytes = (HS == D ? HKV : 1) * D * int(sizeof(T));
  const int v_row_bytes = (VHS == DV ? HKV : 1) * DV * int(sizeof(T));
  int64_t off[kChunk], voff[kChunk];
  const float* vr[kChunk];
  // Quantized: bytes of a head's row (int8: with its scale) and the per-tensor factors (fp8).
  const int k_foot = D + (KT == kInt8 ? 4 : 0), v_foot = DV + (KT == kInt8 ? 4 : 0);
  const float ktf = tensor_factor<KT>(p.k_scale), vtf = tensor_factor<KT>(p.v_scale);
  if constexpr (kQuant) {
    // The first chunk's rows, asked for together (later chunks are prefetched a chunk ahead, below).
    for (int t = it.t0; t < std::min(it.t1, it.t0 + kChunk); ++t) {
      int64_t ko, vo;
      row(t, ko, vo);
      prefetch_token(K, V, ko, vo, HKV, HS, VHS, k_foot, v_foot);
    }
  }

  for (int c0 = it.t0; c0 < it.t1; c0 += kChunk) {
    const int n = std::min(kChunk, it.t1 - c0);
    for (int i = 0; i < n; ++i) row(c0 + i, off[i], voff[i]);
    if constexpr (kQuant) {
      // Scores: the next chunk's rows are prefetched (a whole chunk's time before they are read), then per kv
      // head the chunk's K rows are dequantized into the row buffer and dotted two at a time.
      for (int t = c0 + kChunk; t < std::min(it.t1, c0 + 2 * kChunk); ++t) {
        int64_t ko, vo;
        row(t, ko, vo);
        prefetch_token(K, V, ko, vo, HKV, HS, VHS, k_foot, v_foot);
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
      // spare score lands in an unused column). Meanwhile K rows kAhead tokens on and this chunk's V rows,
      // which P·V reads next, are prefetched.
      for (int i = 0; i < n; i += 2) {
        const int i1 = i + 1 < n ? i + 1 : i;
        for (int j = i; j <= i1; ++j) {
          if (c0 + j + kAhead < it.t1) {
            int64_t ka, va;
            row(c0 + j + kAhead, ka, va);
            prefetch_row(K + ka, row_bytes);
            prefetch_row(V + va, v_row_bytes);
          }
        }
        for (int kh = 0; kh < HKV; ++kh) {
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

// ------------------------------------------------------------------------------------ AVX-512 path
// Written with intrinsics because the generic loops above leave two costs GCC does not remove:
//   * every score ends in a horizontal sum of a vector (at head_dim 128 as many shuffle/add steps as
//     FMAs); here each (head, token) keeps a 16-lane partial sum and 16 tokens' partials are reduced
//     together by a transpose tree (~3 operations per score instead of ~8);
//   * 16-bit K/V rows were widened into a buffer and read back; here they are widened in registers as
//     they are loaded (bf16: zero-extend and shift; fp16: vcvtph2ps).
// Per chunk and kv head: scores 2 tokens x up to 4 heads of the GQA group at a time (8 independent FMA
// chains, each K vector feeds 4 FMAs); P.V keeps a 4-head x 64-dim tile of accumulators (16 registers)
// across the chunk's tokens. head_dim must be a multiple of 16 and v_head_dim of 64 (compiled: 64/64,
// 128/128, 256/256 and 192/128).
// bf16 takes fewer instructions per element, which matters because at half the bytes per token the
// widening and FMAs no longer hide behind the memory traffic: V rows are widened 32 elements per load by
// a shift and a mask (even and odd dims of each 32-bit lane, no shuffle), the P.V accumulators hold dims
// in that even/odd order and are put back in order once per item; where the CPU has AVX512_BF16, scores
// are vdpbf16ps of the raw bf16 query and K rows (two products per lane and instruction, no widening;
// products of bf16 values are exact in fp32), scaled after the reduction.
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _mm512_undefined_* helpers.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define VP_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define VP_AVX512 VP_AVX512_TARGET VP_INLINE
#define VP_AVX512BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512bf16")))

template <int DT>
VP_AVX512 __m512 load16(const typename Elem<DT>::T* src) {
  if constexpr (DT == kFloat32) {
    return _mm512_loadu_ps(src);
  } else if constexpr (DT == kBFloat16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  }
}

// Lane j of the result = the sum of the 16 floats of row j (rows 16 floats apart).
VP_AVX512 __m512 reduce_rows16(const float* rows) {
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

// fast_exp of 16 lanes (same polynomial; 2^n applied by vscalefps).
VP_AVX512 __m512 exp16(__m512 x) {
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

// Partial score vectors of GB query heads (q rows D apart) against the n K rows at off[] + hoff, into
// red[g][i][16]. ahead / v_ahead (or null): K / V rows a chunk on, whose head slices (D / DV wide) are
// prefetched.
template <int DT, int D, int DV, int GB>
VP_AVX512 void scores_tile(const float* __restrict q, const typename Elem<DT>::T* K, const typename Elem<DT>::T* V,
                           const int64_t* off, const int64_t* ahead, const int64_t* v_ahead, int64_t hoff,
                           int64_t v_hoff, int n, float* __restrict red) {
  using T = typename Elem<DT>::T;
  static_assert(D % 16 == 0, "scores take 16 dims at a time");
  for (int i = 0; i < n; i += 2) {
    const int i1 = i + 1 < n ? i + 1 : i;  // an odd last token pairs with itself
    if (ahead) {
      for (int j = i; j <= i1; ++j) {
        if (ahead[j] >= 0) {
          prefetch_row(K + ahead[j] + hoff, D * int(sizeof(T)));
          prefetch_row(V + v_ahead[j] + v_hoff, DV * int(sizeof(T)));
        }
      }
    }
    const T* k0 = K + off[i] + hoff;
    const T* k1 = K + off[i1] + hoff;
    __m512 a[GB], b[GB];
    for (int g = 0; g < GB; ++g) a[g] = b[g] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int c = 0; c < D; c += 16) {
      const __m512 x = load16<DT>(k0 + c), y = load16<DT>(k1 + c);
      for (int g = 0; g < GB; ++g) {
        const __m512 qv = _mm512_loadu_ps(q + g * D + c);
        a[g] = _mm512_fmadd_ps(qv, x, a[g]);
        b[g] = _mm512_fmadd_ps(qv, y, b[g]);
      }
    }
    for (int g = 0; g < GB; ++g) {
      _mm512_storeu_ps(red + (g * kChunk + i) * 16, a[g]);
      _mm512_storeu_ps(red + (g * kChunk + i1) * 16, b[g]);
    }
  }
}

// scores_tile for bf16 by vdpbf16ps: q is the raw (unscaled) bf16 query of the GB heads, rows D apart;
// lane j of a partial vector sums the products of dims 2j and 2j+1. Not inlined: it needs AVX512_BF16,
// which the item function that calls it (shared with CPUs without it) is not compiled for.
template <int D, int DV, int GB>
__attribute__((noinline)) VP_AVX512BF16_TARGET void scores_tile_bf16dp(const uint16_t* __restrict q, const uint16_t* K,
                                                                       const uint16_t* V, const int64_t* off,
                                                                       const int64_t* ahead, const int64_t* v_ahead,
                                                                       int64_t hoff, int64_t v_hoff, int n,
                                                                       float* __restrict red) {
  static_assert(D % 32 == 0, "bf16 dot products take 32 dims at a time");
  for (int i = 0; i < n; i += 2) {
    const int i1 = i + 1 < n ? i + 1 : i;
    if (ahead) {
      for (int j = i; j <= i1; ++j) {
        if (ahead[j] >= 0) {
          prefetch_row(K + ahead[j] + hoff, D * 2);
          prefetch_row(V + v_ahead[j] + v_hoff, DV * 2);
        }
      }
    }
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

// acc[g] (rows D apart) += sum_i ps[g][i] * V row i, for GB heads, 64 dims at a time held in registers.
// bf16: each 32 dims of acc hold the 16 even dims, then the 16 odd ones (unpermute_pairs puts them back).
template <int DT, int D, int GB>
VP_AVX512 void pv_tile(float* __restrict acc, const typename Elem<DT>::T* V, const int64_t* off, int64_t hoff, int n,
                       const float* __restrict ps) {
  static_assert(D % 64 == 0, "P.V tiles are 64 dims wide");
  for (int d0 = 0; d0 < D; d0 += 64) {
    __m512 a[GB][4];
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < 4; ++j) a[g][j] = _mm512_loadu_ps(acc + g * D + d0 + 16 * j);
    for (int i = 0; i < n; ++i) {
      const typename Elem<DT>::T* vr = V + off[i] + hoff + d0;
      __m512 v0, v1, v2, v3;
      if constexpr (DT == kBFloat16) {
        // Each 32-bit lane holds dims 2j (low half) and 2j+1 (high half): shifted up and masked, each is fp32.
        const __m512i x = _mm512_loadu_si512(vr), y = _mm512_loadu_si512(vr + 32);
        const __m512i high = _mm512_set1_epi32(int(0xffff0000u));
        v0 = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        v1 = _mm512_castsi512_ps(_mm512_and_si512(x, high));
        v2 = _mm512_castsi512_ps(_mm512_slli_epi32(y, 16));
        v3 = _mm512_castsi512_ps(_mm512_and_si512(y, high));
      } else {
        v0 = load16<DT>(vr), v1 = load16<DT>(vr + 16), v2 = load16<DT>(vr + 32), v3 = load16<DT>(vr + 48);
      }
      for (int g = 0; g < GB; ++g) {
        const __m512 pg = _mm512_set1_ps(ps[g * kChunk + i]);
        a[g][0] = _mm512_fmadd_ps(pg, v0, a[g][0]);
        a[g][1] = _mm512_fmadd_ps(pg, v1, a[g][1]);
        a[g][2] = _mm512_fmadd_ps(pg, v2, a[g][2]);
        a[g][3] = _mm512_fmadd_ps(pg, v3, a[g][3]);
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + g * D + d0 + 16 * j, a[g][j]);
  }
}

// A row of D floats whose every 32 hold 16 even dims then 16 odd ones, back in dim order.
VP_AVX512 void unpermute_pairs(float* row, int D) {
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int d = 0; d < D; d += 32) {
    const __m512 e = _mm512_loadu_ps(row + d), o = _mm512_loadu_ps(row + d + 16);
    _mm512_storeu_ps(row + d, _mm512_permutex2var_ps(e, lo, o));
    _mm512_storeu_ps(row + d + 16, _mm512_permutex2var_ps(e, hi, o));
  }
}

// DP: bf16 scores by vdpbf16ps (scores_tile_bf16dp; only with DT == kBFloat16, on CPUs with AVX512_BF16).
template <int DT, int D, int DV, bool DP = false>
VP_AVX512_TARGET void run_item_avx512(const DecodeParams& p, const Item& it, float* ws, float* part_acc,
                                      float* part_ml) {
  static_assert(!DP || DT == kBFloat16, "dot products of bf16 pairs need bf16 data");
  using T = typename Elem<DT>::T;
  constexpr int DR = D > DV ? D : DV;
  const int H = p.num_heads, HKV = p.num_kv_heads, G = H / HKV;
  float* __restrict qf = ws;                 // [H][D] query, pre-scaled
  float* __restrict acc = qf + H * D;        // [H][DV] unnormalised output
  float* __restrict red = acc + H * DV;      // [4][kChunk][16] partial score vectors (kChunk * DR >= 2048)
  float* __restrict sc = red + kChunk * DR;  // [H][kChunk] scores, then probabilities
  float* __restrict m = sc + H * kChunk;     // [H] running max
  float* __restrict l = m + H;               // [H] running sum of exp(score - max)

  const T* q = static_cast<const T*>(p.q) + int64_t(it.b) * H * D;
  for (int i = 0; i < H * D; ++i) qf[i] = Elem<DT>::load(q[i]) * p.scale;
  std::fill(acc, acc + H * DV, 0.0f);
  std::fill(red, red + 4 * kChunk * 16, 0.0f);  // rows past a short chunk's end are summed, never used
  std::fill(m, m + H, -std::numeric_limits<float>::infinity());
  std::fill(l, l + H, 0.0f);

  const T* K = static_cast<const T*>(p.k);
  const T* V = static_cast<const T*>(p.v);
  const RowFinder row(p, it.b);
  const int64_t HS = p.head_stride, VHS = p.v_head_stride;
  int64_t off[kChunk], voff[kChunk], ahead[kChunk], v_ahead[kChunk];

  // Each head's slices are prefetched one chunk ahead, in the pass over that head: a whole chunk's time
  // before they are read (half a chunk measured 5-10 % slower for bf16, a chunk and two alike). The first
  // chunk of an item has no chunk before it: its rows are all asked for here, so that they arrive in
  // parallel instead of as one demand miss after another.
  for (int t = it.t0; t < std::min(it.t1, it.t0 + kChunk); ++t) {
    int64_t ko, vo;
    row(t, ko, vo);
    for (int kh = 0; kh < HKV; ++kh) {
      prefetch_row(K + ko + kh * HS, D * int(sizeof(T)));
      prefetch_row(V + vo + kh * VHS, DV * int(sizeof(T)));
    }
  }

  for (int c0 = it.t0; c0 < it.t1; c0 += kChunk) {
    const int n = std::min(kChunk, it.t1 - c0);
    for (int i = 0; i < n; ++i) {
      row(c0 + i, off[i], voff[i]);
      if (c0 + i + kChunk < it.t1) {
        row(c0 + i + kChunk, ahead[i], v_ahead[i]);
      } else {
        ahead[i] = v_ahead[i] = -1;
      }
    }
    for (int kh = 0; kh < HKV; ++kh) {
      for (int g0 = 0; g0 < G; g0 += 4) {
        const int gb = std::min(4, G - g0);
        const float* qg = qf + (kh * G + g0) * D;
        const int64_t* pf = g0 == 0 ? ahead : nullptr;
        if constexpr (DP) {
          const uint16_t* qr = q + (kh * G + g0) * D;
          switch (gb) {
            case 4:
              scores_tile_bf16dp<D, DV, 4>(qr, K, V, off, pf, v_ahead, kh * HS, kh * VHS, n, red);
              break;
            case 3:
              scores_tile_bf16dp<D, DV, 3>(qr, K, V, off, pf, v_ahead, kh * HS, kh * VHS, n, red);
              break;
            case 2:
              scores_tile_bf16dp<D, DV, 2>(qr, K, V, off, pf, v_ahead, kh * HS, kh * VHS, n, red);
              break;
            default:
              scores_tile_bf16dp<D, DV, 1>(qr, K, V, off, pf, v_ahead, kh * HS, kh * VHS, n, red);
          }
          const __m512 vscale = _mm512_set1_ps(p.scale);  // the raw query's scores, scaled here
          for (int g = 0; g < gb; ++g)
            for (int i = 0; i < n; i += 16)
              _mm512_storeu_ps(sc + (kh * G + g0 + g) * kChunk + i,
                               _mm512_mul_ps(reduce_rows16(red + (g * kChunk + i) * 16), vscale));
          continue;
        }
        switch (gb) {
          case 4:
            scores_tile<DT, D, DV, 4>(qg, K, V, off, pf, v_ahead, kh * HS, kh * VHS, n, red);
            break;
          case 3:
            scores_tile<DT, D, DV, 3>(qg, K, V, off, pf, v_ahead, kh * HS, kh * VHS, n, red);
            break;
          case 2:
            scores_tile<DT, D, DV, 2>(qg, K, V, off, pf, v_ahead, kh * HS, kh * VHS, n, red);
            break;
          default:
            scores_tile<DT, D, DV, 1>(qg, K, V, off, pf, v_ahead, kh * HS, kh * VHS, n, red);
        }
        for (int g = 0; g < gb; ++g)
          for (int i = 0; i < n; i += 16)
            _mm512_storeu_ps(sc + (kh * G + g0 + g) * kChunk + i, reduce_rows16(red + (g * kChunk + i) * 16));
      }
    }

    // Online softmax, once per chunk and head.
    const __mmask16 m0 = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
    const __mmask16 m1 = n >= 32 ? __mmask16(0xffff) : n > 16 ? __mmask16((1u << (n - 16)) - 1) : __mmask16(0);
    for (int h = 0; h < H; ++h) {
      float* s = sc + h * kChunk;
      const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
      const float mx = std::max(_mm512_mask_reduce_max_ps(m0, s0),
                                m1 ? _mm512_mask_reduce_max_ps(m1, s1) : -std::numeric_limits<float>::infinity());
      const float mn = mx > m[h] ? mx : m[h];
      const float alpha = m[h] == -std::numeric_limits<float>::infinity() ? 0.0f : fast_exp(m[h] - mn);
      const __m512 vmn = _mm512_set1_ps(mn);
      const __m512 e0 = _mm512_maskz_mov_ps(m0, exp16(_mm512_sub_ps(s0, vmn)));
      const __m512 e1 = _mm512_maskz_mov_ps(m1, exp16(_mm512_sub_ps(s1, vmn)));
      _mm512_storeu_ps(s, e0);
      _mm512_storeu_ps(s + 16, e1);
      l[h] = l[h] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
      m[h] = mn;
      if (alpha != 1.0f) {
        const __m512 va = _mm512_set1_ps(alpha);
        float* a = acc + h * DV;
        for (int d = 0; d < DV; d += 16) _mm512_storeu_ps(a + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), va));
      }
    }

    for (int kh = 0; kh < HKV; ++kh) {
      for (int g0 = 0; g0 < G; g0 += 4) {
        float* a = acc + (kh * G + g0) * DV;
        const float* ps = sc + (kh * G + g0) * kChunk;
        switch (std::min(4, G - g0)) {
          case 4:
            pv_tile<DT, DV, 4>(a, V, voff, kh * VHS, n, ps);
            break;
          case 3:
            pv_tile<DT, DV, 3>(a, V, voff, kh * VHS, n, ps);
            break;
          case 2:
            pv_tile<DT, DV, 2>(a, V, voff, kh * VHS, n, ps);
            break;
          default:
            pv_tile<DT, DV, 1>(a, V, voff, kh * VHS, n, ps);
        }
      }
    }
  }
  if constexpr (DT == kBFloat16)
    for (int h = 0; h < H; ++h) unpermute_pairs(acc + h * DV, DV);
  finish_item<DT>(p, it, acc, m, l, part_acc, part_ml);
}
#pragma GCC diagnostic pop

// ------------------------------------------------------------------------------------ AVX2 tile path
// For 16-bit and 1-byte K/V (fp32 q/out for the 1-byte formats). The generic loop widens or dequantizes rows
// into a buffer and reads them back, and ends every score in a horizontal sum; below 4 bytes per element that
// work, not the memory traffic, bounded it (int8 / fp8 ran 0.85-0.95x the time of bf16 on the 2-core AMD EPYC
// dev box, bf16 1.07x vLLM's CPU kernel). Here, as in the AVX-512 path: K and V elements are widened or
// dequantized in registers as they are loaded (8 per load), each (head, token) score keeps an 8-lane partial sum and 8
// tokens' partials are reduced together (9 operations per 8 scores), and the per-row work moves out of the
// element loops: the fp8 k_scale is folded into q and v_scale into the output, an int8 row's scale multiplies
// its token's score (K) or probability (V). Whole token rows (all kv heads) are prefetched kAhead tokens
// ahead during the first kv head's scores pass, as in the generic loop: prefetching each head's rows a chunk
// ahead, in that head's pass, left the 1-byte formats at 0.85-0.95x of bf16 from memory (0.6x in cache),
// whole rows brought them to ~0.6x. Compiled for head dims 64/64, 128/128, 256/256 and 192/128; fp32 K/V
// keep the generic loop (select_dim).

// Stored element type of K/V format KT in the tile loop: uint16_t for the 16-bit types, a byte for the 1-byte
// formats.
template <int KT>
using Stored = std::conditional_t<is_quantized(KT), uint8_t, uint16_t>;

// 8 elements at src as floats: bf16 widened by a shift, fp16 by vcvtph2ps, 1-byte formats dequantized (int8:
// the integer; e4m3: 2^-8 of its value; e5m2: its value).
template <int KT>
VP_AVX2 __m256 load8k(const Stored<KT>* src) {
  static_assert(KT != kFloat32, "fp32 K/V take the generic loop");
  if constexpr (KT == kBFloat16) {
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

// Lane j of the result = the sum of the 8 floats of row j (rows 8 floats apart).
VP_AVX2 __m256 reduce_rows8(const float* r) {
  const __m256 h01 = _mm256_hadd_ps(_mm256_loadu_ps(r), _mm256_loadu_ps(r + 8));
  const __m256 h23 = _mm256_hadd_ps(_mm256_loadu_ps(r + 16), _mm256_loadu_ps(r + 24));
  const __m256 h45 = _mm256_hadd_ps(_mm256_loadu_ps(r + 32), _mm256_loadu_ps(r + 40));
  const __m256 h67 = _mm256_hadd_ps(_mm256_loadu_ps(r + 48), _mm256_loadu_ps(r + 56));
  const __m256 a = _mm256_hadd_ps(h01, h23);  // per 128-bit half: rows 0..3, that half's dims
  const __m256 b = _mm256_hadd_ps(h45, h67);  // rows 4..7
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Partial score vectors of GB query heads (q rows D apart) against the n K rows at off[] + hoff, into
// red[g][i][8]; two tokens at a time (8 independent FMA chains, each K vector feeds GB FMAs).
// Whole token rows (K and V, all kv heads) to prefetch while a scores tile passes their tokens kAhead earlier.
struct RowAhead {
  const uint8_t *K, *V;
  const int64_t *k_off, *v_off;  // per token of the chunk: the rows kAhead tokens on, or -1
  int HKV;
  int64_t HS, VHS;
  int k_foot, v_foot;
};

template <int KT, int D, int GB>
VP_AVX2 void scores_tile8(const float* __restrict q, const Stored<KT>* K, const int64_t* off, int64_t hoff, int n,
                          float* __restrict red, const RowAhead* ahead) {
  static_assert(D % 8 == 0, "scores take 8 dims at a time");
  for (int i = 0; i < n; i += 2) {
    const int i1 = i + 1 < n ? i + 1 : i;  // an odd last token pairs with itself
    if (ahead) {
      for (int j = i; j <= i1; ++j)
        if (ahead->k_off[j] >= 0)
          prefetch_token(ahead->K, ahead->V, ahead->k_off[j], ahead->v_off[j], ahead->HKV, ahead->HS, ahead->VHS,
                         ahead->k_foot, ahead->v_foot);
    }
    const Stored<KT>* k0 = K + off[i] + hoff;
    const Stored<KT>* k1 = K + off[i1] + hoff;
    __m256 a[GB], b[GB];
    for (int g = 0; g < GB; ++g) a[g] = b[g] = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < D; c += 8) {
      const __m256 x = load8k<KT>(k0 + c), y = load8k<KT>(k1 + c);
      for (int g = 0; g < GB; ++g) {
        const __m256 qv = _mm256_loadu_ps(q + g * D + c);
        a[g] = _mm256_fmadd_ps(qv, x, a[g]);
        b[g] = _mm256_fmadd_ps(qv, y, b[g]);
      }
    }
    for (int g = 0; g < GB; ++g) {
      _mm256_storeu_ps(red + (g * kChunk + i) * 8, a[g]);
      _mm256_storeu_ps(red + (g * kChunk + i1) * 8, b[g]);
    }
  }
}

// acc[g] (rows DV apart) += sum_i ps[g][i] * V row i, for GB heads, 16 dims at a time held in registers.
template <int KT, int DV, int GB>
VP_AVX2 void pv_tile8(float* __restrict acc, const Stored<KT>* V, const int64_t* off, int64_t hoff, int n,
                      const float* __restrict ps) {
  static_assert(DV % 16 == 0, "P.V tiles are 16 dims wide");
  for (int d0 = 0; d0 < DV; d0 += 16) {
    __m256 a[GB][2];
    for (int g = 0; g < GB; ++g) {
      a[g][0] = _mm256_loadu_ps(acc + g * DV + d0);
      a[g][1] = _mm256_loadu_ps(acc + g * DV + d0 + 8);
    }
    for (int i = 0; i < n; ++i) {
      const Stored<KT>* vr = V + off[i] + hoff + d0;
      const __m256 v0 = load8k<KT>(vr), v1 = load8k<KT>(vr + 8);
      for (int g = 0; g < GB; ++g) {
        const __m256 pg = _mm256_broadcast_ss(ps + g * kChunk + i);
        a[g][0] = _mm256_fmadd_ps(pg, v0, a[g][0]);
        a[g][1] = _mm256_fmadd_ps(pg, v1, a[g][1]);
      }
    }
    for (int g = 0; g < GB; ++g) {
      _mm256_storeu_ps(acc + g * DV + d0, a[g][0]);
      _mm256_storeu_ps(acc + g * DV + d0 + 8, a[g][1]);
    }
  }
}

template <int DT, int KT, int D, int DV>
VP_AVX2_TARGET void run_item_tiles_avx2(const DecodeParams& p, const Item& it, float* ws, float* part_acc,
                                        float* part_ml) {
  using ET = Stored<KT>;
  constexpr int kBytes = int(sizeof(ET));
  constexpr bool kRowScale = KT == kInt8;
  constexpr bool kTensorScale = KT == kFloat8E4M3 || KT == kFloat8E5M2;
  constexpr int kFoot = D + (kRowScale ? 4 : 0), kVFoot = DV + (kRowScale ? 4 : 0);  // elements of a head row
  const int H = p.num_heads, HKV = p.num_kv_heads, G = H / HKV;
  constexpr int DR = D > DV ? D : DV;
  float* __restrict qf = ws;                 // [H][D] query, pre-scaled (fp8: by k_scale too)
  float* __restrict acc = qf + H * D;        // [H][DV] unnormalised output
  float* __restrict red = acc + H * DV;      // [4][kChunk][8] partial score vectors (kChunk * DR >= 1024)
  float* __restrict sc = red + kChunk * DR;  // [H][kChunk] scores, then probabilities
  float* __restrict m = sc + H * kChunk;     // [H] running max
  float* __restrict l = m + H;               // [H] running sum of exp(score - max)
  alignas(32) float rs[kChunk];              // int8: the chunk's row scales of one kv head (0 past n)
  alignas(32) float pr[4 * kChunk];          // int8: probabilities times their V row's scale

  const typename Elem<DT>::T* q = static_cast<const typename Elem<DT>::T*>(p.q) + int64_t(it.b) * H * D;
  const float qs = p.scale * (kTensorScale ? tensor_factor<KT>(p.k_scale) : 1.0f);
  for (int i = 0; i < H * D; ++i) qf[i] = Elem<DT>::load(q[i]) * qs;
  std::fill(acc, acc + H * DV, 0.0f);
  std::fill(red, red + 4 * kChunk * 8, 0.0f);  // rows past a short chunk's end are summed, never used
  std::fill(m, m + H, -std::numeric_limits<float>::infinity());
  std::fill(l, l + H, 0.0f);
  std::fill(rs, rs + kChunk, 0.0f);

  const ET* K = static_cast<const ET*>(p.k);
  const ET* V = static_cast<const ET*>(p.v);
  const uint8_t* KB = reinterpret_cast<const uint8_t*>(K);  // for prefetches, which count bytes
  const uint8_t* VB = reinterpret_cast<const uint8_t*>(V);
  const RowFinder row(p, it.b);
  const int64_t HS = p.head_stride, VHS = p.v_head_stride;
  const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  // Rows of this chunk (off, voff) and of the next one (noff, nvoff, nn of them): each kv head's rows of the
  // next chunk are prefetched in this chunk's pass over that head, so that the prefetches are spread over the
  // chunk instead of asked for all at once. The first chunk's rows are asked for here.
  int64_t off[kChunk], voff[kChunk], aoff[kChunk], avoff[kChunk];
  for (int t = it.t0; t < std::min(it.t1, it.t0 + kAhead); ++t) {
    int64_t ko, vo;
    row(t, ko, vo);
    prefetch_token(KB, VB, ko * kBytes, vo * kBytes, HKV, HS * kBytes, VHS * kBytes, kFoot * kBytes, kVFoot * kBytes);
  }
  const RowAhead ahead{KB, VB, aoff, avoff, HKV, HS * kBytes, VHS * kBytes, kFoot * kBytes, kVFoot * kBytes};

  for (int c0 = it.t0; c0 < it.t1; c0 += kChunk) {
    const int n = std::min(kChunk, it.t1 - c0);
    for (int i = 0; i < n; ++i) {
      row(c0 + i, off[i], voff[i]);
      if (c0 + i + kAhead < it.t1) {
        row(c0 + i + kAhead, aoff[i], avoff[i]);
        aoff[i] *= kBytes;
        avoff[i] *= kBytes;
      } else {
        aoff[i] = avoff[i] = -1;
      }
    }

    for (int kh = 0; kh < HKV; ++kh) {
      const RowAhead* pf = kh == 0 ? &ahead : nullptr;  // whole rows, in the first kv head's pass
      if constexpr (kRowScale)
        for (int i = 0; i < n; ++i) rs[i] = row_factor<KT>(KB + off[i] + kh * HS, D, 1.0f);
      for (int g0 = 0; g0 < G; g0 += 4, pf = nullptr) {
        const int gb = std::min(4, G - g0);
        const float* qg = qf + (kh * G + g0) * D;
        switch (gb) {
          case 4:
            scores_tile8<KT, D, 4>(qg, K, off, kh * HS, n, red, pf);
            break;
          case 3:
            scores_tile8<KT, D, 3>(qg, K, off, kh * HS, n, red, pf);
            break;
          case 2:
            scores_tile8<KT, D, 2>(qg, K, off, kh * HS, n, red, pf);
            break;
          default:
            scores_tile8<KT, D, 1>(qg, K, off, kh * HS, n, red, pf);
        }
        for (int g = 0; g < gb; ++g) {
          for (int i = 0; i < n; i += 8) {
            __m256 s8 = reduce_rows8(red + (g * kChunk + i) * 8);
            if constexpr (kRowScale) s8 = _mm256_mul_ps(s8, _mm256_load_ps(rs + i));
            _mm256_storeu_ps(sc + (kh * G + g0 + g) * kChunk + i, s8);
          }
        }
      }
    }

    // Online softmax, once per chunk and head, 8 tokens per vector; lanes past n are masked (bitwise: what
    // they held, even inf or NaN, becomes 0).
    __m256 valid[kChunk / 8];
    for (int j = 0; j < kChunk / 8; ++j)
      valid[j] = _mm256_cmp_ps(_mm256_add_ps(_mm256_set1_ps(float(8 * j)), iota), _mm256_set1_ps(float(n)), _CMP_LT_OQ);
    for (int h = 0; h < H; ++h) {
      float* s = sc + h * kChunk;
      __m256 v[kChunk / 8];
      __m256 vmx = ninf;
      for (int j = 0; j < kChunk / 8; ++j) {
        v[j] = _mm256_loadu_ps(s + 8 * j);
        vmx = _mm256_max_ps(vmx, _mm256_blendv_ps(ninf, v[j], valid[j]));
      }
      const float mx = hmax8(vmx);
      const float mn = mx > m[h] ? mx : m[h];
      const float alpha = m[h] == -std::numeric_limits<float>::infinity() ? 0.0f : fast_exp(m[h] - mn);
      const __m256 vmn = _mm256_set1_ps(mn);
      __m256 vsum = _mm256_setzero_ps();
      for (int j = 0; j < kChunk / 8; ++j) {
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(v[j], vmn)), valid[j]);
        _mm256_storeu_ps(s + 8 * j, e);
        vsum = _mm256_add_ps(vsum, e);
      }
      l[h] = l[h] * alpha + hsum8(vsum);
      m[h] = mn;
      if (alpha != 1.0f) {
        float* a = acc + h * DV;
        const __m256 va = _mm256_set1_ps(alpha);
        for (int d = 0; d < DV; d += 8) _mm256_storeu_ps(a + d, _mm256_mul_ps(_mm256_loadu_ps(a + d), va));
      }
    }

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
        switch (gb) {
          case 4:
            pv_tile8<KT, DV, 4>(a, V, voff, kh * VHS, n, ps);
            break;
          case 3:
            pv_tile8<KT, DV, 3>(a, V, voff, kh * VHS, n, ps);
            break;
          case 2:
            pv_tile8<KT, DV, 2>(a, V, voff, kh * VHS, n, ps);
            break;
          default:
            pv_tile8<KT, DV, 1>(a, V, voff, kh * VHS, n, ps);
        }
      }
    }
  }
  if constexpr (kTensorScale) {
    const float vf = tensor_factor<KT>(p.v_scale);  // fp8: v_scale (e4m3: times 2^8) on the whole output
    for (int i = 0; i < H * DV; ++i) acc[i] *= vf;
  }
  finish_item<DT>(p, it, acc, m, l, part_acc, part_ml);
}

using ItemFn = void (*)(const DecodeParams&, const Item&, float*, float*, float*);

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

// The AVX-512 item function of a compiled head dim pair; bf16 with dot products of bf16 pairs when asked.
template <int DT, int D, int DV>
ItemFn avx512_item(bool bf16_dot) {
  if constexpr (DT == kBFloat16) {
    if (bf16_dot) return run_item_avx512<DT, D, DV, true>;
  }
  return run_item_avx512<DT, D, DV, false>;
}

template <int DT>
ItemFn select_dim(int D, int DV, int isa) {
  const bool avx2 = isa >= kIsaAvx2;
  if (isa >= kIsaAvx512) {
    const bool dot = isa >= kIsaAvx512Bf16;
    if (D == DV) {
      switch (D) {
        case 64:
          return avx512_item<DT, 64, 64>(dot);
        case 128:
          return avx512_item<DT, 128, 128>(dot);
        case 256:
          return avx512_item<DT, 256, 256>(dot);
        default:
          break;  // other head dims: the AVX2 build
      }
    } else if (D == 192 && DV == 128) {
      return avx512_item<DT, 192, 128>(dot);  // K with a rotary part next to a 128-wide V (e.g. DeepSeek MLA)
    }
  }
  // 16-bit K/V on AVX2: the tile path (widened in registers; 0.5-0.85x the generic loop's time on the EPYC dev
  // box). fp32 keeps the generic loop, which reads its rows as they are and measured 1.0-1.17x faster there.
  if constexpr (DT != kFloat32) {
    if (avx2 && cpu_has_f16c()) {
      if (D == DV) {
        switch (D) {
          case 64:
            return run_item_tiles_avx2<DT, DT, 64, 64>;
          case 128:
            return run_item_tiles_avx2<DT, DT, 128, 128>;
          case 256:
            return run_item_tiles_avx2<DT, DT, 256, 256>;
          default:
            break;
        }
      } else if (D == 192 && DV == 128) {
        return run_item_tiles_avx2<DT, DT, 192, 128>;
      }
    }
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

// Quantized K/V (fp32 q/out): the AVX2 build (AVX2 + F16C dequantization) on every path from AVX2 up, AVX-512
// included (no AVX-512 build of the 1-byte formats: dequantization by AVX2 is not their bound), else portable.
template <int KT>
ItemFn select_quant(int D, int DV, int isa) {
  const bool v3 = isa >= kIsaAvx2 && cpu_has_f16c();  // every AVX2 CPU has F16C; checked all the same
  if (v3) {
    if (D == DV) {
      switch (D) {
        case 64:
          return run_item_tiles_avx2<kFloat32, KT, 64, 64>;
        case 128:
          return run_item_tiles_avx2<kFloat32, KT, 128, 128>;
        case 256:
          return run_item_tiles_avx2<kFloat32, KT, 256, 256>;
        default:
          break;  // other head dims: the generic loop of the AVX2 build
      }
    } else if (D == 192 && DV == 128) {
      return run_item_tiles_avx2<kFloat32, KT, 192, 128>;
    }
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
  return cpu_has_avx512_bf16() ? kIsaAvx512Bf16
         : cpu_has_avx512()    ? kIsaAvx512
         : cpu_has_avx2()      ? kIsaAvx2
                               : kIsaBaseline;
}

int resolve_cpu_isa(const char* op, int isa) {
  if (isa == kIsaAuto) return cpu_best_isa();
  if (isa < kIsaBaseline || isa > kIsaAvx512Bf16)
    throw InvalidArgument(std::string(op) + ": unknown CPU code path " + std::to_string(isa));
  if (isa > cpu_best_isa())
    throw InvalidArgument(std::string(op) + ": this CPU cannot run the requested code path (" +
                          std::string(isa == kIsaAvx512Bf16 ? "AVX512_BF16"
                                      : isa == kIsaAvx512   ? "AVX-512"
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

  const ItemFn fn = select_item_fn(p.dtype, p.kv_dtype, D, DV, isa);
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
