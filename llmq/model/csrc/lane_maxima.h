// A greedy step's argmax kept as its LM head's product goes (tiled_linear.h's and panel_linear.h's
// argmax_of_product), included by both: each thread keeps, for each row, 16 running maxima and their
// columns, and the row's argmax is read from all of them at the end.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace llmq_argmax {

constexpr int kLanes = 16;

// A row's running argmax over the columns one thread has seen: for each of 16 lanes (a column's lane is
// its position in the 16-column tile or panel it came in), the largest value so far and its column. A
// lane's value is replaced only by a larger one, or by an equal one from an earlier column, so that it
// keeps its first column of equals in whatever order the thread meets its columns (one that is done with
// its own columns takes others from the back: work_split.h's StealingRuns), and NaN never wins
// (argmax_rows's rule).
struct alignas(64) LaneMaxima {
  float best[kLanes];
  int32_t column[kLanes];
};

// `threads` x `rows` of them, thread t's row r at t * rows + r, each lane at -infinity.
inline std::vector<LaneMaxima> fresh_lane_maxima(int64_t threads, int64_t rows) {
  std::vector<LaneMaxima> maxima(threads * rows);
  for (LaneMaxima& l : maxima) {
    std::fill_n(l.best, kLanes, -std::numeric_limits<float>::infinity());
    std::fill_n(l.column, kLanes, 0);
  }
  return maxima;
}

// Each row's argmax from every thread's lanes: the row's maximum over them all, and the first column
// holding it (0 where every value was NaN or -infinity).
inline void first_columns_of_maxima(const std::vector<LaneMaxima>& maxima, int64_t threads, int64_t rows,
                                    int64_t* result) {
  for (int64_t row = 0; row < rows; ++row) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < threads; ++t) {
      const float* best = maxima[t * rows + row].best;
      top = std::max(top, *std::max_element(best, best + kLanes));
    }
    int32_t first = std::numeric_limits<int32_t>::max();  // some lane holds `top` (-inf where all are)
    for (int64_t t = 0; t < threads; ++t)
      for (int i = 0; i < kLanes; ++i)
        if (maxima[t * rows + row].best[i] == top) first = std::min(first, maxima[t * rows + row].column[i]);
    result[row] = first;
  }
}

}  // namespace llmq_argmax
