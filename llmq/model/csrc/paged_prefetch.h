// Asking for the next piece of decode attention's keys and values ahead of it, included by cpu_kernels.cpp
// and the bfloat16 decode kernels (decode_attention_bf16.h, decode_attention_amx.h).
#pragma once

#include <cstdint>

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

}  // namespace llmq_prefetch
