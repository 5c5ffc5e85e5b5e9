// bfloat16 matrix products for weights laid out in tiles once at load (llmq/model/cpu_prepack.py's
// tile_weight), included by cpu_kernels.cpp: on the CPU's matrix units where it has AMX, else in
// AVX512-BF16's dot products (VDPBF16PS), which read the same layout, or, on a CPU whose VDPBF16PS is slow
// beside its float32 multiply-adds, in those multiply-adds over the same tiles widened as they are read
// (bf16_widening.h).
//
// Why a kernel of our own: a decode step's products have few rows, so what they cost is reading the weight
// from memory, and oneDNN's product (with its weight prepacked) reads it well below the memory's speed at
// those shapes and spends tens of microseconds per call before any arithmetic. Here each weight tile is read
// once per call, in the order it lies in memory, and a call costs little more than its tiles. The same
// loop, with the gate/up weight paired, gives silu(gate) * up without storing the product (`gated`).
//
// Layout: weight [N, K] -> tiles [N / 16, K / 32, 16, 32]. Tile (n, k) holds output columns n * 16 ..
// n * 16 + 15 over inputs k * 32 .. k * 32 + 31, as TDPBF16PS reads its second operand: row r holds, for
// each of the 16 columns c in turn, the pair W[n * 16 + c][k * 32 + 2r], W[n * 16 + c][k * 32 + 2r + 1].
// That row is also one vector of VDPBF16PS: 16 columns' sums, each over the input pair 2r, 2r + 1.
#pragma once

#if defined(__AVX512BF16__)
#define LLMQ_HAS_TILED_LINEAR 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define LLMQ_HAS_AMX 1
#endif
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "lane_maxima.h"
#include "paged_prefetch.h"
#include "bf16_widening.h"
#include "panel_linear.h"  // store_first_sums (the greedy screen's exact pass stores as the panels' does), with_rows
#include "work_split.h"

namespace llmq_tiled {

constexpr int kTileRows = 16;                      // rows of an input tile and of a result tile
constexpr int kTileInputs = 32;                    // bfloat16 inputs a tile row spans
constexpr int kTileElements = kTileRows * kTileInputs;
// The most bytes of weight tiles in a thread's run of column pairs (kept in its L2 while every group of
// 32 rows passes over them, beside those rows' tiles). Decode-sized products (up to kFewRowTiles row
// tiles) take shorter runs: the first group's pass over a run waits on memory and the later groups' do
// not, so short runs alternate the two more finely.
constexpr int64_t kChunkBytes = 512 * 1024;
constexpr int64_t kFewRowTiles = 4;
constexpr int64_t kFewRowsChunkBytes = 128 * 1024;
// The first group's pass asks for the weight tiles this many k-steps ahead into L2: a tile load that
// misses stalls the matrix units until its bytes arrive (tile registers are not renamed, so nothing is
// loaded ahead otherwise), and the hardware prefetcher alone runs too short a distance ahead. The dot
// products take it where a call has a few rows or a long pair (below) and for a thread's first chunk.
constexpr int64_t kPrefetchSteps = 16;
// The dot products otherwise ask for a thread's next chunk while they multiply its present one, a few
// lines at every k-step of every pass (NextChunkFetch): only a chunk's first pass reads it from memory,
// and asked for all at once, ahead of that pass, the reads came in a burst while the later passes left the
// memory idle. Spread evenly, the reads overlap the arithmetic (README, CPU kernels: "Next chunk spread
// over the passes"). Only where the present chunk, the next and a pass's rows fit in L2 together (a 1.1 B
// model's down projection, 352 KiB a pair, keeps the first pass's prefetch), and where a chunk takes more
// than one pass: with no later passes to spread the reads over, the first pass's prefetch, further ahead,
// kept more of them in flight.
constexpr int64_t kSpreadChunkBytes = 256 * 1024;
// Every pass on the matrix units also asks for the weight tiles this many k-steps ahead into L1. A tile
// load whose 16 lines are in L2 still waits for all 16 to come up, and the matrix units wait with it; with
// the lines already in L1 they only wait where memory is slower than their arithmetic. It pays most where
// the cores share the memory with other work, and where two row tiles make each k-step's arithmetic longer.
constexpr int64_t kL1PrefetchSteps = 2;

#ifdef LLMQ_HAS_AMX
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands a process the matrix units' register state only once asked (arch_prctl); the answer holds
// for every thread of the process.
inline bool permitted() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}
#endif

// Whether the products may take the matrix units where they are there: the tests turn them off to check
// the dot products' path on a CPU that has both.
inline std::atomic<bool>& matrix_units_allowed() {
  static std::atomic<bool> allowed{true};
  return allowed;
}

// Whether the products run on the matrix units (AMX, where built for, granted and allowed), else on
// AVX512-BF16's dot products (VDPBF16PS), which read the same layout: a tile row is one vector of 16
// columns' pairs.
inline bool on_matrix_units() {
#ifdef LLMQ_HAS_AMX
  return matrix_units_allowed() && permitted();
#else
  return false;
#endif
}

// Asks for the 16 lines of one weight tile (1 KiB) into L2 (Locality 2: prefetcht1) or L1 (3: prefetcht0).
template <int Locality = 2>
inline void prefetch_tile(const char* tile) {
  for (int64_t offset = 0; offset < kTileElements * 2; offset += 64) __builtin_prefetch(tile + offset, 0, Locality);
}

// Asks for the weight tiles of k-step `step` counted from column pair `pair`'s first (a step past the pair's
// last is in the pairs after it) into L2 (or, with Locality 3, into L1: prefetcht1 and prefetcht0): the
// tiles of both its column blocks, as a pass reads them.
template <int Locality = 2>
inline void prefetch_weight_step(const uint16_t* tiles, int64_t pair, int64_t step, int64_t pairs, int64_t k_tiles,
                                 int64_t col_blocks) {
  pair += step / k_tiles;
  if (pair >= pairs) return;
  const int64_t block = pair * 2;
  const char* first = reinterpret_cast<const char*>(tiles + (block * k_tiles + step % k_tiles) * kTileElements);
  prefetch_tile<Locality>(first);
  if (block + 1 < col_blocks) prefetch_tile<Locality>(first + k_tiles * kTileElements * 2);
}

#ifdef LLMQ_HAS_AMX
// Every tile 16 rows of 64 bytes. Tiles 0-3: results (2 row tiles x 2 column tiles); 4-5: input rows;
// 6-7: weight. The configuration is the calling thread's.
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTileRows;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}
#endif

// A pass's results: float32 tiles of 16 x 16, [row tile][column tile][row][column].
using ResultTiles = float[2][2][kTileRows][16];

// The weight as the kernel reads it: k_tiles of 32 inputs, col_blocks of 16 output columns taken two
// at a time (a column pair: blocks 2p and 2p + 1).
struct TiledWeight {
  const uint16_t* tiles;
  int64_t k_tiles, col_blocks;
};

// Checks a tiled weight for `input` and returns its [M, K] rows, contiguous; for the matrix units padded
// with zeros to a multiple of 16 in a copy where needed (every tile then has one shape, configured once;
// laying the input out in tiles as well, for contiguous tile loads, measured slower: the copy costs more
// than it saves). The dot products take any number of rows.
inline at::Tensor padded_rows(const at::Tensor& input, const at::Tensor& tiles, const char* op) {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && tiles.scalar_type() == at::kBFloat16, op,
              ": bfloat16 input and tiles");
  const bool plain = tiles.dim() == 4, paired = tiles.dim() == 5 && tiles.size(1) == 2;
  TORCH_CHECK((plain || paired) && tiles.size(-2) == kTileRows && tiles.size(-1) == kTileInputs &&
                  tiles.is_contiguous(),
              op, ": tiles must be [N/16, K/32, 16, 32] or paired [N/32, 2, K/32, 16, 32], contiguous");
  const int64_t k = tiles.size(-3) * kTileInputs;
  TORCH_CHECK(input.size(-1) == k, op, ": input has ", input.size(-1), " features, the weight ", k);
  const at::Tensor x = input.reshape({-1, k});
  const int64_t m = x.size(0);
  if (!on_matrix_units()) return x.contiguous();
  if (m % kTileRows == 0 && x.is_contiguous()) return x;
  at::Tensor a = at::zeros({(m + kTileRows - 1) / kTileRows * kTileRows, k}, x.options());
  a.narrow(0, 0, m).copy_(x);
  return a;
}

// How `multiply` splits the weight between threads: runs of column pairs, no longer than kChunkBytes (or
// kFewRowsChunkBytes for up to kFewRowTiles row tiles), as many for each thread, of (nearly) equal length.
struct PairRuns {
  int64_t pairs, per_chunk, chunks;
  int64_t pair_bytes;  // a column pair's tiles (both blocks), laid out one pair after the other

  PairRuns(const TiledWeight& w, int64_t row_tiles) {
    pairs = (w.col_blocks + 1) / 2;
    pair_bytes = 2 * w.k_tiles * kTileElements * 2;
    const int64_t chunk_bytes = row_tiles <= kFewRowTiles ? kFewRowsChunkBytes : kChunkBytes;
    const llmq_split::EqualChunks cut(pairs, std::max<int64_t>(1, chunk_bytes / pair_bytes), at::get_num_threads());
    per_chunk = cut.per_chunk;
    chunks = cut.chunks;
  }
};

using llmq_split::NextChunkFetch;

// Rows (at most kDotRows) bfloat16 rows of a, from `a0` (row stride k), times one column pair's tiles b0
// (and b1 where two_cols) over every k-step in VDPBF16PS, into the results' rows from `first` (of the
// group's 32), asking for next_chunk's lines as it goes. Eight rows keep 16 sums in registers; twelve (24
// sums) measured slower at 2,048 rows on an AMD Zen 4.
constexpr int kDotRows = 8;

template <int Rows>
inline void dot_rows(const uint16_t* a0, int64_t k, const uint16_t* b0, const uint16_t* b1, bool two_cols,
                     int64_t k_tiles, bool prefetch, NextChunkFetch& next_chunk, llmq_prefetch::KvWarmup* warmup,
                     int64_t share, const uint16_t* tiles, int64_t pair, int64_t pairs, int64_t col_blocks,
                     float (*c)[2][kTileRows][16], int first) {
  // Every loop over the rows unrolled, so that the sums are registers, not an array: where one loop (the
  // stores at the end) stayed a loop, the array stayed in memory, and the compiler stored every sum back
  // to it at every tile row (README: CPU kernels, "Sums kept in registers").
  __m512 acc[Rows][2];
#pragma GCC unroll 16
  for (int i = 0; i < Rows; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    if (prefetch) prefetch_weight_step(tiles, pair, kt + kPrefetchSteps, pairs, k_tiles, col_blocks);
    next_chunk.step();
    if (warmup != nullptr) warmup->step(share);
    const uint16_t* t0 = b0 + kt * kTileElements;
    const uint16_t* t1 = b1 + kt * kTileElements;
    const uint16_t* a = a0 + kt * kTileInputs;
    for (int r = 0; r < kTileRows; ++r) {
      const __m512i p0 = _mm512_loadu_si512(t0 + r * kTileInputs);
      const __m512i p1 = two_cols ? _mm512_loadu_si512(t1 + r * kTileInputs) : p0;
#pragma GCC unroll 16
      for (int i = 0; i < Rows; ++i) {
        int32_t both;
        std::memcpy(&both, a + i * k + 2 * r, 4);
        const __m512bh x = (__m512bh)_mm512_set1_epi32(both);
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, (__m512bh)p0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, (__m512bh)p1);
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < Rows; ++i) {
    const int row = first + i;
    _mm512_store_ps(c[row / kTileRows][0][row % kTileRows], acc[i][0]);
    _mm512_store_ps(c[row / kTileRows][1][row % kTileRows], acc[i][1]);
  }
}

// sum + x0 * w.even + x1 * w.odd, in that order: the widened path's step for one row and one tile row.
inline __m512 widened_step(__m512 sum, float x0, float x1, const llmq_widening::WidenedPairs& w) {
  return _mm512_fmadd_ps(_mm512_set1_ps(x1), w.odd, _mm512_fmadd_ps(_mm512_set1_ps(x0), w.even, sum));
}

inline float bfloat16_value(uint16_t bits) { return c10::BFloat16(bits, c10::BFloat16::from_bits()); }

// The widened path takes the rows in groups of 32, each group in one pass over each column block, a sum
// vector a row: every weight tile is read once for all of a group's rows (a decode step's, up to 32), and
// a tile row's shift and mask are shared by all of them. Where a group's 32 rows took passes of up to 12
// over both blocks of a pair, a decode step of 13 to 32 rows read each pair two or three times, and
// memory and arithmetic overlapped badly (README: CPU kernels, "Widened rows in one pass a block").
// Thirty sums and the tile row's two halves fill the 32 vector registers; at 31 and 32 rows the compiler
// keeps a few sums in memory, which measured no slower than two passes of 16.
constexpr int64_t kGroupRows = 2 * kTileRows;

// The rows of a [m, k] bfloat16 as float32 for the widened path, in a buffer of the calling thread's (valid
// until its next call), each group of kGroupRows rows (the last: what is left) a k-pair at a time: group g
// from g * kGroupRows * k, its rows' inputs 2j and 2j + 1 side by side, [k / 2][rows][2]. A pass then
// reaches every row's pair from one pointer at fixed offsets: with a pointer a row, as the rows' own
// layout needs, the compiler ran out of general registers and reloaded the pointers from the stack at
// every tile row.
inline const float* widened_groups(const uint16_t* a, int64_t m, int64_t k) {
  thread_local std::vector<float> rows;
  if (static_cast<int64_t>(rows.size()) < m * k) rows.resize(m * k);
  for (int64_t g0 = 0; g0 < m; g0 += kGroupRows) {
    const int64_t count = std::min(kGroupRows, m - g0);
    const auto* in = reinterpret_cast<const uint32_t*>(a + g0 * k);  // a row's pairs, 2 bfloat16 each
    auto* out = reinterpret_cast<uint64_t*>(rows.data() + g0 * k);    // a row's pair as 2 float32
    for (int64_t j = 0; j < k / 2; ++j) {
      for (int64_t i = 0; i < count; ++i) {
        const uint32_t both = in[i * (k / 2) + j];
        out[j * count + i] = static_cast<uint64_t>(both << 16) | static_cast<uint64_t>(both & 0xFFFF0000u) << 32;
      }
    }
  }
  return rows.data();
}

// A group of Rows (at most kGroupRows) widened rows (widened_groups's layout, from `group`) times one
// column block's tiles `b` over every k-step, into the results' column tile `ct`, asking for next_chunk's
// lines as it goes, and, where `prefetch`, for the weight kPrefetchTiles tiles ahead in memory (into the
// next block and pair, up to `weight_end`). Each row's sums run over the inputs in the order the greedy
// screen's exact pass, row_times_blocks_as<true>, takes them: the same sums.
constexpr int64_t kPrefetchTiles = 2 * kPrefetchSteps;  // as far ahead as a pair's kPrefetchSteps k-steps

template <int Rows>
inline void block_rows(const float* group, const uint16_t* b, int64_t k_tiles, bool prefetch, const char* weight_end,
                       NextChunkFetch& next_chunk, llmq_prefetch::KvWarmup* warmup, int64_t share,
                       float (*c)[2][kTileRows][16], int ct) {
  __m512 acc[Rows];  // every loop over the rows unrolled: the sums stay registers ("Sums kept in registers")
#pragma GCC unroll 32
  for (int i = 0; i < Rows; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const char* ahead = reinterpret_cast<const char*>(b + (kt + kPrefetchTiles) * kTileElements);
    const bool fetch = prefetch && ahead < weight_end;
    next_chunk.step();
    if (warmup != nullptr) warmup->step(share);
    const uint16_t* t = b + kt * kTileElements;
    const float* x = group + kt * kTileRows * Rows * 2;
    for (int r = 0; r < kTileRows; ++r, x += Rows * 2) {
      // The tile ahead asked for a line with each tile row, not its 16 lines at once: asked at once, they
      // reach the core's queue to memory together, and it then idles through the rest of the tile's
      // arithmetic; one a row keeps it fed evenly (README: CPU kernels, "A line ahead with each tile row").
      if (fetch) __builtin_prefetch(ahead + r * 64, 0, 2);
      const llmq_widening::WidenedPairs w = llmq_widening::widened_pairs(_mm512_loadu_si512(t + r * kTileInputs));
#pragma GCC unroll 32
      for (int i = 0; i < Rows; ++i) acc[i] = widened_step(acc[i], x[2 * i], x[2 * i + 1], w);
    }
  }
#pragma GCC unroll 32
  for (int i = 0; i < Rows; ++i) _mm512_store_ps(c[i / kTileRows][ct][i % kTileRows], acc[i]);
}

#ifdef LLMQ_HAS_AMX
// `multiply` on the matrix units, for a [row_tiles * 16, K].
template <typename Emit>
void multiply_on_tiles(const at::Tensor& a, const TiledWeight& w, const Emit& emit) {
  const int64_t k = w.k_tiles * kTileInputs, k_tiles = w.k_tiles, col_blocks = w.col_blocks;
  const int64_t row_tiles = a.size(0) / kTileRows;
  const auto* A = reinterpret_cast<const uint16_t*>(a.data_ptr());
  const uint16_t* B = w.tiles;
  const int64_t a_stride = k * 2;
  // Each weight tile is read once, in memory order: a thread takes runs of column pairs, and every
  // group of 32 rows passes over a run while its tiles are in the thread's L2.
  const PairRuns split(w, row_tiles);
  const int64_t pairs = split.pairs, per_chunk = split.per_chunk, chunks = split.chunks;
  // Decode-sized products take their chunks in contiguous runs, one per thread, the ends of which go to
  // whichever thread finishes its own first (StealingRuns): memory sets their pace, and a thread's
  // prefetch runs on into its own next chunk. Longer ones are dealt a chunk at a time to whichever thread
  // is free: their arithmetic sets the pace, and equal shares finished apart.
  const bool dealt = row_tiles > kFewRowTiles;
  std::atomic<int64_t> next_chunk{0};
  const int64_t threads = llmq_split::threads_for(chunks);
  llmq_split::StealingRuns runs(chunks, threads);
  const auto take = [&](int64_t own) -> int64_t {
    if (!dealt) return runs.next(own);
    const int64_t chunk = next_chunk++;
    return chunk < chunks ? chunk : -1;
  };
  llmq_split::for_each_run(threads, [&](int64_t own) {
    configure_tiles();
    alignas(64) ResultTiles c;
    for (int64_t chunk = take(own); chunk >= 0; chunk = take(own)) {
      const int64_t last_pair = std::min(pairs, (chunk + 1) * per_chunk);
      for (int64_t rt = 0; rt < row_tiles; rt += 2) {
        const bool two_rows = rt + 1 < row_tiles;
        const uint16_t* a0 = A + rt * kTileRows * k;
        const uint16_t* a1 = a0 + kTileRows * k;
        for (int64_t pair = chunk * per_chunk; pair < last_pair; ++pair) {
          const int64_t block = pair * 2;
          const bool two_cols = block + 1 < col_blocks;
          const uint16_t* b0 = B + block * k_tiles * kTileElements;
          const uint16_t* b1 = b0 + k_tiles * kTileElements;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t kt = 0; kt < k_tiles; ++kt) {
            if (rt == 0) prefetch_weight_step(B, pair, kt + kPrefetchSteps, pairs, k_tiles, col_blocks);
            prefetch_weight_step<3>(B, pair, kt + kL1PrefetchSteps, pairs, k_tiles, col_blocks);
            _tile_loadd(4, a0 + kt * kTileInputs, a_stride);
            _tile_loadd(6, b0 + kt * kTileElements, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (two_cols) {
              _tile_loadd(7, b1 + kt * kTileElements, 64);
              _tile_dpbf16ps(1, 4, 7);
            }
            if (two_rows) {
              _tile_loadd(5, a1 + kt * kTileInputs, a_stride);
              _tile_dpbf16ps(2, 5, 6);
              if (two_cols) _tile_dpbf16ps(3, 5, 7);
            }
          }
          _tile_stored(0, c[0][0], 64);
          if (two_cols) _tile_stored(1, c[0][1], 64);
          if (two_rows) {
            _tile_stored(2, c[1][0], 64);
            if (two_cols) _tile_stored(3, c[1][1], 64);
          }
          emit(c, two_rows ? 2 : 1, two_cols ? 2 : 1, rt * kTileRows, pair);
        }
      }
    }
    _tile_release();
  });
}
#endif

// One row of a (K inputs) times `count` (at most 8) column blocks, `blocks`, into out[j]: each block's 16 sums
// made as the products make them, step for step (in VDPBF16PS as dot_rows, or widened as block_rows, where
// llmq_widening::widens_bf16), so they are the same sums (greedy_screen.h multiplies a row's candidate
// blocks again with it). The blocks' chains run side by side.
template <bool Widened>
inline void row_times_blocks_as(const uint16_t* a, int64_t k_tiles, const uint16_t* tiles, const int64_t* blocks,
                                int count, float (*out)[16]) {
  constexpr int kMost = 8;
  const uint16_t* b[kMost];
  __m512 acc[kMost];
  for (int j = 0; j < kMost; ++j) {  // past `count`, the last block again: the chains cost nothing extra
    b[j] = tiles + blocks[std::min(j, count - 1)] * k_tiles * kTileElements;
    acc[j] = _mm512_setzero_ps();
  }
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    for (int r = 0; r < kTileRows; ++r) {
      const uint16_t* x = a + kt * kTileInputs + 2 * r;
      if constexpr (Widened) {
        const float x0 = bfloat16_value(x[0]), x1 = bfloat16_value(x[1]);
#pragma GCC unroll 8
        for (int j = 0; j < kMost; ++j)
          acc[j] = widened_step(acc[j], x0, x1,
                                llmq_widening::widened_pairs(_mm512_loadu_si512(b[j] + kt * kTileElements + r * kTileInputs)));
      } else {
        int32_t both;
        std::memcpy(&both, x, 4);
        const __m512bh pair = (__m512bh)_mm512_set1_epi32(both);
#pragma GCC unroll 8
        for (int j = 0; j < kMost; ++j)
          acc[j] = _mm512_dpbf16_ps(acc[j], pair,
                                    (__m512bh)_mm512_loadu_si512(b[j] + kt * kTileElements + r * kTileInputs));
      }
    }
  }
  llmq_panels::store_first_sums(out, acc, count);
}

inline void row_times_blocks(const uint16_t* a, int64_t k_tiles, const uint16_t* tiles, const int64_t* blocks,
                             int count, float (*out)[16]) {
  if (llmq_widening::widens_bf16()) {
    row_times_blocks_as<true>(a, k_tiles, tiles, blocks, count, out);
  } else {
    row_times_blocks_as<false>(a, k_tiles, tiles, blocks, count, out);
  }
}

// The passes over a column pair for a group of `rows` (at most 32) in VDPBF16PS, each of at most kDotRows.
constexpr int64_t passes_in_group(int64_t rows) { return (rows + kDotRows - 1) / kDotRows; }

// How often multiply_in_vectors reads each column pair's tiles for `rows` rows (in groups of 32, the last
// what is left): once a pass in VDPBF16PS, widened once a group.
inline int64_t reads_of_pair(int64_t rows, bool widened) {
  const int64_t groups = (rows + kGroupRows - 1) / kGroupRows;
  if (widened) return groups;
  return rows / kGroupRows * passes_in_group(kGroupRows) + passes_in_group(rows % kGroupRows);
}

// The k-steps multiply_in_vectors takes over a column pair: those of its reads, widened one pass for each
// of the pair's two blocks.
inline int64_t steps_of_pair(int64_t rows, bool widened, int64_t k_tiles) {
  return reads_of_pair(rows, widened) * (widened ? 2 : 1) * k_tiles;
}

// The k-steps of the dot products that multiply_in_vectors takes over a [rows, K] times `tiles`, all
// threads' together.
inline int64_t dot_steps(const at::Tensor& tiles, int64_t rows) {
  const int64_t k_tiles = tiles.size(-3), col_blocks = tiles.numel() / (k_tiles * kTileElements);
  return (col_blocks + 1) / 2 * steps_of_pair(rows, llmq_widening::widens_bf16(), k_tiles);
}

// `multiply` in AVX512-BF16's dot products (In = uint16_t: A holds the bfloat16 rows) or in the widened
// multiply-adds (In = float: A holds them in widened_groups's layout), for [M, K] of any M: the same runs,
// each group of 32 rows taken in passes of up to kDotRows rows over both blocks of a pair in VDPBF16PS, or
// widened in one pass over each block; their sums in registers.
template <typename In, typename Emit>
void multiply_in_vectors(const In* A, int64_t m, const TiledWeight& w, const Emit& emit) {
  constexpr bool widened = std::is_same_v<In, float>;
  const int64_t k = w.k_tiles * kTileInputs, k_tiles = w.k_tiles, col_blocks = w.col_blocks;
  const int64_t row_tiles = (m + kTileRows - 1) / kTileRows;
  const uint16_t* B = w.tiles;
  const PairRuns split(w, row_tiles);
  const int64_t threads = llmq_split::threads_for(split.chunks);
  llmq_split::StealingRuns runs(split.chunks, threads);
  const int64_t chunk_bytes = split.per_chunk * split.pair_bytes;
  const int64_t weight_bytes = col_blocks * k_tiles * kTileElements * 2;
  const char* const weight_end = reinterpret_cast<const char*>(B) + weight_bytes;
  const bool spread = reads_of_pair(m, widened) > 1 && chunk_bytes <= kSpreadChunkBytes;
  const int64_t pair_steps = steps_of_pair(m, widened, k_tiles);
  llmq_prefetch::KvWarmup* const warmup = llmq_prefetch::active_kv_warmup();
  llmq_split::for_each_run(threads, [&](int64_t own) {
    alignas(64) ResultTiles c;
    const int64_t share = at::get_thread_num();
    int64_t fetched = -1;  // the chunk asked for while the thread multiplied its last one
    for (int64_t chunk = runs.next(own); chunk >= 0; chunk = runs.next(own)) {
      const int64_t last_pair = std::min(split.pairs, (chunk + 1) * split.per_chunk);
      NextChunkFetch next_chunk;
      if (spread && runs.is_next_of(own, chunk + 1)) {
        const auto* tiles = reinterpret_cast<const char*>(B);
        next_chunk = NextChunkFetch(tiles + (chunk + 1) * chunk_bytes,
                                    tiles + std::min((chunk + 2) * chunk_bytes, weight_bytes),
                                    (last_pair - chunk * split.per_chunk) * pair_steps);
      }
      const bool prefetch_first_pass = chunk != fetched;
      fetched = next_chunk.lines_per_step > 0 ? chunk + 1 : -1;
      for (int64_t row0 = 0; row0 < m; row0 += kGroupRows) {
        const int64_t rows = std::min<int64_t>(kGroupRows, m - row0);
        for (int64_t pair = chunk * split.per_chunk; pair < last_pair; ++pair) {
          const int64_t block = pair * 2;
          const bool two_cols = block + 1 < col_blocks;
          const uint16_t* b0 = B + block * k_tiles * kTileElements;
          const uint16_t* b1 = b0 + k_tiles * kTileElements;
          if constexpr (widened) {
            const bool prefetch = prefetch_first_pass && row0 == 0;
            const float* group = A + row0 * k;
            llmq_panels::with_rows<kGroupRows>(rows, [&](auto rows_constant) {
              constexpr int kCount = decltype(rows_constant)::value;
              block_rows<kCount>(group, b0, k_tiles, prefetch, weight_end, next_chunk, warmup, share, c, 0);
              if (two_cols)
                block_rows<kCount>(group, b1, k_tiles, prefetch, weight_end, next_chunk, warmup, share, c, 1);
            });
          } else {
            // The group's rows in passes of nearly equal size, none over kDotRows.
            const int64_t passes = passes_in_group(rows);
            for (int64_t p = 0; p < passes; ++p) {
              const int first = static_cast<int>(rows * p / passes);
              const bool prefetch = prefetch_first_pass && row0 == 0 && p == 0;
              llmq_panels::with_rows<kDotRows>(rows * (p + 1) / passes - first, [&](auto rows_constant) {
                dot_rows<decltype(rows_constant)::value>(A + (row0 + first) * k, k, b0, b1, two_cols, k_tiles,
                                                         prefetch, next_chunk, warmup, share, B, pair, split.pairs,
                                                         col_blocks, c, first);
              });
            }
          }
          emit(c, static_cast<int>((rows + kTileRows - 1) / kTileRows), two_cols ? 2 : 1, row0, pair);
        }
      }
    }
  });
}

// The dot products take a long product's rows (a prefill step's) this many at a time, each block over the
// whole weight in turn. In one pass every run of the weight's column pairs goes over all of the rows, and
// at a few thousand inputs a row, a prefill's 2,048 rows measured slower to read again for each run than
// a block's (README: CPU kernels, "Long products in row blocks"). A multiple of 32, the rows of a group
// (kGroupRows), so that the blocks' passes are the ones a single call would make.
constexpr int64_t kDotRowBlock = 512;

// a [M, K] bfloat16 (padded_rows) @ the weight, each column pair's results for up to 32 rows handed to
// emit(c, row tiles, column tiles, first row, pair) as they are done; emit drops rows past M.
template <typename Emit>
void multiply(const at::Tensor& a, const TiledWeight& w, const Emit& emit) {
#ifdef LLMQ_HAS_AMX
  if (on_matrix_units()) return multiply_on_tiles(a, w, emit);
#endif
  const int64_t m = a.size(0), k = w.k_tiles * kTileInputs;
  const auto* A = reinterpret_cast<const uint16_t*>(a.data_ptr());
  const bool widened = llmq_widening::widens_bf16();
  for (int64_t first = 0; first < m; first += kDotRowBlock) {
    const int64_t rows = std::min(kDotRowBlock, m - first);
    const auto block_emit = [&](const ResultTiles& c, int row_tiles, int col_tiles, int64_t row0, int64_t pair) {
      emit(c, row_tiles, col_tiles, first + row0, pair);
    };
    if (widened) {
      multiply_in_vectors(widened_groups(A + first * k, rows, k), rows, w, block_emit);
    } else {
      multiply_in_vectors(A + first * k, rows, w, block_emit);
    }
  }
}

inline TiledWeight tiled_weight(const at::Tensor& tiles) {
  const int64_t k_tiles = tiles.size(-3);
  return {reinterpret_cast<const uint16_t*>(tiles.data_ptr()), k_tiles, tiles.numel() / (k_tiles * kTileElements)};
}

inline at::Tensor float_bias(const c10::optional<at::Tensor>& bias, int64_t n, const char* op) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, op, ": bias has ", bias->numel(), " elements, the weight ", n, " columns");
  return bias->to(at::kFloat).contiguous();
}

// x [..., K] bfloat16 @ W.T (+ bias [N]) -> [..., N] bfloat16, summed in float32, for W laid out in tiles:
// [N/16, K/32, 16, 32] (cpu_prepack.tile_weight), or paired [N/32, 2, K/32, 16, 32]
// (cpu_prepack.tile_gate_up), whose column pair p holds columns 16p .. 16p + 15 and N/2 + 16p .. N/2 + 16p + 15.
inline at::Tensor linear(const at::Tensor& input, const at::Tensor& tiles, const c10::optional<at::Tensor>& bias) {
  const at::Tensor a = padded_rows(input, tiles, "tiled_linear");
  const TiledWeight w = tiled_weight(tiles);
  const int64_t m = input.numel() / input.size(-1), n = w.col_blocks * 16;
  const bool paired = tiles.dim() == 5;
  auto out_shape = input.sizes().vec();
  out_shape.back() = n;
  at::Tensor out = at::empty({m, n}, input.options());
  if (m == 0) return out.view(out_shape);
  const at::Tensor bias_f = float_bias(bias, n, "tiled_linear");
  const float* bias_ptr = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto* O = reinterpret_cast<uint16_t*>(out.data_ptr());
  multiply(a, w, [&](const ResultTiles& c, int row_tiles, int col_tiles, int64_t row0, int64_t pair) {
    for (int rt = 0; rt < row_tiles; ++rt) {
      for (int r = 0; r < kTileRows; ++r) {
        const int64_t row = row0 + rt * kTileRows + r;
        if (row >= m) return;
        for (int ct = 0; ct < col_tiles; ++ct) {
          const int64_t col = paired ? ct * (n / 2) + pair * 16 : (pair * 2 + ct) * 16;
          __m512 v = _mm512_load_ps(c[rt][ct][r]);
          if (bias_ptr != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias_ptr + col));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(O + row * n + col), (__m256i)_mm512_cvtneps_pbh(v));
        }
      }
    }
  });
  return out.view(out_shape);
}

// x [..., K] bfloat16 against W [V, K] in tiles -> int64 [M]: each row's argmax over x @ W.T, each value
// rounded to bfloat16 as `linear` stores it, the first of equals, NaN never winning (argmax_rows's rule):
// a greedy step's LM head, whose logits nothing else reads, without writing them out and reading them
// back. Each thread keeps, for each row, 16 running maxima and their columns (lane_maxima.h: one per lane
// of a column tile); the row's maximum over every thread and lane, and the first column holding it, come
// last.
inline at::Tensor argmax_of_product(const at::Tensor& input, const at::Tensor& tiles) {
  TORCH_CHECK(tiles.dim() == 4, "tiled_argmax: tiles must be [V/16, K/32, 16, 32] (not paired)");
  const at::Tensor a = padded_rows(input, tiles, "tiled_argmax");
  const TiledWeight w = tiled_weight(tiles);
  const int64_t m = input.numel() / input.size(-1), threads = at::get_num_threads();
  at::Tensor out = at::zeros({m}, input.options().dtype(at::kLong));
  if (m == 0) return out;
  std::vector<llmq_argmax::LaneMaxima> lanes = llmq_argmax::fresh_lane_maxima(threads, m);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  multiply(a, w, [&](const ResultTiles& c, int row_tiles, int col_tiles, int64_t row0, int64_t pair) {
    llmq_argmax::LaneMaxima* mine = lanes.data() + at::get_thread_num() * m;
    const __m512i columns[2] = {_mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(pair * 32))),
                                _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(pair * 32 + 16)))};
    for (int rt = 0; rt < row_tiles; ++rt) {
      for (int r = 0; r < kTileRows; ++r) {
        const int64_t row = row0 + rt * kTileRows + r;
        if (row >= m) return;
        __m512 best = _mm512_load_ps(mine[row].best);
        __m512i column = _mm512_load_si512(mine[row].column);
        for (int ct = 0; ct < col_tiles; ++ct) {
          const __m512 v = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_load_ps(c[rt][ct][r])));
          const __mmask16 taken = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ) |
                                  (_mm512_cmp_ps_mask(v, best, _CMP_EQ_OQ) &
                                   _mm512_cmplt_epi32_mask(columns[ct], column));
          best = _mm512_mask_mov_ps(best, taken, v);
          column = _mm512_mask_mov_epi32(column, taken, columns[ct]);
        }
        _mm512_store_ps(mine[row].best, best);
        _mm512_store_si512(mine[row].column, column);
      }
    }
  });
  llmq_argmax::first_columns_of_maxima(lanes, threads, m, out.data_ptr<int64_t>());
  return out;
}

// x [..., K] bfloat16 against a paired gate/up weight [I/16, 2, K/32, 16, 32] (+ bias [2 I]) -> [..., I]:
// combine(gate, up, out) gets each row's 16 gate and 16 up columns of a pair, rounded to bfloat16 as
// `linear` would store them, and writes that row's 16 outputs. The [M, 2 I] product is never stored.
template <typename Combine>
at::Tensor gated(const at::Tensor& input, const at::Tensor& tiles, const c10::optional<at::Tensor>& bias,
                 const Combine& combine) {
  TORCH_CHECK(tiles.dim() == 5, "tiled_gated: tiles must be paired, [I/16, 2, K/32, 16, 32]");
  const at::Tensor a = padded_rows(input, tiles, "tiled_gated");
  const TiledWeight w = tiled_weight(tiles);
  const int64_t m = input.numel() / input.size(-1), width = w.col_blocks * 8;
  auto out_shape = input.sizes().vec();
  out_shape.back() = width;
  at::Tensor out = at::empty({m, width}, input.options());
  if (m == 0) return out.view(out_shape);
  const at::Tensor bias_f = float_bias(bias, 2 * width, "tiled_gated");
  const float* bias_ptr = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto* O = reinterpret_cast<uint16_t*>(out.data_ptr());
  multiply(a, w, [&](const ResultTiles& c, int row_tiles, int, int64_t row0, int64_t pair) {
    alignas(64) uint16_t halves[2][16];
    for (int rt = 0; rt < row_tiles; ++rt) {
      for (int r = 0; r < kTileRows; ++r) {
        const int64_t row = row0 + rt * kTileRows + r;
        if (row >= m) return;
        for (int ct = 0; ct < 2; ++ct) {
          __m512 v = _mm512_load_ps(c[rt][ct][r]);
          if (bias_ptr != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias_ptr + ct * width + pair * 16));
          _mm256_store_si256(reinterpret_cast<__m256i*>(halves[ct]), (__m256i)_mm512_cvtneps_pbh(v));
        }
        combine(halves[0], halves[1], O + row * width + pair * 16);
      }
    }
  });
  return out.view(out_shape);
}

}  // namespace llmq_tiled
#endif
