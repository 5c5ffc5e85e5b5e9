// A greedy step's tokens from a fraction of its LM head's product, exactly: the argmax that the whole
// product gives (tiled_linear.h's and panel_linear.h's argmax_of_product), included by cpu_kernels.cpp.
//
// The head's weight has an int8 copy (greedy_screen.py's screen_weight: each column scaled by its largest
// weight), and each row of inputs is scaled to int8 likewise. Their product (vpdpbusd: four byte pairs a
// lane, twice the bfloat16 dot products' pairs and a quarter of float32's bytes) gives every logit to
// within a bound worked out from the two roundings: |x.w - x'.w'| <= |x - x'| |w| + |x'| |w - w'|
// (Euclidean norms), plus what float32 sums may lose. A column whose logit plus its bound falls below
// some other column's logit minus its bound cannot be the argmax; the few that can are multiplied again
// by the head's own product for one row, the same arithmetic in the same order as the whole product's (so
// the same sums), and their argmax is the row's. A row whose inputs are not finite, or are all zero, or
// whose candidates are too many (a bound too loose to cut), is left to the whole product.
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define LLMQ_HAS_GREEDY_SCREEN 1
#include <immintrin.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "work_split.h"

namespace llmq_screen {

constexpr int64_t kColumns = 16;  // a block of columns: one register's int32 lanes
constexpr int64_t kQuad = 4;      // the inputs one lane sums in one instruction
constexpr int kScreenRows = 8;    // rows whose sums stay in registers, for kScreenBlocks blocks each
// Blocks a pass takes at once: 24 sums, their 3 blocks' weights and a row's broadcast inputs in 28 of
// AVX-512's 32 registers (two blocks, one broadcast to every two instructions, measured slower).
constexpr int kScreenBlocks = 3;
// A thread's blocks are taken this many bytes at a time (a block is 16 K bytes: 16 blocks at 1,024
// inputs), kept in its L2 while every group of rows passes over them.
constexpr int64_t kChunkBytes = 256 * 1024;
// Rows whose candidates span more than this share of the blocks go to the whole product: past it, their
// blocks one row at a time cost about what the whole product's pass over them would.
constexpr int64_t kMostBlocksShare = 4;
// The blocks a row's candidates are multiplied again in at a time: as many sums in flight, each a chain
// of multiply-adds that must run in the whole product's order.
constexpr int kExactBlocks = 8;

// greedy_screen.py's per-column terms, rows of a [3, N] float32 tensor: the column's scale, |w - w'| and |w|.
enum Term : int64_t { kScale = 0, kResidualNorm = 1, kNorm = 2 };

// The weight's int8 values + 128, as unsigned bytes [N/16, K/4, 16, 4] (block b, input quad t: column
// 16b + c's inputs 4t .. 4t + 3 at [b][t][c]): vpdpbusd multiplies unsigned bytes by signed ones, and the
// inputs' signed quads then come straight from memory, broadcast by the instruction itself. The 128s add
// 128 times the sum of a row's int8 inputs to each of its sums, taken off after.
struct Screen {
  const uint8_t* q;
  const float* terms;
  int64_t n, k;
  const float* term(Term t) const { return terms + t * n; }
};

inline float bfloat16_rounded(float v) {  // to nearest, ties to even, as cvtneps_pbh and c10::BFloat16 round
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000u;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// A row of inputs as the screen multiplies it: int8 values, their scale, what the weight's 128s add to
// each sum, and its bound's terms.
struct ScreenRow {
  bool usable = false;
  float scale = 0;
  int32_t offset = 0;
  // A column's bound is times_norm * |w| + times_residual_norm * |w - w'| + kLeastBound.
  float times_norm = 0;           // |x - x'|, and the float32 sums' loss
  float times_residual_norm = 0;  // |x'|
};

// Covers what flushing subnormal values to zero may change in a sum (the bfloat16 dot products do).
constexpr float kLeastBound = 1e-30f;

inline ScreenRow screen_row(const float* x, int64_t k, int8_t* quads) {
  ScreenRow row;
  float largest = 0;
  for (int64_t i = 0; i < k; ++i) {
    if (!std::isfinite(x[i])) return row;
    largest = std::max(largest, std::fabs(x[i]));
  }
  if (largest == 0) return row;  // every logit 0: each column ties, which the whole product settles
  const float scale = largest / 127;  // x' = scale * q, in the float32 scale the screen multiplies by
  const double step = scale;
  double residual = 0, rounded = 0, norm = 0;  // squared norms
  int32_t sum = 0;
  for (int64_t i = 0; i < k; ++i) {
    const double q = std::clamp(std::nearbyint(x[i] / step), -127.0, 127.0);
    quads[i] = static_cast<int8_t>(q);
    sum += quads[i];
    residual += (x[i] - q * step) * (x[i] - q * step);
    rounded += q * step * q * step;
    norm += static_cast<double>(x[i]) * x[i];
  }
  // A float32 sum of k products loses at most k units in the last place of the sum of their magnitudes
  // (at most |x| |w|): the whole product's logits are that far from the exact ones at most.
  const double sums_loss = static_cast<double>(k + 2) * std::ldexp(1.0, -23) * std::sqrt(norm);
  // The screen's own float32 roundings (its logit from the int32 sum, the bound, the range's ends) are
  // within 2^-20 of |x'| |w'| <= |x'| (|w| + |w - w'|): that much more, and a little for these sums.
  const double rounded_norm = std::sqrt(rounded), own_roundings = std::ldexp(rounded_norm, -20);
  row.usable = true;
  row.scale = scale;
  row.offset = 128 * sum;
  const double widened = 1 + std::ldexp(1.0, -16);
  row.times_norm = static_cast<float>((std::sqrt(residual) + sums_loss + own_roundings) * widened);
  row.times_residual_norm = static_cast<float>((rounded_norm + own_roundings) * widened);
  return row;
}

// What one thread keeps for a row: the largest lower end of a logit's range among the columns it has
// screened (each lane's, and all of them as of the row's last pass), the columns whose upper end reached
// the floor as it was (`kept_from`: that floor, or below it by what rounding to bfloat16 may take off),
// and their upper ends.
struct RowCandidates {
  alignas(64) float lane_floor[kColumns];
  float floor = -std::numeric_limits<float>::infinity();
  float kept_from = -std::numeric_limits<float>::infinity();
  std::vector<int32_t> columns;
  std::vector<float> highs;
  RowCandidates() { std::fill_n(lane_floor, kColumns, -std::numeric_limits<float>::infinity()); }
};

// Rows row0 .. row0 + Rows - 1 against blocks b .. b + count - 1 (count <= 3): their int32 sums, then each
// column's range, kept where it can hold the row's argmax. `rounded`: the argmax is over logits rounded to
// bfloat16, so a column within the rounding of the floor may tie it.
template <int Rows>
inline void screen_rows(const Screen& s, const int8_t* quads, const ScreenRow* rows, int64_t row0, int64_t b,
                        int count, bool rounded, RowCandidates* kept, llmq_split::NextChunkFetch& ahead) {
  const int64_t steps = s.k / kQuad;
  const uint8_t* w0 = s.q + b * steps * 64;
  const uint8_t* w1 = count > 1 ? w0 + steps * 64 : w0;  // past count, block b again (its sums unread)
  const uint8_t* w2 = count > 2 ? w0 + 2 * steps * 64 : w0;
  const int8_t* x0 = quads + row0 * s.k;
  // Named sums, not an array: GCC moves an array's registers about on every step.
  __m512i p0 = _mm512_setzero_si512(), p1 = p0, p2 = p0, p3 = p0, p4 = p0, p5 = p0, p6 = p0, p7 = p0;
  __m512i r0 = p0, r1 = p0, r2 = p0, r3 = p0, r4 = p0, r5 = p0, r6 = p0, r7 = p0;
  __m512i u0 = p0, u1 = p0, u2 = p0, u3 = p0, u4 = p0, u5 = p0, u6 = p0, u7 = p0;
  for (int64_t t = 0; t < steps; ++t) {
    ahead.step();
    const __m512i b0 = _mm512_loadu_si512(w0 + t * 64);
    const __m512i b1 = _mm512_loadu_si512(w1 + t * 64);
    const __m512i b2 = _mm512_loadu_si512(w2 + t * 64);
#define LLMQ_SCREEN_ROW(R)                                                           \
  if constexpr (Rows > R) {                                                          \
    int32_t four;                                                                    \
    std::memcpy(&four, x0 + R * s.k + t * kQuad, 4);                                 \
    const __m512i x = _mm512_set1_epi32(four);                                       \
    p##R = _mm512_dpbusd_epi32(p##R, b0, x);                                         \
    r##R = _mm512_dpbusd_epi32(r##R, b1, x);                                         \
    u##R = _mm512_dpbusd_epi32(u##R, b2, x);                                         \
  }
    LLMQ_SCREEN_ROW(0) LLMQ_SCREEN_ROW(1) LLMQ_SCREEN_ROW(2) LLMQ_SCREEN_ROW(3)
    LLMQ_SCREEN_ROW(4) LLMQ_SCREEN_ROW(5) LLMQ_SCREEN_ROW(6) LLMQ_SCREEN_ROW(7)
#undef LLMQ_SCREEN_ROW
  }
  const __m512i acc[kScreenRows][kScreenBlocks] = {{p0, r0, u0}, {p1, r1, u1}, {p2, r2, u2}, {p3, r3, u3},
                                                   {p4, r4, u4}, {p5, r5, u5}, {p6, r6, u6}, {p7, r7, u7}};
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int i = 0; i < Rows; ++i) {
    const ScreenRow& row = rows[row0 + i];
    if (!row.usable) continue;
    RowCandidates& mine = kept[row0 + i];
    __m512 lane_floor = _mm512_load_ps(mine.lane_floor);
    for (int j = 0; j < count; ++j) {
      const int64_t first = (b + j) * kColumns;
      const __m512i dot = _mm512_sub_epi32(acc[i][j], _mm512_set1_epi32(row.offset));
      const __m512 scales = _mm512_mul_ps(_mm512_set1_ps(row.scale), _mm512_loadu_ps(s.term(kScale) + first));
      const __m512 approx = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), scales);
      const __m512 bound = _mm512_fmadd_ps(_mm512_loadu_ps(s.term(kNorm) + first), _mm512_set1_ps(row.times_norm),
                                           _mm512_fmadd_ps(_mm512_loadu_ps(s.term(kResidualNorm) + first),
                                                           _mm512_set1_ps(row.times_residual_norm),
                                                           _mm512_set1_ps(kLeastBound)));
      const __m512 low = _mm512_sub_ps(approx, bound), high = _mm512_add_ps(approx, bound);
      lane_floor = _mm512_max_ps(lane_floor, low);
      // Against the floor as of the row's last pass: a lower floor keeps more columns, never too few.
      const __mmask16 keep = _mm512_cmp_ps_mask(high, _mm512_set1_ps(mine.kept_from), _CMP_GE_OQ);
      if (keep) {
        alignas(64) int32_t columns[kColumns];
        alignas(64) float highs[kColumns];
        const int taken = __builtin_popcount(keep);
        _mm512_mask_compressstoreu_epi32(columns, keep,
                                         _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(first))));
        _mm512_mask_compressstoreu_ps(highs, keep, high);
        mine.columns.insert(mine.columns.end(), columns, columns + taken);
        mine.highs.insert(mine.highs.end(), highs, highs + taken);
      }
    }
    _mm512_store_ps(mine.lane_floor, lane_floor);
    mine.floor = std::max(mine.floor, _mm512_reduce_max_ps(lane_floor));
    // Rounded to bfloat16, a logit can fall by up to half its last place (2^-8 of it, and below the
    // normal range less than 2^-133): columns that far under the floor may round to tie it.
    mine.kept_from = rounded && std::isfinite(mine.floor)
                         ? mine.floor - std::fabs(mine.floor) * 0x1p-7f - 0x1p-120f
                         : mine.floor;
  }
}

// Each row's argmax (the first column of equals) over x [M, K] (float32, contiguous) times the head the
// screen copies, into result; `rounded` where the head's argmax is over logits rounded to bfloat16.
// exact(row, blocks, count, out) writes the head's own 16 logits of each of `count` (at most kExactBlocks)
// blocks for one row, as its whole product computes them. Returns the rows left to the whole product
// (their result unset). Adds to counts[0 .. 2] the rows, the blocks multiplied again, and the rows left to
// the whole product.
template <typename Exact>
std::vector<int64_t> screened_argmax(const at::Tensor& x, const Screen& s, bool rounded, const Exact& exact,
                                     int64_t* result, int64_t* counts) {
  const int64_t m = x.size(0), k = s.k, blocks = s.n / kColumns;
  const float* values = x.data_ptr<float>();
  std::vector<int8_t> quads(m * k);
  std::vector<ScreenRow> rows(m);
  for (int64_t r = 0; r < m; ++r) rows[r] = screen_row(values + r * k, k, quads.data() + r * k);

  const int64_t block_bytes = k * kColumns;
  const int64_t threads = llmq_split::threads_for(blocks);
  const int64_t chunk_blocks =
      std::max<int64_t>(kScreenBlocks, kChunkBytes / block_bytes / kScreenBlocks * kScreenBlocks);
  const llmq_split::EqualChunks cut(blocks, chunk_blocks, threads, 4);
  llmq_split::StealingRuns shares(cut.chunks, threads);
  std::vector<std::vector<RowCandidates>> kept(threads, std::vector<RowCandidates>(m));
  llmq_split::for_each_run(threads, [&](int64_t own) {
    RowCandidates* mine = kept[own].data();
    for (int64_t chunk = shares.next(own); chunk >= 0; chunk = shares.next(own)) {
      const int64_t first = cut.first(chunk), last = std::min(blocks, first + cut.per_chunk);
      llmq_split::NextChunkFetch ahead;  // the next chunk, while this one is screened
      if (shares.is_next_of(own, chunk + 1)) {
        const auto* screen = reinterpret_cast<const char*>(s.q);
        const int64_t passes = (last - first + kScreenBlocks - 1) / kScreenBlocks;
        ahead = llmq_split::NextChunkFetch(screen + last * block_bytes,
                                           screen + std::min(blocks, last + cut.per_chunk) * block_bytes,
                                           (m + kScreenRows - 1) / kScreenRows * passes * (k / kQuad));
      }
      for (int64_t row0 = 0; row0 < m; row0 += kScreenRows) {
        for (int64_t b = first; b < last; b += kScreenBlocks) {
          const int count = static_cast<int>(std::min<int64_t>(kScreenBlocks, last - b));
#define LLMQ_SCREEN_ROWS(R) screen_rows<R>(s, quads.data(), rows.data(), row0, b, count, rounded, mine, ahead); break;
          switch (std::min<int64_t>(kScreenRows, m - row0)) {
            case 1: LLMQ_SCREEN_ROWS(1)
            case 2: LLMQ_SCREEN_ROWS(2)
            case 3: LLMQ_SCREEN_ROWS(3)
            case 4: LLMQ_SCREEN_ROWS(4)
            case 5: LLMQ_SCREEN_ROWS(5)
            case 6: LLMQ_SCREEN_ROWS(6)
            case 7: LLMQ_SCREEN_ROWS(7)
            default: LLMQ_SCREEN_ROWS(8)
          }
#undef LLMQ_SCREEN_ROWS
        }
      }
    }
  });

  // Each row: its floor over every thread's columns, the candidates whose range reaches it, and their blocks'
  // logits from the head itself.
  std::vector<uint8_t> left_over(m, 0);
  std::vector<int64_t> recomputed(m, 0);
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> columns;
    std::vector<int64_t> row_blocks;
    alignas(64) float logits[kExactBlocks][kColumns];
    for (int64_t r = begin; r < end; ++r) {
      if (!rows[r].usable) {
        left_over[r] = 1;
        continue;
      }
      float floor = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < threads; ++t) floor = std::max(floor, kept[t][r].floor);
      const float floor_kept = rounded ? bfloat16_rounded(floor) : floor;
      columns.clear();
      for (int64_t t = 0; t < threads; ++t) {
        const RowCandidates& c = kept[t][r];
        for (size_t i = 0; i < c.columns.size(); ++i)
          if ((rounded ? bfloat16_rounded(c.highs[i]) : c.highs[i]) >= floor_kept) columns.push_back(c.columns[i]);
      }
      std::sort(columns.begin(), columns.end());
      row_blocks.clear();
      for (const int32_t column : columns)
        if (row_blocks.empty() || row_blocks.back() != column / kColumns) row_blocks.push_back(column / kColumns);
      const int64_t distinct = static_cast<int64_t>(row_blocks.size());
      if (distinct == 0 || distinct > blocks / kMostBlocksShare) {
        left_over[r] = 1;
        continue;
      }
      // The blocks in column order, each whole: a column of one that is not a candidate is below the floor,
      // so below the row's maximum, and cannot tie it. Strictly larger replaces, so equals keep the first.
      float best = -std::numeric_limits<float>::infinity();
      int64_t best_column = -1;
      for (int64_t i = 0; i < distinct; i += kExactBlocks) {
        const int count = static_cast<int>(std::min<int64_t>(kExactBlocks, distinct - i));
        exact(r, row_blocks.data() + i, count, logits);
        for (int j = 0; j < count; ++j)
          for (int64_t c = 0; c < kColumns; ++c) {
            const float v = rounded ? bfloat16_rounded(logits[j][c]) : logits[j][c];
            if (v > best) best = v, best_column = row_blocks[i + j] * kColumns + c;
          }
      }
      recomputed[r] = distinct;
      if (best_column < 0) left_over[r] = 1;
      else result[r] = best_column;
    }
  });
  std::vector<int64_t> whole;
  for (int64_t r = 0; r < m; ++r)
    if (left_over[r]) whole.push_back(r);
  counts[0] += m;
  for (int64_t r = 0; r < m; ++r) counts[1] += recomputed[r];
  counts[2] += static_cast<int64_t>(whole.size());
  return whole;
}

}  // namespace llmq_screen
#endif
