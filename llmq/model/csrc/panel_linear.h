// float32 matrix products for weights laid out in panels once at load (llmq/model/cpu_prepack.py's
// panel_weight), on the fused multiply-adds of AVX2 or AVX-512, included by cpu_kernels.cpp: float32
// weights, or bfloat16 ones widened as they are read (a CPU without AVX512-BF16 has no bfloat16 arithmetic,
// and torch's bfloat16 product there is far slower than its float32 one; the weight read from memory is
// still half the bytes). Where the CPU has AVX512-BF16, bfloat16 weights go in tiles instead
// (tiled_linear.h), so on such a CPU these take the float32 ones.
//
// Why a kernel of our own: a decode step's products have few rows, and oneDNN's float32 product over its
// prepacked weight runs them well below the arithmetic's speed: on an AVX2 CPU it was slower than this one
// at every row count measured, prefill's included; on an AVX-512 one, at up to 64 rows, and level at 128
// to 256 (benchmarks/product_shapes.py prints both). Here each thread streams its own contiguous run of
// panels, every weight element is loaded once per group of rows, and a call costs little more than its
// panels.
//
// Layout: weight [N, K] -> panels [N / 16, K, 16]: panel p holds output columns 16p .. 16p + 15, one row of
// 16 per input. A block of kRows input rows times one panel keeps its kRows x 16 sums in registers (a
// vector a row on AVX-512, two 8-lane vectors on AVX2) while the panel streams past once.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
// On AVX-512 a panel row is one 16-lane vector (panel_rows below, in its AVX-512 form), and the input rows
// are read packed (inputs_for_panels); the blocking and the threads' shares are the same on both.
#define LLMQ_HAS_PANEL_LINEAR 1
#include <immintrin.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "lane_maxima.h"
#include "work_split.h"

namespace llmq_panels {

constexpr int64_t kPanelColumns = 16;
#if defined(__AVX512F__)
// Rows whose sums stay in registers: a vector a row, 12 of AVX-512's 32; each input is broadcast from
// memory by its multiply-add.
constexpr int kRows = 12;
// A thread's panels are taken in runs of at most this many bytes, kept in its L2 while every group of
// rows passes over them (the input rows of a group come from L1/L2 as well).
constexpr int64_t kRunBytes = 1024 * 1024;
// A float32 product takes the inputs (K) this many at a time: a slice of a panel (16 KB) that every block
// of rows reads from L1 beside the block's inputs for it (12 KB). Unsliced, a panel of large K (the 1.1 B
// model's down projection: 5,632 inputs, 352 KB) does not fit in L2 beside the next one being fetched,
// and each group of rows would read it from memory again.
constexpr int64_t kSliceInputs = 256;
#else
// Rows whose sums stay in registers: 6 rows x 2 vectors = 12 of AVX2's 16, the other 4 for the panel's two
// vectors and the broadcast input.
constexpr int kRows = 6;
// As above, for the smaller L2 of the AVX2 CPU these were measured on.
constexpr int64_t kRunBytes = 192 * 1024;
// As above: slices of 32 KB.
constexpr int64_t kSliceInputs = 512;
#endif
// The chunks a thread's run of panels is cut into at the least: the slower thread's last chunks are what
// a faster one can take over from it.
constexpr int64_t kChunksEach = 4;
constexpr int64_t kCacheLine = 64;

// Eight of a panel row's weights as float32: float32 as they are, bfloat16 (held as uint16_t) widened.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

#if defined(__AVX512F__)
// Sixteen of a panel row's weights as float32: float32 as they are, bfloat16 (held as uint16_t) widened.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// A row's 16 outputs of a panel; bfloat16 ones rounded to nearest, ties to even, NaN to the quiet NaN, as
// c10::BFloat16 rounds.
inline void store16(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
inline void store16(uint16_t* out, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(rounded));
}

// Rows (at most kRows) rows of inputs packed step by step (`packed`: step i's Rows inputs at i * Rows, as
// inputs_for_panels lays them out) times one panel [K, 16] of W (float32 or bfloat16) -> out's 16 columns of
// those rows (row stride ldo, in O), plus bias (16 values) where given; added to what out holds where
// `accumulate` (a float32 output: an earlier slice's sums).
// Where `ahead` is given, the pass also asks for ahead_lines cache lines from there (part of the next
// panel) as it goes, evenly spaced over its K steps, so that they come from memory while this panel is
// multiplied.
template <int Rows, typename W, typename O>
inline void panel_rows(const float* packed, const W* panel, int64_t k, const float* bias, O* out, int64_t ldo,
                       const char* ahead, int64_t ahead_lines, bool accumulate) {
  // Named sums, not an array: GCC keeps an array of vectors in memory and stores it on every step.
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0,
         c9 = c0, c10 = c0, c11 = c0;
  static_assert(Rows <= 12, "panel_rows: at most 12 rows on AVX-512");
  if constexpr (std::is_same_v<O, float>) {
    if (accumulate) {
#define LLMQ_PANEL_SUMS(R) \
  if constexpr (Rows > R) c##R = _mm512_loadu_ps(out + R * ldo);
      LLMQ_PANEL_SUMS(0) LLMQ_PANEL_SUMS(1) LLMQ_PANEL_SUMS(2) LLMQ_PANEL_SUMS(3)
      LLMQ_PANEL_SUMS(4) LLMQ_PANEL_SUMS(5) LLMQ_PANEL_SUMS(6) LLMQ_PANEL_SUMS(7)
      LLMQ_PANEL_SUMS(8) LLMQ_PANEL_SUMS(9) LLMQ_PANEL_SUMS(10) LLMQ_PANEL_SUMS(11)
#undef LLMQ_PANEL_SUMS
    }
  }
  if (ahead == nullptr) ahead_lines = 0;
  // The K steps in stretches of fetch_every, each after one line of `ahead`, so that the steps themselves
  // run without a branch.
  const int64_t fetch_every = ahead_lines > 0 ? std::max<int64_t>(1, k / ahead_lines) : k;
  const W* w = panel;
  const float* x = packed;
  int64_t fetched = 0;
  for (int64_t start = 0; start < k; start += fetch_every) {
    if (fetched < ahead_lines) _mm_prefetch(ahead + fetched++ * kCacheLine, _MM_HINT_T0);
    const W* stretch_end = panel + std::min(k, start + fetch_every) * kPanelColumns;
    for (; w != stretch_end; w += kPanelColumns, x += Rows) {
      const __m512 row = load16(w);
#define LLMQ_PANEL_ROW(R) \
  if constexpr (Rows > R) c##R = _mm512_fmadd_ps(_mm512_set1_ps(x[R]), row, c##R);
      LLMQ_PANEL_ROW(0) LLMQ_PANEL_ROW(1) LLMQ_PANEL_ROW(2) LLMQ_PANEL_ROW(3)
      LLMQ_PANEL_ROW(4) LLMQ_PANEL_ROW(5) LLMQ_PANEL_ROW(6) LLMQ_PANEL_ROW(7)
      LLMQ_PANEL_ROW(8) LLMQ_PANEL_ROW(9) LLMQ_PANEL_ROW(10) LLMQ_PANEL_ROW(11)
#undef LLMQ_PANEL_ROW
    }
  }
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 sums[12] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11};
  for (int r = 0; r < Rows; ++r) store16(out + r * ldo, _mm512_add_ps(sums[r], b));
}

// The first `count` of a few chains' sums into out[j]: a loop over all of them, unrolled, storing those
// below `count`. A loop to `count` itself would leave the sums an array in memory, stored back at every
// step (tiled_linear.h, dot_rows).
template <int Most>
inline void store_first_sums(float (*out)[16], const __m512 (&sums)[Most], int count) {
#pragma GCC unroll 16
  for (int j = 0; j < Most; ++j)
    if (j < count) _mm512_storeu_ps(out[j], sums[j]);
}

// One row of float32 inputs (k of them) times `count` (at most 8) float32 panels, `which`, into out[j]: each
// panel's 16 sums made as panel_rows makes them, one multiply-add an input in order (its slices carry the
// sums on exactly), so they are the same sums (greedy_screen.h multiplies a row's candidate panels again
// with it). The panels' chains run side by side.
inline void row_times_panels(const float* a, int64_t k, const float* panels, const int64_t* which, int count,
                             float (*out)[16]) {
  constexpr int kMost = 8;
  const float* p[kMost];
  __m512 acc[kMost];
  for (int j = 0; j < kMost; ++j) {  // past `count`, the last panel again: the chains cost nothing extra
    p[j] = panels + which[std::min(j, count - 1)] * k * kPanelColumns;
    acc[j] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < k; ++i) {
    const __m512 x = _mm512_set1_ps(a[i]);
#pragma GCC unroll 8
    for (int j = 0; j < kMost; ++j) acc[j] = _mm512_fmadd_ps(x, _mm512_loadu_ps(p[j] + i * kPanelColumns), acc[j]);
  }
  store_first_sums(out, acc, count);
}

#else
// Eight float32 sums rounded to bfloat16 bits in the low halves of their lanes: to nearest, ties to even,
// NaN to the quiet NaN, as c10::BFloat16 rounds.
inline __m256i bfloat16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

// A row's 16 outputs of a panel: columns 0-7 in lo, 8-15 in hi.
inline void store16(float* out, __m256 lo, __m256 hi) {
  _mm256_storeu_ps(out, lo);
  _mm256_storeu_ps(out + 8, hi);
}
inline void store16(uint16_t* out, __m256 lo, __m256 hi) {
  // packus interleaves the two by 128-bit lane (lo 0-3, hi 0-3, lo 4-7, hi 4-7); the permute puts them in order.
  const __m256i packed = _mm256_packus_epi32(bfloat16_bits(lo), bfloat16_bits(hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(packed, 0xD8));
}

// Rows (at most kRows) rows of a (float32, row stride lda) times one panel [K, 16] of W (float32 or
// bfloat16) -> out's 16 columns of those rows (row stride ldo, in O), plus bias (16 values) where given;
// added to what out holds where `accumulate` (a float32 output: an earlier slice's sums).
// Where `ahead` is given, the pass also asks for ahead_lines cache lines from there (part of the next
// panel) as it goes, evenly spaced over its K steps, so that they come from memory while this panel is
// multiplied.
template <int Rows, typename W, typename O>
inline void panel_rows(const float* a, int64_t lda, const W* panel, int64_t k, const float* bias, O* out,
                       int64_t ldo, const char* ahead, int64_t ahead_lines, bool accumulate) {
  // Named sums, not an array: GCC keeps an array of vectors in memory and stores it on every step.
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  if constexpr (std::is_same_v<O, float>) {
    if (accumulate) {
#define LLMQ_PANEL_SUMS(R)                                                       \
  if constexpr (Rows > R) {                                                      \
    c##R##0 = _mm256_loadu_ps(out + R * ldo);                                    \
    c##R##1 = _mm256_loadu_ps(out + R * ldo + 8);                                \
  }
      LLMQ_PANEL_SUMS(0) LLMQ_PANEL_SUMS(1) LLMQ_PANEL_SUMS(2) LLMQ_PANEL_SUMS(3) LLMQ_PANEL_SUMS(4) LLMQ_PANEL_SUMS(5)
#undef LLMQ_PANEL_SUMS
    }
  }
  if (ahead == nullptr) ahead_lines = 0;
  // The K steps in stretches of fetch_every, each after one line of `ahead`, so that the steps themselves
  // run without a branch. Row r's input for step i is at p[r * lda]: two pointers walk rows 0 and 1, and
  // every row is one of them plus 0, 2 or 4 rows (an address the load computes itself).
  const int64_t fetch_every = ahead_lines > 0 ? std::max<int64_t>(1, k / ahead_lines) : k;
  const float* p0 = a;
  const float* p1 = a + lda;
  const W* w = panel;
  int64_t fetched = 0;
  for (int64_t start = 0; start < k; start += fetch_every) {
    if (fetched < ahead_lines) _mm_prefetch(ahead + fetched++ * kCacheLine, _MM_HINT_T0);
    const W* stretch_end = panel + std::min(k, start + fetch_every) * kPanelColumns;
    for (; w != stretch_end; w += kPanelColumns, ++p0, ++p1) {
      const __m256 w0 = load8(w);
      const __m256 w1 = load8(w + 8);
#define LLMQ_PANEL_ROW(R, BASE, OFFSET)                          \
  if constexpr (Rows > R) {                                      \
    const __m256 x = _mm256_broadcast_ss(BASE + OFFSET);         \
    c##R##0 = _mm256_fmadd_ps(x, w0, c##R##0);                   \
    c##R##1 = _mm256_fmadd_ps(x, w1, c##R##1);                   \
  }
      LLMQ_PANEL_ROW(0, p0, 0)
      LLMQ_PANEL_ROW(1, p1, 0)
      LLMQ_PANEL_ROW(2, p0, 2 * lda)
      LLMQ_PANEL_ROW(3, p1, 2 * lda)
      LLMQ_PANEL_ROW(4, p0, 4 * lda)
      LLMQ_PANEL_ROW(5, p1, 4 * lda)
#undef LLMQ_PANEL_ROW
    }
  }
  const __m256 b0 = bias != nullptr ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias != nullptr ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  const __m256 sums[6][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int r = 0; r < Rows; ++r) store16(out + r * ldo, _mm256_add_ps(sums[r][0], b0), _mm256_add_ps(sums[r][1], b1));
}
#endif  // AVX-512, else AVX2

// The inputs a product of output O takes at a time (kSliceInputs): a float32 output holds a slice's sums
// until the next adds to them; a bfloat16 one, rounded, cannot, and takes all of K at once.
template <typename O>
inline int64_t slice_inputs(int64_t k) {
  return std::is_same_v<O, float> ? std::min(k, kSliceInputs) : k;
}

// How a pass's rows go into blocks of at most kRows, as even as they divide: 26 rows go as 6+5+5+5+5 (at
// AVX2's 6), not 6+6+6+6+2. The first `extra` blocks hold base + 1 rows, the others base.
struct RowBlocks {
  int64_t count, base, extra;
  explicit RowBlocks(int64_t rows) : count((rows + kRows - 1) / kRows), base(rows / count), extra(rows % count) {}
  int64_t rows_of(int64_t block) const { return base + (block < extra ? 1 : 0); }
  int64_t first_row(int64_t block) const { return block * base + std::min(block, extra); }
  int64_t block_of(int64_t row) const {
    const int64_t in_longer = extra * (base + 1);
    return row < in_longer ? row / (base + 1) : extra + (row - in_longer) / base;
  }
};

// f(std::integral_constant<int, rows>) for a count of rows from 1 to Max: panel_rows (and the tiled
// products' passes) take their rows as a constant, so that a loop holds exactly their multiply-adds.
template <int Max, typename F>
inline void with_rows(int64_t rows, const F& f) {
  if constexpr (Max > 1) {
    if (rows < Max) return with_rows<Max - 1>(rows, f);
  }
  TORCH_CHECK(rows == Max, "with_rows: ", rows, " rows in one pass, out of its range");
  f(std::integral_constant<int, Max>{});
}

// Rows of a (as inputs_for_panels gives them) times one panel into out, a slice of K at a time
// (slice_inputs) and in each slice `rows` of them in blocks (RowBlocks). A block of few rows has too few
// sums for the multiply-adds in flight to hide each one's latency (its chain of sums waits on itself), so
// it costs nearly what a full block does (on AVX2, blocks of 5 cost no more per row than blocks of 6).
// The passes also fetch the ahead_bytes at `ahead` (nullptr: none), each pass an equal share. Spread over
// every pass, not asked for all at once in the first, the requests stay within what the core can have in
// flight to memory (more are dropped or stall it), and the memory's transfers overlap all of the panel's
// arithmetic (benchmarks/product_shapes.py measures products whose weights come from memory).
template <typename W, typename O>
inline void panel_times_rows(const float* a, int64_t rows, int64_t k, const W* panel, const float* bias, O* out,
                             int64_t ldo, const char* ahead, int64_t ahead_bytes) {
  const int64_t slice = slice_inputs<O>(k), slices = (k + slice - 1) / slice;
  const int64_t lines = ahead != nullptr ? (ahead_bytes + kCacheLine - 1) / kCacheLine : 0;
  const RowBlocks blocks(rows);
  const int64_t lines_per_pass = (lines + blocks.count * slices - 1) / (blocks.count * slices);
  for (int64_t first = 0; first < k; first += slice) {
    const int64_t inputs = std::min(slice, k - first);
    const W* panel_slice = panel + first * kPanelColumns;
    const float* slice_bias = first + inputs == k ? bias : nullptr;  // added once, with the last slice
    for (int64_t block = 0; block < blocks.count; ++block) {
      const int64_t r = blocks.first_row(block);
      O* rows_out = out + r * ldo;
      const int64_t pass = first / slice * blocks.count + block;
      const int64_t first_line = std::min(lines, pass * lines_per_pass);
      const int64_t fetch_lines = std::min(lines_per_pass, lines - first_line);
      const char* fetch = fetch_lines > 0 ? ahead + first_line * kCacheLine : nullptr;
      with_rows<kRows>(blocks.rows_of(block), [&](auto rows_constant) {
        constexpr int kBlockRows = decltype(rows_constant)::value;
#if defined(__AVX512F__)
        panel_rows<kBlockRows>(a + first * rows + r * inputs, panel_slice, inputs, slice_bias, rows_out, ldo, fetch,
                               fetch_lines, first > 0);  // inputs_for_panels' layout
#else
        panel_rows<kBlockRows>(a + r * k + first, k, panel_slice, inputs, slice_bias, rows_out, ldo, fetch,
                               fetch_lines, first > 0);
#endif
      });
    }
  }
}

// The input rows as panel_times_rows reads them for a product of m rows, k inputs, rows taken `group` at
// a time and inputs `slice` at a time: on AVX2 the rows as they are (`a`); on AVX-512 packed into a buffer
// of the calling thread's, where each group of rows takes the place its rows had (from row0 * k), holding
// its slices in order, each slice its blocks (RowBlocks) in order, and each block [inputs][block rows]: a
// step's inputs side by side. A block then reads its inputs from one stream instead of one per row; with
// a stream a row, the products ran at about half the speed of their multiply-adds.
inline const float* inputs_for_panels(const float* a, int64_t m, int64_t k, int64_t group, int64_t slice) {
#if defined(__AVX512F__)
  // Every block of every group, as (the group's first row, its rows, the block), packed in parallel.
  struct Block {
    int64_t row0, rows, block;
  };
  std::vector<Block> blocks;
  for (int64_t row0 = 0; row0 < m; row0 += group) {
    const int64_t rows = std::min(group, m - row0);
    for (int64_t block = 0; block < RowBlocks(rows).count; ++block) blocks.push_back({row0, rows, block});
  }
  // Kept by the thread for its next product, grown where one needs more: a fresh buffer each call cost
  // more than the packing itself (its pages faulted in, then zeroed).
  thread_local std::vector<float> packed_inputs;
  if (static_cast<int64_t>(packed_inputs.size()) < m * k) packed_inputs.resize(m * k);
  float* packed = packed_inputs.data();
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const auto [row0, rows, block] = blocks[b];
      const RowBlocks division(rows);
      const int64_t r = division.first_row(block), block_rows = division.rows_of(block);
      const float* from = a + (row0 + r) * k;
      for (int64_t first = 0; first < k; first += slice) {
        const int64_t inputs = std::min(slice, k - first);
        float* to = packed + row0 * k + first * rows + r * inputs;
        with_rows<kRows>(block_rows, [&](auto rows_constant) {
          constexpr int kBlockRows = decltype(rows_constant)::value;
          for (int64_t i = 0; i < inputs; ++i)
            for (int j = 0; j < kBlockRows; ++j) to[i * kBlockRows + j] = from[j * k + first + i];
        });
      }
    }
  });
  return packed;
#else
  (void)m, (void)k, (void)group, (void)slice;
  return a;
#endif
}

// The rows that pass over a run of panels together: as many as keep their inputs for a slice of
// `inputs` beside the run in L2.
inline int64_t row_group(int64_t inputs) {
  return std::max<int64_t>(kRows, (kRunBytes / (inputs * 4)) / kRows * kRows);
}

// A bfloat16 panel [K, 16] widened to float32 into `to`.
inline void widen(const uint16_t* panel, int64_t k, float* to) {
  for (int64_t i = 0; i < k * kPanelColumns; i += 8) _mm256_storeu_ps(to + i, load8(panel + i));
}

// The loop the products share (multiply, gated_multiply, argmax_of_product). Units are panels, or gate/up
// pairs of panels, `unit_bytes` each, taken in chunks of at most kRunBytes, kChunksEach or more for each
// thread: a contiguous run of them per thread, whose last ones go to whichever thread is done with its
// own first (StealingRuns). visit(unit, row0, rows, last_unit, scratch) multiplies rows row0 .. row0 +
// rows - 1 (at most `group` of them) by one unit. `scratch` is the thread's own `scratch_floats` floats.
template <typename Visit>
void over_units(int64_t m, int64_t group, int64_t units, int64_t unit_bytes, int64_t scratch_floats,
                const Visit& visit) {
  const int64_t threads = llmq_split::threads_for(units);
  const llmq_split::EqualChunks cut(units, std::max<int64_t>(1, kRunBytes / unit_bytes), threads, kChunksEach);
  llmq_split::StealingRuns shares(cut.chunks, threads);
  llmq_split::for_each_run(threads, [&](int64_t own) {
    std::vector<float> scratch(scratch_floats);
    for (int64_t chunk = shares.next(own); chunk >= 0; chunk = shares.next(own)) {
      const int64_t first = cut.first(chunk), last = std::min(units, first + cut.per_chunk);
      for (int64_t row0 = 0; row0 < m; row0 += group)
        for (int64_t u = first; u < last; ++u) visit(u, row0, std::min(group, m - row0), u + 1 == units, scratch.data());
    }
  });
}

// Whether a bfloat16 panel is widened once into float32 before `rows` rows read it: where more than one
// block of rows reads it, since widening as it is read costs each block about as much again as its
// multiply-adds.
template <typename W>
inline bool widens(int64_t rows) {
  return std::is_same_v<W, uint16_t> && rows > kRows;
}

// The floats panel_block needs for a widened panel in a product of m rows and k inputs (none where it
// never widens).
template <typename W>
inline int64_t widened_floats(int64_t m, int64_t k) {
  return widens<W>(m) ? k * kPanelColumns : 0;
}

// Rows of a [rows, K] times one panel into out (row stride ldo), as multiply does it: a panel that widens
// goes first into `widened` (widened_floats of them), which every block reads. Where `fetch_next`, the
// panel after it in memory (the next of the thread's share) is fetched while this one multiplies.
template <typename W, typename O>
inline void panel_block(const float* a, int64_t rows, int64_t k, const W* panel, const float* bias, O* out,
                        int64_t ldo, bool fetch_next, float* widened) {
  const int64_t panel_bytes = k * kPanelColumns * static_cast<int64_t>(sizeof(W));
  const char* ahead = fetch_next ? reinterpret_cast<const char*>(panel) + panel_bytes : nullptr;
  if constexpr (std::is_same_v<W, uint16_t>) {
    if (widens<W>(rows)) {
      widen(panel, k, widened);
      panel_times_rows(a, rows, k, static_cast<const float*>(widened), bias, out, ldo, ahead, panel_bytes);
      return;
    }
  }
  panel_times_rows(a, rows, k, panel, bias, out, ldo, ahead, panel_bytes);
}

// Each panel's passes fetch the next panel of the thread's share while they multiply, so that memory and
// arithmetic overlap: the hardware's prefetcher only follows the stream it is in. Not with one or two
// float32 rows, a pass that only streams: there it measured slower.
template <typename W>
inline bool fetches_ahead(int64_t m) {
  return m >= 3 || std::is_same_v<W, uint16_t>;
}

// a [M, K] (float32, contiguous) @ the panels -> out [M, N] (contiguous), + bias [N] where given.
template <typename W, typename O>
void multiply(const float* a, int64_t m, int64_t k, const W* panels, int64_t num_panels, const float* bias, O* out) {
  const int64_t n = num_panels * kPanelColumns, panel_elements = k * kPanelColumns;
  const bool fetch_ahead = fetches_ahead<W>(m);
  const int64_t group = row_group(slice_inputs<O>(k));
  const float* inputs = inputs_for_panels(a, m, k, group, slice_inputs<O>(k));
  over_units(m, group, num_panels, panel_elements * static_cast<int64_t>(sizeof(W)), widened_floats<W>(m, k),
             [&](int64_t p, int64_t row0, int64_t rows, bool last, float* widened) {
               panel_block(inputs + row0 * k, rows, k, panels + p * panel_elements,
                           bias != nullptr ? bias + p * kPanelColumns : nullptr, out + row0 * n + p * kPanelColumns, n,
                           fetch_ahead && !last, widened);
             });
}

// a [M, K] @ a gate/up weight in panels, N = 2 I (gate's I columns, then up's) -> out [M, I]: for each
// pair of panels (gate's p and up's p), a group's 16 gate and 16 up columns go to a scratch block of the
// thread's, in O as multiply would store them, and combine(gate, up, dst) writes each row's 16 outputs.
// The [M, 2 I] product is never stored, nor read back.
template <typename W, typename O, typename Combine>
void gated_multiply(const float* a, int64_t m, int64_t k, const W* panels, int64_t num_panels, const float* bias,
                    O* out, const Combine& combine) {
  const int64_t pairs = num_panels / 2, width = pairs * kPanelColumns, panel_elements = k * kPanelColumns;
  const int64_t group = row_group(slice_inputs<O>(k));
  const int64_t widened = widened_floats<W>(m, k);
  constexpr int64_t kBlockColumns = 2 * kPanelColumns;  // a scratch row: 16 gate, then 16 up
  const int64_t block_floats = (group * kBlockColumns * static_cast<int64_t>(sizeof(O)) + 3) / 4;
  const bool fetch_ahead = fetches_ahead<W>(m);
  const float* inputs = inputs_for_panels(a, m, k, group, slice_inputs<O>(k));
  over_units(m, group, pairs, 2 * panel_elements * static_cast<int64_t>(sizeof(W)), widened + block_floats,
             [&](int64_t p, int64_t row0, int64_t rows, bool last, float* scratch) {
               O* block = reinterpret_cast<O*>(scratch + widened);
               for (int half = 0; half < 2; ++half) {  // gate, then up
                 const int64_t index = half * pairs + p;
                 panel_block(inputs + row0 * k, rows, k, panels + index * panel_elements,
                             bias != nullptr ? bias + index * kPanelColumns : nullptr, block + half * kPanelColumns,
                             kBlockColumns, fetch_ahead && !last, scratch);
               }
               for (int64_t r = 0; r < rows; ++r) {
                 const O* gate = block + r * kBlockColumns;
                 combine(gate, gate + kPanelColumns, out + (row0 + r) * width + p * kPanelColumns);
               }
             });
}

// The input's rows widened to a float32 [M, K], and its bias to float32 (undefined where there is none).
inline std::pair<at::Tensor, at::Tensor> float_operands(const at::Tensor& input, const at::Tensor& panels,
                                                        const c10::optional<at::Tensor>& bias, const char* name) {
  const auto dtype = panels.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && input.scalar_type() == dtype, name,
              ": float32 or bfloat16 input and panels, the same");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanelColumns && panels.is_contiguous(), name,
              ": panels must be [N/16, K, 16], contiguous");
  const int64_t k = panels.size(1), n = panels.size(0) * kPanelColumns;
  TORCH_CHECK(input.size(-1) == k, name, ": input has ", input.size(-1), " features, the weight ", k);
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, name, ": bias has ", bias->numel(), " elements, the weight ", n, " columns");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  return {input.reshape({-1, k}).to(at::kFloat).contiguous(), bias_f};  // bfloat16 rows widened once
}

// An input [..., K]'s product of `width` outputs a row: fill(x, m, k, weights, bias, out) with x the
// input's rows as a float32 [m, k], the panels' and out's data as the element types the products take
// (float for float32, uint16_t bfloat16 bits for bfloat16), bias float32 (nullptr: none); returned as
// [..., width].
template <typename Fill>
inline at::Tensor product_of(const at::Tensor& input, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                             int64_t width, const char* name, const Fill& fill) {
  const auto [x, bias_f] = float_operands(input, panels, bias, name);
  const int64_t m = x.size(0), k = panels.size(1);
  auto out_shape = input.sizes().vec();
  out_shape.back() = width;
  at::Tensor out = at::empty({m, width}, input.options());
  if (m == 0) return out.view(out_shape);
  const float* bias_ptr = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  if (panels.scalar_type() == at::kFloat) {
    fill(x.data_ptr<float>(), m, k, panels.data_ptr<float>(), bias_ptr, out.data_ptr<float>());
  } else {
    fill(x.data_ptr<float>(), m, k, reinterpret_cast<const uint16_t*>(panels.data_ptr()), bias_ptr,
         reinterpret_cast<uint16_t*>(out.data_ptr()));
  }
  return out.view(out_shape);
}

// x [..., K] @ W.T (+ bias [N]) -> [..., N], for W laid out in panels [N/16, K, 16] (cpu_prepack.panel_weight):
// float32 throughout, or bfloat16 input, weight and output with the sums in float32, rounded once.
inline at::Tensor linear(const at::Tensor& input, const at::Tensor& panels, const c10::optional<at::Tensor>& bias) {
  const int64_t num_panels = panels.size(0);
  return product_of(input, panels, bias, num_panels * kPanelColumns, "panel_linear",
                    [&](const float* x, int64_t m, int64_t k, const auto* weights, const float* bias_ptr, auto* out) {
                      multiply(x, m, k, weights, num_panels, bias_ptr, out);
                    });
}

// A row's lanes (lane_maxima.h) against a panel's 16 outputs of it (float32, or bfloat16 bits as `linear`
// stores them), the panel's first column `first_column`.
inline void keep_larger(llmq_argmax::LaneMaxima& best, const float* outputs, int32_t first_column) {
  for (int64_t i = 0; i < kPanelColumns; i += 8) {
    const __m256 held = _mm256_load_ps(best.best + i), v = _mm256_loadu_ps(outputs + i);
    const __m256i columns = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                             _mm256_set1_epi32(first_column + static_cast<int32_t>(i)));
    const __m256i held_columns = _mm256_load_si256(reinterpret_cast<const __m256i*>(best.column + i));
    const __m256 earlier = _mm256_castsi256_ps(_mm256_cmpgt_epi32(held_columns, columns));
    const __m256 taken = _mm256_or_ps(_mm256_cmp_ps(v, held, _CMP_GT_OQ),
                                      _mm256_and_ps(_mm256_cmp_ps(v, held, _CMP_EQ_OQ), earlier));
    _mm256_store_ps(best.best + i, _mm256_blendv_ps(held, v, taken));
    _mm256_store_si256(reinterpret_cast<__m256i*>(best.column + i),
                       _mm256_blendv_epi8(held_columns, columns, _mm256_castps_si256(taken)));
  }
}
inline void keep_larger(llmq_argmax::LaneMaxima& best, const uint16_t* outputs, int32_t first_column) {
  alignas(64) float widened[kPanelColumns];
  for (int64_t i = 0; i < kPanelColumns; i += 8) _mm256_store_ps(widened + i, load8(outputs + i));
  keep_larger(best, widened, first_column);
}

// Each row's argmax (the first of equals, NaN never winning) of x [..., K] @ W.T for W in panels, as
// argmax_rows of `linear`'s output (rounded to bfloat16 first where the panels are bfloat16): a greedy
// step's LM head, whose logits nothing else reads, without writing them out and reading them back. Each
// thread multiplies its share of panels as `multiply` does, a panel's outputs for a group of rows into a
// block of its own, and keeps each row's lanes (lane_maxima.h); the row's maximum over every thread and
// lane, and the first column holding it, come last.
inline at::Tensor argmax_of_product(const at::Tensor& input, const at::Tensor& panels) {
  const auto [x, unused_bias] = float_operands(input, panels, c10::nullopt, "panel_argmax");
  const int64_t m = x.size(0), k = panels.size(1), num_panels = panels.size(0), threads = at::get_num_threads();
  at::Tensor out = at::zeros({m}, input.options().dtype(at::kLong));
  if (m == 0) return out;
  std::vector<llmq_argmax::LaneMaxima> lanes = llmq_argmax::fresh_lane_maxima(threads, m);
  const auto search = [&](const auto* weights) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(weights)>>;
    using O = W;  // `linear`'s output type for these panels
    const int64_t panel_elements = k * kPanelColumns, group = row_group(slice_inputs<O>(k));
    const int64_t block_floats = (group * kPanelColumns * static_cast<int64_t>(sizeof(O)) + 3) / 4;
    const int64_t widened = widened_floats<W>(m, k);
    const float* inputs = inputs_for_panels(x.data_ptr<float>(), m, k, group, slice_inputs<O>(k));
    const bool fetch_ahead = fetches_ahead<W>(m);
    over_units(m, group, num_panels, panel_elements * static_cast<int64_t>(sizeof(W)), widened + block_floats,
               [&](int64_t p, int64_t row0, int64_t rows, bool last, float* scratch) {
                 O* block = reinterpret_cast<O*>(scratch + widened);
                 panel_block(inputs + row0 * k, rows, k, weights + p * panel_elements, nullptr, block,
                             kPanelColumns, fetch_ahead && !last, scratch);
                 llmq_argmax::LaneMaxima* mine = lanes.data() + at::get_thread_num() * m + row0;
                 const auto first_column = static_cast<int32_t>(p * kPanelColumns);
                 for (int64_t r = 0; r < rows; ++r) keep_larger(mine[r], block + r * kPanelColumns, first_column);
               });
  };
  if (panels.scalar_type() == at::kFloat) {
    search(panels.data_ptr<float>());
  } else {
    search(reinterpret_cast<const uint16_t*>(panels.data_ptr()));
  }
  llmq_argmax::first_columns_of_maxima(lanes, threads, m, out.data_ptr<int64_t>());
  return out;
}

// x [..., K] against a gate/up weight in panels [2 I/16, K, 16] (+ bias [2 I]) -> [..., I], each output
// combine(gate, up, dst) of 16 gate and 16 up columns as `linear` would store them (float32, or bfloat16 as
// uint16_t bits). Where I is whole panels (an even number of them).
template <typename Combine>
at::Tensor gated(const at::Tensor& input, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                 const Combine& combine) {
  // (Panels of another shape are float_operands' error.)
  TORCH_CHECK(panels.dim() != 3 || panels.size(0) % 2 == 0, "panel_gated: gate and up must each be whole panels");
  const int64_t num_panels = panels.size(0);
  return product_of(input, panels, bias, num_panels / 2 * kPanelColumns, "panel_gated",
                    [&](const float* x, int64_t m, int64_t k, const auto* weights, const float* bias_ptr, auto* out) {
                      gated_multiply(x, m, k, weights, num_panels, bias_ptr, out, combine);
                    });
}

}  // namespace llmq_panels
#endif
