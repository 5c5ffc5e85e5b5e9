// float32 matrix products for weights laid out in panels once at load (llmq/model/cpu_prepack.py's
// panel_weight), on AVX2's fused multiply-adds, included by cpu_kernels.cpp.
//
// Why a kernel of our own: a decode step's products have few rows, so what they should cost is reading
// the weight once from memory. oneDNN's float32 product over its prepacked weight reads it well below the
// memory's speed at those shapes on an AVX2 CPU (benchmarks/product_shapes.py prints both). Here each
// thread streams its own contiguous run of panels, every weight element is loaded once per group of rows,
// and a call costs little more than its panels.
//
// Layout: weight [N, K] -> panels [N / 16, K, 16]: panel p holds output columns 16p .. 16p + 15, one row of
// 16 per input. A group of kRows input rows times one panel keeps its kRows x 16 sums in registers (two
// 8-lane vectors a row) while the panel streams past once.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// Built for AVX2 CPUs without AVX-512 only: with AVX-512, oneDNN's float32 products use the wider vectors
// and this kernel (8-lane) has not been measured against them.
#define LLMQ_HAS_PANEL_LINEAR 1
#include <immintrin.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace llmq_panels {

constexpr int64_t kPanelColumns = 16;
// Rows whose sums stay in registers: 6 rows x 2 vectors = 12 of AVX2's 16, the other 4 for the panel's two
// vectors and the broadcast input.
constexpr int kRows = 6;
// A thread's panels are taken in runs of at most this many bytes, kept in its L2 while every group of
// rows passes over them (the input rows of a group come from L1/L2 as well).
constexpr int64_t kRunBytes = 192 * 1024;

// Rows (at most kRows) rows of a (row stride lda) times one panel [K, 16] -> out's 16 columns of those
// rows (row stride ldo), plus bias (16 values) where given.
template <int Rows>
inline void panel_rows(const float* a, int64_t lda, const float* panel, int64_t k, const float* bias, float* out,
                       int64_t ldo) {
  // Named sums, not an array: GCC keeps an array of vectors in memory and stores it on every step.
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const float* a0 = a;
  const float* a3 = a + 3 * lda;
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w0 = _mm256_loadu_ps(panel + i * kPanelColumns);
    const __m256 w1 = _mm256_loadu_ps(panel + i * kPanelColumns + 8);
#define LLMQ_PANEL_ROW(R, BASE, OFFSET)                          \
  if constexpr (Rows > R) {                                      \
    const __m256 x = _mm256_broadcast_ss(BASE + OFFSET + i);     \
    c##R##0 = _mm256_fmadd_ps(x, w0, c##R##0);                   \
    c##R##1 = _mm256_fmadd_ps(x, w1, c##R##1);                   \
  }
    LLMQ_PANEL_ROW(0, a0, 0)
    LLMQ_PANEL_ROW(1, a0, lda)
    LLMQ_PANEL_ROW(2, a0, 2 * lda)
    LLMQ_PANEL_ROW(3, a3, 0)
    LLMQ_PANEL_ROW(4, a3, lda)
    LLMQ_PANEL_ROW(5, a3, 2 * lda)
#undef LLMQ_PANEL_ROW
  }
  const __m256 b0 = bias != nullptr ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias != nullptr ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  const __m256 sums[6][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int r = 0; r < Rows; ++r) {
    _mm256_storeu_ps(out + r * ldo, _mm256_add_ps(sums[r][0], b0));
    _mm256_storeu_ps(out + r * ldo + 8, _mm256_add_ps(sums[r][1], b1));
  }
}

// a [M, K] (contiguous) @ the panels -> out [M, N] (contiguous), + bias [N] where given.
inline void multiply(const float* a, int64_t m, int64_t k, const float* panels, int64_t num_panels,
                     const float* bias, float* out) {
  const int64_t n = num_panels * kPanelColumns, panel_floats = k * kPanelColumns;
  const int64_t run = std::max<int64_t>(1, kRunBytes / (panel_floats * 4));
  // A group of rows passes over a run of panels: as many rows as keep their inputs beside the run in L2.
  const int64_t group = std::max<int64_t>(kRows, (kRunBytes / (k * 4)) / kRows * kRows);
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t first = begin; first < end; first += run) {
      const int64_t last = std::min(end, first + run);
      for (int64_t row0 = 0; row0 < m; row0 += group) {
        const int64_t rows_in_group = std::min(group, m - row0);
        for (int64_t p = first; p < last; ++p) {
          const float* panel = panels + p * panel_floats;
          const float* panel_bias = bias != nullptr ? bias + p * kPanelColumns : nullptr;
          for (int64_t r = 0; r < rows_in_group; r += kRows) {
            const float* rows_a = a + (row0 + r) * k;
            float* rows_out = out + (row0 + r) * n + p * kPanelColumns;
#define LLMQ_PANEL_ROWS(R)                                            \
  panel_rows<R>(rows_a, k, panel, k, panel_bias, rows_out, n); \
  break;
            switch (std::min<int64_t>(kRows, rows_in_group - r)) {
              case 1: LLMQ_PANEL_ROWS(1)
              case 2: LLMQ_PANEL_ROWS(2)
              case 3: LLMQ_PANEL_ROWS(3)
              case 4: LLMQ_PANEL_ROWS(4)
              case 5: LLMQ_PANEL_ROWS(5)
              default: LLMQ_PANEL_ROWS(6)
            }
#undef LLMQ_PANEL_ROWS
          }
        }
      }
    }
  });
}

// x [..., K] float32 @ W.T (+ bias [N]) -> [..., N] float32, for W laid out in panels [N/16, K, 16]
// (cpu_prepack.panel_weight).
inline at::Tensor linear(const at::Tensor& input, const at::Tensor& panels, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat,
              "panel_linear: float32 input and panels");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanelColumns && panels.is_contiguous(),
              "panel_linear: panels must be [N/16, K, 16], contiguous");
  const int64_t k = panels.size(1), num_panels = panels.size(0), n = num_panels * kPanelColumns;
  TORCH_CHECK(input.size(-1) == k, "panel_linear: input has ", input.size(-1), " features, the weight ", k);
  const at::Tensor x = input.reshape({-1, k}).contiguous();
  const int64_t m = x.size(0);
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "panel_linear: bias has ", bias->numel(), " elements, the weight ", n, " columns");
    bias_c = bias->to(at::kFloat).contiguous();
  }
  auto out_shape = input.sizes().vec();
  out_shape.back() = n;
  at::Tensor out = at::empty({m, n}, x.options());
  if (m > 0) {
    multiply(x.data_ptr<float>(), m, k, panels.data_ptr<float>(), num_panels,
             bias_c.defined() ? bias_c.data_ptr<float>() : nullptr, out.data_ptr<float>());
  }
  return out.view(out_shape);
}

}  // namespace llmq_panels
#endif
