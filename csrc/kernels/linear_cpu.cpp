// A linear layer's product for few rows, from a weight packed in column panels (see linear_cpu.h).
//
// Two builds, picked at run time as the other CPU kernels' are: the portable x86-64 one (the reference: scalar
// loops GCC may vectorise) and AVX2 + FMA. The AVX2 build holds a tile of up to 6 rows x 16 outputs in 12
// registers of 8 lanes: each k step loads the panel's 16 weights once (two vectors, bf16 widened by a shift) and
// broadcasts each row's x[k], 12 fused multiply-adds for 2 loads of weights. A panel is read from memory by the
// tile of the first rows and from L2 by the others (a 576-wide panel is 36 KiB); the first tile also prefetches
// the panel a few KiB ahead, so the stream runs ahead of the arithmetic instead of behind it.
//
// Threads split the panels (each thread writes its own output columns); rows are taken in chunks whose x fits the
// L2 beside a panel, so a long prompt chunk re-reads its weight once per chunk rather than x once per panel. For a
// chunk of many rows a bf16 panel is widened to fp32 once, and its tiles read the widened copy.
#include <omp.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/errors.h"
#include "kernels/cpu_math.h"
#include "kernels/decode.h"
#include "kernels/linear_cpu.h"

namespace vpaged {
namespace kernels {
namespace {

constexpr int kW = int(kLinearPanelWidth);
constexpr int kMaxTileRows = 6;
// Calls with fewer multiply-adds run on the calling thread: waking the team costs ~5-10 us, a 192 x 576
// product of 2 rows ~5 us of one core.
constexpr int64_t kParallelMacs = int64_t(1) << 18;
// The bytes of x rows a chunk may hold (fp32): beside one panel in a 512 KiB L2.
constexpr int64_t kChunkXBytes = int64_t(384) << 10;
// How far ahead of the tile the first tile of a chunk prefetches its panel.
constexpr int64_t kPrefetchBytes = int64_t(8) << 10;
// bf16 panels are widened to fp32 once per chunk from this many tiles on (13+ rows), in each tile's registers
// below: at 512 rows widening in registers cost 1.18x oneDNN's time on the fp32 copy (Zen 3, SmolLM2's layers),
// at a few rows a separate pass would add a write and a read of every panel to a stream that is the whole cost.
constexpr int64_t kWidenTiles = 3;

// One tile's result: up to kMaxTileRows x kW fp32 sums, before bias and rounding.
struct TileSums {
  alignas(32) float v[kMaxTileRows][kW];
};

// ------------------------------------------------------------------------------------ portable build
template <int WT>
void tile_base(const float* x, int64_t xs, int mr, const void* panel_v, int64_t K, TileSums& out) {
  using W = typename Elem<WT>::T;
  const W* panel = static_cast<const W*>(panel_v);
  float acc[kMaxTileRows][kW] = {};
  for (int64_t k = 0; k < K; ++k) {
    float w[kW];
    for (int j = 0; j < kW; ++j) w[j] = Elem<WT>::load(panel[k * kW + j]);
    for (int r = 0; r < mr; ++r) {
      const float a = x[r * xs + k];
#pragma omp simd
      for (int j = 0; j < kW; ++j) acc[r][j] += a * w[j];
    }
  }
  for (int r = 0; r < mr; ++r) std::copy(acc[r], acc[r] + kW, out.v[r]);
}

// ------------------------------------------------------------------------------------ AVX2 build
template <int WT>
VP_AVX2 void load16(const typename Elem<WT>::T* p, __m256& lo, __m256& hi) {
  lo = load8<WT>(p);
  hi = load8<WT>(p + 8);
}

// MR rows x 16 outputs over all of K. The accumulators are named registers, not an array: GCC keeps an array of
// vectors on the stack and stores it back on every step.
template <int WT, int MR, bool kPrefetch>
VP_AVX2 void tile_avx2_rows(const float* x, int64_t xs, const void* panel_v, int64_t K, TileSums& out) {
  using W = typename Elem<WT>::T;
  const W* panel = static_cast<const W*>(panel_v);
  const char* ahead = reinterpret_cast<const char*>(panel) + kPrefetchBytes;
  const __m256 z = _mm256_setzero_ps();
  __m256 a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z, a40 = z, a41 = z, a50 = z, a51 = z;
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (kPrefetch) _mm_prefetch(ahead + k * kW * int64_t(sizeof(W)), _MM_HINT_T0);
    __m256 b0, b1;
    load16<WT>(panel + k * kW, b0, b1);
#define VP_LINEAR_ROW(r)                                  \
  if constexpr (MR > r) {                                 \
    const __m256 a = _mm256_broadcast_ss(x + r * xs + k); \
    a##r##0 = _mm256_fmadd_ps(a, b0, a##r##0);            \
    a##r##1 = _mm256_fmadd_ps(a, b1, a##r##1);            \
  }
    VP_LINEAR_ROW(0) VP_LINEAR_ROW(1) VP_LINEAR_ROW(2) VP_LINEAR_ROW(3) VP_LINEAR_ROW(4) VP_LINEAR_ROW(5)
#undef VP_LINEAR_ROW
  }
#define VP_LINEAR_STORE(r)                  \
  if constexpr (MR > r) {                   \
    _mm256_store_ps(out.v[r], a##r##0);     \
    _mm256_store_ps(out.v[r] + 8, a##r##1); \
  }
  VP_LINEAR_STORE(0) VP_LINEAR_STORE(1) VP_LINEAR_STORE(2) VP_LINEAR_STORE(3) VP_LINEAR_STORE(4) VP_LINEAR_STORE(5)
#undef VP_LINEAR_STORE
}

template <int WT, bool kPrefetch>
VP_AVX2_TARGET void tile_avx2(const float* x, int64_t xs, int mr, const void* panel, int64_t K, TileSums& out) {
  switch (mr) {
    case 1:
      return tile_avx2_rows<WT, 1, kPrefetch>(x, xs, panel, K, out);
    case 2:
      return tile_avx2_rows<WT, 2, kPrefetch>(x, xs, panel, K, out);
    case 3:
      return tile_avx2_rows<WT, 3, kPrefetch>(x, xs, panel, K, out);
    case 4:
      return tile_avx2_rows<WT, 4, kPrefetch>(x, xs, panel, K, out);
    case 5:
      return tile_avx2_rows<WT, 5, kPrefetch>(x, xs, panel, K, out);
    default:
      return tile_avx2_rows<WT, 6, kPrefetch>(x, xs, panel, K, out);
  }
}

// A bf16 panel widened to fp32 once (16 x K values), prefetched ahead as the first tile does: for a chunk of
// several tiles, where widening in every tile's registers would repeat the widening per tile.
VP_AVX2_TARGET void widen_panel_avx2(const void* panel_v, int64_t K, float* dst) {
  const uint16_t* panel = static_cast<const uint16_t*>(panel_v);
  const char* ahead = reinterpret_cast<const char*>(panel) + kPrefetchBytes;
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(ahead + k * kW * 2, _MM_HINT_T0);
    __m256 lo, hi;
    load16<kBFloat16>(panel + k * kW, lo, hi);
    _mm256_storeu_ps(dst + k * kW, lo);
    _mm256_storeu_ps(dst + k * kW + 8, hi);
  }
}

// finish() below in 8 lanes: the bias added and the sums rounded to DT eight at a time (a bf16 output's rounding is
// a dozen integer operations per element in scalar code: at prompt sizes as much as a tenth of the call).
template <int DT>
VP_AVX2_TARGET void finish_avx2(const TileSums& sums, int mr, int valid, const void* bias_v, int64_t n0, void* out_v,
                                int64_t os, int64_t r0) {
  using T = typename Elem<DT>::T;
  const T* bias = static_cast<const T*>(bias_v);
  T* out = static_cast<T*>(out_v);
  for (int r = 0; r < mr; ++r) {
    T* o = out + (r0 + r) * os + n0;
    int j = 0;
    for (; j + 8 <= valid; j += 8) {
      __m256 v = _mm256_load_ps(sums.v[r] + j);
      if (bias) v = _mm256_add_ps(v, load8<DT>(bias + n0 + j));
      store8<DT>(o + j, v);
    }
    for (; j < valid; ++j) o[j] = Elem<DT>::store(sums.v[r][j] + (bias ? Elem<DT>::load(bias[n0 + j]) : 0.0f));
  }
}

// bf16 rows widened to fp32 once per call, eight at a time.
VP_AVX2_TARGET void widen_rows_avx2(const uint16_t* x, int64_t xs, int64_t rows, int64_t K, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* src = x + r * xs;
    float* d = dst + r * K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) _mm256_storeu_ps(d + k, load8<kBFloat16>(src + k));
    for (; k < K; ++k) d[k] = Elem<kBFloat16>::load(src[k]);
  }
}

void widen_panel_base(const void* panel_v, int64_t K, float* dst) {
  const uint16_t* panel = static_cast<const uint16_t*>(panel_v);
  for (int64_t i = 0; i < K * kW; ++i) dst[i] = Elem<kBFloat16>::load(panel[i]);
}

// ------------------------------------------------------------------------------------ driver
using TileFn = void (*)(const float*, int64_t, int, const void*, int64_t, TileSums&);

// The tile's sums plus bias, rounded to out's dtype, for its rows and the panel's valid outputs.
template <int DT>
void finish(const TileSums& sums, int mr, int valid, const void* bias_v, int64_t n0, void* out_v, int64_t os,
            int64_t r0) {
  using T = typename Elem<DT>::T;
  const T* bias = static_cast<const T*>(bias_v);
  T* out = static_cast<T*>(out_v);
  for (int r = 0; r < mr; ++r) {
    T* o = out + (r0 + r) * os + n0;
    for (int j = 0; j < valid; ++j) {
      const float b = bias ? Elem<DT>::load(bias[n0 + j]) : 0.0f;
      o[j] = Elem<DT>::store(sums.v[r][j] + b);
    }
  }
}

struct Call {
  const float* x;  // fp32 rows (bf16 x widened once by the caller)
  int64_t xs, rows, K, N;
  const char* panels;
  int64_t panel_bytes;
  const void* bias;
  void* out;
  int64_t os;
  TileFn first, rest;  // the chunk's first tile (prefetching the panel) and the others
  // bf16 panels: the widening of a panel to fp32 and the fp32 tiles that read it, for chunks of kWidenTiles tiles
  // or more (null for fp32 panels)
  void (*widen)(const void*, int64_t, float*);
  TileFn fp32_tile;
  void (*finish)(const TileSums&, int, int, const void*, int64_t, void*, int64_t, int64_t);
};

// The rows a chunk takes for rows of K values: x fits the L2 beside a panel, a whole number of tiles.
int64_t chunk_rows(int64_t K) {
  return std::max<int64_t>(kMaxTileRows, std::min<int64_t>(120, kChunkXBytes / (K * 4)) / kMaxTileRows * kMaxTileRows);
}

// Whether a chunk of `rows` rows of bf16 panels widens each panel once instead of in every tile's registers.
bool widens(int64_t rows) { return (rows + kMaxTileRows - 1) / kMaxTileRows >= kWidenTiles; }

// Panels [p0, p1) for every row, chunk by chunk; a chunk's rows in near-equal tiles of at most kMaxTileRows.
// scratch: K x kW floats of this thread's (for widened bf16 panels; none where no chunk widens), allocated by the
// caller outside the parallel region: an allocation that throws there would end the process.
void run_panels(const Call& c, int64_t p0, int64_t p1, float* scratch) {
  const int64_t chunk = chunk_rows(c.K);
  TileSums sums;
  for (int64_t m0 = 0; m0 < c.rows; m0 += chunk) {
    const int64_t m1 = std::min(c.rows, m0 + chunk);
    const int64_t tiles = (m1 - m0 + kMaxTileRows - 1) / kMaxTileRows;
    const bool widen = c.widen != nullptr && widens(m1 - m0);
    for (int64_t p = p0; p < p1; ++p) {
      const char* panel = c.panels + p * c.panel_bytes;
      const int valid = int(std::min<int64_t>(kW, c.N - p * kW));
      if (widen) c.widen(panel, c.K, scratch);
      int64_t r = m0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int mr = int((m1 - r) / (tiles - t));
        if (widen)
          c.fp32_tile(c.x + r * c.xs, c.xs, mr, scratch, c.K, sums);
        else
          (t == 0 ? c.first : c.rest)(c.x + r * c.xs, c.xs, mr, panel, c.K, sums);
        c.finish(sums, mr, valid, c.bias, p * kW, c.out, c.os, r);
        r += mr;
      }
    }
  }
}

template <int WT>
void pick_tiles(bool avx2, TileFn& first, TileFn& rest) {
  if (avx2) {
    first = tile_avx2<WT, true>;
    rest = tile_avx2<WT, false>;
  } else {
    first = rest = tile_base<WT>;
  }
}

}  // namespace

void linear_panels_cpu(const void* x, int64_t x_stride, int64_t rows, int64_t in_features, const void* panels,
                       int weight_dtype, int64_t out_features, const void* bias, void* out, int64_t out_stride,
                       int dtype, int num_threads, int isa) {
  if (rows < 0 || in_features < 1 || out_features < 1)
    throw InvalidArgument("linear: needs rows >= 0, in_features >= 1 and out_features >= 1, got " +
                          std::to_string(rows) + ", " + std::to_string(in_features) + ", " +
                          std::to_string(out_features));
  if ((dtype != kFloat32 && dtype != kBFloat16) || (weight_dtype != kFloat32 && weight_dtype != kBFloat16))
    throw InvalidArgument("linear: float32 or bfloat16 rows and weights only, got dtype codes " +
                          std::to_string(dtype) + " / " + std::to_string(weight_dtype));
  if (x_stride < in_features || out_stride < out_features)
    throw InvalidArgument("linear: row strides must cover a row (x " + std::to_string(x_stride) + " < " +
                          std::to_string(in_features) + " or out " + std::to_string(out_stride) + " < " +
                          std::to_string(out_features) + ")");
  const bool avx2 = resolve_cpu_isa("linear", isa) >= kIsaAvx2;
  if (rows == 0) return;

  Call c{};
  std::vector<float> widened;
  if (dtype == kFloat32) {
    c.x = static_cast<const float*>(x);
    c.xs = x_stride;
  } else {
    widened.resize(size_t(rows * in_features));
    const uint16_t* xb = static_cast<const uint16_t*>(x);
    if (avx2) {
      widen_rows_avx2(xb, x_stride, rows, in_features, widened.data());
    } else {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < in_features; ++k)
          widened[size_t(r * in_features + k)] = Elem<kBFloat16>::load(xb[r * x_stride + k]);
    }
    c.x = widened.data();
    c.xs = in_features;
  }
  c.rows = rows;
  c.K = in_features;
  c.N = out_features;
  c.panels = static_cast<const char*>(panels);
  c.panel_bytes = in_features * kW * (weight_dtype == kFloat32 ? 4 : 2);
  c.bias = bias;
  c.out = out;
  c.os = out_stride;
  if (weight_dtype == kFloat32) {
    pick_tiles<kFloat32>(avx2, c.first, c.rest);
  } else {
    pick_tiles<kBFloat16>(avx2, c.first, c.rest);
    TileFn unused;
    pick_tiles<kFloat32>(avx2, unused, c.fp32_tile);
    c.widen = avx2 ? widen_panel_avx2 : widen_panel_base;
  }
  if (avx2)
    c.finish = dtype == kFloat32 ? finish_avx2<kFloat32> : finish_avx2<kBFloat16>;
  else
    c.finish = dtype == kFloat32 ? finish<kFloat32> : finish<kBFloat16>;

  const int64_t num_panels = (out_features + kW - 1) / kW;
  int nt = num_threads > 0 ? num_threads : omp_get_max_threads();
  if (rows * in_features * out_features < kParallelMacs) nt = 1;
  nt = int(std::min<int64_t>(nt, num_panels));
  // Only calls with a chunk that widens get scratch (the first chunk is the largest): decode-size calls on bf16
  // panels, ~200 a step, allocate nothing.
  const int64_t per_thread = c.widen != nullptr && widens(std::min(rows, chunk_rows(c.K))) ? c.K * kW : 0;
  std::vector<float> scratch(size_t(std::max(nt, 1) * per_thread));
  if (nt <= 1) {
    run_panels(c, 0, num_panels, scratch.data());
    return;
  }
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int t = 0; t < nt; ++t)
    run_panels(c, num_panels * t / nt, num_panels * (t + 1) / nt, scratch.data() + t * per_thread);
}

}  // namespace kernels
}  // namespace vpaged
