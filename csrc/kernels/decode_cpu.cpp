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
// Every helper is always_inline and the per-item entry points are compiled twice, for the baseline
// x86-64 ISA and for AVX2+FMA, and picked at run time: the extension must run on any x86-64 (no -march),
// yet decode at long contexts is bound by how fast rows are consumed, so 256-bit FMAs matter.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../errors.h"
#include "decode.h"

#define VP_INLINE inline __attribute__((always_inline))

namespace vpaged {
namespace kernels {

void check_params(const DecodeParams& p) {
  auto fail = [](const std::string& m) { throw InvalidArgument("decode attention: " + m); };
  if (p.dtype != kFloat32 && p.dtype != kFloat16 && p.dtype != kBFloat16)
    fail("unsupported dtype code " + std::to_string(p.dtype));
  if (p.num_seqs < 0) fail("num_seqs < 0");
  if (p.num_heads <= 0 || p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0)
    fail("num_heads (" + std::to_string(p.num_heads) + ") must be a positive multiple of num_kv_heads (" +
         std::to_string(p.num_kv_heads) + ")");
  if (p.head_dim <= 0 || p.head_dim > 256) fail("head_dim must be in 1..256, got " + std::to_string(p.head_dim));
  const int64_t hs = p.head_stride ? p.head_stride : p.head_dim;
  if (hs < p.head_dim) fail("head_stride " + std::to_string(p.head_stride) + " is smaller than head_dim");
  if (hs == p.head_dim ? p.token_stride < int64_t(p.num_kv_heads) * p.head_dim : p.token_stride < p.head_dim)
    fail("token_stride " + std::to_string(p.token_stride) + " overlaps the tokens' heads");
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
    if (!p.slots || p.slot_stride < 0) fail("slots missing or negative slot_stride");
  }
}

namespace {

constexpr int kChunk = 32;      // tokens per online-softmax step
constexpr int kMinSplit = 256;  // fewest tokens worth a separate item (merging costs ~ one head_dim pass)
constexpr int kAhead = 16;      // tokens of prefetch distance (4 was too close; 8..48 measured alike)

// ------------------------------------------------------------------------------------ element types
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

inline uint16_t f32_to_bf16(float f) {
  const uint32_t x = f_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);  // keep NaN a NaN
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

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
VP_INLINE void dot4x2(const float* __restrict q, int qs, const float* __restrict k0, const float* __restrict k1,
                      int D, float* __restrict s, int ss) {
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

// ------------------------------------------------------------------------------------ items
struct Item {
  int b;
  int t0, t1;        // tokens [t0, t1) of sequence b
  int64_t partial;   // index of its partial result, or -1: the item covers the whole sequence
};

// Where token t's row starts (elements from k / v).
struct RowFinder {
  const DecodeParams& p;
  int b;
  int64_t slot_base = 0;
  int shift = 0;
  RowFinder(const DecodeParams& params, int seq) : p(params), b(seq) {
    if (p.paged) {
      while ((1 << shift) < p.block_size) ++shift;
    } else {
      slot_base = int64_t(p.slots[b]) * p.slot_stride;
    }
  }
  VP_INLINE int64_t operator()(int t) const {
    if (!p.paged) return slot_base + int64_t(t) * p.token_stride;
    int32_t blk = p.block_tables[int64_t(b) * p.bt_stride + (t >> shift)];
    blk = blk < 0 ? 0 : (blk >= p.num_blocks ? p.num_blocks - 1 : blk);  // never read outside the pool
    return ((int64_t(blk) << shift) + (t & (p.block_size - 1))) * p.token_stride;
  }
};

// Floats of per-thread workspace an item needs.
size_t workspace_floats(const DecodeParams& p) {
  const size_t H = p.num_heads, D = p.head_dim;
  return 2 * H * D + size_t(kChunk) * D + H * kChunk + 2 * H;
}

template <int DT, int DC>
VP_INLINE void run_item_impl(const DecodeParams& p, const Item& it, float* ws, float* part_acc, float* part_ml) {
  using T = typename Elem<DT>::T;
  const int D = DC ? DC : p.head_dim;
  const int H = p.num_heads, HKV = p.num_kv_heads, G = H / HKV;
  float* __restrict qf = ws;               // [H][D] query, pre-scaled
  float* __restrict acc = qf + H * D;      // [H][D] unnormalised output
  float* __restrict rows = acc + H * D;    // [kChunk][D] widened K or V rows of one kv head
  float* __restrict sc = rows + kChunk * D;  // [H][kChunk] scores, then probabilities
  float* __restrict m = sc + H * kChunk;   // [H] running max
  float* __restrict l = m + H;             // [H] running sum of exp(score - max)

  const T* q = static_cast<const T*>(p.q) + int64_t(it.b) * H * D;
  for (int i = 0; i < H * D; ++i) qf[i] = Elem<DT>::load(q[i]) * p.scale;
  std::fill(acc, acc + H * D, 0.0f);
  std::fill(m, m + H, -std::numeric_limits<float>::infinity());
  std::fill(l, l + H, 0.0f);

  const T* K = static_cast<const T*>(p.k);
  const T* V = static_cast<const T*>(p.v);
  const RowFinder row(p, it.b);
  const int64_t HS = p.head_stride ? p.head_stride : D;  // elements between kv heads of a token
  // Prefetch a token's whole row when its heads are dense, else the first head's slice.
  const int row_bytes = (HS == D ? HKV : 1) * D * int(sizeof(T));
  int64_t off[kChunk];
  const float* vr[kChunk];

  for (int c0 = it.t0; c0 < it.t1; c0 += kChunk) {
    const int n = std::min(kChunk, it.t1 - c0);
    for (int i = 0; i < n; ++i) off[i] = row(c0 + i);

    // Scores of the chunk, all heads, two tokens at a time (an odd last token is paired with itself; the
    // spare score lands in an unused column). Meanwhile K rows kAhead tokens on and this chunk's V rows,
    // which P·V reads next, are prefetched.
    for (int i = 0; i < n; i += 2) {
      const int i1 = i + 1 < n ? i + 1 : i;
      for (int j = i; j <= i1; ++j) {
        if (c0 + j + kAhead < it.t1) {
          const int64_t ahead = row(c0 + j + kAhead);
          prefetch_row(K + ahead, row_bytes);
          prefetch_row(V + ahead, row_bytes);
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
        float* a = acc + h * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) a[d] *= alpha;
      }
    }

    // P·V: widen each V row of the chunk once, use it for the G heads that share it.
    for (int kh = 0; kh < HKV; ++kh) {
      for (int i = 0; i < n; ++i) vr[i] = widen<DT, DC>(V + off[i] + kh * HS, rows + i * D, D);
      int g = 0;
      if (D % 16 == 0) {
        for (; g + 4 <= G; g += 4) pv4x16(acc + (kh * G + g) * D, vr, sc + (kh * G + g) * kChunk, n, D);
      }
      for (; g < G; ++g) {
        const int h = kh * G + g;
        float* a = acc + h * D;
        const float* ps = sc + h * kChunk;
        int i = 0;
        for (; i + 4 <= n; i += 4) axpy4<DC>(a, vr[i], vr[i + 1], vr[i + 2], vr[i + 3], ps + i, D);
        for (; i < n; ++i) axpy1<DC>(a, vr[i], ps[i], D);
      }
    }
  }

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

using ItemFn = void (*)(const DecodeParams&, const Item&, float*, float*, float*);

template <int DT, int DC>
void run_item_base(const DecodeParams& p, const Item& it, float* ws, float* pa, float* pm) {
  run_item_impl<DT, DC>(p, it, ws, pa, pm);
}

template <int DT, int DC>
__attribute__((target("avx2,fma"))) void run_item_avx2(const DecodeParams& p, const Item& it, float* ws, float* pa,
                                                        float* pm) {
  run_item_impl<DT, DC>(p, it, ws, pa, pm);
}

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

template <int DT>
ItemFn select_dim(int D, bool avx2) {
  switch (D) {
    case 64:
      return avx2 ? run_item_avx2<DT, 64> : run_item_base<DT, 64>;
    case 128:
      return avx2 ? run_item_avx2<DT, 128> : run_item_base<DT, 128>;
    case 256:
      return avx2 ? run_item_avx2<DT, 256> : run_item_base<DT, 256>;
    default:
      return avx2 ? run_item_avx2<DT, 0> : run_item_base<DT, 0>;
  }
}

ItemFn select_item_fn(int dtype, int D, bool force_baseline) {
  const bool avx2 = !force_baseline && cpu_has_avx2();
  switch (dtype) {
    case kFloat32:
      return select_dim<kFloat32>(D, avx2);
    case kFloat16:
      return select_dim<kFloat16>(D, avx2);
    default:
      return select_dim<kBFloat16>(D, avx2);
  }
}

// Merge the partial results of one sequence's splits: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
template <int DT>
void merge_seq(const DecodeParams& p, int b, int64_t first, int count, const float* part_acc,
               const float* part_ml, float* tmp) {
  using T = typename Elem<DT>::T;
  const int H = p.num_heads, D = p.head_dim;
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

void decode_cpu(const DecodeParams& p, int num_threads, bool force_baseline) {
  check_params(p);
  if (p.num_seqs == 0) return;
  const int nt = num_threads > 0 ? num_threads : omp_get_max_threads();
  const int B = p.num_seqs, H = p.num_heads, D = p.head_dim;

  std::vector<int> len(B);
  int64_t total = 0;
  for (int b = 0; b < B; ++b) {
    len[b] = std::clamp(p.lengths[b], 0, p.max_tokens);
    total += len[b];
  }
  // Aim at >= 4 items per thread (dynamic scheduling evens out mixed lengths), but never below kMinSplit
  // tokens per item, where merging would cost more than it balances. Multiple of kChunk: full chunks.
  int64_t per_item = std::max<int64_t>(kMinSplit, (total + 4 * nt - 1) / (4 * nt));
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
  std::vector<float> part_acc(size_t(partials) * H * D), part_ml(size_t(partials) * H * 2);

  const ItemFn fn = select_item_fn(p.dtype, D, force_baseline);
  const size_t ws_floats = workspace_floats(p);
  const int64_t n_items = int64_t(items.size());
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> ws(ws_floats);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) fn(p, items[i], ws.data(), part_acc.data(), part_ml.data());
  }
  if (partials == 0) return;
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> tmp(D);
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

}  // namespace kernels
}  // namespace vpaged
