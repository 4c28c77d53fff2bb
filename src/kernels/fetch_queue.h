// src/kernels/fetch_queue.h - rows to bring into L2 a few cache lines at a time while a fused
// attention work item computes (schedule-inl.h, RunSegments): fetched in one burst they stalled
// the thread as long as reading them would have, so the score and P.V micro-kernels
// (attention-inl.h) issue a few lines between their register blocks instead.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/bf16_dot.h"  // fetch_l2

namespace posenc::kernels {

class FetchQueue {
 public:
  void Clear() {
    rows_.clear();
    row_ = 0;
    at_ = 0;
    lines_ = 0;
  }
  // Queues the cache lines of [p, p + bytes).
  void Add(const void* p, int64_t bytes) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const uintptr_t first = a & ~uintptr_t{63};
    const uintptr_t last = (a + static_cast<uintptr_t>(bytes) - 1) & ~uintptr_t{63};
    const int64_t n = static_cast<int64_t>((last - first) / 64 + 1);
    rows_.push_back({first, n});
    lines_ += n;
  }
  int64_t Pending() const { return lines_; }
  // One load of a byte per 4 KiB page of the queued rows: a load walks the page tables where a
  // prefetch that misses the TLB may be dropped or delayed (with 4 KiB pages, rows of several
  // heads touch a new page every few rows).
  void TouchPages() const {
    uintptr_t last = ~uintptr_t{0};
    for (const Run& r : rows_) {
      const uintptr_t end = r.first + static_cast<uintptr_t>(r.lines) * 64;
      for (uintptr_t a = r.first; a < end; a = (a | 4095) + 1) {
        if ((a >> 12) == last) continue;
        last = a >> 12;
        static_cast<void>(*reinterpret_cast<const volatile char*>(a));
      }
    }
  }
  // Fetches the next n lines (all of them when n < 0), a run of consecutive lines at a time.
  void Issue(int64_t n) {
    while (n != 0 && row_ < rows_.size()) {
      const Run& r = rows_[row_];
      const int64_t left = r.lines - at_;
      const int64_t m = n < 0 ? left : std::min(n, left);
      fetch_l2(reinterpret_cast<const void*>(r.first + static_cast<uintptr_t>(at_) * 64), m * 64);
      lines_ -= m;
      at_ += m;
      if (at_ == r.lines) {
        ++row_;
        at_ = 0;
      }
      if (n > 0) n -= m;
    }
  }

 private:
  struct Run {
    uintptr_t first;  // the first line's address
    int64_t lines;
  };
  std::vector<Run> rows_;
  size_t row_ = 0;
  int64_t at_ = 0, lines_ = 0;
};

}  // namespace posenc::kernels
