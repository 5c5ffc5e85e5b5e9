// A softmax's exponentials over a row of scores, in place, included by cpu_kernels.cpp (decode attention)
// and prompt_attention.h: one code for both kernels.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace llmq_softmax {

// scores[0 .. length) -> exp(score - the largest), in place; returns their sum, by which the caller
// divides (once, where it suits it).
inline float exponentiate(float* scores, int64_t length) {
  using fVec = at::vec::Vectorized<float>;
  constexpr int64_t lanes = fVec::size();
  int64_t i = 0;
  fVec top_v(-std::numeric_limits<float>::infinity());
  for (; i + lanes <= length; i += lanes) top_v = at::vec::maximum(top_v, fVec::loadu(scores + i));
  float top = at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return at::vec::maximum(x, y); }, top_v);
  for (; i < length; ++i) top = std::max(top, scores[i]);
  top_v = fVec(top);
  fVec total_v(0.f);
  for (i = 0; i + lanes <= length; i += lanes) {
    const fVec e = (fVec::loadu(scores + i) - top_v).exp_u20();
    e.store(scores + i);
    total_v = total_v + e;
  }
  float total = at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, total_v);
  for (; i < length; ++i) {
    scores[i] = std::exp(scores[i] - top);
    total += scores[i];
  }
  return total;
}

}  // namespace llmq_softmax
