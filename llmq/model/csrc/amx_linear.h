// bfloat16 matrix products on the CPU's matrix units (AMX), included by cpu_kernels.cpp, for weights laid
// out in tiles once at load (llmq/model/cpu_prepack.py's tile_weight).
//
// Why a kernel of our own: a decode step's products have few rows, so what they cost is reading the weight
// from memory, and oneDNN's product (with its weight prepacked) reads it well below the memory's speed at
// those shapes and spends tens of microseconds per call before any arithmetic. Here each weight tile is read
// once per call, in the order it lies in memory, and a call costs little more than its tiles.
//
// Layout: weight [N, K] -> tiles [N / 16, K / 32, 16, 32]. Tile (n, k) holds output columns n * 16 ..
// n * 16 + 15 over inputs k * 32 .. k * 32 + 31, as TDPBF16PS reads its second operand: row r holds, for
// each of the 16 columns c in turn, the pair W[n * 16 + c][k * 32 + 2r], W[n * 16 + c][k * 32 + 2r + 1].
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LLMQ_HAS_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace llmq_amx {

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
// loaded ahead otherwise), and the hardware prefetcher alone runs too short a distance ahead.
constexpr int64_t kPrefetchSteps = 16;

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

// Result tiles (float32, 16 x 16) of rows [row0, row0 + 16 * row_tiles) and columns [col0, col0 + 16 *
// col_tiles) rounded to bfloat16 into out [m, n], bias added; rows past m are padding and dropped.
inline void store_rows(const float (*c)[2][kTileRows][16], int row_tiles, int col_tiles, int64_t row0,
                       int64_t col0, int64_t m, int64_t n, const float* bias, uint16_t* out) {
  for (int rt = 0; rt < row_tiles; ++rt) {
    for (int r = 0; r < kTileRows; ++r) {
      const int64_t row = row0 + rt * kTileRows + r;
      if (row >= m) return;
      for (int ct = 0; ct < col_tiles; ++ct) {
        const int64_t col = col0 + ct * 16;
        __m512 v = _mm512_load_ps(c[rt][ct][r]);
        if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + col));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + row * n + col), (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}

// Asks for the weight tiles of k-step `step` counted from column pair `pair`'s first (a step past the pair's
// last is in the pairs after it) into L2: the tiles of both its column blocks, as a pass reads them.
inline void prefetch_weight_step(const uint16_t* tiles, int64_t pair, int64_t step, int64_t pairs, int64_t k_tiles,
                                 int64_t col_blocks) {
  pair += step / k_tiles;
  if (pair >= pairs) return;
  const int64_t block = pair * 2;
  const char* first = reinterpret_cast<const char*>(tiles + (block * k_tiles + step % k_tiles) * kTileElements);
  for (int64_t offset = 0; offset < kTileElements * 2; offset += 64) _mm_prefetch(first + offset, _MM_HINT_T1);
  if (block + 1 < col_blocks) {
    const char* second = first + k_tiles * kTileElements * 2;
    for (int64_t offset = 0; offset < kTileElements * 2; offset += 64) _mm_prefetch(second + offset, _MM_HINT_T1);
  }
}

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

// x [M, K] bfloat16 @ tiles [N/16, K/32, 16, 32] (+ bias [N]) -> [M, N] bfloat16, summed in float32.
inline at::Tensor linear(const at::Tensor& input, const at::Tensor& tiles, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(permitted(), "amx_linear: the kernel refused this process the CPU's matrix units");
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && tiles.scalar_type() == at::kBFloat16,
              "amx_linear: bfloat16 input and tiles");
  TORCH_CHECK(tiles.dim() == 4 && tiles.size(2) == kTileRows && tiles.size(3) == kTileInputs && tiles.is_contiguous(),
              "amx_linear: tiles must be [N/16, K/32, 16, 32], contiguous");
  const int64_t k = tiles.size(1) * kTileInputs, col_blocks = tiles.size(0), n = col_blocks * 16;
  TORCH_CHECK(input.size(-1) == k, "amx_linear: input has ", input.size(-1), " features, the weight ", k);
  auto out_shape = input.sizes().vec();
  out_shape.back() = n;
  const at::Tensor x = input.reshape({-1, k});
  const int64_t m = x.size(0);
  at::Tensor out = at::empty({m, n}, input.options());
  if (m == 0) return out.view(out_shape);
  // Rows padded to a multiple of 16 in a copy where needed: every tile then has one shape, configured
  // once. (Laying the input out in tiles as well, for contiguous tile loads, measured slower: the copy
  // costs more than it saves.)
  const int64_t row_tiles = (m + kTileRows - 1) / kTileRows;
  at::Tensor a = x;
  if (m % kTileRows != 0 || !x.is_contiguous()) {
    a = at::zeros({row_tiles * kTileRows, k}, x.options());
    a.narrow(0, 0, m).copy_(x);
  }
  at::Tensor bias_f;
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "amx_linear: bias has ", bias->numel(), " elements, the weight ", n, " columns");
    bias_f = bias->to(at::kFloat).contiguous();
    bias_ptr = bias_f.data_ptr<float>();
  }
  const auto* A = reinterpret_cast<const uint16_t*>(a.data_ptr());
  const auto* B = reinterpret_cast<const uint16_t*>(tiles.data_ptr());
  auto* O = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t k_tiles = tiles.size(1), a_stride = k * 2;
  // Each weight tile is read once, in memory order: a thread takes runs of column pairs, and every
  // group of 32 rows passes over a run while its tiles are in the thread's L2.
  const int64_t pairs = (col_blocks + 1) / 2;
  const int64_t pair_bytes = 2 * k_tiles * kTileElements * 2;
  // Runs no longer than kChunkBytes, as many for each thread, of (nearly) equal length.
  const int64_t chunk_bytes = row_tiles <= kFewRowTiles ? kFewRowsChunkBytes : kChunkBytes;
  const int64_t threads = at::get_num_threads(), longest = std::max<int64_t>(1, chunk_bytes / pair_bytes);
  const int64_t runs = ((pairs + longest - 1) / longest + threads - 1) / threads * threads;
  const int64_t per_chunk = (pairs + runs - 1) / runs;
  const int64_t chunks = (pairs + per_chunk - 1) / per_chunk;

  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float c[2][2][kTileRows][16];
    for (int64_t chunk = begin; chunk < end; ++chunk) {
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
          store_rows(c, two_rows ? 2 : 1, two_cols ? 2 : 1, rt * kTileRows, block * 16, m, n, bias_ptr, O);
        }
      }
    }
    _tile_release();
  });
  return out.view(out_shape);
}

}  // namespace llmq_amx
#endif
