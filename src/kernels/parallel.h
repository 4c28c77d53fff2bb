// src/kernels/parallel.h - the one threading primitive of posenc's kernels.
//
// parallel_for(n, threads, f) calls f(i) for i in [0, n), spreading the items over `threads`
// OpenMP threads, handed out one at a time in index order (dynamic schedule). Each item is computed
// by exactly one thread and never split, so results do not depend on the thread count. Runs
// serially with one thread, one item, inside an enclosing parallel region, or without OpenMP.
#pragma once

#include <algorithm>
#include <cstdint>

#include "posenc/size.h"

#ifdef POSENC_WITH_OPENMP
#include <omp.h>
#endif

namespace posenc::kernels {

// Threads to use: `requested` if > 0, else what OpenMP offers (1 without OpenMP); never more
// than kMaxThreads (posenc/size.h), whatever OMP_NUM_THREADS says.
inline int resolve_threads(int requested) {
  if (requested > 0) return std::min(requested, kMaxThreads);
#ifdef POSENC_WITH_OPENMP
  return std::clamp(omp_get_max_threads(), 1, kMaxThreads);
#else
  return 1;
#endif
}

template <class F>
void parallel_for(int64_t n, int threads, F&& f) {
  if (n <= 0) return;
  const int t = static_cast<int>(std::min<int64_t>(std::clamp(threads, 1, kMaxThreads), n));
#ifdef POSENC_WITH_OPENMP
  if (t > 1 && !omp_in_parallel()) {
#pragma omp parallel for num_threads(t) schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) f(i);
}

// Index of the calling thread inside parallel_for (0 when serial).
inline int thread_index() {
#ifdef POSENC_WITH_OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

}  // namespace posenc::kernels
