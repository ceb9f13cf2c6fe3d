// Scatter of new tokens' K/V into a contiguous cache: row i of k/v ([num_rows, num_kv_heads, head_dim], any
// row and head strides, each head's elements dense) goes to token positions[i] of sequence rows[i] of a
// batch descriptor (the same base pointers and slot / token / head strides the contiguous decode kernel reads,
// see decode.h): slot slots[rows[i]], element slots * slot_stride + position * token_stride + h * head_stride.
// One call writes every new token of one layer, whatever the number of sequences.
//
// Safety: a cache maps only the tokens below each sequence's length, and a sequence may write only tokens in
// pages it does not share. So every row is checked before anything is written: its sequence index in
// 0..num_seqs-1, its position in writable_from[seq]..lengths[seq]-1 (writable_from may be null: 0), and, when
// an extent is given, every byte it writes inside it. One bad row raises InvalidArgument
// and leaves the cache unchanged. The CUDA path gets the check on host copies of the indices first (its
// kernel skips any row that would fail it, as a second line: it cannot raise).
#pragma once
#include <cstdint>

namespace vpaged {
namespace kernels {

struct WriteKVParams {
  // Bytes per element (4: float32, 2: float16 / bfloat16; 8: float64; 1: quantized rows as raw bytes, e.g.
  // int8 K/V of decode.h, whose head_dim here is the row's footprint: head_dim + 4 bytes with its scale).
  int itemsize = 4;
  int num_rows = 0;
  int num_seqs = 0;  // sequences of the descriptor (entries of slots / lengths / writable_from)
  int num_kv_heads = 0;
  int head_dim = 0;    // of K
  int v_head_dim = 0;  // of V (0: head_dim)
  // Sources, in elements.
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t k_row_stride = 0, k_head_stride = 0;
  int64_t v_row_stride = 0, v_head_stride = 0;
  // Destination: the descriptor, in elements.
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int64_t slot_stride = 0, token_stride = 0, head_stride = 0;
  int64_t v_slot_stride = 0, v_token_stride = 0, v_cache_head_stride = 0;
  const int32_t* slots = nullptr;              // [num_seqs]
  const int32_t* lengths = nullptr;            // [num_seqs] tokens mapped: positions must lie below
  const int32_t* writable_from = nullptr;      // [num_seqs] first writable token, or null (0)
  const int32_t* rows = nullptr;               // [num_rows] sequence (descriptor index) of each row
  const int32_t* positions = nullptr;          // [num_rows] token position of each row
  uintptr_t extent_lo = 0, extent_hi = 0;      // memory K lives in (0, 0: not checked)
  uintptr_t v_extent_lo = 0, v_extent_hi = 0;  // memory V lives in (0, 0: not checked)
};

// Throws InvalidArgument unless every row may be written (reads slots, lengths, writable_from, rows and
// positions: host pointers).
void write_kv_check(const WriteKVParams& p);
// Checks, then copies (OpenMP over rows when the copy is large enough to pay for the threads).
void write_kv_cpu(const WriteKVParams& p, int num_threads);
// Index arrays and tensors on `device`; asynchronous on `stream`. The caller has run write_kv_check on host
// copies of the same indices. Without VPAGED_WITH_CUDA this raises BackendUnavailable.
void write_kv_cuda(const WriteKVParams& p, int device, uintptr_t stream);

}  // namespace kernels
}  // namespace vpaged
