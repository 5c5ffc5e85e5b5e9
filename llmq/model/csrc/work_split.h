// Dealing attention's pieces of work to threads, and finding a paged call's prompt chunks, included by
// cpu_kernels.cpp, decode_attention_bf16.h and the prompt kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace llmq_split {

// A piece's cost beyond its context: loading its queries, the softmax's passes, writing its output.
constexpr int64_t kFixedCost = 16;

// What a query of context `length` costs each of its pieces; nothing where it has no context (a row the
// kernel skips: a longer prompt chunk's, which SDPA takes).
inline int64_t piece_cost(int32_t length) { return length > 0 ? length + kFixedCost : 0; }

// Boundaries 0 = b[0] <= b[1] <= ... <= b[parts] = pieces that cut pieces 0 .. pieces - 1, piece i costing
// cost(i), into `parts` contiguous runs of about equal cost.
template <typename Cost>
std::vector<int64_t> equal_cost_runs(int64_t pieces, int64_t parts, const Cost& cost) {
  std::vector<int64_t> bounds(parts + 1, pieces);
  bounds[0] = 0;
  int64_t total = 0;
  for (int64_t piece = 0; piece < pieces; ++piece) total += cost(piece);
  int64_t done = 0, part = 1;
  for (int64_t piece = 0; piece < pieces && part < parts; ++piece) {
    done += cost(piece);
    while (part < parts && done * parts >= total * part) bounds[part++] = piece + 1;
  }
  return bounds;
}

// The runs (query n, KV head h: piece n * kv_heads + h) of a paged call's pieces, a piece's work growing
// with its query's context length: contiguous, so that a thread's pieces share their queries' token rows;
// by work, since a prompt chunk's later tokens read ever more of the cache.
inline std::vector<int64_t> balanced_runs(const int32_t* lens, int64_t num_queries, int64_t kv_heads, int64_t parts) {
  return equal_cost_runs(num_queries * kv_heads, parts,
                         [&](int64_t piece) { return piece_cost(lens[piece / kv_heads]); });
}

// Each run of a paged call's n queries that is one prompt chunk's tokens: queries that read the same block
// table row (query_tables), each one position past the one before (lens, their context lengths, the
// query included; a row the call leaves alone has none). chunk(first, last) for each, queries first ..
// last - 1; a decode is a run of one.
template <typename Chunk>
void for_each_chunk(const int32_t* query_tables, const int32_t* lens, int64_t n, const Chunk& chunk) {
  for (int64_t first = 0, last = 0; first < n; first = last) {
    last = first + 1;
    while (last < n && lens[first] > 0 && query_tables[last] == query_tables[first] && lens[last] == lens[last - 1] + 1)
      ++last;
    chunk(first, last);
  }
}

}  // namespace llmq_split
