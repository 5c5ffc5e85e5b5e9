// Asking for the next piece of decode attention's keys and values ahead of it, included by cpu_kernels.cpp
// and the bfloat16 decode kernels (decode_attention_bf16.h, decode_attention_amx.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace llmq_prefetch {

// Every line of the cache blocks that one (sequence, KV head) reads: its `length` tokens through `table`,
// each block `block_bytes` long from the head's start (k_head, v_head), asked for into L2 a few at a time
// (`next`) while the piece before it computes, in the order they will be read: its blocks lie anywhere in
// the cache, where the hardware's prefetcher cannot see them coming. Asked for all at once, most requests
// find the core's queue to memory full and are dropped (on an AVX2 EPYC, decode attention took as long as
// with none at all).
class ContextFetch {
 public:
  ContextFetch() = default;
  ContextFetch(const char* k_head, const char* v_head, const int32_t* table, int64_t length, int64_t block_size,
               int64_t block_bytes)
      : k_head_(k_head), v_head_(v_head), table_(table), blocks_((length + block_size - 1) / block_size),
        block_bytes_(block_bytes) {}

  // Lines of each of the keys and the values: what `next` has to ask for in all.
  int64_t lines() const { return blocks_ * ((block_bytes_ + 63) / 64); }

  // Asks for the next `count` lines of the keys and as many of the values. A block's address is worked out
  // once, and the position kept in locals: the kernels call this between every few keys, and a loop that
  // looked up the table and stored the position for every line cost more than the keys' arithmetic.
  void next(int64_t count) {
    int64_t block = block_, offset = offset_;
    while (count > 0 && block < blocks_) {
      const int64_t at = static_cast<int64_t>(table_[block]) * block_bytes_;
      const char* k = k_head_ + at;
      const char* v = v_head_ + at;
      for (; count > 0 && offset < block_bytes_; --count, offset += 64) {
        __builtin_prefetch(k + offset, 0, 2);
        __builtin_prefetch(v + offset, 0, 2);
      }
      if (offset >= block_bytes_) {
        offset = 0;
        ++block;
      }
    }
    block_ = block;
    offset_ = offset;
  }

 private:
  const char* k_head_ = nullptr;
  const char* v_head_ = nullptr;
  const int32_t* table_ = nullptr;
  int64_t blocks_ = 0, block_bytes_ = 0, block_ = 0, offset_ = 0;
};

// Whether query n is the first to read its block table row (query_tables[n], or n's own where there are
// none): a decode always is; a prompt chunk's later tokens re-read the blocks their predecessor just read,
// which are still in L2, and asking for them again costs more than it saves.
inline bool first_of_its_table(const int32_t* query_tables, int64_t n) {
  return query_tables == nullptr || n == 0 || query_tables[n] != query_tables[n - 1];
}

// The keys and values that a layer's decode attention will read, asked for while the layer before it
// multiplies (cpu_kernels.cpp: its down projection). Decode attention waits on memory (its blocks lie
// anywhere in the cache, a few KiB each) and the products wait on their arithmetic: read during a product,
// the blocks are in the caches (L2, and L3 as L2 lets them go) when attention comes. Each thread of the products asks for its
// share, a step's worth at every step of their passes (step(share)), in the order attention will take
// them: the queries' (query, KV head) pieces cut into `shares` contiguous runs of equal lines.
class KvWarmup {
 public:
  static constexpr int64_t kMostShares = 8;  // threads that can take a share (more take none)

  KvWarmup(const char* k_cache, const char* v_cache, int64_t head_bytes, const int32_t* tables, int64_t table_stride,
           const int32_t* lens, int64_t queries, int64_t kv_heads, int64_t block_size, int64_t block_bytes,
           int64_t shares, int64_t steps_per_share)
      : k_(k_cache), v_(v_cache), head_bytes_(head_bytes), tables_(tables), table_stride_(table_stride), lens_(lens),
        kv_heads_(kv_heads), block_size_(block_size), block_bytes_(block_bytes),
        shares_(std::clamp<int64_t>(shares, 1, kMostShares)) {
    shares = shares_;
    const int64_t pieces = queries * kv_heads, lines_per_block = (block_bytes + 63) / 64;
    std::vector<int64_t> lines(pieces + 1, 0);  // lines before piece p
    for (int64_t p = 0; p < pieces; ++p) lines[p + 1] = lines[p] + blocks_of(p / kv_heads) * lines_per_block;
    int64_t piece = 0;
    for (int64_t s = 0; s < shares; ++s) {
      Cursor& c = cursors_[s];
      c.piece = piece;
      while (piece < pieces && lines[piece + 1] * shares <= lines[pieces] * (s + 1)) ++piece;
      if (s == shares - 1) piece = pieces;
      c.end = piece;
      const int64_t own_lines = lines[c.end] - lines[c.piece];
      c.per_step = (own_lines + steps_per_share - 1) / std::max<int64_t>(1, steps_per_share);
    }
  }

  // Share `share`'s next lines: per_step of the keys and as many of the values, each line's address handed
  // to ask. By default asked for as prefetcht2 asks: into the outer caches, not into L1, where the products
  // keep their own lines.
  void step(int64_t share) {
    step(share, [](const char* line) { __builtin_prefetch(line, 0, 1); });
  }

  template <typename Ask>
  void step(int64_t share, const Ask& ask) {
    if (share >= shares_) return;
    Cursor& c = cursors_[share];
    for (int64_t count = c.per_step; count > 0 && c.piece < c.end;) {
      const int64_t n = c.piece / kv_heads_, head = c.piece % kv_heads_;
      if (c.block >= blocks_of(n)) {
        ++c.piece;
        c.block = c.offset = 0;
        continue;
      }
      const int64_t at = head * head_bytes_ + static_cast<int64_t>(tables_[n * table_stride_ + c.block]) * block_bytes_;
      for (; count > 0 && c.offset < block_bytes_; --count, c.offset += 64) {
        ask(k_ + at + c.offset);
        ask(v_ + at + c.offset);
      }
      if (c.offset >= block_bytes_) {
        c.offset = 0;
        ++c.block;
      }
    }
  }

 private:
  int64_t blocks_of(int64_t n) const { return lens_[n] > 0 ? (lens_[n] + block_size_ - 1) / block_size_ : 0; }

  struct alignas(64) Cursor {  // a cache line each: the threads write theirs at every step
    int64_t piece = 0, end = 0, block = 0, offset = 0, per_step = 0;
  };
  const char* k_;
  const char* v_;
  int64_t head_bytes_;
  const int32_t* tables_;
  int64_t table_stride_;
  const int32_t* lens_;
  int64_t kv_heads_, block_size_, block_bytes_, shares_;
  Cursor cursors_[kMostShares];
};

// The warm-up the products step while it is set (KvWarmupScope): one at a time, set and cleared by the
// calling thread between the products' parallel regions.
inline KvWarmup*& active_kv_warmup() {
  static KvWarmup* active = nullptr;
  return active;
}

struct KvWarmupScope {
  explicit KvWarmupScope(KvWarmup* warmup) { active_kv_warmup() = warmup; }
  ~KvWarmupScope() { active_kv_warmup() = nullptr; }
  KvWarmupScope(const KvWarmupScope&) = delete;
  KvWarmupScope& operator=(const KvWarmupScope&) = delete;
};

}  // namespace llmq_prefetch
