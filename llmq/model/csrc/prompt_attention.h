// Causal attention for one prompt chunk over its whole context, as small matrix products on the panel
// products' multiply-adds (panel_linear.h), included by cpu_kernels.cpp, built for AVX2 CPUs without
// AVX-512 (on AVX-512 the panel products read their inputs packed, and this kernel has not been measured
// against the paged kernel and SDPA there).
//
// Why: the paged kernel (cpu_kernels.cpp's attend) takes each of a chunk's tokens as a decode: every
// multiply-add of a score loads both its key and its query, so its long chunks run at a fraction of the
// cores' peak, below torch's SDPA (benchmarks/prompt_attention.py). Here a tile of the chunk's tokens,
// times one KV head's query heads, multiplies that head's keys and then its values as products of a
// few dozen rows: the keys, laid out once per call as panels of 16 ([Dh, 16] each), and the values (panels
// of 16 of their columns), are read from the caches by every row of the tile, as a weight's panels are by
// a product's rows. The softmax is exact: a tile's every score first, then its weighted sum of values.
#pragma once

#if defined(LLMQ_HAS_PANEL_LINEAR) && !defined(__AVX512F__)
#define LLMQ_HAS_PROMPT_ATTENTION 1

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "softmax.h"
#include "work_split.h"

namespace llmq_prompt {

using llmq_panels::kPanelColumns;
using fVec = at::vec::Vectorized<float>;

// The most tokens of the chunk that share one pass over their KV head's context: with its G query heads,
// the products' rows. A chunk's tiles are as even as they divide (16 tokens go as 8 + 8, not 12 + 4: a
// tile of few tokens passes over the whole context for little work).
constexpr int64_t kTileTokens = 12;

// In a call of the paged kernel (cpu_kernels.cpp's paged_decode_attention), the prompt chunks this kernel
// takes instead of each of their tokens as a decode: those whose context is longer than
// kLongestDecodedContext and whose tokens times query heads per KV head (the rows of its products) are at
// least kLeastRows. Up to 128 tokens of a fresh prompt the decode kernel measured as fast
// (benchmarks/prompt_attention.py). A chunk of few tokens after a cached prefix pays this kernel's cost per
// call, laying out the whole context's keys and values once per KV head, for little work: after 200 and
// 1,000 cached tokens on an AVX2 EPYC, this kernel measured faster from 32 tokens at 2 query heads per KV
// head and from 8 at 8, and at 16 and 2 slower or level (the figures vary by a third from run to run).
constexpr int64_t kLeastRows = 64;
constexpr int64_t kLongestDecodedContext = 128;

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// Whether the kernel takes a head size: the values' panels are 16 of their columns each.
inline bool supports(int64_t head_dim) { return head_dim > 0 && head_dim % kPanelColumns == 0; }

// Each row of scores [rows, width] (query row r's own context: lengths[r] leading scores) -> its softmax,
// zero past its context, so that the product with the values can run over the tile's whole width.
inline void softmax_rows(float* scores, int64_t rows, int64_t width, const int64_t* lengths) {
  constexpr int64_t lanes = fVec::size();
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * width;
    const int64_t length = lengths[r];
    const float inv_total = 1.f / llmq_softmax::exponentiate(s, length);
    const fVec inv(inv_total);
    int64_t i = 0;
    for (; i + lanes <= length; i += lanes) (fVec::loadu(s + i) * inv).store(s + i);
    for (; i < length; ++i) s[i] *= inv_total;
    std::fill(s + length, s + width, 0.f);
  }
}

// Where a context's token t lies in its keys and values (element strides): tensors [KVH, tokens, Dh], or
// the paged caches [KVH, slots, Dh] through a block table row (token t at slot
// table[t / block_size] * block_size + t % block_size).
struct Context {
  int64_t k_head_stride, k_token_stride, v_head_stride, v_token_stride;
  const int32_t* table = nullptr;  // paged: the sequence's block table row; nullptr: token t is row t
  int64_t block_size = 1;

  int64_t row(int64_t t) const {
    return table == nullptr ? t : static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
  }
};

// q [n, H, Dh] (heads contiguous; strides in elements), the keys and values of its context (`where`),
// the chunk's token i at position num_cached + i -> out [n, H * Dh]; T is the tensors' element type,
// computed in float32.
template <typename T>
void attend_chunk(const T* q, int64_t q_token_stride, int64_t q_head_stride, const T* keys, const T* values,
                  const Context& where, int64_t n, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                  int64_t num_cached, float scale, T* out, int64_t out_stride) {
  const int64_t context = num_cached + n, width = round_up(context, kPanelColumns);
  const int64_t key_panels = width / kPanelColumns, value_panels = head_dim / kPanelColumns;
  const int64_t group = num_heads / num_kv_heads, head_floats = width * head_dim;
  // Per KV head: its keys as panels [key_panels, Dh, 16] (panel p, row d: dimension d of keys 16p .. 16p+15)
  // and its values as panels [value_panels, width, 16] (panel c, row t: columns 16c .. 16c+15 of value t),
  // both zero past the context. Left unset at allocation: every element is written once, below.
  const std::unique_ptr<float[]> key_tiles(new float[num_kv_heads * head_floats]);
  const std::unique_ptr<float[]> value_tiles(new float[num_kv_heads * head_floats]);
  at::parallel_for(0, num_kv_heads * key_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / key_panels, p = item % key_panels;
      float* kp = key_tiles.get() + h * head_floats + p * head_dim * kPanelColumns;
      for (int64_t j = 0; j < kPanelColumns; ++j) {
        const int64_t t = p * kPanelColumns + j;
        const bool padding = t >= context;  // past the context: zeros, and nothing read
        const T* key = keys + h * where.k_head_stride + (padding ? 0 : where.row(t)) * where.k_token_stride;
        const T* value = values + h * where.v_head_stride + (padding ? 0 : where.row(t)) * where.v_token_stride;
        for (int64_t d = 0; d < head_dim; ++d) kp[d * kPanelColumns + j] = padding ? 0.f : static_cast<float>(key[d]);
        for (int64_t c = 0; c < value_panels; ++c) {
          float* vp = value_tiles.get() + h * head_floats + (c * width + t) * kPanelColumns;
          for (int64_t d = 0; d < kPanelColumns; ++d)
            vp[d] = padding ? 0.f : static_cast<float>(value[c * kPanelColumns + d]);
        }
      }
    }
  });

  // Pieces of work: (tile of tokens, KV head), dealt to threads in contiguous runs of about equal work,
  // a later tile's context being longer.
  const int64_t tiles = (n + kTileTokens - 1) / kTileTokens, tile_tokens = (n + tiles - 1) / tiles;
  std::vector<int32_t> tile_context(tiles);
  for (int64_t tile = 0; tile < tiles; ++tile)
    tile_context[tile] = static_cast<int32_t>(num_cached + std::min(n, (tile + 1) * tile_tokens));
  const int64_t threads = std::max(1, at::get_num_threads());
  const std::vector<int64_t> runs = llmq_split::balanced_runs(tile_context.data(), tiles, num_kv_heads, threads);

  at::parallel_for(0, threads, 1, [&](int64_t first_run, int64_t last_run) {
    const int64_t most_rows = tile_tokens * group;
    std::vector<float> query(most_rows * head_dim), scores(most_rows * width), result(most_rows * head_dim);
    std::vector<int64_t> lengths(most_rows);
    for (int64_t run = first_run; run < last_run; ++run)
      for (int64_t item = runs[run]; item < runs[run + 1]; ++item) {
        const int64_t tile = item / num_kv_heads, h = item % num_kv_heads;
        const int64_t first = tile * tile_tokens, tokens = std::min(tile_tokens, n - first);
        if (tokens <= 0) continue;
        const int64_t rows = tokens * group;  // row t * G + g: the tile's token t, the head's query head g
        const int64_t span = round_up(tile_context[tile], kPanelColumns);  // the keys any row of the tile reads
        for (int64_t t = 0; t < tokens; ++t)
          for (int64_t g = 0; g < group; ++g) {
            const T* src = q + (first + t) * q_token_stride + (h * group + g) * q_head_stride;
            float* dst = query.data() + (t * group + g) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * scale;
            lengths[t * group + g] = num_cached + first + t + 1;
          }
        const float* kh = key_tiles.get() + h * head_floats;
        for (int64_t p = 0; p < span / kPanelColumns; ++p)
          llmq_panels::panel_times_rows(query.data(), rows, head_dim, kh + p * head_dim * kPanelColumns,
                                        static_cast<const float*>(nullptr), scores.data() + p * kPanelColumns, span,
                                        nullptr, 0);
        softmax_rows(scores.data(), rows, span, lengths.data());
        const float* vh = value_tiles.get() + h * head_floats;
        for (int64_t c = 0; c < value_panels; ++c)
          llmq_panels::panel_times_rows(scores.data(), rows, span, vh + c * width * kPanelColumns,
                                        static_cast<const float*>(nullptr), result.data() + c * kPanelColumns,
                                        head_dim, nullptr, 0);
        for (int64_t t = 0; t < tokens; ++t)
          for (int64_t g = 0; g < group; ++g) {
            const float* src = result.data() + (t * group + g) * head_dim;
            T* dst = out + (first + t) * out_stride + (h * group + g) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(src[d]);
          }
      }
  });
}

// Rows first .. first + tokens - 1 of a paged kernel's call: one prompt chunk's tokens.
struct Chunk {
  int64_t first, tokens;
};

// The chunks among a paged call's n queries (`group` query heads per KV head) that this kernel takes
// (kLeastRows, kLongestDecodedContext): runs of queries that read the same block table row (query_tables),
// each one position past the last (lens, their context lengths; a row the call leaves alone has none).
inline std::vector<Chunk> long_chunks(const int32_t* query_tables, const int32_t* lens, int64_t n, int64_t group) {
  std::vector<Chunk> chunks;
  llmq_split::for_each_chunk(query_tables, lens, n, [&](int64_t first, int64_t last) {
    if ((last - first) * group >= kLeastRows && lens[last - 1] > kLongestDecodedContext)
      chunks.push_back({first, last - first});
  });
  return chunks;
}

}  // namespace llmq_prompt
#endif
