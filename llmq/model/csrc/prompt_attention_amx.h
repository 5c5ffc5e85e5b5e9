// Causal attention for bfloat16 prompt chunks on the CPU's matrix units (AMX), included by cpu_kernels.cpp
// where the tiled products run on them (tiled_linear.h).
//
// Why: the paged kernel (decode_attention_bf16.h) takes each of a chunk's tokens as a decode: for every
// query token it reads the context's keys and values again and sums each score across a register's lanes,
// so a prefill step's attention costs far more than its arithmetic. Here 16 of a chunk's tokens at a time,
// for one query head, multiply their KV head's keys (S = Q K^T) and, after an exact softmax of each row
// (every score first), the values (P V), in tiles of the matrix units. The products' sums come in another
// order than the paged kernel's, so a score, and through it a probability rounded to bfloat16, can land
// one rounding away; the softmax is the paged kernel's own (its exponential, its rounding of the
// probabilities to bfloat16).
//
// Layouts, made once per (chunk, KV head) and read by each of its query heads' tiles:
// - keys: for each 16 keys and 32 dimensions, the tile TDPBF16PS reads as its second operand: row r holds,
//   for each of the 16 keys in turn, its dimensions 2r and 2r + 1;
// - values: for each 32 keys and 16 dimensions, row r holds, for each of the 16 dimensions in turn, the
//   values of keys 2r and 2r + 1.
// Both are zero past the context, so that a tile may run over its end (the probabilities there are zero).
#pragma once

#include "decode_attention_bf16.h"
#include "tiled_linear.h"

// The matrix units' products, and the bfloat16 decode kernel's softmax (which needs ATen's AVX-512 vectors).
#if defined(LLMQ_HAS_AMX) && defined(LLMQ_HAS_BF16_DECODE_ATTENTION)
#define LLMQ_HAS_AMX_PROMPT_ATTENTION 1

#include <immintrin.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "work_split.h"

namespace llmq_prompt_amx {

using llmq_tiled::kTileElements;      // bfloat16 elements of a tile: 16 rows of 32
constexpr int64_t kTileTokens = 16;   // a tile's query rows: 16 tokens of one query head
constexpr int64_t kMostDimTiles = 4;  // a tile's queries stay in tile registers: at most 4 tiles of 32 dimensions

// In a paged call, the chunks this kernel takes rather than each of their tokens as a decode: those of at
// least this many tokens. In a call of many chunks it measured level with the decode kernel at 8 tokens a
// chunk, faster from there on, and slower at 4 (a tile of 16 rows then does a quarter of its work).
constexpr int64_t kLeastTokens = 8;

// Whether the kernel takes heads of `head_dim`: whole tiles of 32 dimensions, all of a query tile's in
// tile registers at once.
inline bool supports(int64_t head_dim) { return head_dim > 0 && head_dim % 32 == 0 && head_dim / 32 <= kMostDimTiles; }

// Whether the kernel runs here for bfloat16 heads of `head_dim`: supports(head_dim), on the matrix units.
inline bool runs_here(int64_t head_dim) { return supports(head_dim) && llmq_tiled::on_matrix_units(); }

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// A chunk's `tokens` queries from row `first` of the call, at positions num_cached .. num_cached + tokens - 1,
// and where its context's token t lies in the caches [KVH, slots, Dh]: slot table[t / block_size] *
// block_size + t % block_size, or slot t where there is no table (keys and values as [KVH, tokens, Dh]).
struct Chunk {
  int64_t first, tokens, num_cached;
  const int32_t* table;

  int64_t context() const { return num_cached + tokens; }
  int64_t slot(int64_t t, int64_t block_size) const {
    return table == nullptr ? t : static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
  }
};

// Where a (chunk, KV head)'s laid-out keys and values start in the call's buffers.
struct Layout {
  int64_t keys, values;
};

// 16 bfloat16 values in the low half of a register.
inline __m512i widen(const uint16_t* values) {
  return _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values)));
}

// Lays out `context` tokens' values (the layout above) at value_tiles, token t's row at row(t); zeros from
// the context's end to the next 32 keys. Also the matrix units' decode kernel's (decode_attention_amx.h).
template <typename Row>
void lay_out_values(int64_t context, int64_t head_dim, const Row& row, uint16_t* value_tiles) {
  const int64_t dim_blocks = head_dim / 16, pair_blocks = (context + 31) / 32;
  // Two keys' 16 dimensions interleaved per tile row.
  const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                              6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  for (int64_t vb = 0; vb < pair_blocks; ++vb)
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t a = vb * 32 + 2 * r, b = a + 1;
      const uint16_t* va = a < context ? row(a) : nullptr;
      const uint16_t* vb_row = b < context ? row(b) : nullptr;
      for (int64_t c = 0; c < dim_blocks; ++c) {
        const __m512i lo = va ? widen(va + c * 16) : _mm512_setzero_si512();
        const __m512i hi = vb_row ? widen(vb_row + c * 16) : _mm512_setzero_si512();
        _mm512_storeu_si512(value_tiles + ((vb * dim_blocks + c) * 16 + r) * 32,
                            _mm512_permutex2var_epi16(lo, interleave, hi));
      }
    }
}

// Lays out one (chunk, KV head)'s keys and values (the layouts above) at key_tiles and value_tiles.
inline void lay_out(const Chunk& chunk, const uint16_t* k_head, const uint16_t* v_head, int64_t token_stride,
                    int64_t block_size, int64_t head_dim, uint16_t* key_tiles, uint16_t* value_tiles) {
  const int64_t context = chunk.context(), dim_tiles = head_dim / 32;
  const int64_t key_blocks = (context + 15) / 16;
  // Keys: a 16 x 16 transpose of 32-bit pairs per tile (a key's 32 dimensions are one row of 16 pairs).
  for (int64_t kb = 0; kb < key_blocks; ++kb)
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t t = kb * 16 + j;
      // Past the context: zeros (its block table has no entry there).
      const uint16_t* row = t < context ? k_head + chunk.slot(t, block_size) * token_stride : nullptr;
      const auto* key = reinterpret_cast<const uint32_t*>(row);
      for (int64_t dt = 0; dt < dim_tiles; ++dt) {
        auto* tile = reinterpret_cast<uint32_t*>(key_tiles + (kb * dim_tiles + dt) * kTileElements);
        for (int64_t r = 0; r < 16; ++r) tile[r * 16 + j] = key != nullptr ? key[dt * 16 + r] : 0u;
      }
    }
  lay_out_values(context, head_dim, [&](int64_t t) { return v_head + chunk.slot(t, block_size) * token_stride; },
                 value_tiles);
}

// A query tile's scores against keys 0 .. key_blocks * 16 - 1: S [16, key_blocks * 16] (row stride `width`
// floats), its queries (16 rows of head_dim bfloat16, contiguous) held in tiles 2 .. 2 + kDimTiles - 1.
template <int kDimTiles>
void score_tile(const uint16_t* queries, const uint16_t* key_tiles, int64_t key_blocks, float* scores,
                int64_t width) {
  constexpr int64_t stride = kDimTiles * 64;  // bytes per query row
  _tile_loadd(2, queries, stride);
  if (kDimTiles > 1) _tile_loadd(3, queries + 32, stride);
  if (kDimTiles > 2) _tile_loadd(4, queries + 64, stride);
  if (kDimTiles > 3) _tile_loadd(5, queries + 96, stride);
  for (int64_t kb = 0; kb < key_blocks; kb += 2) {
    const bool two = kb + 1 < key_blocks;
    const uint16_t* first = key_tiles + kb * kDimTiles * kTileElements;
    const uint16_t* second = first + kDimTiles * kTileElements;
    _tile_zero(0);
    _tile_zero(1);
#define LLMQ_SCORE_DIMS(DT, Q)                                        \
  _tile_loadd(6, first + DT * kTileElements, 64);                     \
  _tile_dpbf16ps(0, Q, 6);                                            \
  if (two) {                                                          \
    _tile_loadd(7, second + DT * kTileElements, 64);                  \
    _tile_dpbf16ps(1, Q, 7);                                          \
  }
    LLMQ_SCORE_DIMS(0, 2)
    if (kDimTiles > 1) { LLMQ_SCORE_DIMS(1, 3) }
    if (kDimTiles > 2) { LLMQ_SCORE_DIMS(2, 4) }
    if (kDimTiles > 3) { LLMQ_SCORE_DIMS(3, 5) }
#undef LLMQ_SCORE_DIMS
    _tile_stored(0, scores + kb * 16, width * 4);
    if (two) _tile_stored(1, scores + kb * 16 + 16, width * 4);
  }
}

// Each of the tile's `rows` score rows (row i's context: lengths[i] leading scores, times `scale`) -> its
// probabilities in bfloat16 [16, width], zero past its context and in rows past `rows`: the paged
// kernel's softmax (decode_attention_bf16.h's probabilities), its padding to 16 keys included.
inline void probabilities(float* scores, int64_t rows, const int64_t* lengths, float scale, int64_t width,
                          uint16_t* probs) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < 16; ++i) {
    uint16_t* p = probs + i * width;
    const int64_t length = i < rows ? lengths[i] : 0, padded = round_up(length, 16);
    float* s = scores + i * width;
    for (int64_t t = 0; t < padded; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), scale_v));
    if (length > 0) llmq_bf16::probabilities(s, length, padded, p);
    std::fill(p + padded, p + width, uint16_t{0});
  }
}

// The tile's output, O = P V over keys 0 .. pair_blocks * 32 - 1: [16, head_dim] floats, contiguous.
inline void weigh_values(const uint16_t* probs, int64_t width, const uint16_t* value_tiles, int64_t pair_blocks,
                         int64_t dim_blocks, float* result) {
  for (int64_t c0 = 0; c0 < dim_blocks; c0 += 4) {
    const int64_t count = std::min<int64_t>(4, dim_blocks - c0);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t vb = 0; vb < pair_blocks; ++vb) {
      const uint16_t* values = value_tiles + (vb * dim_blocks + c0) * kTileElements;
      _tile_loadd(4, probs + vb * 32, width * 2);
      _tile_loadd(5, values, 64);
      _tile_dpbf16ps(0, 4, 5);
      if (count > 1) {
        _tile_loadd(6, values + kTileElements, 64);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (count > 2) {
        _tile_loadd(5, values + 2 * kTileElements, 64);
        _tile_dpbf16ps(2, 4, 5);
      }
      if (count > 3) {
        _tile_loadd(6, values + 3 * kTileElements, 64);
        _tile_dpbf16ps(3, 4, 6);
      }
    }
    const int64_t stride = dim_blocks * 16 * 4;
    _tile_stored(0, result + c0 * 16, stride);
    if (count > 1) _tile_stored(1, result + (c0 + 1) * 16, stride);
    if (count > 2) _tile_stored(2, result + (c0 + 2) * 16, stride);
    if (count > 3) _tile_stored(3, result + (c0 + 3) * 16, stride);
  }
}

// A row of `length` floats (a multiple of 16), rounded to bfloat16 at dst.
inline void store_rounded(const float* row, int64_t length, uint16_t* dst) {
  for (int64_t d = 0; d < length; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(row + d))));
}

// The chunks' attention: q [rows of the call, H, Dh] bfloat16 (strides in elements), the caches' KV head h
// at k_cache + h * head_stride (its slot s at s * token_stride), out [rows, H * Dh] (rows out_stride apart).
// Runs on the matrix units: the caller checks runs_here(head_dim).
inline void attend_chunks(const std::vector<Chunk>& chunks, const uint16_t* q, int64_t q_token_stride,
                          int64_t q_head_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                          int64_t head_stride, int64_t token_stride, int64_t block_size, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, float scale, uint16_t* out, int64_t out_stride) {
  if (chunks.empty()) return;
  const int64_t group = num_heads / num_kv_heads, dim_tiles = head_dim / 32, dim_blocks = head_dim / 16;
  // Every (chunk, KV head)'s keys and values laid out, first, in a call's buffers.
  std::vector<Layout> layouts(chunks.size() * num_kv_heads);
  int64_t key_elements = 0, value_elements = 0;
  for (size_t c = 0; c < chunks.size(); ++c)
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      layouts[c * num_kv_heads + h] = {key_elements, value_elements};
      key_elements += (chunks[c].context() + 15) / 16 * dim_tiles * kTileElements;
      value_elements += (chunks[c].context() + 31) / 32 * dim_blocks * kTileElements;
    }
  // Left unset at allocation: lay_out writes every element.
  const std::unique_ptr<uint16_t[]> key_tiles(new uint16_t[key_elements]), value_tiles(new uint16_t[value_elements]);
  at::parallel_for(0, static_cast<int64_t>(layouts.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % num_kv_heads;
      lay_out(chunks[item / num_kv_heads], k_cache + h * head_stride, v_cache + h * head_stride, token_stride,
              block_size, head_dim, key_tiles.get() + layouts[item].keys, value_tiles.get() + layouts[item].values);
    }
  });

  // Then the pieces of work: (chunk, query tile, query head), each costing about its keys, dealt to threads
  // in contiguous runs of about equal cost.
  struct Piece {
    int64_t chunk, tile, head, keys;
  };
  std::vector<Piece> pieces;
  for (size_t c = 0; c < chunks.size(); ++c)
    for (int64_t tile = 0; tile * kTileTokens < chunks[c].tokens; ++tile) {
      const int64_t keys = chunks[c].num_cached + std::min(chunks[c].tokens, (tile + 1) * kTileTokens);
      for (int64_t head = 0; head < num_heads; ++head) pieces.push_back({static_cast<int64_t>(c), tile, head, keys});
    }
  const int64_t threads = std::max(1, at::get_num_threads());
  const std::vector<int64_t> bounds = llmq_split::equal_cost_runs(
      static_cast<int64_t>(pieces.size()), threads, [&](int64_t i) { return pieces[i].keys; });
  auto score = dim_tiles == 1 ? score_tile<1> : dim_tiles == 2 ? score_tile<2> : dim_tiles == 3 ? score_tile<3>
                                                                                                   : score_tile<4>;
  at::parallel_for(0, threads, 1, [&](int64_t first_part, int64_t last_part) {
    if (bounds[first_part] == bounds[last_part]) return;
    llmq_tiled::configure_tiles();
    std::vector<uint16_t> queries(kTileTokens * head_dim), probs;
    std::vector<float> scores, result(kTileTokens * head_dim);
    int64_t lengths[kTileTokens];
    for (int64_t i = bounds[first_part]; i < bounds[last_part]; ++i) {
      const Piece& piece = pieces[i];
      const Chunk& chunk = chunks[piece.chunk];
      const int64_t kv_head = piece.head / group, first = piece.tile * kTileTokens;
      const int64_t rows = std::min(kTileTokens, chunk.tokens - first), width = round_up(piece.keys, 32);
      for (int64_t r = 0; r < kTileTokens; ++r) {
        uint16_t* dst = queries.data() + r * head_dim;
        if (r < rows)
          std::memcpy(dst, q + (chunk.first + first + r) * q_token_stride + piece.head * q_head_stride, head_dim * 2);
        else
          std::fill(dst, dst + head_dim, uint16_t{0});
        lengths[r] = chunk.num_cached + first + r + 1;
      }
      scores.resize(kTileTokens * width);
      probs.resize(kTileTokens * width);
      const Layout& layout = layouts[piece.chunk * num_kv_heads + kv_head];
      score(queries.data(), key_tiles.get() + layout.keys, (piece.keys + 15) / 16, scores.data(), width);
      probabilities(scores.data(), rows, lengths, scale, width, probs.data());
      weigh_values(probs.data(), width, value_tiles.get() + layout.values, width / 32, dim_blocks, result.data());
      for (int64_t r = 0; r < rows; ++r)
        store_rounded(result.data() + r * head_dim, head_dim,
                      out + (chunk.first + first + r) * out_stride + piece.head * head_dim);
    }
    _tile_release();
  });
}

// The chunks among a paged call's n queries that this kernel takes (kLeastTokens): runs of queries that
// read the same block table row (query_tables), each one position past the last (lens, their context
// lengths, the query included; a row the call leaves alone has none).
inline std::vector<Chunk> long_chunks(const int32_t* query_tables, const int32_t* lens, int64_t n,
                                      const int32_t* block_tables, int64_t table_stride) {
  std::vector<Chunk> chunks;
  llmq_split::for_each_chunk(query_tables, lens, n, [&](int64_t first, int64_t last) {
    if (lens[first] > 0 && last - first >= kLeastTokens)
      chunks.push_back({first, last - first, lens[first] - 1, block_tables + query_tables[first] * table_stride});
  });
  return chunks;
}

}  // namespace llmq_prompt_amx
#endif
