// Fused CPU kernels for the small operations of a step: one pass over memory where plain PyTorch makes
// several, each with its own allocation and thread fork. And, where the CPU has AVX512-BF16, bfloat16
// products over weights laid out in tiles, on its matrix units where it has AMX (tiled_linear.h); on a
// CPU with AVX2 or AVX-512, float32 products over float32 or bfloat16 weights laid out in panels
// (panel_linear.h). Built at first use by llmq/model/cpu_kernels.py, which also holds the plain-PyTorch
// twin of every function here (the tests hold the two together).
//
// Arithmetic is in float32 whatever the tensors' dtype; bfloat16 and float16 are rounded on the way out,
// where the twin rounds after every operator, and also where that rounding is the model's own (RMSNorm's
// normalised row before the weight scales it, SiLU's output before the product), as transformers does.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "panel_linear.h"

// argmax_rows: on AVX-512, or on AVX2 where panel_linear.h is built (its widening loads).
#if defined(__AVX512F__) || defined(LLMQ_HAS_PANEL_LINEAR)
#define LLMQ_HAS_ARGMAX_ROWS 1
#include <immintrin.h>
#endif
#include "tiled_linear.h"
#include "decode_attention_amx.h"
#include "decode_attention_bf16.h"
#include "greedy_screen.h"
#include "paged_prefetch.h"
#include "prompt_attention.h"
#include "prompt_attention_amx.h"
#include "softmax.h"
#include "work_split.h"

// float32, bfloat16 and float16: the dtypes the engine computes in.
#define DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                                                \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                   \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)            \
                                         AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
constexpr int64_t kLanes = fVec::size();
constexpr int64_t kMaxGroup = 64;  // query heads per KV head that decode attention takes

// kLanes elements of scalar_t, as float32; and back, rounded to scalar_t.
template <typename scalar_t>
inline fVec load_f(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return fVec::loadu(p);
  } else {
    fVec v;
    at::vec::load_to_float<scalar_t>(p, v);
    return v;
  }
}

template <typename scalar_t>
inline void store_f(scalar_t* p, const fVec& v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    v.store(p);
  } else {
    at::vec::convert_from_float<scalar_t>(v, v).store(p, kLanes);
  }
}

// The value an operator's output in scalar_t would hold.
template <typename scalar_t>
inline fVec rounded(const fVec& v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return v;
  } else {
    return std::get<0>(at::vec::convert_to_float<scalar_t>(at::vec::convert_from_float<scalar_t>(v, v)));
  }
}

template <typename scalar_t>
inline float rounded(float value) {
  return static_cast<float>(static_cast<scalar_t>(value));
}

inline float sum_lanes(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, v);
}

// sum(q[i] * x[i]) over n elements, q in float32.
template <typename scalar_t>
inline float dot(const float* q, const scalar_t* x, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
  if (n >= kLanes) {
    fVec acc(0.f);
    for (; i + kLanes <= n; i += kLanes) acc = at::vec::fmadd(fVec::loadu(q + i), load_f(x + i), acc);
    total = sum_lanes(acc);
  }
  for (; i < n; ++i) total += q[i] * static_cast<float>(x[i]);
  return total;
}

// acc[i] += p * x[i] over n elements, acc in float32.
template <typename scalar_t>
inline void axpy(float p, const scalar_t* x, float* acc, int64_t n) {
  int64_t i = 0;
  const fVec pv(p);
  for (; i + kLanes <= n; i += kLanes) at::vec::fmadd(pv, load_f(x + i), fVec::loadu(acc + i)).store(acc + i);
  for (; i < n; ++i) acc[i] += p * static_cast<float>(x[i]);
}

void check_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

// ---- RMSNorm, and RMSNorm after a residual add ------------------------------------------------------

// out = weight * normalised(row), as llama.py's RMSNorm: in float32 the product is taken in float32; in
// a half dtype the normalised row is rounded to it before the weight scales it, as transformers does.
// `row` holds the input already in float32.
template <typename scalar_t>
void rms_norm_row(const float* row, const scalar_t* weight, scalar_t* out, int64_t hidden, double eps) {
  const float inv = 1.f / std::sqrt(dot(row, row, hidden) / static_cast<float>(hidden) + static_cast<float>(eps));
  int64_t i = 0;
  const fVec inv_v(inv);
  for (; i + kLanes <= hidden; i += kLanes)
    store_f(out + i, rounded<scalar_t>(fVec::loadu(row + i) * inv_v) * load_f(weight + i));
  for (; i < hidden; ++i) out[i] = static_cast<scalar_t>(rounded<scalar_t>(row[i] * inv) * static_cast<float>(weight[i]));
}

template <typename scalar_t>
inline void widen(const scalar_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) load_f(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

void check_norm_weight(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden] in x's dtype");
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, hidden] with contiguous rows");
  check_norm_weight(x, weight);
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t rows = x.size(0), hidden = x.size(1), stride = x.stride(0);
  DISPATCH_FLOAT_TYPES(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(hidden);
      for (int64_t r = begin; r < end; ++r) {
        widen(xp + r * stride, row.data(), hidden);
        rms_norm_row(row.data(), wp, op + r * hidden, hidden, eps);
      }
    });
  });
  return out;
}

// (normalised(x + residual), x + residual): the sum rounded to the dtype, as `residual + x` would be.
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                        const torch::Tensor& weight, double eps) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type(),
              "x and residual must be contiguous [T, hidden] of one dtype");
  check_norm_weight(x, weight);
  auto out = torch::empty_like(x);
  auto sum = torch::empty_like(x);
  const int64_t rows = x.size(0), hidden = x.size(1);
  DISPATCH_FLOAT_TYPES(x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(hidden);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t base = r * hidden;
        int64_t i = 0;
        for (; i + kLanes <= hidden; i += kLanes) {
          const fVec total = rounded<scalar_t>(load_f(rp + base + i) + load_f(xp + base + i));
          store_f(sp + base + i, total);
          total.store(row.data() + i);
        }
        for (; i < hidden; ++i) {
          const scalar_t total = static_cast<scalar_t>(static_cast<float>(rp[base + i]) + static_cast<float>(xp[base + i]));
          sp[base + i] = total;
          row[i] = static_cast<float>(total);
        }
        rms_norm_row(row.data(), wp, op + base, hidden, eps);
      }
    });
  });
  return {out, sum};
}

// ---- rotary embedding, in place ----------------------------------------------------------------------

// x [T, heads, Dh] (a view into the qkv projection's output), rotate-half layout; cos, sin [T, Dh].
void rotary_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x must be [T, heads, head_dim] with contiguous heads of an even size");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == x.size(0) &&
                  cos.size(1) == x.size(2) && cos.scalar_type() == x.scalar_type() && sin.sizes() == cos.sizes() &&
                  sin.scalar_type() == x.scalar_type(),
              "cos and sin must be contiguous [T, head_dim] in x's dtype");
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2), half = head_dim / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  DISPATCH_FLOAT_TYPES(x.scalar_type(), "rotary_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* c = cp + t * head_dim;
        const scalar_t* s = sp + t * head_dim;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* v = xp + t * token_stride + h * head_stride;
          int64_t i = 0;
          for (; i + kLanes <= half; i += kLanes) {
            const fVec a = load_f(v + i), b = load_f(v + half + i);
            store_f(v + i, a * load_f(c + i) - b * load_f(s + i));
            store_f(v + half + i, b * load_f(c + half + i) + a * load_f(s + half + i));
          }
          for (; i < half; ++i) {
            const float a = static_cast<float>(v[i]), b = static_cast<float>(v[i + half]);
            v[i] = static_cast<scalar_t>(a * static_cast<float>(c[i]) - b * static_cast<float>(s[i]));
            v[i + half] = static_cast<scalar_t>(b * static_cast<float>(c[i + half]) + a * static_cast<float>(s[i + half]));
          }
        }
      }
    });
  });
}

// ---- SiLU(gate) * up ---------------------------------------------------------------------------------

// exp(x) as precise as the dtype needs: float32 takes the exact-to-an-ulp exp; a half dtype one within
// 20 float32 ulps (a few parts in a million, far below a half dtype's rounding), which costs much less.
template <typename scalar_t>
inline fVec exp_for(const fVec& x) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return x.exp();
  } else {
    return x.exp_u20();
  }
}

// dst[i] = silu(gate[i]) * up[i] over `width` elements; silu's output rounded to the dtype before the product.
template <typename scalar_t>
inline void silu_mul_row(const scalar_t* gate, const scalar_t* up, scalar_t* dst, int64_t width) {
  const fVec one(1.f);
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes) {
    const fVec g = load_f(gate + i);
    store_f(dst + i, rounded<scalar_t>(g / (one + exp_for<scalar_t>(g.neg()))) * load_f(up + i));
  }
  for (; i < width; ++i) {
    const float g = static_cast<float>(gate[i]);
    dst[i] = static_cast<scalar_t>(rounded<scalar_t>(g / (1.f + std::exp(-g))) * static_cast<float>(up[i]));
  }
}

// gate_up [T, 2 I] (gate, then up) -> [T, I].
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  check_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [T, 2 * intermediate]");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = torch::empty({rows, width}, gate_up.options());
  DISPATCH_FLOAT_TYPES(gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = in + r * 2 * width;
        silu_mul_row(gate, gate + width, op + r * width, width);
      }
    });
  });
  return out;
}

// ---- decode attention over the paged cache -----------------------------------------------------------

// Asks for a cache block's lines ahead of their use: blocks lie anywhere in the cache, so the hardware's
// prefetcher, which follows addresses, does not see the next one coming.
template <typename scalar_t>
inline void prefetch_block(const scalar_t* head, int32_t block, int64_t block_elems) {
  const char* start = reinterpret_cast<const char*>(head + static_cast<int64_t>(block) * block_elems);
  for (int64_t offset = 0; offset < block_elems * static_cast<int64_t>(sizeof(scalar_t)); offset += 64)
    __builtin_prefetch(start + offset);
}

// q's dot product with a key of kChunks vectors, as a vector whose lanes sum to it: in two running sums
// (kChunks > 1), so that successive multiply-adds do not wait on each other.
template <int kChunks, typename scalar_t>
inline fVec dot_lanes(const float* q, const scalar_t* key) {
  if constexpr (kChunks == 1) {
    return fVec::loadu(q) * load_f(key);
  } else {
    fVec even = fVec::loadu(q) * load_f(key), odd = fVec::loadu(q + kLanes) * load_f(key + kLanes);
    for (int c = 2; c < kChunks; c += 2) {
      even = at::vec::fmadd(fVec::loadu(q + c * kLanes), load_f(key + c * kLanes), even);
      odd = at::vec::fmadd(fVec::loadu(q + (c + 1) * kLanes), load_f(key + (c + 1) * kLanes), odd);
    }
    return even + odd;
  }
}

// Where the vectors are AVX2's or AVX-512's, store_lane_sums sums eight vectors' lanes at once, and a
// block's keys are scored for several query heads at a time (score_block); elsewhere each key's vector is
// summed alone as soon as it is made.
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#define LLMQ_SUMS_LANES_TOGETHER 1
constexpr int64_t kKeysTogether = 8;
#else
constexpr int64_t kKeysTogether = 1;
#endif

#if defined(CPU_CAPABILITY_AVX512)
// AVX2's _mm256_hadd_ps on AVX-512 vectors, in each 128-bit lane: [a0 + a1, a2 + a3, b0 + b1, b2 + b3].
inline __m512 pairwise_sums(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}
#endif

// Each of kKeysTogether vectors' sum of lanes, into out[0..count): on AVX2 and AVX-512 all eight at once
// (a transposing tree of pairwise sums), where summing each alone costs a shuffle chain per score.
// Every vector's lanes are summed in the same order wherever it stands, so a key's score does not depend
// on the keys beside it.
inline void store_lane_sums(const fVec* parts, int64_t count, float* out) {
#if defined(CPU_CAPABILITY_AVX2)
  const __m256 p01 = _mm256_hadd_ps(parts[0], parts[1]), p23 = _mm256_hadd_ps(parts[2], parts[3]);
  const __m256 p45 = _mm256_hadd_ps(parts[4], parts[5]), p67 = _mm256_hadd_ps(parts[6], parts[7]);
  // low: in each 128-bit half, lane j holds part j's sum over that half's lanes; high: the same for
  // parts 4-7. Adding the halves gives each part's whole sum, in order.
  const __m256 low = _mm256_hadd_ps(p01, p23), high = _mm256_hadd_ps(p45, p67);
  const fVec sums = _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
  sums.store(out, count);
#elif defined(CPU_CAPABILITY_AVX512)
  const __m512 p01 = pairwise_sums(parts[0], parts[1]), p23 = pairwise_sums(parts[2], parts[3]);
  const __m512 p45 = pairwise_sums(parts[4], parts[5]), p67 = pairwise_sums(parts[6], parts[7]);
  // low: in each of the four 128-bit quarters, lane j holds part j's sum over that quarter's lanes; high:
  // the same for parts 4-7.
  const __m512 low = pairwise_sums(p01, p23), high = pairwise_sums(p45, p67);
  // Quarters: low's first two summed, low's last two, then high's the same.
  const __m512 halves = _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
  // Quarter 0: parts 0-3's whole sums; quarter 1: parts 4-7's.
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_f32x4(halves, halves, 0x08),
                                    _mm512_shuffle_f32x4(halves, halves, 0x0D));
  // All eight in a plain store where they fit: the scores are read back one by one next, and a masked
  // store cannot pass its data on to those loads, which then wait for it to reach the cache.
  if (count == 8) {
    _mm256_storeu_ps(out, _mm512_castps512_ps256(sums));
  } else {
    _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << count) - 1), sums);
  }
#else
  for (int64_t j = 0; j < count; ++j) out[j] = sum_lanes(parts[j]);
#endif
}

#if defined(LLMQ_SUMS_LANES_TOGETHER)
// The scores of a block's `count` keys for `group` query heads, kHeads heads and 8 / kHeads keys at a time:
// each key vector is loaded once for the kHeads heads it serves, into eight running sums, one a (head, key)
// pair, whose lanes store_lane_sums then sums together. A pair's sum runs over head_dim in the same order
// whatever else is in the pass, so a key's score does not depend on the keys or heads beside it. With each
// pass of keys it asks for their share of `ahead`'s lines, as attend does.
template <int kChunks, int kHeads, typename scalar_t>
void score_block(const float* query, const scalar_t* keys, int64_t count, int64_t group, int64_t head_dim,
                 float* scores, int64_t length, llmq_prefetch::ContextFetch* ahead, int64_t ahead_per_key) {
  constexpr int kKeys = 8 / kHeads;
  for (int64_t first_head = 0; first_head < group; first_head += kHeads)
    for (int64_t t = 0; t < count; t += kKeys) {
      const int64_t width = std::min<int64_t>(kKeys, count - t);
      if (ahead != nullptr && first_head == 0) ahead->next(ahead_per_key * width);
      fVec sums[8];
      for (int i = 0; i < 8; ++i) sums[i] = fVec(0.f);
      for (int c = 0; c < kChunks; ++c)
        for (int j = 0; j < kKeys; ++j) {
          const fVec key = j < width ? load_f(keys + (t + j) * head_dim + c * kLanes) : fVec(0.f);
          for (int h = 0; h < kHeads; ++h)
            sums[h * kKeys + j] =
                at::vec::fmadd(fVec::loadu(query + (first_head + h) * head_dim + c * kLanes), key, sums[h * kKeys + j]);
        }
      float lane_sums[8];
      store_lane_sums(sums, 8, lane_sums);
      for (int h = 0; h < kHeads; ++h)
        for (int64_t j = 0; j < width; ++j) scores[(first_head + h) * length + t + j] = lane_sums[h * kKeys + j];
    }
}

// The weighted sums of values for `group` query heads (each row of `weights` a head's, over `length` tokens),
// kHeads heads and 8 / kHeads of a head's kChunks vectors at a time: each value vector is loaded once for
// the kHeads heads it serves, into eight running sums, one a (head, vector). Each head's sum is scaled by
// its inv_total into out [group, head_dim]. The first pass asks for each next block as attend's did.
template <int kChunks, int kHeads, typename scalar_t>
void weigh_values(const float* weights, const scalar_t* v_head, const int32_t* table, int64_t length,
                  int64_t block_size, int64_t group, int64_t head_dim, const float* inv_total, float* out) {
  constexpr int kVectors = 8 / kHeads;
  static_assert(kChunks % kVectors == 0, "a pass takes whole vectors of a head");
  for (int64_t first_head = 0; first_head < group; first_head += kHeads)
    for (int first_vector = 0; first_vector < kChunks; first_vector += kVectors) {
      fVec sums[kHeads][kVectors];
      for (int h = 0; h < kHeads; ++h)
        for (int c = 0; c < kVectors; ++c) sums[h][c] = fVec(0.f);
      for (int64_t first = 0; first < length; first += block_size) {
        const int64_t count = std::min(block_size, length - first);
        const scalar_t* values = v_head + static_cast<int64_t>(table[first / block_size]) * block_size * head_dim +
                                 first_vector * kLanes;
        if (first_head == 0 && first_vector == 0 && first + block_size < length)
          prefetch_block(v_head, table[first / block_size + 1], block_size * head_dim);
        for (int64_t t = 0; t < count; ++t) {
          fVec weight[kHeads];
          for (int h = 0; h < kHeads; ++h) weight[h] = fVec(weights[(first_head + h) * length + first + t]);
          for (int c = 0; c < kVectors; ++c) {
            const fVec value = load_f(values + t * head_dim + c * kLanes);
            for (int h = 0; h < kHeads; ++h) sums[h][c] = at::vec::fmadd(weight[h], value, sums[h][c]);
          }
        }
      }
      for (int h = 0; h < kHeads; ++h) {
        const fVec inv(inv_total[first_head + h]);
        for (int c = 0; c < kVectors; ++c)
          (sums[h][c] * inv).store(out + (first_head + h) * head_dim + (first_vector + c) * kLanes);
      }
    }
}
#endif

// Decode attention for one (sequence, KV head): its G query heads ([G, Dh], float32, scaled) against the
// `length` keys and values that `table` names, into out [G, Dh]. `scores` holds G * length floats.
// kChunks > 0: head_dim is kChunks vectors, known when compiled, so that a key's dot product and a
// head's running sum of values stay in registers; 0: any head_dim. As it scores each key it asks for
// an equal share of `ahead`'s lines (the next piece's context; none where null), the rest at the end.
template <int kChunks, typename scalar_t>
void attend(const float* query, const scalar_t* k_head, const scalar_t* v_head, const int32_t* table,
            int64_t length, int64_t block_size, int64_t group, int64_t head_dim, float* scores, float* out,
            llmq_prefetch::ContextFetch* ahead) {
  const int64_t ahead_per_key = ahead != nullptr ? (ahead->lines() + length - 1) / length : 0;
#if defined(LLMQ_SUMS_LANES_TOGETHER)
  auto score_here = group % 8 == 0 ? score_block<kChunks, 8, scalar_t> : group % 4 == 0 ? score_block<kChunks, 4, scalar_t>
                  : group % 2 == 0 ? score_block<kChunks, 2, scalar_t> : score_block<kChunks, 1, scalar_t>;
#endif
  // Scores, a block at a time (one block-table lookup per block, no division per token). On AVX2 and
  // AVX-512, with heads of whole vectors, score_block takes the block for several heads at once; otherwise
  // each key's dot product alone.
  for (int64_t first = 0; first < length; first += block_size) {
    const int64_t count = std::min(block_size, length - first);
    const scalar_t* keys = k_head + static_cast<int64_t>(table[first / block_size]) * block_size * head_dim;
    if (first + block_size < length) prefetch_block(k_head, table[first / block_size + 1], block_size * head_dim);
#if defined(LLMQ_SUMS_LANES_TOGETHER)
    if constexpr (kChunks > 0) {
      score_here(query, keys, count, group, head_dim, scores + first, length, ahead, ahead_per_key);
      continue;
    }
#endif
    for (int64_t t = 0; t < count; t += kKeysTogether) {
      const int64_t width = std::min(kKeysTogether, count - t);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = query + g * head_dim;
        float* out_scores = scores + g * length + first + t;
        if constexpr (kChunks > 0) {
          fVec parts[kKeysTogether];
          for (int64_t j = 0; j < kKeysTogether; ++j)
            parts[j] = j < width ? dot_lanes<kChunks>(qg, keys + (t + j) * head_dim) : fVec(0.f);
          store_lane_sums(parts, width, out_scores);
        } else {
          for (int64_t j = 0; j < width; ++j) out_scores[j] = dot(qg, keys + (t + j) * head_dim, head_dim);
        }
      }
      if (ahead != nullptr) ahead->next(ahead_per_key * width);
    }
  }
  if (ahead != nullptr) ahead->next(ahead->lines());
  // Softmax's exponentials; each head's 1 / sum scales its weighted sum of values at the end.
  float inv_total[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) inv_total[g] = 1.f / llmq_softmax::exponentiate(scores + g * length, length);
  // The weighted sum of values. On AVX2 and AVX-512, with heads of four or eight vectors and an even
  // group, two heads at a time, each value vector loaded once for both (weigh_values; on AVX2 four heads
  // at a time measured level in float32). Otherwise a head at a time: below eight vectors a head, two
  // running sums (even and odd tokens) so that enough multiply-adds are in flight; at eight, one set
  // already is, and a second would not fit in AVX2's sixteen registers.
#if defined(LLMQ_SUMS_LANES_TOGETHER)
  if constexpr (kChunks >= 4) {
    if (group % 2 == 0) {
      weigh_values<kChunks, 2, scalar_t>(scores, v_head, table, length, block_size, group, head_dim, inv_total, out);
      return;
    }
  }
#endif
  constexpr int kSums = kChunks >= 8 ? 1 : 2;
  for (int64_t g = 0; g < group; ++g) {
    const float* p = scores + g * length;
    float* dst = out + g * head_dim;
    if constexpr (kChunks > 0) {
      fVec sums[kSums][kChunks];
      for (int s = 0; s < kSums; ++s)
        for (int c = 0; c < kChunks; ++c) sums[s][c] = fVec(0.f);
      for (int64_t first = 0; first < length; first += block_size) {
        const int64_t count = std::min(block_size, length - first);
        const scalar_t* values = v_head + static_cast<int64_t>(table[first / block_size]) * block_size * head_dim;
        if (first + block_size < length) prefetch_block(v_head, table[first / block_size + 1], block_size * head_dim);
        int64_t t = 0;
        if constexpr (kSums == 2) {
          for (; t + 1 < count; t += 2) {
            const fVec even(p[first + t]), odd(p[first + t + 1]);
            for (int c = 0; c < kChunks; ++c) {
              sums[0][c] = at::vec::fmadd(even, load_f(values + t * head_dim + c * kLanes), sums[0][c]);
              sums[1][c] = at::vec::fmadd(odd, load_f(values + (t + 1) * head_dim + c * kLanes), sums[1][c]);
            }
          }
        }
        for (; t < count; ++t) {
          const fVec weight(p[first + t]);
          for (int c = 0; c < kChunks; ++c)
            sums[0][c] = at::vec::fmadd(weight, load_f(values + t * head_dim + c * kLanes), sums[0][c]);
        }
      }
      const fVec inv(inv_total[g]);
      for (int c = 0; c < kChunks; ++c) {
        fVec total = sums[0][c];
        if constexpr (kSums == 2) total = total + sums[1][c];
        (total * inv).store(dst + c * kLanes);
      }
    } else {
      std::fill(dst, dst + head_dim, 0.f);
      for (int64_t first = 0; first < length; first += block_size) {
        const int64_t count = std::min(block_size, length - first);
        const scalar_t* values = v_head + static_cast<int64_t>(table[first / block_size]) * block_size * head_dim;
        for (int64_t t = 0; t < count; ++t) axpy(p[first + t], values + t * head_dim, dst, head_dim);
      }
      for (int64_t d = 0; d < head_dim; ++d) dst[d] *= inv_total[g];
    }
  }
}

// Each query token as a decode: q [N, H, Dh]; caches [KVH, slots, Dh]; query n reads block table row
// r = query_tables[n] (n where there are none), the slot of position p being
// block_tables[r][p / block_size] * block_size + p % block_size, over its context_lens[n] positions (itself
// included). A decode is one query with a row of its own; a prompt chunk's tokens share their sequence's row,
// each with its own length (the causal mask). Each (query, KV head) pair is one piece of work: its
// G = H / KVH query heads share every key and value it reads, in place. Softmax is exact: every score first,
// then the weighted sum of values. Each thread takes a contiguous run of pieces of about equal work, then
// what is left of the others' from their backs (work_split.h), and each piece asks for the next one's keys
// and values into L2 as it computes (paged_prefetch.h's ContextFetch), where the thread will most likely
// take it next, unless its query follows another of its table's (a chunk's: those blocks are warm).
template <typename scalar_t>
void decode_attention_kernel(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                             const torch::Tensor& block_tables, const int32_t* query_tables,
                             const torch::Tensor& context_lens, int64_t block_size, double scale, torch::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), group = num_heads / num_kv_heads;
  const int64_t q_token_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t cache_head_stride = k_cache.stride(0), out_stride = out.stride(0);
  const int64_t table_stride = block_tables.stride(0);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t chunks = head_dim % kLanes == 0 ? head_dim / kLanes : 0;
  auto attend_here = chunks == 1 ? attend<1, scalar_t> : chunks == 2 ? attend<2, scalar_t>
                   : chunks == 4 ? attend<4, scalar_t> : chunks == 8 ? attend<8, scalar_t> : attend<0, scalar_t>;
  auto table_of = [&](int64_t n) { return tables + (query_tables != nullptr ? query_tables[n] : n) * table_stride; };
  const int64_t threads = std::max(1, at::get_num_threads());
  llmq_split::StealingRuns runs(llmq_split::balanced_runs(lens, num_seqs, num_kv_heads, threads));

  llmq_split::for_each_run(runs.parts(), [&](int64_t own) {
    std::vector<float> query(group * head_dim), result(group * head_dim), scores;
    for (int64_t item = runs.next(own); item >= 0; item = runs.next(own)) {
      const int64_t n = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t length = lens[n];
      if (length <= 0) continue;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = qp + n * q_token_stride + (kv_head * group + g) * q_head_stride;
        for (int64_t d = 0; d < head_dim; ++d) query[g * head_dim + d] = static_cast<float>(src[d]) * scale;
      }
      const int64_t next = (item + 1) / num_kv_heads, next_head = (item + 1) % num_kv_heads;
      const bool fetch_next = runs.is_next_of(own, item + 1) && llmq_prefetch::first_of_its_table(query_tables, next);
      llmq_prefetch::ContextFetch ahead;
      if (fetch_next) {
        ahead = llmq_prefetch::ContextFetch(reinterpret_cast<const char*>(kp + next_head * cache_head_stride),
                                            reinterpret_cast<const char*>(vp + next_head * cache_head_stride),
                                            table_of(next), lens[next], block_size,
                                            block_size * head_dim * static_cast<int64_t>(sizeof(scalar_t)));
      }
      scores.resize(group * length);
      attend_here(query.data(), kp + kv_head * cache_head_stride, vp + kv_head * cache_head_stride, table_of(n),
                  length, block_size, group, head_dim, scores.data(), result.data(), fetch_next ? &ahead : nullptr);
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = op + n * out_stride + (kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(result[g * head_dim + d]);
      }
    }
  });
}

void paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                            const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                            int64_t block_size, double scale, torch::Tensor& out,
                            const c10::optional<torch::Tensor>& query_tables) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [N, H, head_dim] with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 3 && k_cache.size(2) == q.size(2) && k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "the caches must be contiguous [KVH, slots, head_dim] in q's dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0 && q.size(1) / k_cache.size(0) <= kMaxGroup,
              "the query heads must be a multiple of the KV heads, at most ", kMaxGroup, " per KV head");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  block_tables.dim() == 2 && block_tables.stride(1) == 1 && context_lens.is_contiguous() &&
                  context_lens.size(0) >= q.size(0),
              "block_tables [rows, max_blocks] and context_lens [N] must be int32");
  const int32_t* query_table_ptr = nullptr;
  if (query_tables.has_value() && query_tables->defined()) {
    TORCH_CHECK(query_tables->scalar_type() == at::kInt && query_tables->dim() == 1 && query_tables->is_contiguous() &&
                    query_tables->size(0) >= q.size(0),
                "query_tables must be int32 [N]");
    query_table_ptr = query_tables->data_ptr<int32_t>();
    for (int64_t n = 0; n < q.size(0); ++n)
      TORCH_CHECK(query_table_ptr[n] >= 0 && query_table_ptr[n] < block_tables.size(0), "query ", n,
                  " names block table row ", query_table_ptr[n], " of ", block_tables.size(0));
  } else {
    TORCH_CHECK(block_tables.size(0) >= q.size(0), "block_tables needs a row for each query");
  }
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) >= q.size(0) &&
                  out.size(1) == q.size(1) * q.size(2) && out.scalar_type() == q.scalar_type(),
              "out must be [N, H * head_dim] in q's dtype");
  // The long prompt chunks go to the prompt kernel where this build has it; the rest, each token as a decode.
  torch::Tensor decode_lens = context_lens;
#ifdef LLMQ_HAS_AMX_PROMPT_ATTENTION
  if (query_table_ptr != nullptr && q.scalar_type() == at::kBFloat16 && llmq_prompt_amx::runs_here(q.size(2))) {
    const auto chunks = llmq_prompt_amx::long_chunks(query_table_ptr, context_lens.data_ptr<int32_t>(), q.size(0),
                                                     block_tables.data_ptr<int32_t>(), block_tables.stride(0));
    if (!chunks.empty()) {
      decode_lens = context_lens.clone();
      for (const auto& chunk : chunks)  // the decode kernel skips them
        std::fill_n(decode_lens.data_ptr<int32_t>() + chunk.first, chunk.tokens, 0);
      llmq_prompt_amx::attend_chunks(chunks, reinterpret_cast<const uint16_t*>(q.data_ptr()), q.stride(0), q.stride(1),
                                     reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
                                     reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), k_cache.stride(0),
                                     k_cache.stride(1), block_size, q.size(1), k_cache.size(0), q.size(2),
                                     static_cast<float>(scale), reinterpret_cast<uint16_t*>(out.data_ptr()),
                                     out.stride(0));
    }
  }
#endif
#ifdef LLMQ_HAS_PROMPT_ATTENTION
  if (query_table_ptr != nullptr && llmq_prompt::supports(q.size(2))) {
    const int32_t* lens = context_lens.data_ptr<int32_t>();
    const auto chunks = llmq_prompt::long_chunks(query_table_ptr, lens, q.size(0), q.size(1) / k_cache.size(0));
    if (!chunks.empty()) decode_lens = context_lens.clone();
    const int64_t head_stride = k_cache.stride(0), token_stride = k_cache.stride(1);  // the caches' alike
    for (const auto& chunk : chunks) {
      std::fill_n(decode_lens.data_ptr<int32_t>() + chunk.first, chunk.tokens, 0);  // the decode kernel skips them
      const int32_t* table = block_tables.data_ptr<int32_t>() + query_table_ptr[chunk.first] * block_tables.stride(0);
      const llmq_prompt::Context where{head_stride, token_stride, head_stride, token_stride, table, block_size};
      DISPATCH_FLOAT_TYPES(q.scalar_type(), "paged_decode_attention", [&] {
        llmq_prompt::attend_chunk<scalar_t>(q.data_ptr<scalar_t>() + chunk.first * q.stride(0), q.stride(0),
                                            q.stride(1), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                            where, chunk.tokens, q.size(1), k_cache.size(0), q.size(2),
                                            lens[chunk.first] - 1, static_cast<float>(scale),
                                            out.data_ptr<scalar_t>() + chunk.first * out.stride(0), out.stride(0));
      });
    }
  }
#endif
#ifdef LLMQ_HAS_BF16_DECODE_ATTENTION
  if (q.scalar_type() == at::kBFloat16 && llmq_bf16::supports(q.size(2))) {
    auto attend = [&](auto* kernel) {  // the kernel's type, as a null pointer to one
      llmq_bf16::decode_attention<std::remove_pointer_t<decltype(kernel)>>(
          q.data_ptr<at::BFloat16>(), q.stride(0), q.stride(1), k_cache.data_ptr<at::BFloat16>(),
          v_cache.data_ptr<at::BFloat16>(), k_cache.stride(0), block_tables.data_ptr<int32_t>(), block_tables.stride(0),
          query_table_ptr, decode_lens.data_ptr<int32_t>(), q.size(0), q.size(1), k_cache.size(0), q.size(2),
          block_size, static_cast<float>(scale), out.data_ptr<at::BFloat16>(), out.stride(0));
    };
#ifdef LLMQ_HAS_AMX_DECODE_ATTENTION
    if (llmq_decode_amx::runs_here(q.size(1) / k_cache.size(0), q.size(2))) {
      attend(static_cast<llmq_decode_amx::TileAttend*>(nullptr));
      return;
    }
#endif
    attend(static_cast<llmq_bf16::VectorAttend*>(nullptr));
    return;
  }
#endif
  DISPATCH_FLOAT_TYPES(q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_kernel<scalar_t>(q, k_cache, v_cache, block_tables, query_table_ptr, decode_lens, block_size,
                                      scale, out);
  });
}

// Which code decode attention runs for `dtype`, `head_dim` and `group` query heads per KV head: "amx"
// (decode_attention_amx.h), "avx512-bf16" (decode_attention_bf16.h) or "vector" (attend above).
std::string decode_attention_path(const std::string& dtype, int64_t head_dim, int64_t group) {
#ifdef LLMQ_HAS_BF16_DECODE_ATTENTION
  if (dtype == "bfloat16" && llmq_bf16::supports(head_dim)) {
#ifdef LLMQ_HAS_AMX_DECODE_ATTENTION
    if (llmq_decode_amx::runs_here(group, head_dim)) return "amx";
#endif
    return llmq_widening::widens_bf16() ? "avx512-widened" : "avx512-bf16";
  }
#endif
  (void)group;
  return "vector";
}

// ---- a long prompt chunk's attention over its whole context (prompt_attention.h) -----------------------

// Whether prompt_attention (and the paged call) takes a chunk of `dtype` whose heads are `head_dim` long here:
// on the matrix units, bfloat16 (prompt_attention_amx.h); on an AVX2 CPU without AVX-512, every dtype
// (prompt_attention.h).
bool prompt_attention_supported(int64_t head_dim, const std::string& dtype) {
#ifdef LLMQ_HAS_AMX_PROMPT_ATTENTION
  if (dtype == "bfloat16" && llmq_prompt_amx::runs_here(head_dim)) return true;
#endif
#ifdef LLMQ_HAS_PROMPT_ATTENTION
  return llmq_prompt::supports(head_dim);
#else
  (void)head_dim;
  (void)dtype;
  return false;
#endif
}

// q [n, H, Dh]; keys, values [KVH, num_cached + n, Dh] (the chunk's context, its own tokens last) -> causal
// attention [n, H * Dh], the chunk's token i at position num_cached + i.
torch::Tensor prompt_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                               int64_t num_cached, double scale) {
#ifdef LLMQ_HAS_AMX_PROMPT_ATTENTION
  if (q.scalar_type() == at::kBFloat16 && q.dim() == 3 && llmq_prompt_amx::runs_here(q.size(2))) {
    check_cpu(q, "q");
    TORCH_CHECK(q.stride(2) == 1, "q must be [n, H, head_dim] with contiguous heads");
    const int64_t n = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
    TORCH_CHECK(num_cached >= 0, "prompt_attention: num_cached must not be negative");
    TORCH_CHECK(keys.dim() == 3 && keys.sizes() == values.sizes() && keys.size(1) == num_cached + n &&
                    keys.size(2) == head_dim && keys.scalar_type() == q.scalar_type() &&
                    values.scalar_type() == q.scalar_type(),
                "prompt_attention: keys and values must be [KVH, num_cached + n, head_dim] alike, in q's dtype");
    TORCH_CHECK(keys.size(0) > 0 && num_heads % keys.size(0) == 0,
                "prompt_attention: the query heads must be a multiple of the KV heads");
    const torch::Tensor k = keys.contiguous(), v = values.contiguous();  // the kernel reads both with one stride
    torch::Tensor out = torch::empty({n, num_heads * head_dim}, q.options());
    const std::vector<llmq_prompt_amx::Chunk> whole{{0, n, num_cached, nullptr}};
    llmq_prompt_amx::attend_chunks(n > 0 ? whole : std::vector<llmq_prompt_amx::Chunk>(),
                                   reinterpret_cast<const uint16_t*>(q.data_ptr()), q.stride(0), q.stride(1),
                                   reinterpret_cast<const uint16_t*>(k.data_ptr()),
                                   reinterpret_cast<const uint16_t*>(v.data_ptr()), k.stride(0), k.stride(1), 1,
                                   num_heads, k.size(0), head_dim, static_cast<float>(scale),
                                   reinterpret_cast<uint16_t*>(out.data_ptr()), out.stride(0));
    return out;
  }
#endif
#ifdef LLMQ_HAS_PROMPT_ATTENTION
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [n, H, head_dim] with contiguous heads");
  const int64_t n = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  TORCH_CHECK(llmq_prompt::supports(head_dim), "prompt_attention: head_dim must be a multiple of ",
              llmq_panels::kPanelColumns, ", not ", head_dim);
  TORCH_CHECK(num_cached >= 0, "prompt_attention: num_cached must not be negative");
  TORCH_CHECK(keys.dim() == 3 && keys.sizes() == values.sizes() && keys.stride(2) == 1 && values.stride(2) == 1 &&
                  keys.size(1) == num_cached + n && keys.size(2) == head_dim &&
                  keys.scalar_type() == q.scalar_type() && values.scalar_type() == q.scalar_type(),
              "prompt_attention: keys and values must be [KVH, num_cached + n, head_dim] alike, in q's dtype");
  TORCH_CHECK(keys.size(0) > 0 && num_heads % keys.size(0) == 0,
              "prompt_attention: the query heads must be a multiple of the KV heads");
  torch::Tensor out = torch::empty({n, num_heads * head_dim}, q.options());
  if (n == 0) return out;
  DISPATCH_FLOAT_TYPES(q.scalar_type(), "prompt_attention", [&] {
    const llmq_prompt::Context where{keys.stride(0), keys.stride(1), values.stride(0), values.stride(1)};
    llmq_prompt::attend_chunk<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), keys.data_ptr<scalar_t>(),
                                        values.data_ptr<scalar_t>(), where, n, num_heads, keys.size(0), head_dim,
                                        num_cached, static_cast<float>(scale), out.data_ptr<scalar_t>(),
                                        out.stride(0));
  });
  return out;
#else
  TORCH_CHECK(false, "prompt_attention: this build has none for this dtype and head size (bfloat16 heads of 32, 64, 96 "
              "or 128 on the matrix units; every dtype on an AVX2 CPU without AVX-512)");
#endif
}

// ---- writing a step's keys and values into the cache ----------------------------------------------

// k, v [T, KVH, Dh] (rows of any stride, heads contiguous) into caches [KVH, slots, Dh] at slot_mapping [T].
void write_kv(torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& k, const torch::Tensor& v,
              const torch::Tensor& slot_mapping) {
  check_cpu(k, "k");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 3 && k_cache.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type(),
              "the caches must be contiguous [KVH, slots, head_dim] in k's dtype");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == k_cache.size(0) &&
                  k.size(2) == k_cache.size(2) && k.stride(2) == 1 && v.stride(2) == 1 &&
                  v.scalar_type() == k.scalar_type(),
              "k and v must be [T, KVH, head_dim] with contiguous heads, matching the cache");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) && slot_mapping.is_contiguous() &&
                  slot_mapping.scalar_type() == at::kLong,
              "slot_mapping must be int64 [T]");
  const int64_t tokens = k.size(0), heads = k.size(1), head_dim = k.size(2), slots = k_cache.size(1);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot ", slot[t], " is outside the cache's ", slots, " slots");
  const int64_t bytes = head_dim * k.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t element = k.element_size(), head_bytes = slots * bytes;
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t at_slot = h * head_bytes + slot[t] * bytes;
        std::memcpy(kc + at_slot, kp + (t * k.stride(0) + h * k.stride(1)) * element, bytes);
        std::memcpy(vc + at_slot, vp + (t * v.stride(0) + h * v.stride(1)) * element, bytes);
      }
  });
}

// ---- greedy sampling ------------------------------------------------------------------------------

#ifdef LLMQ_HAS_ARGMAX_ROWS

#if defined(__AVX512F__)
// 16 elements from p as float32: bfloat16 is the high half of a float32.
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// The index of a row's largest value, the first of equals, in one pass over the row: each of 16 lanes
// keeps the first maximum of the elements it saw, then the lanes agree. The tail, after every lane's
// elements, replaces the maximum only where strictly larger. NaN never wins (torch.argmax would pick it).
template <typename scalar_t>
int64_t row_argmax(const scalar_t* row, int64_t n) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i best_at = _mm512_setzero_si512();
  __m512i at = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i sixteen = _mm512_set1_epi32(16);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = load16(row + j);
    const __mmask16 larger = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, larger, v);
    best_at = _mm512_mask_mov_epi32(best_at, larger, at);
    at = _mm512_add_epi32(at, sixteen);
  }
  float top = _mm512_reduce_max_ps(best);
  const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  int64_t index = holders ? _mm512_mask_reduce_min_epi32(holders, best_at) : 0;
  for (; j < n; ++j) {
    const float v = static_cast<float>(row[j]);
    if (v > top) {
      top = v;
      index = j;
    }
  }
  return index;
}

#else
// 8 elements from p as float32 (panel_linear.h's loads: bfloat16 is the high half of a float32).
inline __m256 load8(const at::BFloat16* p) { return llmq_panels::load8(reinterpret_cast<const uint16_t*>(p)); }
inline __m256 load8(const float* p) { return llmq_panels::load8(p); }

// As above, on AVX2, in two passes over the row: its maximum, in four independent running maxima (one
// alone would wait on its own latency every step), then the first element equal to it, found eight at a
// time while the row is still in L2. NaN never wins here either: max_ps keeps its second operand.
template <typename scalar_t>
int64_t row_argmax(const scalar_t* row, int64_t n) {
  const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m0 = lowest, m1 = lowest, m2 = lowest, m3 = lowest;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    m0 = _mm256_max_ps(load8(row + j), m0);
    m1 = _mm256_max_ps(load8(row + j + 8), m1);
    m2 = _mm256_max_ps(load8(row + j + 16), m2);
    m3 = _mm256_max_ps(load8(row + j + 24), m3);
  }
  for (; j + 8 <= n; j += 8) m0 = _mm256_max_ps(load8(row + j), m0);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
  float top = *std::max_element(lanes, lanes + 8);
  for (; j < n; ++j) top = std::max(top, static_cast<float>(row[j]));  // NaN: std::max keeps top
  const __m256 target = _mm256_set1_ps(top);
  for (j = 0; j + 8 <= n; j += 8) {
    if (_mm256_movemask_ps(_mm256_cmp_ps(load8(row + j), target, _CMP_EQ_OQ)) != 0) break;
  }
  for (; j < n; ++j) {
    if (static_cast<float>(row[j]) == top) return j;
  }
  return 0;  // nothing equals top (every element NaN), as the AVX-512 kernel says
}
#endif

// Each row's row_argmax, the rows shared between the threads.
template <typename scalar_t>
void argmax_rows_kernel(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t n = x.size(1), stride = x.stride(0);
  const scalar_t* data = x.data_ptr<scalar_t>();
  int64_t* result = out.data_ptr<int64_t>();
  at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) result[r] = row_argmax(data + r * stride, n);
  });
}

// x [S, V] float32 or bfloat16, rows of contiguous values -> int64 [S]: each row's argmax, first of equals.
torch::Tensor argmax_rows(const torch::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "argmax_rows: x must be [S, V] with contiguous rows");
  auto out = torch::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kBFloat16) {
    argmax_rows_kernel<at::BFloat16>(x, out);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "argmax_rows: float32 or bfloat16");
    argmax_rows_kernel<float>(x, out);
  }
  return out;
}
#endif

// ---- bfloat16 products over weights laid out in tiles ----------------------------------------------

// What runs tiled_linear here: "amx" (the matrix units: built for a CPU with AMX, and the kernel lets this
// process use them), "avx512-bf16" (the vector dot products), "avx512-widened" (the tiles widened to float32
// on AVX-512's multiply-adds, where the dot products are the slower: bf16_widening.h), or ""
// where this build has none of them.
std::string tiled_products() {
#ifdef LLMQ_HAS_TILED_LINEAR
  if (llmq_tiled::on_matrix_units()) return "amx";
  return llmq_widening::widens_bf16() ? "avx512-widened" : "avx512-bf16";
#else
  return "";
#endif
}

// Makes the dot products' path of tiled_linear, and bfloat16 decode attention, widen bfloat16 to float32
// (true) or take VDPBF16PS (false), whichever this CPU runs faster (the tests check both paths); returns
// whether they widened before.
bool widen_tiles(bool widened) {
#ifdef LLMQ_HAS_TILED_LINEAR
  const bool before = llmq_widening::widens_bf16();
  llmq_widening::widening_choice().store(widened ? 1 : 0);
  return before;
#else
  return widened;
#endif
}

// Lets tiled_linear take the matrix units where the CPU has them, or not (the tests check both paths);
// returns whether it could before.
bool allow_matrix_units(bool allowed) {
#ifdef LLMQ_HAS_TILED_LINEAR
  return llmq_tiled::matrix_units_allowed().exchange(allowed);
#else
  return allowed;
#endif
}

// The chunk each of a sequence of StealingRuns::next calls returns, call i made by the thread of run
// callers[i] (tests: the products' split between threads, in one thread's time).
std::vector<int64_t> stealing_runs_order(int64_t chunks, int64_t parts, const std::vector<int64_t>& callers) {
  TORCH_CHECK(chunks >= 0 && chunks < (int64_t{1} << 32) && parts >= 1, "stealing_runs_order: ", chunks,
              " chunks in ", parts, " runs");
  llmq_split::StealingRuns runs(chunks, parts);
  std::vector<int64_t> taken;
  for (const int64_t own : callers) {
    TORCH_CHECK(own >= 0 && own < parts, "stealing_runs_order: no run ", own, " of ", parts);
    taken.push_back(runs.next(own));
  }
  return taken;
}

// The lines a KvWarmup over these caches asks for, for each share in turn, as (step, 0 for a key's line or 1
// for a value's, its byte offset in that cache), each share stepped until it asks for nothing more (tests).
std::vector<std::vector<std::tuple<int64_t, int64_t, int64_t>>> kv_warmup_lines(
    const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& block_tables,
    const torch::Tensor& context_lens, int64_t block_size, int64_t shares, int64_t steps_per_share) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() && k_cache.dim() == 3 &&
                  block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  block_tables.stride(1) == 1 && context_lens.is_contiguous(),
              "kv_warmup_lines: caches [KVH, slots, head_dim], int32 tables and lengths");
  const int64_t element = k_cache.element_size();
  const auto* k = static_cast<const char*>(k_cache.data_ptr());
  const auto* v = static_cast<const char*>(v_cache.data_ptr());
  llmq_prefetch::KvWarmup warmup(k, v, k_cache.stride(0) * element, block_tables.data_ptr<int32_t>(),
                                 block_tables.stride(0), context_lens.data_ptr<int32_t>(), context_lens.size(0),
                                 k_cache.size(0), block_size, block_size * k_cache.size(2) * element, shares,
                                 steps_per_share);
  std::vector<std::vector<std::tuple<int64_t, int64_t, int64_t>>> lines(shares);
  for (int64_t share = 0; share < shares; ++share) {
    for (int64_t step = 0;; ++step) {
      const size_t before = lines[share].size();
      warmup.step(share, [&](const char* line) {
        const bool key = line >= k && line < k + k_cache.nbytes();
        lines[share].emplace_back(step, key ? 0 : 1, line - (key ? k : v));
      });
      if (lines[share].size() == before) break;
    }
  }
  return lines;
}

// Gives every run of the work split between threads (the products' column chunks, decode attention's
// pieces) to the calling thread, or not (tests); returns whether it did before.
bool take_runs_in_one_thread(bool one) { return llmq_split::one_thread_takes_every_run().exchange(one); }

torch::Tensor tiled_linear(const torch::Tensor& x, const torch::Tensor& tiles, const c10::optional<torch::Tensor>& bias) {
#ifdef LLMQ_HAS_TILED_LINEAR
  check_cpu(x, "x");
  return llmq_tiled::linear(x, tiles, bias);
#else
  TORCH_CHECK(false, "tiled_linear: this build has no AVX512-BF16 (the CPU lacks it, or the compiler does not target it)");
#endif
}

// Each row's argmax (the first of equals) over x @ W.T in bfloat16, for W [V, K] laid out in tiles
// (cpu_prepack.tile_weight): argmax_rows(tiled_linear(x, tiles)) without storing the product.
torch::Tensor tiled_argmax(const torch::Tensor& x, const torch::Tensor& tiles) {
#ifdef LLMQ_HAS_TILED_LINEAR
  check_cpu(x, "x");
  return llmq_tiled::argmax_of_product(x, tiles);
#else
  TORCH_CHECK(false, "tiled_argmax: this build has no AVX512-BF16 (the CPU lacks it, or the compiler does not target it)");
#endif
}

// silu(x @ gate.T) * (x @ up.T) in bfloat16, for a gate/up weight laid out paired in tiles
// (cpu_prepack.tile_gate_up): equal to silu_and_mul(tiled_linear(x, tiles)) without storing the product.
torch::Tensor tiled_silu_and_mul(const torch::Tensor& x, const torch::Tensor& tiles,
                                 const c10::optional<torch::Tensor>& bias) {
#ifdef LLMQ_HAS_TILED_LINEAR
  check_cpu(x, "x");
  return llmq_tiled::gated(x, tiles, bias, [](const uint16_t* gate, const uint16_t* up, uint16_t* dst) {
    silu_mul_row(reinterpret_cast<const c10::BFloat16*>(gate), reinterpret_cast<const c10::BFloat16*>(up),
                 reinterpret_cast<c10::BFloat16*>(dst), 16);
  });
#else
  TORCH_CHECK(false,
              "tiled_silu_and_mul: this build has no AVX512-BF16 (the CPU lacks it, or the compiler does not target it)");
#endif
}

// ---- a greedy step's tokens through an int8 screen of the LM head (greedy_screen.h) -----------

// Whether this build screens: on a CPU with AVX512-VNNI.
bool screens_greedy_head() {
#ifdef LLMQ_HAS_GREEDY_SCREEN
  return true;
#else
  return false;
#endif
}

#ifdef LLMQ_HAS_GREEDY_SCREEN
llmq_screen::Screen screen_of(const torch::Tensor& screen, const torch::Tensor& terms, int64_t n, int64_t k) {
  TORCH_CHECK(screen.scalar_type() == at::kByte && screen.is_contiguous() && screen.dim() == 2 &&
                  screen.size(0) * llmq_screen::kColumns == n && screen.size(1) == k * llmq_screen::kColumns,
              "screened argmax: the screen must be uint8 [N/16, 16 K], contiguous (greedy_screen.screen_weight)");
  TORCH_CHECK(terms.scalar_type() == at::kFloat && terms.is_contiguous() && terms.dim() == 2 && terms.size(0) == 3 &&
                  terms.size(1) == n,
              "screened argmax: the terms must be float32 [3, N], contiguous (greedy_screen.screen_weight)");
  // A lane sums k products of at most 255 * 127 in int32.
  TORCH_CHECK(k % llmq_screen::kQuad == 0 && k <= 65536,
              "screened argmax: the inputs must be a multiple of 4, at most 65,536");
  return {screen.data_ptr<uint8_t>(), terms.data_ptr<float>(), n, k};
}

// Each row's token through the screen (`values`: the rows in float32; `exact`: greedy_screen.h's), the rows
// it leaves through the head's whole product, `whole_argmax` of those of `rows` (the head's own input).
// counts: int64 [3], which screened_argmax adds to.
template <typename Exact, typename WholeArgmax>
torch::Tensor screened_tokens(const torch::Tensor& values, const torch::Tensor& rows, const torch::Tensor& screen,
                              const torch::Tensor& terms, const torch::Tensor& counts, int64_t n, bool rounded,
                              const Exact& exact, const WholeArgmax& whole_argmax) {
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.is_contiguous() && counts.numel() == 3,
              "screened argmax: counts must be int64 [3]");
  torch::Tensor out = torch::zeros({values.size(0)}, values.options().dtype(at::kLong));
  if (values.size(0) == 0) return out;
  const std::vector<int64_t> whole =
      llmq_screen::screened_argmax(values, screen_of(screen, terms, n, values.size(1)), rounded, exact,
                                   out.data_ptr<int64_t>(), counts.data_ptr<int64_t>());
  if (!whole.empty()) {
    const torch::Tensor left = torch::tensor(whole, out.options());
    out.index_put_({left}, whole_argmax(rows.index_select(0, left)));
  }
  return out;
}
#endif

// tiled_argmax(x, tiles), its candidates found by the int8 screen (greedy_screen.screen_weight of the same
// weight) and multiplied again by the same dot products. On the matrix units, the whole product.
torch::Tensor screened_tiled_argmax(const torch::Tensor& x, const torch::Tensor& tiles, const torch::Tensor& screen,
                                   const torch::Tensor& terms, const torch::Tensor& counts) {
#if defined(LLMQ_HAS_TILED_LINEAR) && defined(LLMQ_HAS_GREEDY_SCREEN)
  check_cpu(x, "x");
  using namespace llmq_tiled;
  if (on_matrix_units()) return argmax_of_product(x, tiles);
  TORCH_CHECK(tiles.dim() == 4, "screened_tiled_argmax: tiles must be [V/16, K/32, 16, 32] (not paired)");
  const torch::Tensor a = padded_rows(x, tiles, "screened_tiled_argmax");
  const TiledWeight w = tiled_weight(tiles);
  const int64_t k = w.k_tiles * kTileInputs;
  const auto* rows = reinterpret_cast<const uint16_t*>(a.data_ptr());
  return screened_tokens(
      a.to(at::kFloat), a, screen, terms, counts, w.col_blocks * 16, /*rounded=*/true,
      [&](int64_t row, const int64_t* blocks, int count, float (*logits)[16]) {
        row_times_blocks(rows + row * k, w.k_tiles, w.tiles, blocks, count, logits);
      },
      [&](const torch::Tensor& some) { return argmax_of_product(some, tiles); });
#else
  TORCH_CHECK(false, "screened_tiled_argmax: this build has no AVX512-BF16 or no AVX512-VNNI");
#endif
}

// panel_argmax(x, panels) for float32 panels, its candidates found by the int8 screen and multiplied again
// by the same panel products.
torch::Tensor screened_panel_argmax(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& screen,
                                   const torch::Tensor& terms, const torch::Tensor& counts) {
#if defined(LLMQ_HAS_PANEL_LINEAR) && defined(__AVX512F__) && defined(LLMQ_HAS_GREEDY_SCREEN)
  check_cpu(x, "x");
  using namespace llmq_panels;
  TORCH_CHECK(panels.scalar_type() == at::kFloat, "screened_panel_argmax: float32 panels");
  const auto [rows, unused_bias] = float_operands(x, panels, c10::nullopt, "screened_panel_argmax");
  const int64_t k = panels.size(1);
  const float* values = rows.data_ptr<float>();
  const float* weights = panels.data_ptr<float>();
  return screened_tokens(
      rows, rows, screen, terms, counts, panels.size(0) * kPanelColumns, /*rounded=*/false,
      [&](int64_t row, const int64_t* which, int count, float (*logits)[16]) {
        row_times_panels(values + row * k, k, weights, which, count, logits);
      },
      [&](const torch::Tensor& some) { return argmax_of_product(some, panels); });
#else
  TORCH_CHECK(false, "screened_panel_argmax: this build has no AVX-512 panel products or no AVX512-VNNI");
#endif
}

// ---- float32 products over weights laid out in panels (float32 or bfloat16) --------------------

// What runs panel_linear here: "avx512" or "avx2" (their fused multiply-adds), or "" where this build does
// not have it (no AVX2).
std::string panel_products() {
#if defined(LLMQ_HAS_PANEL_LINEAR) && defined(__AVX512F__)
  return "avx512";
#elif defined(LLMQ_HAS_PANEL_LINEAR)
  return "avx2";
#else
  return "";
#endif
}

torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& panels, const c10::optional<torch::Tensor>& bias) {
#ifdef LLMQ_HAS_PANEL_LINEAR
  check_cpu(x, "x");
  return llmq_panels::linear(x, panels, bias);
#else
  TORCH_CHECK(false, "panel_linear: this build has no panel products (they are built for CPUs with AVX2)");
#endif
}

// Each row's argmax (the first of equals) of x @ W.T for W in panels: argmax_rows of panel_linear(x, panels,
// None), without storing the product.
torch::Tensor panel_argmax(const torch::Tensor& x, const torch::Tensor& panels) {
#ifdef LLMQ_HAS_PANEL_LINEAR
  check_cpu(x, "x");
  return llmq_panels::argmax_of_product(x, panels);
#else
  TORCH_CHECK(false, "panel_argmax: this build has no panel products (they are built for CPUs with AVX2)");
#endif
}

// silu(x @ gate.T) * (x @ up.T), for a gate/up weight in panels whose gate and up are each whole panels:
// equal to silu_and_mul(panel_linear(x, panels)) without storing the product.
torch::Tensor panel_silu_and_mul(const torch::Tensor& x, const torch::Tensor& panels,
                                 const c10::optional<torch::Tensor>& bias) {
#ifdef LLMQ_HAS_PANEL_LINEAR
  check_cpu(x, "x");
  // float32 outputs as they are; bfloat16 ones as their bits (uint16_t).
  return llmq_panels::gated(x, panels, bias, [](const auto* gate, const auto* up, auto* dst) {
    if constexpr (std::is_same_v<std::remove_pointer_t<decltype(dst)>, float>) {
      silu_mul_row(gate, up, dst, llmq_panels::kPanelColumns);
    } else {
      silu_mul_row(reinterpret_cast<const c10::BFloat16*>(gate), reinterpret_cast<const c10::BFloat16*>(up),
                   reinterpret_cast<c10::BFloat16*>(dst), llmq_panels::kPanelColumns);
    }
  });
#else
  TORCH_CHECK(false, "panel_silu_and_mul: this build has no panel products (they are built for CPUs with AVX2)");
#endif
}

// ---- a whole decoder layer, for a step whose attention is all the paged kernel's ----------------------

// One Llama decoder layer's weights, gathered once so that a step's call passes one object, not a dozen
// tensors. Each product's weight is laid out for the product llama.py's `linear` would run: in tiles
// (qkv, o, down: cpu_prepack.tile_weight; gate/up paired: tile_gate_up), in panels (every one of them:
// cpu_prepack.panel_weight), or oneDNN's packed layout (every one of them).
struct LayerWeights {
  torch::Tensor input_norm, post_norm;
  torch::Tensor qkv, o, gate_up, down;
  c10::optional<torch::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias;
  double eps;
  int64_t num_heads, num_kv_heads, head_dim;
  double scale;
};

// Whether a prepacked weight is laid out in tiles (4-d, or 5-d paired) for tiled_linear: neither oneDNN's
// packed layout nor panels (3-d).
inline bool in_tiles(const torch::Tensor& weight) { return !weight.is_mkldnn() && weight.dim() != 3; }

// llama.py's `linear` for a prepacked weight: oneDNN's product for its packed layout, panel_linear for one
// in panels, else tiled_linear.
torch::Tensor product(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  if (weight.is_mkldnn()) {
    static auto onednn = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                               c10::string_view, c10::List<std::optional<at::Scalar>>,
                                               std::optional<c10::string_view>)>();
    return onednn.call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), std::optional<c10::string_view>(""));
  }
  if (in_tiles(weight)) return tiled_linear(x, weight, bias);
  return panel_linear(x, weight, bias);
}

// silu(gate) * up of the gate/up product, as NativeKernels.silu_and_mul_of runs it: in one pass over a
// paired weight in tiles, or panels whose gate and up are each whole panels; else (oneDNN's, or other
// panels) the product and then silu_and_mul.
torch::Tensor gated_product(const torch::Tensor& x, const torch::Tensor& gate_up,
                            const c10::optional<torch::Tensor>& bias) {
  if (gate_up.dim() == 3 && gate_up.size(0) % 2 == 0) return panel_silu_and_mul(x, gate_up, bias);
  if (gate_up.is_mkldnn() || gate_up.dim() == 3) return silu_and_mul(product(x, gate_up, bias));
  return tiled_silu_and_mul(x, gate_up, bias);
}

// The next layer's caches, where decoder_layer is told them: its MLP asks for the blocks the next layer's
// attention will read (paged_prefetch.h's KvWarmup).
struct NextCaches {
  const torch::Tensor* k_cache = nullptr;  // none: no warm-up
  const torch::Tensor* v_cache = nullptr;
};

// The warm-up of the next layer's keys and values over this layer's down projection, where its products
// run in AVX512-BF16's dot products (the steps that ask for them) and every query is a decode with a block
// table row of its own; else none. Over the down projection alone, the last product before that attention:
// asked for earlier (over the whole MLP, at a lower rate) the blocks wait longer in L3, where the other
// cores' work may take them, and measured slower when the machine was busy.
std::optional<llmq_prefetch::KvWarmup> next_layer_warmup(const LayerWeights& w, int64_t rows, const NextCaches& next,
                                                        const torch::Tensor& block_tables,
                                                        const torch::Tensor& context_lens,
                                                        const c10::optional<torch::Tensor>& query_tables,
                                                        int64_t block_size) {
#ifdef LLMQ_HAS_TILED_LINEAR
  if (next.k_cache == nullptr || next.v_cache == nullptr ||
      (query_tables.has_value() && query_tables->defined()) || llmq_tiled::on_matrix_units() || !in_tiles(w.o) ||
      !in_tiles(w.gate_up) || !in_tiles(w.down))
    return std::nullopt;
  const torch::Tensor& k = *next.k_cache;
  const torch::Tensor& v = *next.v_cache;
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.dim() == 3 && k.sizes() == v.sizes() &&
                  k.scalar_type() == v.scalar_type(),
              "decoder_layer: the next layer's caches must be contiguous [KVH, slots, head_dim], alike");
  const int64_t threads = at::get_num_threads();
  if (threads > llmq_prefetch::KvWarmup::kMostShares) return std::nullopt;
  const int64_t steps = llmq_tiled::dot_steps(w.down, rows);
  const int64_t element = k.element_size();
  return std::make_optional<llmq_prefetch::KvWarmup>(
      static_cast<const char*>(k.data_ptr()), static_cast<const char*>(v.data_ptr()), k.stride(0) * element,
      block_tables.data_ptr<int32_t>(), block_tables.stride(0), context_lens.data_ptr<int32_t>(),
      context_lens.size(0), k.size(0), block_size, block_size * k.size(2) * element, threads, steps / threads);
#else
  return std::nullopt;
#endif
}

// decoder_layer below for rows that go through it together (all of a step's, or some of a long step's).
std::vector<torch::Tensor> layer_rows(const LayerWeights& w, const torch::Tensor& hidden,
                                      const c10::optional<torch::Tensor>& residual, const torch::Tensor& cos,
                                      const torch::Tensor& sin, torch::Tensor& k_cache, torch::Tensor& v_cache,
                                      const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                                      const torch::Tensor& context_lens,
                                      const c10::optional<torch::Tensor>& query_tables, int64_t block_size,
                                      const NextCaches& next) {
  torch::Tensor x, stream;
  if (residual.has_value() && residual->defined()) {
    auto normed = add_rms_norm(hidden, *residual, w.input_norm, w.eps);
    x = normed[0];
    stream = normed[1];
  } else {
    x = rms_norm(hidden, w.input_norm, w.eps);
    stream = hidden;
  }
  const int64_t rows = x.size(0), tokens = slot_mapping.size(0);
  const int64_t q_size = w.num_heads * w.head_dim, kv_size = w.num_kv_heads * w.head_dim;
  TORCH_CHECK(context_lens.size(0) == tokens && tokens <= rows,
              "decoder_layer: every token row must be one the paged kernel attends for");
  torch::Tensor qkv = product(x, w.qkv, w.qkv_bias);
  torch::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({rows, w.num_heads + w.num_kv_heads, w.head_dim});
  rotary_(qk, cos, sin);
  const torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, w.num_kv_heads, w.head_dim}).narrow(0, 0, tokens);
  const torch::Tensor v =
      qkv.narrow(1, q_size + kv_size, kv_size).view({rows, w.num_kv_heads, w.head_dim}).narrow(0, 0, tokens);
  write_kv(k_cache, v_cache, k, v, slot_mapping);
  torch::Tensor attended = torch::empty({rows, q_size}, x.options());
  if (rows > tokens) attended.narrow(0, tokens, rows - tokens).zero_();
  torch::Tensor token_rows = attended.narrow(0, 0, tokens);
  paged_decode_attention(qk.narrow(1, 0, w.num_heads).narrow(0, 0, tokens), k_cache, v_cache, block_tables,
                         context_lens, block_size, w.scale, token_rows, query_tables);
  std::optional<llmq_prefetch::KvWarmup> warmup = next_layer_warmup(w, rows, next, block_tables, context_lens,
                                                                     query_tables, block_size);
  auto normed = add_rms_norm(product(attended, w.o, w.o_bias), stream, w.post_norm, w.eps);
  torch::Tensor gated = gated_product(normed[0], w.gate_up, w.gate_up_bias);
  llmq_prefetch::KvWarmupScope warming(warmup ? &*warmup : nullptr);
  return {product(gated, w.down, w.down_bias), normed[1]};
}

// Rows a decoder layer takes through all of its operations at a time. A prefill step has thousands, and
// taken all at once every operation's output ([rows, 3 x hidden] after the gate/up product) streams
// through memory between operations, and each product's inputs no longer stay in L2 while its panels
// pass; this many at a time stay in the caches, at the cost of reading the layer's weights once for
// each of them, which the products at this many rows hide (benchmarks/product_shapes.py).
constexpr int64_t kLayerRowsAtOnce = 256;
// Where the products run in tiles, a layer takes this many: a tiled product keeps its own inputs in L2
// (every group of 32 rows passes over a run of weight tiles while the run stays there; the dot products
// take a long product 512 rows at a time, kDotRowBlock), so more rows at once read each weight fewer
// times and make fewer, longer calls, and measured faster up to a step's 2,048: on the matrix units, and
// in AVX512-BF16's dot products (README: CPU kernels). oneDNN's products and the float32 panels measured
// slower at 2,048.
constexpr int64_t kTiledLayerRowsAtOnce = 2048;

// The rows decoder_layer takes through a layer at once with these weights.
int64_t layer_rows_at_once(const LayerWeights& w) {
  return in_tiles(w.gate_up) ? kTiledLayerRowsAtOnce : kLayerRowsAtOnce;
}

// llama.py's LlamaDecoderLayer.forward, each operation the fused kernel the model would call, in one call
// from Python: the Python between them (a module call, a wrapper and views per operation) costs more
// than several of the operations at decode sizes. Every query row is a decode or a short prompt chunk's
// token (the paged kernel's: no SDPA span); rows past the slot mapping's are the model's padding (its
// products' row counts are oneDNN's buckets), which attention leaves zero as paged_attention does.
// Rows go through layer_rows_at_once(w) at a time, in order: a prompt's token attends only to positions up
// to its own, whose keys and values the rows before it (or its own) have written into the cache by then.
// Returns (output, residual), as the layer does.
std::vector<torch::Tensor> decoder_layer(const LayerWeights& w, const torch::Tensor& hidden,
                                         const c10::optional<torch::Tensor>& residual, const torch::Tensor& cos,
                                         const torch::Tensor& sin, torch::Tensor& k_cache, torch::Tensor& v_cache,
                                         const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                                         const torch::Tensor& context_lens,
                                         const c10::optional<torch::Tensor>& query_tables, int64_t block_size,
                                         const c10::optional<torch::Tensor>& next_k_cache,
                                         const c10::optional<torch::Tensor>& next_v_cache) {
  const int64_t rows = hidden.size(0), tokens = slot_mapping.size(0), at_once = layer_rows_at_once(w);
  NextCaches next;
  if (next_k_cache.has_value() && next_k_cache->defined() && next_v_cache.has_value() && next_v_cache->defined())
    next = NextCaches{&*next_k_cache, &*next_v_cache};
  if (rows <= at_once)
    return layer_rows(w, hidden, residual, cos, sin, k_cache, v_cache, slot_mapping, block_tables, context_lens,
                      query_tables, block_size, next);
  const bool has_residual = residual.has_value() && residual->defined();
  const bool has_query_tables = query_tables.has_value() && query_tables->defined();
  torch::Tensor out = torch::empty_like(hidden), stream = torch::empty_like(hidden);
  for (int64_t start = 0; start < rows; start += at_once) {
    const int64_t count = std::min(at_once, rows - start);
    const int64_t first_token = std::min(start, tokens), count_tokens = std::min(start + count, tokens) - first_token;
    auto part = layer_rows(
        w, hidden.narrow(0, start, count),
        has_residual ? c10::optional<torch::Tensor>(residual->narrow(0, start, count)) : c10::nullopt,
        cos.narrow(0, start, count), sin.narrow(0, start, count), k_cache, v_cache,
        slot_mapping.narrow(0, first_token, count_tokens),
        // query n's table: the row query_tables names, else row n (each decode has its own).
        has_query_tables ? block_tables : block_tables.narrow(0, first_token, count_tokens),
        context_lens.narrow(0, first_token, count_tokens),
        has_query_tables ? c10::optional<torch::Tensor>(query_tables->narrow(0, first_token, count_tokens)) : c10::nullopt,
        block_size, NextCaches{});
    out.narrow(0, start, count).copy_(part[0]);
    stream.narrow(0, start, count).copy_(part[1]);
  }
  return {out, stream};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "weight * RMSNorm(x)");
  m.def("add_rms_norm", &add_rms_norm, "(RMSNorm(x + residual) * weight, x + residual)");
  m.def("rotary_", &rotary_, "rotate-half rotary embedding, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("paged_decode_attention", &paged_decode_attention,
        "each query token as a decode over the paged cache, through its own or a shared block table row",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("block_size"), py::arg("scale"), py::arg("out"), py::arg("query_tables") = py::none());
  m.def("decode_attention_path", &decode_attention_path,
        "which code decode attention runs for a dtype, head size and query heads per KV head");
  m.def("write_kv", &write_kv, "a step's keys and values into their cache slots");
  m.def("prompt_attention_supported", &prompt_attention_supported,
        "whether prompt_attention takes a head size and dtype here", py::arg("head_dim"), py::arg("dtype"));
  m.def("prompt_attention", &prompt_attention, "a prompt chunk's causal attention over its whole context",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("num_cached"), py::arg("scale"));
#ifdef LLMQ_HAS_ARGMAX_ROWS
  m.def("argmax_rows", &argmax_rows, "each row's argmax (the first of equals) in one pass");
#endif
  m.def("tiled_products", &tiled_products, "what runs tiled_linear on this CPU: amx, avx512-bf16, avx512-widened, or none");
  m.def("allow_matrix_units", &allow_matrix_units, "whether tiled_linear may take the matrix units (tests)");
  m.def("widen_tiles", &widen_tiles, "whether tiled_linear's dot products and bfloat16 decode attention widen to float32 (tests)");
  m.def("stealing_runs_order", &stealing_runs_order, "the chunks StealingRuns hands to a sequence of calls (tests)",
        py::arg("chunks"), py::arg("parts"), py::arg("callers"));
  m.def("kv_warmup_lines", &kv_warmup_lines, "the lines a KvWarmup asks for, share by share (tests)",
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("block_size"),
        py::arg("shares"), py::arg("steps_per_share"));
  m.def("take_runs_in_one_thread", &take_runs_in_one_thread,
        "whether every run of the products' and decode attention's work goes to the calling thread (tests)");
  m.def("tiled_linear", &tiled_linear, "x @ W.T (+ bias) in bfloat16, W laid out in tiles",
        py::arg("x"), py::arg("tiles"), py::arg("bias") = py::none());
  m.def("panel_products", &panel_products, "what runs panel_linear on this CPU: avx512, avx2, or none");
  m.def("panel_linear", &panel_linear, "x @ W.T (+ bias), float32 sums, W (float32 or bfloat16) laid out in panels",
        py::arg("x"), py::arg("panels"), py::arg("bias") = py::none());
  m.def("panel_silu_and_mul", &panel_silu_and_mul,
        "silu(x @ gate.T) * (x @ up.T), a gate/up weight in panels whose gate and up are each whole panels",
        py::arg("x"), py::arg("panels"), py::arg("bias") = py::none());
  py::class_<LayerWeights>(m, "LayerWeights")
      .def(py::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                    c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                    c10::optional<torch::Tensor>, double, int64_t, int64_t, int64_t, double>(),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"), py::arg("qkv_bias"), py::arg("o_bias"), py::arg("gate_up_bias"), py::arg("down_bias"),
           py::arg("eps"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"));
  m.def("layer_rows_at_once", &layer_rows_at_once, "the rows decoder_layer takes through a layer at once");
  m.def("decoder_layer", &decoder_layer, "a Llama decoder layer whose attention is all the paged kernel's",
        py::arg("weights"), py::arg("hidden"), py::arg("residual"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slot_mapping"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("query_tables"), py::arg("block_size"), py::arg("next_k_cache") = py::none(),
        py::arg("next_v_cache") = py::none());
  m.def("panel_argmax", &panel_argmax, "each row's argmax of x @ W.T, W in panels, without storing it");
  m.def("tiled_argmax", &tiled_argmax, "each row's argmax of x @ W.T in bfloat16, W in tiles, without storing it");
  m.def("screens_greedy_head", &screens_greedy_head, "whether screened_*_argmax run here (AVX512-VNNI)");
  m.def("screened_tiled_argmax", &screened_tiled_argmax, "tiled_argmax, its candidates found by an int8 screen",
        py::arg("x"), py::arg("tiles"), py::arg("screen"), py::arg("terms"), py::arg("counts"));
  m.def("screened_panel_argmax", &screened_panel_argmax,
        "panel_argmax (float32), its candidates found by an int8 screen",
        py::arg("x"), py::arg("panels"), py::arg("screen"), py::arg("terms"), py::arg("counts"));
  m.def("tiled_silu_and_mul", &tiled_silu_and_mul,
        "silu(x @ gate.T) * (x @ up.T) in bfloat16, gate and up laid out paired in tiles",
        py::arg("x"), py::arg("tiles"), py::arg("bias") = py::none());
}
