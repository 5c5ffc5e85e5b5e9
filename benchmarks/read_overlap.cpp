// A loop of nothing but a decode step's two costs, for benchmarks/read_overlap.py: read a buffer of
// bfloat16 pairs once, 64 bytes at a time, and for each 64 bytes do `rows` rows' multiply-adds, widened to
// float32 as llmq's tiled products do on a CPU whose bfloat16 dot products are slow. How long it takes
// against the read alone and the arithmetic alone says how far this machine overlaps the two; no llmq
// kernel is in it.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

namespace {

typedef float Lanes __attribute__((vector_size(64)));      // 16 float32
typedef uint32_t Words __attribute__((vector_size(64)));   // the same 64 bytes as 16 bfloat16 pairs

constexpr int64_t kLine = 64;

// Lines [first, end) of `bytes`, `passes` times, each line's 16 pairs widened (the even inputs' weights
// are the low halves) and multiplied into every row's sums. `distance`: bytes ahead to ask for into L2
// with each line (0: none). Rows is a template argument so that the sums stay in registers.
template <int Rows>
void run(const uint8_t* bytes, int64_t first, int64_t end, int64_t passes, int64_t distance, const float* x,
         float* sums) {
  Lanes acc[Rows > 0 ? Rows : 1] = {};
  Words seen = {};
  for (int64_t pass = 0; pass < passes; ++pass) {
    for (int64_t at = first; at < end; at += kLine) {
      if (distance > 0) __builtin_prefetch(bytes + at + distance, 0, 2);
      Words pairs;
      std::memcpy(&pairs, bytes + at, kLine);
      if constexpr (Rows == 0) {
        seen ^= pairs;  // the read alone: something must use every line
      } else {
        const Lanes even = (Lanes)(pairs << 16), odd = (Lanes)(pairs & 0xFFFF0000u);
#pragma GCC unroll 32
        for (int i = 0; i < Rows; ++i) {
          acc[i] += x[2 * i] * even;  // two statements: two fused multiply-adds, not a product and an add
          acc[i] += x[2 * i + 1] * odd;
        }
      }
    }
  }
  if constexpr (Rows == 0) {
    for (int j = 0; j < 16; ++j) sums[j] = static_cast<float>(seen[j] & 1u);
  } else {
    for (int i = 0; i < Rows; ++i)
      for (int j = 0; j < 16; ++j) sums[i * 16 + j] = acc[i][j];
  }
}

using Loop = void (*)(const uint8_t*, int64_t, int64_t, int64_t, int64_t, const float*, float*);

Loop loop_for(int64_t rows) {
  switch (rows) {
    case 0: return run<0>;
    case 1: return run<1>;
    case 2: return run<2>;
    case 4: return run<4>;
    case 8: return run<8>;
    case 12: return run<12>;
    case 16: return run<16>;
    case 24: return run<24>;
    case 32: return run<32>;
    default: TORCH_CHECK(false, "rows must be one of 0, 1, 2, 4, 8, 12, 16, 24, 32, not ", rows);
  }
}

// `bytes` (uint8, a multiple of 64 bytes a thread) cut into one contiguous run a thread, each run read
// `passes` times with `x`'s rows ([rows, 2] float32: each row's even and odd input). Returns each thread's
// sums, [threads, max(rows, 1), 16] (rows = 0: a bit of each lane's xor, to keep the reads).
at::Tensor stream_rows(const at::Tensor& bytes, const at::Tensor& x, int64_t passes, int64_t distance,
                       int64_t threads) {
  TORCH_CHECK(bytes.scalar_type() == at::kByte && bytes.is_contiguous(), "bytes must be contiguous uint8");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == 2,
              "x must be a contiguous [rows, 2] float32");
  TORCH_CHECK(threads >= 1 && bytes.numel() % (threads * kLine) == 0,
              "bytes must be a multiple of 64 bytes for each of the threads");
  const int64_t rows = x.size(0);
  const Loop loop = loop_for(rows);
  const int64_t span = bytes.numel() / threads;
  at::Tensor sums = at::zeros({threads, std::max<int64_t>(rows, 1), 16}, at::kFloat);
  const uint8_t* data = bytes.data_ptr<uint8_t>();
  const float* inputs = x.data_ptr<float>();
  float* out = sums.data_ptr<float>();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      loop(data, t * span, (t + 1) * span, passes, distance, inputs, out + t * std::max<int64_t>(rows, 1) * 16);
  });
  return sums;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stream_rows", &stream_rows, "read a buffer once per pass, each 64 bytes multiplied into rows' sums");
}
