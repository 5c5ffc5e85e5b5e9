// Decode attention for bfloat16 on the CPU's matrix units (AMX), where several query heads share each KV
// head; included by cpu_kernels.cpp.
//
// Why: the AVX512-BF16 kernel (decode_attention_bf16.h) scores each query head against the keys on its own,
// summing every score across a register's lanes, and weighs the values once per query head, so its
// arithmetic grows with the query heads of a KV head: where eight share one (a 1 B Llama's 32 over 4) it
// costs more than reading the keys and values. Here a (query, KV head)'s query heads are the columns of
// tile products:
// - scores as S^T = K Q^T: 16 keys a tile's rows, read in place where the cache holds them 16 in a row
//   (blocks of 16 or more), else copied together first; the queries laid out once as the second operand;
//   each 16 keys' tile of scores turned into a row per query head;
// - the decode kernel's own softmax (its exponential, its rounding of the probabilities to bfloat16);
// - O = P V, the values laid out as the prompt kernel lays them (prompt_attention_amx.h).
// The products' sums come in another order than the AVX512-BF16 kernel's, so a score, and through it a
// probability rounded to bfloat16, can land one rounding away.
#pragma once

#include "prompt_attention_amx.h"

#ifdef LLMQ_HAS_AMX_PROMPT_ATTENTION
#define LLMQ_HAS_AMX_DECODE_ATTENTION 1

#include <immintrin.h>

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace llmq_decode_amx {

using llmq_tiled::kTileElements;
using llmq_tiled::kTileRows;

// The query heads per KV head it takes: at least kLeastGroup (at 4 it measured level with the AVX512-BF16
// kernel where the cache's blocks are warm, slower where they lie scattered in memory), at most a tile's 16
// columns.
constexpr int64_t kLeastGroup = 8;
constexpr int64_t kMostGroup = 16;
// How far ahead of its products a piece asks for its own keys and values: pairs of 16-key tiles.
constexpr int64_t kFetchPairs = 4;

// Whether it runs here for KV heads of `head_dim` shared by `group` query heads: on the matrix units.
inline bool runs_here(int64_t group, int64_t head_dim) {
  return group >= kLeastGroup && group <= kMostGroup && llmq_prompt_amx::runs_here(head_dim);
}

// What a thread of llmq_bf16::decode_attention runs for each (query, KV head), in its place of VectorAttend:
// configures the thread's tiles when made, releases them when done, and keeps its buffers between items.
class TileAttend {
 public:
  explicit TileAttend(int64_t head_dim)
      : head_dim_(head_dim), query_tiles_(head_dim / 32 * kTileElements), staged_keys_(2 * kTileRows * head_dim),
        result_(kTileRows * head_dim) {
    llmq_tiled::configure_tiles();
  }
  ~TileAttend() { _tile_release(); }
  TileAttend(const TileAttend&) = delete;
  TileAttend& operator=(const TileAttend&) = delete;

  // VectorAttend's call. Its rows of scores and probabilities are whole tiles of 32 keys, and its
  // probabilities 16 rows of them (a tile's), zero past the group.
  void operator()(const uint16_t* q, int64_t q_head_stride, const uint16_t* k_head, const uint16_t* v_head,
                  const int64_t* rows, int64_t length, int64_t group, float scale, uint16_t* out,
                  llmq_prefetch::ContextFetch& ahead) {
    const int64_t width = llmq_prompt_amx::round_up(length, 32), dim_blocks = head_dim_ / 16;
    scores_.resize(kTileRows * width);
    probs_.resize(kTileRows * width);
    values_.resize(width / 32 * dim_blocks * kTileElements);
    lay_out_queries(q, q_head_stride, group);
    score(k_head, v_head, rows, length, group, width, ahead);
    int64_t lengths[kTileRows];
    std::fill_n(lengths, kTileRows, length);
    llmq_prompt_amx::probabilities(scores_.data(), group, lengths, scale, width, probs_.data());
    llmq_prompt_amx::lay_out_values(length, head_dim_, [&](int64_t t) { return v_head + rows[t]; }, values_.data());
    llmq_prompt_amx::weigh_values(probs_.data(), width, values_.data(), width / 32, dim_blocks, result_.data());
    for (int64_t g = 0; g < group; ++g)
      llmq_prompt_amx::store_rounded(result_.data() + g * head_dim_, head_dim_, out + g * head_dim_);
  }

 private:
  // The queries as the second operand of S^T = K Q^T: in tile dt, row r holds, for each query head in turn
  // (a column; zeros past the group), its dimensions 32 dt + 2r and 32 dt + 2r + 1.
  void lay_out_queries(const uint16_t* q, int64_t q_head_stride, int64_t group) {
    std::fill(query_tiles_.begin(), query_tiles_.end(), uint16_t{0});
    auto* tiles = reinterpret_cast<uint32_t*>(query_tiles_.data());
    for (int64_t h = 0; h < group; ++h) {
      const auto* pairs = reinterpret_cast<const uint32_t*>(q + h * q_head_stride);
      for (int64_t i = 0; i < head_dim_ / 2; ++i) tiles[i * 16 + h] = pairs[i];
    }
  }

  // Keys first .. first + 15, 16 rows head_dim apart: in place where the cache holds them so, else copied
  // together, at staging area `staging` (0 or 1; past the context, rows repeats the last key).
  const uint16_t* sixteen_keys(const uint16_t* k_head, const int64_t* rows, int64_t first, int64_t length,
                               int64_t staging) {
    bool in_place = first + kTileRows <= length;
    for (int64_t i = 1; in_place && i < kTileRows; ++i) in_place = rows[first + i] == rows[first] + i * head_dim_;
    if (in_place) return k_head + rows[first];
    uint16_t* staged = staged_keys_.data() + staging * kTileRows * head_dim_;
    for (int64_t i = 0; i < kTileRows; ++i) std::memcpy(staged + i * head_dim_, k_head + rows[first + i], head_dim_ * 2);
    return staged;
  }

  // Scores [group, width] at scores_, unscaled: tiles S^T = K Q^T of 16 keys, two at a time (the second's
  // products run while the first's finish), each turned into the rows of the group's query heads.
  void score(const uint16_t* k_head, const uint16_t* v_head, const int64_t* rows, int64_t length, int64_t group,
             int64_t width, llmq_prefetch::ContextFetch& ahead) {
    const int64_t dim_tiles = head_dim_ / 32, stride = head_dim_ * 2, row_bytes = head_dim_ * 2;
    const uint16_t* queries = query_tiles_.data();
    _tile_loadd(2, queries, 64);
    if (dim_tiles > 1) _tile_loadd(3, queries + kTileElements, 64);
    if (dim_tiles > 2) _tile_loadd(4, queries + 2 * kTileElements, 64);
    if (dim_tiles > 3) _tile_loadd(5, queries + 3 * kTileElements, 64);
    // A tile load that misses holds up the matrix units until its bytes come (tile registers are not
    // renamed), and blocks lie anywhere in the cache: ask for each pair of tiles' keys kFetchPairs pairs
    // ahead, and for their values, which the values' layout reads next. The next piece's lines (`ahead`) are
    // asked for into L2 a share per pair of tiles: this piece's products are too short to cover asking for
    // them all at once, as VectorAttend does.
    auto fetch = [&](int64_t first) {
      for (int64_t t = first; t < std::min(length, first + 2 * kTileRows); ++t) {
        llmq_bf16::prefetch_row(k_head + rows[t], row_bytes);
        llmq_bf16::prefetch_row(v_head + rows[t], row_bytes);
      }
    };
    for (int64_t pair = 0; pair < kFetchPairs; ++pair) fetch(pair * 2 * kTileRows);
    const int64_t pairs = (length + 2 * kTileRows - 1) / (2 * kTileRows);
    const int64_t ahead_per_pair = (ahead.lines() + pairs - 1) / pairs;
    alignas(64) float tiles[2][kTileRows * 16];
    for (int64_t first = 0; first < length; first += 2 * kTileRows) {
      fetch(first + kFetchPairs * 2 * kTileRows);
      ahead.next(ahead_per_pair);
      const bool two = first + kTileRows < length;
      const uint16_t* a = sixteen_keys(k_head, rows, first, length, 0);
      const uint16_t* b = two ? sixteen_keys(k_head, rows, first + kTileRows, length, 1) : nullptr;
      _tile_zero(0);
      _tile_zero(1);
#define LLMQ_SCORE_DIMS(DT, Q)              \
  _tile_loadd(6, a + DT * 32, stride);      \
  _tile_dpbf16ps(0, 6, Q);                  \
  if (two) {                                \
    _tile_loadd(7, b + DT * 32, stride);    \
    _tile_dpbf16ps(1, 7, Q);                \
  }
      LLMQ_SCORE_DIMS(0, 2)
      if (dim_tiles > 1) { LLMQ_SCORE_DIMS(1, 3) }
      if (dim_tiles > 2) { LLMQ_SCORE_DIMS(2, 4) }
      if (dim_tiles > 3) { LLMQ_SCORE_DIMS(3, 5) }
#undef LLMQ_SCORE_DIMS
      _tile_stored(0, tiles[0], 64);
      at::vec::transpose_mxn<float>(tiles[0], 16, scores_.data() + first, width, kTileRows, group);
      if (two) {
        _tile_stored(1, tiles[1], 64);
        at::vec::transpose_mxn<float>(tiles[1], 16, scores_.data() + first + kTileRows, width, kTileRows, group);
      }
    }
  }

  int64_t head_dim_;
  std::vector<uint16_t> query_tiles_, staged_keys_, probs_, values_;
  std::vector<float> scores_, result_;
};

}  // namespace llmq_decode_amx
#endif
