// bf16 decode attention on AMX tiles (the "amx" CPU code path): contiguous K/V (VirtualKVCache's layouts), GQA
// groups of 4 to 16 query heads per kv head, head dims 64/64, 128/128, 256/256 and 192/128. Other cases on this path
// run the avx512bf16 build (decode_cpu.cpp picks).
//
// Why: with 4 query heads per kv head a decode step is ~8 flops per byte of K/V, and on a 2-core Sapphire Rapids
// class Xeon the avx512bf16 tile loop's products weigh about as much as its memory traffic. A tile product does
// 16 x 16 x 32 multiply-adds per instruction. Measured there (benchmarks/NOTES.md, "bf16 decode on AMX tiles"):
// 0.92-0.95x the avx512bf16 build's time at groups of 4 from memory, 0.72x at groups of 8 with K/V in cache; at
// groups of 2 (and 3 at head dim 64) level or slower, so those stay on avx512bf16 (kAmxMinGroup).
//
// Per chunk of kChunk (32) tokens and kv head:
//   * scores, as (K rows) x (query heads)^T: the A tiles are 16 K rows x 32 dims read in place (tileloadd takes the
//     token stride; a partial chunk's rows are copied into a zero-padded buffer first, so that nothing past the
//     sequence is read), the B tile is the group's query in pairs of dims (VNNI layout, packed once per item).
//     C is 16 tokens x G heads in fp32: exact products of bf16 values, as the avx512bf16 path's vdpbf16ps;
//   * the online softmax (chunk_softmax, 16 lanes) on the scores, scaled after the products;
//   * P.V, as (probabilities) x (V rows): A is the group's probabilities rounded to bf16 (the one rounding this
//     path adds over avx512bf16: at most 2^-9 of each probability, so at most 2^-9 max|v| on an output, below the
//     bf16 output's own rounding), B is V in pairs of tokens, packed per chunk by vpunpck{l,h}wd of two rows. Each
//     16-dim block of the accumulators is loaded as a C tile straight from the (rescaled) fp32 accumulator rows,
//     takes the product and is stored back. The unpack interleaves the dims of each 128-bit lane, so the
//     accumulators hold dims in that order and are put back once per item (unpermute).
// Prefetch: the next chunk's K and V rows of every kv head are walked a few lines at a time (LineWalk) from every
// slice of the scores and every token pair of the V packing.
//
// The tile registers belong to the thread that configures them: each item loads its configuration and releases
// the tiles when done (nothing stays configured between calls). Linux hands the tile state only to a process that
// asks for it (cpu_has_amx asks once, decode_cpu.cpp).
#include <immintrin.h>

#include "kernels/decode_cpu_item.h"

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512bf16,amx-tile,amx-bf16")
#include "kernels/decode_cpu_avx512_lanes.h"

namespace vpaged {
namespace kernels {
namespace cpu_decode {
namespace {

// The tile configuration of palette 1 (64 bytes, as ldtilecfg reads it): rows and bytes per row of each tile.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int tile, int r, int bytes) {
    rows[tile] = uint8_t(r);
    colsb[tile] = uint16_t(bytes);
  }
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

// Tiles. Macros, not constants: GCC's tile intrinsics paste the number into the instruction's text.
#define VP_TILE_SCORES0 0  // C: scores of tokens 0-15 x G heads
#define VP_TILE_SCORES1 1  // C: tokens 16-31
#define VP_TILE_KEYS0 2    // A: K rows 0-15, 32 dims
#define VP_TILE_KEYS1 3    // A: K rows 16-31
#define VP_TILE_QUERY 4    // B: the group's query, 32 dims in pairs
#define VP_TILE_PROBS 5    // A: G heads x 32 tokens of probabilities (bf16)
#define VP_TILE_VALUES 6   // B: 16 token pairs x 16 dims of V
#define VP_TILE_OUT 7      // C: G heads x 16 dims of the accumulators

// Fewest query heads per kv head the tiles are used for: below it the products are too small a part of the work
// (and the tiles' rows too empty) to pay for packing V and storing scores; measured, see the top of this file.
constexpr int kAmxMinGroup = 4;

// bf16 q/K/V/out, contiguous K/V, G = H / HKV <= 16 (the kernel is correct for any such G; amx_item picks it from
// kAmxMinGroup on), D and DV multiples of 32.
template <int D, int DV>
void run_item_amx(const DecodeParams& p, const Item& it, float* ws, float* part_acc, float* part_ml) {
  static_assert(D % 32 == 0 && DV % 32 == 0, "tiles take 32 dims of K and 32 of V at a time");
  using W = Avx512Vec;
  constexpr int S = D / 32;    // 32-dim slices of a K row
  constexpr int NB = DV / 16;  // 16-dim blocks of a V row
  constexpr int kBytes = 2;
  const int H = p.num_heads, HKV = p.num_kv_heads, G = H / HKV;
  uint32_t* __restrict qp = reinterpret_cast<uint32_t*>(ws);  // [HKV][S][16 dim pairs][G], in H * D / 2 words
  float* __restrict acc = ws + H * D;                         // [H][DV] unnormalised output, dims in block order
  float* __restrict sc = acc + H * DV;                        // [H][kChunk] scores, then probabilities
  float* __restrict m = sc + H * kChunk;                      // [H] running max
  float* __restrict l = m + H;                                // [H] running sum
  alignas(64) uint16_t kpad[kChunk * D];                      // a partial chunk's K rows of one head, zero past n
  alignas(64) uint16_t vpack[NB * 16 * 32];                   // [block][token pair][16 dims x 2 tokens]
  alignas(64) float cs[kChunk * 16];                          // the scores tiles as stored: [token][head of the group]
  alignas(64) uint16_t probs[16 * kChunk];                    // [head of the group][token], bf16

  const uint16_t* q = static_cast<const uint16_t*>(p.q) + int64_t(it.b) * H * D;
  for (int kh = 0; kh < HKV; ++kh)
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < 16; ++r)
        for (int g = 0; g < G; ++g)
          std::memcpy(qp + ((kh * S + s) * 16 + r) * G + g, q + (kh * G + g) * D + 32 * s + 2 * r, 4);
  std::fill(acc, acc + H * DV, 0.0f);
  std::fill(m, m + H, -std::numeric_limits<float>::infinity());
  std::fill(l, l + H, 0.0f);

  TileConfig cfg;
  cfg.set(VP_TILE_SCORES0, 16, 4 * G);
  cfg.set(VP_TILE_SCORES1, 16, 4 * G);
  cfg.set(VP_TILE_KEYS0, 16, 64);
  cfg.set(VP_TILE_KEYS1, 16, 64);
  cfg.set(VP_TILE_QUERY, 16, 4 * G);
  cfg.set(VP_TILE_PROBS, G, 64);
  cfg.set(VP_TILE_VALUES, 16, 64);
  cfg.set(VP_TILE_OUT, G, 64);
  _tile_loadconfig(&cfg);

  const uint16_t* K = static_cast<const uint16_t*>(p.k);
  const uint16_t* V = static_cast<const uint16_t*>(p.v);
  const uint8_t* KB = reinterpret_cast<const uint8_t*>(K);
  const uint8_t* VB = reinterpret_cast<const uint8_t*>(V);
  const RowFinder row(p, it.b);
  const int64_t HS = p.head_stride, VHS = p.v_head_stride;
  const int64_t row_bytes = p.token_stride * kBytes;  // contiguous: K rows of a chunk are this far apart
  int64_t off[kChunk], voff[kChunk], aoff[kChunk], avoff[kChunk];
  LineWalk walk{{KB, VB}, {aoff, avoff}, {HS * kBytes, VHS * kBytes}, {D * kBytes, DV * kBytes}, HKV};
  prefetch_rows(row, it.t0, std::min(it.t1, it.t0 + kChunk), kBytes, KB, VB, HKV, HS * kBytes, VHS * kBytes, D * kBytes,
                DV * kBytes);

  for (int c0 = it.t0; c0 < it.t1; c0 += kChunk) {
    const int n = std::min(kChunk, it.t1 - c0);
    for (int i = 0; i < n; ++i) row(c0 + i, off[i], voff[i]);
    rows_ahead(row, c0 + kChunk, it.t1, n, kBytes, aoff, avoff);
    walk.start(n, HKV * (S + 16));
    if (n < kChunk) std::fill(kpad + n * D, kpad + kChunk * D, uint16_t(0));

    for (int kh = 0; kh < HKV; ++kh) {
      const uint16_t* keys = K + off[0] + kh * HS;
      int64_t stride = row_bytes;
      if (n < kChunk) {
        for (int i = 0; i < n; ++i) std::memcpy(kpad + i * D, K + off[i] + kh * HS, D * kBytes);
        keys = kpad;
        stride = D * kBytes;
      }
      const uint16_t* keys16 = reinterpret_cast<const uint16_t*>(reinterpret_cast<const uint8_t*>(keys) + 16 * stride);
      _tile_zero(VP_TILE_SCORES0);
      _tile_zero(VP_TILE_SCORES1);
      for (int s = 0; s < S; ++s) {
        walk.issue();
        _tile_loadd(VP_TILE_QUERY, qp + (kh * S + s) * 16 * G, 4 * G);
        _tile_loadd(VP_TILE_KEYS0, keys + 32 * s, stride);
        _tile_dpbf16ps(VP_TILE_SCORES0, VP_TILE_KEYS0, VP_TILE_QUERY);
        if (n > 16) {
          _tile_loadd(VP_TILE_KEYS1, keys16 + 32 * s, stride);
          _tile_dpbf16ps(VP_TILE_SCORES1, VP_TILE_KEYS1, VP_TILE_QUERY);
        }
      }
      _tile_stored(VP_TILE_SCORES0, cs, 64);
      if (n > 16) _tile_stored(VP_TILE_SCORES1, cs + 16 * 16, 64);
      for (int g = 0; g < G; ++g) {
        float* out = sc + (kh * G + g) * kChunk;
        for (int i = 0; i < n; ++i) out[i] = cs[i * 16 + g] * p.scale;
      }
    }

    chunk_softmax<W>(sc, m, l, acc, H, DV, n);

    for (int kh = 0; kh < HKV; ++kh) {
      for (int g = 0; g < G; ++g) {
        const float* ps = sc + (kh * G + g) * kChunk;
        const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(ps + 16), _mm512_loadu_ps(ps));
        _mm512_storeu_si512(probs + g * kChunk, (__m512i)pair);
      }
      // V in token pairs; a token at or past n is a zero row (its probability is 0, and 0 * a stray NaN is not).
      for (int r = 0; r < 16; ++r) {
        walk.issue();
        const int i0 = 2 * r, i1 = 2 * r + 1;
        const uint16_t* v0 = i0 < n ? V + voff[i0] + kh * VHS : nullptr;
        const uint16_t* v1 = i1 < n ? V + voff[i1] + kh * VHS : nullptr;
        for (int j = 0; j < DV / 32; ++j) {
          const __m512i a = v0 ? _mm512_loadu_si512(v0 + 32 * j) : _mm512_setzero_si512();
          const __m512i b = v1 ? _mm512_loadu_si512(v1 + 32 * j) : _mm512_setzero_si512();
          _mm512_store_si512(vpack + ((2 * j) * 16 + r) * 32, _mm512_unpacklo_epi16(a, b));
          _mm512_store_si512(vpack + ((2 * j + 1) * 16 + r) * 32, _mm512_unpackhi_epi16(a, b));
        }
      }
      _tile_loadd(VP_TILE_PROBS, probs, 64);
      float* a = acc + kh * G * DV;
      for (int blk = 0; blk < NB; ++blk) {
        _tile_loadd(VP_TILE_OUT, a + 16 * blk, DV * 4);
        _tile_loadd(VP_TILE_VALUES, vpack + blk * 16 * 32, 64);
        _tile_dpbf16ps(VP_TILE_OUT, VP_TILE_PROBS, VP_TILE_VALUES);
        _tile_stored(VP_TILE_OUT, a + 16 * blk, DV * 4);
      }
    }
  }
  _tile_release();

  // Block 2j (2j + 1) column c holds dim 32 j + 8 (c / 4) + c % 4 (+ 4): vpunpck{l,h}wd's order.
  alignas(64) float ordered[DV];
  for (int h = 0; h < H; ++h) {
    float* a = acc + h * DV;
    for (int blk = 0; blk < NB; ++blk)
      for (int c = 0; c < 16; ++c) ordered[32 * (blk / 2) + 8 * (c / 4) + 4 * (blk % 2) + c % 4] = a[16 * blk + c];
    std::memcpy(a, ordered, sizeof(ordered));
  }
  finish_item<kBFloat16>(p, it, acc, m, l, part_acc, part_ml);
}

#undef VP_TILE_SCORES0
#undef VP_TILE_SCORES1
#undef VP_TILE_KEYS0
#undef VP_TILE_KEYS1
#undef VP_TILE_QUERY
#undef VP_TILE_PROBS
#undef VP_TILE_VALUES
#undef VP_TILE_OUT

}  // namespace
}  // namespace cpu_decode
}  // namespace kernels
}  // namespace vpaged
#pragma GCC pop_options
#pragma GCC diagnostic pop

namespace vpaged {
namespace kernels {
namespace cpu_decode {

ItemFn amx_item(const DecodeParams& p) {
  if (p.dtype != kBFloat16 || p.kv_dtype != kBFloat16 || p.paged) return nullptr;
  const int group = p.num_heads / p.num_kv_heads;
  if (group < kAmxMinGroup || group > 16) return nullptr;
  const int D = p.head_dim, DV = p.v_head_dim;
  if (D == DV) {
    switch (D) {
      case 64:
        return run_item_amx<64, 64>;
      case 128:
        return run_item_amx<128, 128>;
      case 256:
        return run_item_amx<256, 256>;
      default:
        return nullptr;
    }
  }
  if (D == 192 && DV == 128) return run_item_amx<192, 128>;
  return nullptr;
}

}  // namespace cpu_decode
}  // namespace kernels
}  // namespace vpaged
