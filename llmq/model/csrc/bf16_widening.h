// Whether this CPU's bfloat16 dot products (VDPBF16PS) are worth taking, or bfloat16 is better widened to
// float32 for AVX-512's multiply-adds: decided once a process by timing both, included by tiled_linear.h
// and decode_attention_bf16.h, which take the same path.
#pragma once

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace llmq_widening {

// The best of three times of 4,096 steps of twelve independent chains, c = step(c, x), each from a value of
// its own (chains that start equal and take the same steps are one chain to the compiler); x is hidden from
// the compiler at every step, so nothing is folded.
template <typename Operand, typename Step>
double chains_seconds(Operand x, const Step& step) {
  constexpr int64_t kSteps = 4096;
  volatile float sink = 0;
  double best = 1e30;
  for (int attempt = 0; attempt < 3; ++attempt) {
    __m512 c0 = _mm512_set1_ps(0.0f), c1 = _mm512_set1_ps(1.0f), c2 = _mm512_set1_ps(2.0f),
           c3 = _mm512_set1_ps(3.0f), c4 = _mm512_set1_ps(4.0f), c5 = _mm512_set1_ps(5.0f),
           c6 = _mm512_set1_ps(6.0f), c7 = _mm512_set1_ps(7.0f), c8 = _mm512_set1_ps(8.0f),
           c9 = _mm512_set1_ps(9.0f), c10 = _mm512_set1_ps(10.0f), c11 = _mm512_set1_ps(11.0f);
    const auto started = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < kSteps; ++i) {
      asm volatile("" : "+v"(x));
#define LLMQ_PROBE_STEP(R) c##R = step(c##R, x);
      LLMQ_PROBE_STEP(0) LLMQ_PROBE_STEP(1) LLMQ_PROBE_STEP(2) LLMQ_PROBE_STEP(3) LLMQ_PROBE_STEP(4)
      LLMQ_PROBE_STEP(5) LLMQ_PROBE_STEP(6) LLMQ_PROBE_STEP(7) LLMQ_PROBE_STEP(8) LLMQ_PROBE_STEP(9)
      LLMQ_PROBE_STEP(10) LLMQ_PROBE_STEP(11)
#undef LLMQ_PROBE_STEP
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
    sink = _mm512_reduce_add_ps(c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7 + c8 + c9 + c10 + c11);
  }
  return best;
}

// Whether a VDPBF16PS (32 multiply-adds) runs at less than `ratio` of the rate of AVX-512's float32
// multiply-adds (16 each) on this core, timed over independent chains of each. On some CPUs (an AMD Zen 4)
// the two run at one rate, so the dot products do twice the arithmetic; on others (an Intel Xeon whose
// matrix units the kernel does not hand out) VDPBF16PS issues at a quarter of their rate, and the same
// tiles widened to float32 go twice as fast through the multiply-adds (README: CPU kernels, "bfloat16 tiles
// widened to float32").
inline bool dot_products_slower_than_widened(double ratio) {
  const double dots = chains_seconds((__m512bh)_mm512_set1_epi32(0x3F803F80),
                                     [](__m512 c, __m512bh x) { return _mm512_dpbf16_ps(c, x, x); });
  const double fmas = chains_seconds(_mm512_set1_ps(1.0f), [](__m512 c, __m512 x) { return _mm512_fmadd_ps(x, x, c); });
  // Multiply-adds a second: 32 a dot product, 16 a float32 one.
  return 32.0 / dots < ratio * 16.0 / fmas;
}

// The widened path does two float32 multiply-adds for each VDPBF16PS it replaces, and a shift and a mask
// for each weight vector, shared by a pass's rows (at eight rows a ninth more work on the same ports): it
// pays where the dot products' multiply-adds a second fall below about 0.9 of the float32 ones'. The
// margin below that is for the timing's noise.
constexpr double kWideningPaysBelow = 0.7;

// Whether the products widen the tiles to float32 (1), use VDPBF16PS (0), or have not decided yet (-1: the
// first call times both here). The tests set it to check both paths on one CPU.
inline std::atomic<int>& widening_choice() {
  static std::atomic<int> choice{-1};
  return choice;
}

// Whether the kernels that would take VDPBF16PS (the tiled products' dot-product path, not the matrix
// units', and bfloat16 decode attention) widen bfloat16 to float32 for AVX-512's multiply-adds instead.
inline bool widens_bf16() {
  int choice = widening_choice().load(std::memory_order_relaxed);
  if (choice < 0) {
    choice = dot_products_slower_than_widened(kWideningPaysBelow) ? 1 : 0;
    int unset = -1;
    if (!widening_choice().compare_exchange_strong(unset, choice)) choice = unset;
  }
  return choice == 1;
}

// 16 bfloat16 pairs widened to float32: the even elements (the pairs' low halves: a tile row's even inputs'
// weights, a key's or value's even dims) and the odd ones. Exact: a bfloat16 is a float32's high half.
struct WidenedPairs {
  __m512 even, odd;
};
inline WidenedPairs widened_pairs(__m512i pairs) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))))};
}

}  // namespace llmq_widening
#endif
