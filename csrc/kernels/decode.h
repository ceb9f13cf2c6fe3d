// Decode attention: one new query token per sequence against that sequence's cached K/V, with per-sequence
// lengths. Two ways to find token t of sequence b, one kernel family for both:
//   contiguous (VirtualKVCache): row = slots[b] * slot_stride + t * token_stride
//   paged (PagedKVCache):        row = (block_tables[b][t / block_size] * block_size + t % block_size) * token_stride
// Within a row, kv head h starts at h * head_stride (head_dim when heads are dense, as in PagedKVCache and
// the per_layer / interleaved layouts; a run of pages apart in the head_major layout). V has its own head
// dim and strides (v_*; 0, or -1 for v_slot_stride, means "as K's"), so values may be narrower or wider than
// keys (e.g. K 192 / V 128); V's rows are found with the same token / block indices as K's. Query is dense
// [num_seqs, num_heads, head_dim], output [num_seqs, num_heads, v_head_dim]; query head j reads kv head
// j / (num_heads / num_kv_heads) (GQA). Scores and accumulators are fp32 whatever the storage type.
//
// Quantized K/V (kv_dtype kInt8, kFloat8E4M3, kFloat8E5M2; q and out then float32): K and V are stored as
// 1-byte elements and dequantized as they are read, scores and accumulators stay fp32.
//   fp8 (e4m3 is the "fn" variant: bias 7, no inf, max 448; e5m2 is IEEE-like, bias 15): the value of a stored
//   element x is float(x) * k_scale (K) or * v_scale (V), one scale per tensor. Every finite byte decodes
//   exactly (subnormals included); the NaN codes of e4m3 (0x7f, 0xff) are not special-cased (they read as
//   +-480 * scale).
//   int8: each kv head's row of head_dim int8 values (V: v_head_dim) is followed by its float32 scale (4
//   bytes, little-endian, any alignment) at byte offset head_dim (V: v_head_dim) from the row's start; value =
//   int8 * that scale. A head's footprint is head_dim + 4 bytes, so head_stride >= head_dim + 4 (dense heads:
//   head_stride == head_dim + 4, token_stride >= num_kv_heads * (head_dim + 4)). k_scale / v_scale are unused.
// Strides are in elements of the K/V storage type, i.e. bytes for the 1-byte formats.
//
// Tensors cross as raw pointers: the extension does not link libtorch, vpaged/ops/ checks shapes,
// dtypes and devices before calling, and the kernels never read a token at or past a sequence's length.
#pragma once
#include <cstdint>
#include <string>

namespace vpaged {
namespace kernels {

enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kInt8 = 3, kFloat8E4M3 = 4, kFloat8E5M2 = 5 };
// kv_dtype is one of the 1-byte quantized formats.
constexpr bool is_quantized(int kv_dtype) {
  return kv_dtype == kInt8 || kv_dtype == kFloat8E4M3 || kv_dtype == kFloat8E5M2;
}

struct DecodeParams {
  int dtype = kFloat32;  // of q and out (and of K/V unless kv_dtype says otherwise)
  int kv_dtype = -1;     // of K and V storage: -1 (or dtype) as dtype; quantized formats need dtype kFloat32
  int num_seqs = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;         // of q and K
  int v_head_dim = 0;       // of V and out (0: head_dim)
  const void* q = nullptr;  // [num_seqs, num_heads, head_dim], dense
  void* out = nullptr;      // [num_seqs, num_heads, v_head_dim], dense
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t token_stride = 0;          // elements from one token's row to the next
  int64_t head_stride = 0;           // elements from one kv head to the next (0: head_dim)
  int64_t v_token_stride = 0;        // V's token_stride (0: token_stride)
  int64_t v_head_stride = 0;         // V's head_stride (0: head_stride when v_head_dim == head_dim, else v_head_dim)
  const int32_t* lengths = nullptr;  // [num_seqs] valid tokens per sequence
  int32_t max_tokens = 0;            // capacity per sequence; lengths are clamped to it (no stray reads)
  bool paged = false;
  const int32_t* slots = nullptr;         // contiguous: [num_seqs] slot of each sequence
  int64_t slot_stride = 0;                // contiguous: elements between slots
  int64_t v_slot_stride = -1;             // contiguous: V's slot_stride (-1: slot_stride)
  const int32_t* block_tables = nullptr;  // paged: [num_seqs, bt_stride] block ids
  int64_t bt_stride = 0;
  int block_size = 0;      // paged: a power of two
  int32_t num_blocks = 0;  // paged: block ids are clamped to 0..num_blocks-1
  float scale = 1.0f;      // softmax scale (usually 1/sqrt(head_dim))
  float k_scale = 1.0f;    // fp8 K: stored value * k_scale (per tensor; ignored otherwise)
  float v_scale = 1.0f;    // fp8 V: stored value * v_scale
};

// The parameters with every "as K's" V field (and head_stride 0, kv_dtype -1) spelled out.
DecodeParams resolve_params(const DecodeParams& p);
// Throws InvalidArgument when the parameters are inconsistent (shared by the CPU and CUDA paths; takes
// resolved or unresolved parameters).
void check_params(const DecodeParams& p);

// CPU code paths, chosen at run time: the portable x86-64 build (the reference), AVX2+FMA, AVX-512
// (F/BW/VL/DQ; head_dim = v_head_dim = 64, 128 or 256, and K 192 / V 128; other head dims run the AVX2 build),
// AVX-512 with BF16 dot products (bf16 scores by vdpbf16ps; other dtypes as AVX-512), and AMX (bf16 q/K/V/out on
// contiguous K/V with 4 to 16 query heads per kv head, at those head dims: scores and P.V as tile products,
// decode_cpu_amx.cpp, probabilities rounded to bf16 for P.V; everything else as avx512bf16). On the AVX2 path,
// 16-bit K/V of those head dims run a tile loop that widens rows in registers (fp32 K/V the generic loop).
// Quantized K/V run a tile loop that dequantizes in registers: the AVX2 one (AVX2 + F16C) on the AVX2 path, the
// 16-lane one on the AVX-512 paths; the portable build on baseline.
enum CpuIsa : int {
  kIsaAuto = -1,
  kIsaBaseline = 0,
  kIsaAvx2 = 1,
  kIsaAvx512 = 2,
  kIsaAvx512Bf16 = 3,
  kIsaAmx = 4,
};
// The name of a path ("baseline", "avx2", "avx512", "avx512bf16", "amx"), and back: the code of a name, kIsaAuto for
// "auto", -2 for a name of no path.
const char* cpu_isa_name(int isa);
int cpu_isa_from_name(const std::string& name);
// The best path this CPU (and OS) supports. AMX counts only where the OS grants this process the tile state
// (Linux: arch_prctl ARCH_REQ_XCOMP_PERM, asked once here).
int cpu_best_isa();
// The path kIsaAuto runs: the best one, capped by the environment variable VPAGED_CPU_ISA (baseline, avx2,
// avx512, avx512bf16 or amx; read once) so that a whole process (a serving engine, a benchmark) can run a narrower
// ISA's kernels, as ATEN_CPU_CAPABILITY does for torch's. An unknown value raises InvalidArgument.
int cpu_auto_isa();
// The path a CPU kernel named `op` runs for a requested isa: kIsaAuto -> cpu_auto_isa(); an unknown code or a
// path this CPU lacks raises InvalidArgument.
int resolve_cpu_isa(const char* op, int isa);
// Whether int8 K/V decode on path `isa` (resolved as resolve_cpu_isa does) takes its products in integers, of a
// query quantized per head and of probabilities quantized per chunk: by VNNI dot products on the avx512bf16 and amx
// paths (where the CPU has AVX512_VNNI; probabilities in bytes), by 16-bit products (vpmaddwd) on the avx2 path
// (probabilities in 15 bits). Outputs then hold to the accuracy contract of decode_cpu_tiles.h ("Int8 scores by dot
// products") instead of fp32 rounding. The baseline and avx512 paths keep fp32 products.
bool cpu_int8_dot(int isa);
// The contract's probability steps on path `isa`: 255 (VNNI), 32767 (avx2), 0 where cpu_int8_dot is false.
int cpu_int8_dot_prob_steps(int isa);

// CPU (OpenMP). num_threads <= 0: the OpenMP default. isa: kIsaAuto (the best), or a path to force (tests
// cover every path the CPU has); a path the CPU lacks raises InvalidArgument.
void decode_cpu(const DecodeParams& p, int num_threads, int isa = kIsaAuto);

// CUDA. The caller plans the split of long contexts (vpaged/ops/):
//   num_splits == 1: one pass, each block writes its heads' output directly;
//   num_splits > 1: sequence b's tokens are cut into pieces of split_tokens; pass 1 writes unnormalised
//   partial outputs (partial_acc [num_seqs, num_heads, num_splits, v_head_dim]) and their max / sum
//   (partial_ml [num_seqs, num_heads, num_splits, 2]), pass 2 merges them. All on `stream` (a cudaStream_t
//   of device `device`, e.g. torch.cuda.current_stream().cuda_stream), asynchronously.
struct CudaLaunch {
  int device = 0;
  uintptr_t stream = 0;
  int num_splits = 1;
  int split_tokens = 0;
  float* partial_acc = nullptr;
  float* partial_ml = nullptr;
};
// Without VPAGED_WITH_CUDA this raises BackendUnavailable.
void decode_cuda(const DecodeParams& p, const CudaLaunch& launch);
bool kernels_built_with_cuda();

}  // namespace kernels
}  // namespace vpaged
