// Decode attention for bfloat16 on a CPU with AVX512-BF16: the products in the CPU's bfloat16 dot-product
// instruction (vdpbf16ps: bfloat16 pairs multiplied exactly, summed in float32), included by cpu_kernels.cpp.
//
// Why a kernel of its own: in float32 arithmetic a key's score is a dot product whose 16 lanes must be summed
// across the register, which costs more than the products themselves; here 16 keys' dot products are summed
// together (one transposing reduction for the 16), and the probability-weighted sum of values takes two
// tokens per instruction. The probabilities are rounded to bfloat16 before they weight the values, as the
// plain path's `softmax(...).to(q.dtype) @ values` does; sums stay in float32.
#pragma once

// at::vec must be its AVX512 build here (its exp is used on __m512 registers).
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(CPU_CAPABILITY_AVX512)
#define LLMQ_HAS_BF16_DECODE_ATTENTION 1
#include <immintrin.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "bf16_widening.h"
#include "paged_prefetch.h"
#include "work_split.h"

namespace llmq_bf16 {

constexpr int kKeys = 16;  // keys scored per round: one float32 register's lanes

// v[16] -> one register whose lane i is the sum of v[i]'s 16 lanes.
inline __m512 sum_each(const __m512 (&v)[kKeys]) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sum for keys 4i .. 4i+3 (pairs of floats moved as doubles)
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 halves[2];
  for (int i = 0; i < 2; ++i)  // keys 8i .. 8i+7, each summed over two of its four 128-bit lanes
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

inline void prefetch_row(const void* row, int64_t bytes) {
  const char* start = static_cast<const char*>(row);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(start + offset);
}

// A 32-dim chunk's float32 sums, as two vectors whose lane j holds dim 8 * (j / 4) + j % 4 (`low`) and 4
// dims past that (`high`), as unpacklo and unpackhi leave them, rounded to bfloat16 and stored in the dims'
// order at dst.
inline void store_in_dims_order(__m512 low, __m512 high, uint16_t* dst) {
  const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 lower = _mm512_permutex2var_ps(low, first_half, high);
  const __m512 upper = _mm512_permutex2var_ps(low, second_half, high);
  _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(upper, lower)));
}

// One head's scores s[0 .. length) -> its softmax, normalised, then rounded to bfloat16, at p[0 .. padded),
// padded being length rounded up to 16: s past length is set to -inf here, so that the padding's
// probabilities are zeros (and the last token has a partner to pair with). Also the matrix units' prompt
// kernel's softmax (prompt_attention_amx.h), so that a chunk's tokens round theirs as decodes do.
inline void probabilities(float* s, int64_t length, int64_t padded, uint16_t* p) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = length; t < padded; ++t) s[t] = -std::numeric_limits<float>::infinity();
  __m512 top_v = minus_inf;
  for (int64_t t = 0; t < padded; t += kKeys) top_v = _mm512_max_ps(top_v, _mm512_loadu_ps(s + t));
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(top_v));
  __m512 total_v = _mm512_setzero_ps();
  for (int64_t t = 0; t < padded; t += kKeys) {
    const __m512 e = at::vec::Vectorized<float>(_mm512_sub_ps(_mm512_loadu_ps(s + t), top)).exp_u20();
    _mm512_storeu_ps(s + t, e);
    total_v = _mm512_add_ps(total_v, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total_v));
  for (int64_t t = 0; t < padded; t += kKeys)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(s + t), inv))));
}

// One (sequence, KV head): its `group` query heads (q, bfloat16, `q_head_stride` apart) against the `length`
// keys and values at `rows` (each token's row, in elements from its head's start, padded to `padded` with the
// last one), into out (`group` heads of head_dim, contiguous). kVecs = head_dim / 32.
// scores: group * padded floats; probs: group * padded bfloat16, padded = length rounded up to 16.
template <int kVecs>
void attend(const uint16_t* q, int64_t q_head_stride, const uint16_t* k_head, const uint16_t* v_head,
            const int64_t* rows, int64_t length, int64_t group, float scale, float* scores, uint16_t* probs,
            int64_t padded, uint16_t* out) {
  constexpr int64_t head_dim = kVecs * 32;
  constexpr int64_t row_bytes = head_dim * 2;
  const __m512 scale_v = _mm512_set1_ps(scale);

  // Blocks lie anywhere in the cache, out of the hardware prefetcher's sight: ask for the first two rounds'
  // keys and values now, and for each round's keys two rounds ahead.
  for (int64_t t = 0; t < std::min<int64_t>(length, 2 * kKeys); ++t) {
    prefetch_row(k_head + rows[t], row_bytes);
    prefetch_row(v_head + rows[t], row_bytes);
  }
  // Scores, 16 keys a round (a short last round repeats its last key, and stores only its own lanes).
  for (int64_t first = 0; first < length; first += kKeys) {
    const int64_t count = std::min<int64_t>(kKeys, length - first);
    const uint16_t* keys[kKeys];
    for (int t = 0; t < kKeys; ++t) keys[t] = k_head + rows[first + t];
    for (int64_t ahead = first + 2 * kKeys; ahead < std::min(length, first + 3 * kKeys); ++ahead)
      prefetch_row(k_head + rows[ahead], row_bytes);
    const __mmask16 lanes = static_cast<__mmask16>((1u << count) - 1);
    for (int64_t g = 0; g < group; ++g) {
      const uint16_t* qg = q + g * q_head_stride;
      __m512 acc[kKeys];
      for (int t = 0; t < kKeys; ++t) {
        acc[t] = _mm512_setzero_ps();
        for (int c = 0; c < kVecs; ++c)
          acc[t] = _mm512_dpbf16_ps(acc[t], as_bh(_mm512_loadu_si512(qg + 32 * c)),
                                    as_bh(_mm512_loadu_si512(keys[t] + 32 * c)));
      }
      _mm512_mask_storeu_ps(scores + g * padded + first, lanes, _mm512_mul_ps(sum_each(acc), scale_v));
    }
  }

  for (int64_t g = 0; g < group; ++g) probabilities(scores + g * padded, length, padded, probs + g * padded);

  // Weighted sum of values, two tokens per instruction: vdpbf16ps takes the tokens' values interleaved
  // (v_t[d], v_t+1[d]) against the pair (p_t, p_t+1). The interleave scrambles the dims' order within each
  // 32-dim chunk in a fixed way, undone once at the end. As many heads at a time as 16 registers hold.
  constexpr int64_t kHeadsPerPass = std::max<int64_t>(1, 8 / kVecs);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t g0 = 0; g0 < group; g0 += kHeadsPerPass) {
    const int64_t heads = std::min(kHeadsPerPass, group - g0);
    __m512 acc[kHeadsPerPass][2 * kVecs];
    for (int64_t h = 0; h < kHeadsPerPass; ++h)
      for (int c = 0; c < 2 * kVecs; ++c) acc[h][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < length; t += 2) {
      if (t + 2 * kKeys + 1 < length) {
        prefetch_row(v_head + rows[t + 2 * kKeys], row_bytes);
        prefetch_row(v_head + rows[t + 2 * kKeys + 1], row_bytes);
      }
      const uint16_t* a = v_head + rows[t];
      const uint16_t* b = t + 1 < length ? v_head + rows[t + 1] : nullptr;
      for (int c = 0; c < kVecs; ++c) {
        const __m512i va = _mm512_loadu_si512(a + 32 * c);
        const __m512i vb = b ? _mm512_loadu_si512(b + 32 * c) : zero;
        const __m512bh lo = as_bh(_mm512_unpacklo_epi16(va, vb)), hi = as_bh(_mm512_unpackhi_epi16(va, vb));
        for (int64_t h = 0; h < heads; ++h) {
          int32_t pair;
          std::memcpy(&pair, probs + (g0 + h) * padded + t, sizeof(pair));
          const __m512bh p = as_bh(_mm512_set1_epi32(pair));
          acc[h][2 * c] = _mm512_dpbf16_ps(acc[h][2 * c], lo, p);
          acc[h][2 * c + 1] = _mm512_dpbf16_ps(acc[h][2 * c + 1], hi, p);
        }
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      uint16_t* dst = out + (g0 + h) * head_dim;
      // acc[h][2c]'s lane j sums dim 8 * (j / 4) + j % 4 of chunk c (unpacklo_epi16's), acc[h][2c + 1] 4 past it
      for (int c = 0; c < kVecs; ++c) store_in_dims_order(acc[h][2 * c], acc[h][2 * c + 1], dst + 32 * c);
    }
  }
}

// attend_widened's weighted sum of values for kHeads heads (weights: their float32 probabilities, `padded`
// apart) into out (kHeads heads of head_dim), each token's values widened once for all of them: every loop
// over the heads unrolled, so that the sums stay registers. A chunk's even and odd dims go back into the
// dims' order at the end: interleaved by unpacklo and unpackhi, then store_in_dims_order.
template <int kVecs, int kHeads>
inline void weigh_values(const uint16_t* v_head, const int64_t* rows, int64_t length, const float* weights,
                         int64_t padded, uint16_t* out) {
  constexpr int kHalves = 2 * kVecs;
  constexpr int64_t row_bytes = kVecs * 64;
  __m512 acc[kHeads][kHalves];
#pragma GCC unroll 16
  for (int h = 0; h < kHeads; ++h)
#pragma GCC unroll 16
    for (int c = 0; c < kHalves; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < length; ++t) {
    if (t + 2 * kKeys < length) prefetch_row(v_head + rows[t + 2 * kKeys], row_bytes);
    const uint16_t* v = v_head + rows[t];
    __m512 values[kHalves];
#pragma GCC unroll 16
    for (int c = 0; c < kVecs; ++c) {
      const llmq_widening::WidenedPairs dims = llmq_widening::widened_pairs(_mm512_loadu_si512(v + 32 * c));
      values[2 * c] = dims.even;
      values[2 * c + 1] = dims.odd;
    }
#pragma GCC unroll 16
    for (int h = 0; h < kHeads; ++h) {
      const __m512 p = _mm512_set1_ps(weights[h * padded + t]);
#pragma GCC unroll 16
      for (int c = 0; c < kHalves; ++c) acc[h][c] = _mm512_fmadd_ps(values[c], p, acc[h][c]);
    }
  }
#pragma GCC unroll 16
  for (int h = 0; h < kHeads; ++h) {
#pragma GCC unroll 16
    for (int c = 0; c < kVecs; ++c)
      store_in_dims_order(_mm512_unpacklo_ps(acc[h][2 * c], acc[h][2 * c + 1]),
                          _mm512_unpackhi_ps(acc[h][2 * c], acc[h][2 * c + 1]), out + h * kVecs * 32 + 32 * c);
  }
}

// weigh_values for `heads` heads (1 .. kMost), each count with its own unrolled loops.
template <int kVecs, int kMost>
inline void weigh_values_of(int64_t heads, const uint16_t* v_head, const int64_t* rows, int64_t length,
                            const float* weights, int64_t padded, uint16_t* out) {
  if constexpr (kMost > 1) {
    if (heads < kMost) return weigh_values_of<kVecs, kMost - 1>(heads, v_head, rows, length, weights, padded, out);
  }
  weigh_values<kVecs, kMost>(v_head, rows, length, weights, padded, out);
}

// `attend` on AVX-512's float32 multiply-adds, for a CPU whose VDPBF16PS does less arithmetic than they do
// (bf16_widening.h, as the tiled products decide): a round's keys and each token's values are widened to
// float32 once (a shift and a mask: a pair's even and odd dims) and multiplied into every query head of the
// group, so the widening is shared by the group's heads. The probabilities are attend's (rounded to
// bfloat16); the sums are float32 in another order, so the results are attend's to float32's rounding.
// scratch: kKeys + group widened rows of head_dim floats, 64-byte aligned.
template <int kVecs>
void attend_widened(const uint16_t* q, int64_t q_head_stride, const uint16_t* k_head, const uint16_t* v_head,
                    const int64_t* rows, int64_t length, int64_t group, float scale, float* scores,
                    uint16_t* probs, int64_t padded, uint16_t* out, float* scratch) {
  constexpr int64_t head_dim = kVecs * 32;
  constexpr int64_t row_bytes = head_dim * 2;
  constexpr int kHalves = 2 * kVecs;  // float32 vectors a widened row: each chunk's even dims, then its odd
  const __m512 scale_v = _mm512_set1_ps(scale);
  const auto widen = [&](const uint16_t* row, float* to) {
    for (int c = 0; c < kVecs; ++c) {
      const llmq_widening::WidenedPairs dims = llmq_widening::widened_pairs(_mm512_loadu_si512(row + 32 * c));
      _mm512_store_ps(to + 16 * (2 * c), dims.even);
      _mm512_store_ps(to + 16 * (2 * c + 1), dims.odd);
    }
  };
  float* const keys = scratch;                      // the round's kKeys keys, widened
  float* const queries = scratch + kKeys * head_dim;  // the group's query heads, widened
  for (int64_t g = 0; g < group; ++g) widen(q + g * q_head_stride, queries + g * head_dim);

  for (int64_t t = 0; t < std::min<int64_t>(length, 2 * kKeys); ++t) {
    prefetch_row(k_head + rows[t], row_bytes);
    prefetch_row(v_head + rows[t], row_bytes);
  }
  for (int64_t first = 0; first < length; first += kKeys) {
    const int64_t count = std::min<int64_t>(kKeys, length - first);
    for (int64_t ahead = first + 2 * kKeys; ahead < std::min(length, first + 3 * kKeys); ++ahead)
      prefetch_row(k_head + rows[ahead], row_bytes);
    for (int t = 0; t < kKeys; ++t) widen(k_head + rows[first + t], keys + t * head_dim);
    const __mmask16 lanes = static_cast<__mmask16>((1u << count) - 1);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = queries + g * head_dim;
      __m512 acc[kKeys];  // every loop over the keys unrolled: the sums stay registers
#pragma GCC unroll 16
      for (int t = 0; t < kKeys; ++t) acc[t] = _mm512_setzero_ps();
      for (int h = 0; h < kHalves; ++h) {  // each of the query's vectors once, against all 16 keys
        const __m512 qh = _mm512_load_ps(qg + 16 * h);
#pragma GCC unroll 16
        for (int t = 0; t < kKeys; ++t) acc[t] = _mm512_fmadd_ps(_mm512_load_ps(keys + t * head_dim + 16 * h), qh, acc[t]);
      }
      _mm512_mask_storeu_ps(scores + g * padded + first, lanes, _mm512_mul_ps(sum_each(acc), scale_v));
    }
  }

  // The weights as float32, in place of the scores: the bfloat16 probabilities widened back, exactly.
  for (int64_t g = 0; g < group; ++g) {
    probabilities(scores + g * padded, length, padded, probs + g * padded);
    for (int64_t t = 0; t < padded; t += kKeys) {
      const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(probs + g * padded + t)));
      _mm512_storeu_ps(scores + g * padded + t, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
    }
  }

  // Each token's values widened once a pass, for as many heads as 24 sums and the widened row leave room
  // (the group's heads in passes of nearly equal size).
  constexpr int kMostHeads = std::max(1, 24 / kHalves);
  const int64_t passes = (group + kMostHeads - 1) / kMostHeads;
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t g0 = group * p / passes, heads = group * (p + 1) / passes - g0;
    weigh_values_of<kVecs, kMostHeads>(heads, v_head, rows, length, scores + g0 * padded, padded, out + g0 * head_dim);
  }
}

// Whether `attend` takes heads of this size.
inline bool supports(int64_t head_dim) { return head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256; }

// Rows of `length` tokens padded to whole rounds of kKeys.
inline int64_t padded_length(int64_t length) { return (length + kKeys - 1) / kKeys * kKeys; }

// What a thread of decode_attention runs for each (query, KV head): `attend` above, for the head size, having
// asked for the next piece's keys and values (`ahead`). Made once per thread, as the matrix units' kernel
// (decode_attention_amx.h) is, which configures its tiles then; each keeps its own buffers between pieces.
// The call: `group` query heads (q, `q_head_stride` apart) against the `length` keys and values at `rows`
// (repeating the last one up to padded_length), into out (`group` heads of head_dim, contiguous).
class VectorAttend {
 public:
  explicit VectorAttend(int64_t head_dim)
      : head_dim_(head_dim), widened_(llmq_widening::widens_bf16()),
        attend_(head_dim == 32 ? attend<1> : head_dim == 64 ? attend<2> : head_dim == 128 ? attend<4> : attend<8>),
        attend_widened_(head_dim == 32   ? attend_widened<1>
                        : head_dim == 64 ? attend_widened<2>
                        : head_dim == 128 ? attend_widened<4>
                                          : attend_widened<8>) {}
  void operator()(const uint16_t* q, int64_t q_head_stride, const uint16_t* k_head, const uint16_t* v_head,
                  const int64_t* rows, int64_t length, int64_t group, float scale, uint16_t* out,
                  llmq_prefetch::ContextFetch& ahead) {
    ahead.next(ahead.lines());  // all at once: this kernel's arithmetic outlasts the reads
    const int64_t padded = padded_length(length);
    scores_.resize(group * padded);
    probs_.resize(group * padded);
    if (widened_) {
      // 64-byte aligned: the widened rows are stored and loaded whole vectors at a time.
      scratch_.resize((kKeys + group) * head_dim_ + 16);
      const uintptr_t misaligned = reinterpret_cast<uintptr_t>(scratch_.data()) % 64;
      float* aligned = scratch_.data() + (misaligned == 0 ? 0 : (64 - misaligned) / sizeof(float));
      attend_widened_(q, q_head_stride, k_head, v_head, rows, length, group, scale, scores_.data(), probs_.data(),
                      padded, out, aligned);
    } else {
      attend_(q, q_head_stride, k_head, v_head, rows, length, group, scale, scores_.data(), probs_.data(), padded,
              out);
    }
  }

 private:
  int64_t head_dim_;
  bool widened_;
  decltype(&attend<1>) attend_;
  decltype(&attend_widened<1>) attend_widened_;
  std::vector<float> scratch_;
  std::vector<float> scores_;
  std::vector<uint16_t> probs_;
};

// q [N, H, Dh] (heads contiguous), caches [KVH, slots, Dh] contiguous, out [N, H * Dh] rows `out_stride` apart.
// Query n reads the cache through block table row query_tables[n] (row n where query_tables is null). Each
// (query, KV head) is attended by a thread's Attend (VectorAttend, or decode_attention_amx.h's TileAttend).
template <typename Attend = VectorAttend>
void decode_attention(const c10::BFloat16* q, int64_t q_token_stride, int64_t q_head_stride,
                      const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, int64_t cache_head_stride,
                      const int32_t* tables, int64_t table_stride, const int32_t* query_tables, const int32_t* lens,
                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, float scale, c10::BFloat16* out, int64_t out_stride) {
  const int64_t group = num_heads / num_kv_heads;
  const auto* qp = reinterpret_cast<const uint16_t*>(q);
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache);
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache);
  auto* op = reinterpret_cast<uint16_t*>(out);
  const int64_t threads = std::max(1, at::get_num_threads());
  llmq_split::StealingRuns runs(llmq_split::balanced_runs(lens, num_seqs, num_kv_heads, threads));
  llmq_split::for_each_run(runs.parts(), [&](int64_t own) {
    std::optional<Attend> attend_here;  // made at the thread's first piece (TileAttend configures the tiles)
    // The token rows of table row `rows_of`: the first `rows_built` true, the rest up to the query's
    // padded length repeat the last one. Shared by the table's KV heads and by a chunk's queries, each
    // of which reads a prefix.
    std::vector<int64_t> rows;
    int64_t rows_of = -1, rows_built = 0;
    for (int64_t item = runs.next(own); item >= 0; item = runs.next(own)) {
      const int64_t n = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t length = lens[n];
      if (length <= 0) continue;
      if (!attend_here) attend_here.emplace(head_dim);
      const int64_t table_row = query_tables != nullptr ? query_tables[n] : n;
      const int64_t padded = padded_length(length);
      if (rows_of != table_row) {
        rows_of = table_row;
        rows_built = 0;
      }
      // Past this query's length the rows must repeat its last one (a later query of the chunk, taken
      // from a run's back first, built more).
      rows_built = std::min(rows_built, length);
      if (static_cast<int64_t>(rows.size()) < padded) rows.resize(padded);
      const int32_t* table = tables + table_row * table_stride;
      while (rows_built < length) {  // a block at a time: one division per block, not per token
        const int64_t block = rows_built / block_size, block_end = std::min(length, (block + 1) * block_size);
        const int64_t base = static_cast<int64_t>(table[block]) * block_size * head_dim - block * block_size * head_dim;
        for (; rows_built < block_end; ++rows_built) rows[rows_built] = base + rows_built * head_dim;
      }
      std::fill(rows.begin() + rows_built, rows.begin() + std::max(rows_built, padded), rows[rows_built - 1]);
      // The next piece's keys and values, asked for into L2 while this one computes.
      llmq_prefetch::ContextFetch ahead;
      const int64_t next = (item + 1) / num_kv_heads, next_head = (item + 1) % num_kv_heads;
      if (runs.is_next_of(own, item + 1) && llmq_prefetch::first_of_its_table(query_tables, next)) {
        const int64_t next_row = query_tables != nullptr ? query_tables[next] : next;
        ahead = llmq_prefetch::ContextFetch(reinterpret_cast<const char*>(kp + next_head * cache_head_stride),
                                            reinterpret_cast<const char*>(vp + next_head * cache_head_stride),
                                            tables + next_row * table_stride, lens[next], block_size,
                                            block_size * head_dim * 2);
      }
      (*attend_here)(qp + n * q_token_stride + kv_head * group * q_head_stride, q_head_stride,
                     kp + kv_head * cache_head_stride, vp + kv_head * cache_head_stride, rows.data(), length, group,
                     scale, op + n * out_stride + kv_head * group * head_dim, ahead);
    }
  });
}

}  // namespace llmq_bf16
#endif
