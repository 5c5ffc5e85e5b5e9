// Dealing decode attention's pieces of work to threads, included by cpu_kernels.cpp and
// decode_attention_bf16.h.
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

// Boundaries 0 = b[0] <= b[1] <= ... <= b[parts] = num_queries * kv_heads that cut the pieces (query n,
// KV head h: piece n * kv_heads + h) into `parts` contiguous runs of about equal work, a piece's work
// growing with its query's context length. Contiguous, so that a thread's pieces share their queries'
// token rows; by work, since a prompt chunk's later tokens read ever more of the cache.
inline std::vector<int64_t> balanced_runs(const int32_t* lens, int64_t num_queries, int64_t kv_heads, int64_t parts) {
  const int64_t pieces = num_queries * kv_heads;
  std::vector<int64_t> bounds(parts + 1, pieces);
  bounds[0] = 0;
  int64_t total = 0;
  for (int64_t n = 0; n < num_queries; ++n) total += piece_cost(lens[n]);
  total *= kv_heads;
  int64_t done = 0, part = 1;
  for (int64_t piece = 0; piece < pieces && part < parts; ++piece) {
    done += piece_cost(lens[piece / kv_heads]);
    while (part < parts && done * parts >= total * part) bounds[part++] = piece + 1;
  }
  return bounds;
}

}  // namespace llmq_split
