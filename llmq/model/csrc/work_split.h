// Dealing pieces of work to threads (a product's column runs, attention's queries), and finding a paged
// call's prompt chunks, included by cpu_kernels.cpp, tiled_linear.h, decode_attention_bf16.h and the
// prompt kernels.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
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

// Units 0 .. units - 1 cut into `chunks` chunks of per_chunk units (the last one may be shorter): none
// longer than `longest` units, at least `least_each` for each of `threads` threads, and as many for each
// (where there are units enough), so that equal runs of them (StealingRuns) are nearly equal work.
struct EqualChunks {
  int64_t per_chunk, chunks;

  EqualChunks(int64_t units, int64_t longest, int64_t threads, int64_t least_each = 1) {
    threads = std::max<int64_t>(1, threads);
    const int64_t wanted = std::max((units + longest - 1) / std::max<int64_t>(1, longest), least_each * threads);
    const int64_t runs = (wanted + threads - 1) / threads * threads;
    per_chunk = std::max<int64_t>(1, (units + runs - 1) / runs);
    chunks = (units + per_chunk - 1) / per_chunk;
  }

  int64_t first(int64_t chunk) const { return chunk * per_chunk; }
};

// Chunks 0 .. chunks - 1 in `parts` contiguous runs of (nearly) equal length, each taken front to back by
// its own thread, so that a thread reads its run in order and its prefetches run on into its own next
// chunk. A thread whose run is done takes chunks from the back of the run with the most left: two cores
// need not run at one speed (one shared with a busy neighbour, or a hybrid CPU's smaller core), and with
// fixed shares the faster would wait for the slower.
class StealingRuns {
 public:
  StealingRuns(int64_t chunks, int64_t parts) : StealingRuns(even_bounds(chunks, parts)) {}

  // Runs cut at bounds[0] = 0 <= bounds[1] <= ... <= bounds.back() = chunks (equal_cost_runs's).
  explicit StealingRuns(const std::vector<int64_t>& bounds)
      : runs_(std::max<int64_t>(1, static_cast<int64_t>(bounds.size()) - 1)) {
    for (size_t p = 0; p + 1 < bounds.size(); ++p) runs_[p].bounds.store(pack(bounds[p], bounds[p + 1]));
  }

  int64_t parts() const { return static_cast<int64_t>(runs_.size()); }

  // Whether `chunk` is next in run `own`, so that its thread will most likely be handed it (others take
  // from the back): worth asking for its data ahead.
  bool is_next_of(int64_t own, int64_t chunk) const {
    const uint64_t seen = runs_[own].bounds.load(std::memory_order_relaxed);
    return front(seen) == chunk && chunk < back(seen);
  }

  // The next chunk for the thread of run `own`, or -1 once every chunk has been taken.
  int64_t next(int64_t own) {
    if (const int64_t chunk = take(own, /*from_front=*/true); chunk >= 0) return chunk;
    for (;;) {
      int64_t fullest = -1, most = 0;
      for (int64_t p = 0; p < parts(); ++p) {
        const uint64_t seen = runs_[p].bounds.load(std::memory_order_relaxed);
        if (back(seen) - front(seen) > most) most = back(seen) - front(seen), fullest = p;
      }
      if (fullest < 0) return -1;
      if (const int64_t chunk = take(fullest, /*from_front=*/false); chunk >= 0) return chunk;
    }
  }

 private:
  // A run's next chunk (front) and one past its last (back), in one word so that its owner and a thief
  // never both take the last chunk. Each chunk is taken once; what a thread writes for it is published by
  // the parallel region's closing barrier, so the order asked of these atomics is relaxed.
  struct alignas(64) Run {
    std::atomic<uint64_t> bounds{0};
  };
  static std::vector<int64_t> even_bounds(int64_t chunks, int64_t parts) {
    parts = std::max<int64_t>(1, parts);
    std::vector<int64_t> bounds(parts + 1);
    for (int64_t p = 0; p <= parts; ++p) bounds[p] = chunks * p / parts;
    return bounds;
  }
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | static_cast<uint64_t>(back) << 32;
  }
  static int64_t front(uint64_t bounds) { return static_cast<int64_t>(bounds & 0xffffffffu); }
  static int64_t back(uint64_t bounds) { return static_cast<int64_t>(bounds >> 32); }

  int64_t take(int64_t p, bool from_front) {
    std::atomic<uint64_t>& bounds = runs_[p].bounds;
    uint64_t seen = bounds.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t first = front(seen), end = back(seen);
      if (first >= end) return -1;
      const uint64_t left = from_front ? pack(first + 1, end) : pack(first, end - 1);
      if (bounds.compare_exchange_weak(seen, left, std::memory_order_relaxed)) return from_front ? first : end - 1;
    }
  }

  std::vector<Run> runs_;
};

// The threads worth starting for `pieces` pieces of work: as many as torch runs, but none without a piece.
inline int64_t threads_for(int64_t pieces) {
  return std::max<int64_t>(1, std::min<int64_t>(pieces, at::get_num_threads()));
}

// Whether for_each_run gives every run to the calling thread (tests: the order in which a thread done early
// meets the others' chunks, made certain).
inline std::atomic<bool>& one_thread_takes_every_run() {
  static std::atomic<bool> set{false};
  return set;
}

// body(own) for each of `parts` runs of a StealingRuns, each on a thread of its own; body takes chunks with
// next(own) until there are none. Where one thread gets them all, it takes its own run, then the others'.
template <typename Body>
void for_each_run(int64_t parts, const Body& body) {
  if (one_thread_takes_every_run().load(std::memory_order_relaxed)) return body(0);
  at::parallel_for(0, parts, 1, [&](int64_t own, int64_t) { body(own); });
}

// A thread's next chunk of a weight, [next, end), asked for into L2 `lines_per_step` lines of 64 bytes at
// every step of the passes over its present chunk (none where lines_per_step is 0): the memory's reads
// then overlap all of the chunk's arithmetic, not only its first pass's (the later ones find it in L2).
struct NextChunkFetch {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t lines_per_step = 0;

  NextChunkFetch() = default;
  // [from, to) asked for over `steps` steps, evenly (the last ones may ask for none).
  NextChunkFetch(const char* from, const char* to, int64_t steps)
      : next(from), end(to), lines_per_step(((to - from) / 64 + steps - 1) / std::max<int64_t>(1, steps)) {}

  void step() {
    for (int64_t i = 0; i < lines_per_step && next < end; ++i, next += 64) __builtin_prefetch(next, 0, 2);
  }
};

}  // namespace llmq_split
