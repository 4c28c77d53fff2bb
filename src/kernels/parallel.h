// src/kernels/parallel.h - the threading primitives of posenc's kernels.
//
// parallel_for(n, threads, f) calls f(i) for i in [0, n), spreading the items over `threads`
// OpenMP threads, handed out `grain` at a time in index order (dynamic schedule; grain 1 by
// default). Each item is computed by exactly one thread and never split, so results do not
// depend on the thread count. Runs serially with one thread, one item, inside an enclosing
// parallel region, or without OpenMP. parallel_for_ahead(n, threads, f) is the same with one item
// at a time and f told which item its thread runs next. for_each_thread(n, f) runs f(t) on thread
// t of n (static: the benchmarks' bandwidth baselines, where the thread that first touched a
// chunk reads it).
// Also used by bench/ (the library defines POSENC_WITH_OPENMP; its users see _OPENMP).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "posenc/size.h"

#if defined(POSENC_WITH_OPENMP) || defined(_OPENMP)
#define POSENC_PARALLEL_OPENMP 1
#include <omp.h>
#endif

namespace posenc::kernels {

// Threads to use: `requested` if > 0, else what OpenMP offers (1 without OpenMP); never more
// than kMaxThreads (posenc/size.h), whatever OMP_NUM_THREADS says.
inline int resolve_threads(int requested) {
  if (requested > 0) return std::min(requested, kMaxThreads);
#ifdef POSENC_PARALLEL_OPENMP
  return std::clamp(omp_get_max_threads(), 1, kMaxThreads);
#else
  return 1;
#endif
}

template <class F>
void parallel_for(int64_t n, int threads, F&& f, int64_t grain = 1) {
  if (n <= 0) return;
  const int t = static_cast<int>(std::min<int64_t>(std::clamp(threads, 1, kMaxThreads), n));
#ifdef POSENC_PARALLEL_OPENMP
  if (t > 1 && !omp_in_parallel()) {
    const int64_t chunk = std::max<int64_t>(grain, 1);
#pragma omp parallel for num_threads(t) schedule(dynamic, chunk)
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) f(i);
}

// parallel_for_ahead(n, threads, f) calls f(i, next) for i in [0, n): items are handed out one
// at a time in index order, and a thread claims its next item when it starts one, so that f can
// fetch toward the cache what item `next` (-1: none) will read while it computes item i. A thread
// that finishes early waits for at most its peer's current and claimed items.
template <class F>
void parallel_for_ahead(int64_t n, int threads, F&& f) {
  if (n <= 0) return;
  const int t = static_cast<int>(std::min<int64_t>(std::clamp(threads, 1, kMaxThreads), n));
#ifdef POSENC_PARALLEL_OPENMP
  if (t > 1 && !omp_in_parallel()) {
    std::atomic<int64_t> counter{0};
#pragma omp parallel num_threads(t)
    {
      int64_t i = counter.fetch_add(1, std::memory_order_relaxed);
      while (i < n) {
        const int64_t next = counter.fetch_add(1, std::memory_order_relaxed);
        f(i, next < n ? next : int64_t{-1});
        i = next;
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) f(i, i + 1 < n ? i + 1 : int64_t{-1});
}

template <class F>
void for_each_thread(int n, F&& f) {
  const int t = std::clamp(n, 1, kMaxThreads);
#ifdef POSENC_PARALLEL_OPENMP
  if (t > 1 && !omp_in_parallel()) {
#pragma omp parallel for num_threads(t) schedule(static, 1)
    for (int i = 0; i < t; ++i) f(i);
    return;
  }
#endif
  for (int i = 0; i < n; ++i) f(i);
}

// Index of the calling thread inside parallel_for (0 when serial).
inline int thread_index() {
#ifdef POSENC_PARALLEL_OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

}  // namespace posenc::kernels
