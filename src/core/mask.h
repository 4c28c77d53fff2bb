// src/core/mask.h - which keys a query sees: the causal mask, the sliding window and chunked
// local attention, in one place for the float64 reference, the API's checks and tables and both
// fused kernels (whose per-lane form is kernels/mask-inl.h). Attention sinks are not a mask: they
// join the softmax denominator (docs/attention.md, Masks).
//
// With rel = pos_k - pos_q, a key is visible iff
//   causal:  rel <= 0;
//   window:  |rel| < window;
//   chunk:   floor(pos_k / chunk) == floor(pos_q / chunk);
// each only when set (window, chunk 0: unset). The block tests take position ranges [lo, hi] of
// a block of queries and of keys and answer for every cell at once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

namespace posenc::detail {

// floor(x / c) for c >= 1 (negative x rounds toward -inf).
constexpr int64_t floor_div(int64_t x, int64_t c) { return x >= 0 ? x / c : -((-x + c - 1) / c); }

struct MaskRule {
  bool causal = false;
  int64_t window = 0;  // 0: no window
  int64_t chunk = 0;   // 0: no chunks
  // Some tokens see past the rule (block masks' prefix and global tokens): distances are not
  // bounded by it (clip_distances leaves them).
  bool opens = false;

  constexpr bool visible(int64_t pos_q, int64_t pos_k) const {
    const int64_t rel = pos_k - pos_q;
    if (causal && rel > 0) return false;
    if (window > 0 && (rel < 0 ? -rel : rel) >= window) return false;
    if (chunk > 0 && floor_div(pos_k, chunk) != floor_div(pos_q, chunk)) return false;
    return true;
  }

  // The first position of the query's chunk (chunk > 0).
  constexpr int64_t chunk_start(int64_t pos_q) const { return floor_div(pos_q, chunk) * chunk; }

  // The key positions [lo, hi] a query at pos_q can see (empty when lo > hi).
  constexpr std::pair<int64_t, int64_t> key_range(int64_t pos_q) const {
    int64_t lo = std::numeric_limits<int64_t>::min(), hi = std::numeric_limits<int64_t>::max();
    if (causal) hi = pos_q;
    if (window > 0) {
      lo = pos_q - window + 1;
      if (!causal) hi = pos_q + window - 1;
    }
    if (chunk > 0) {
      const int64_t c0 = chunk_start(pos_q);
      lo = std::max(lo, c0);
      hi = std::min(hi, c0 + chunk - 1);
    }
    return {lo, hi};
  }

  // Narrows the distances delta = pos_q - pos_k in [dlo, dhi] to those the causal mask and the
  // window can leave visible (chunks bound no distance beyond the window's). dlo > dhi after it:
  // none.
  constexpr void clip_distances(int64_t& dlo, int64_t& dhi) const {
    if (opens) return;
    if (causal) dlo = std::max<int64_t>(dlo, 0);
    if (window > 0) {
      dlo = std::max<int64_t>(dlo, 1 - window);
      dhi = std::min<int64_t>(dhi, window - 1);
    }
  }

  // True when no query in [qlo, qhi] sees any key in [klo, khi] (a skipped tile).
  constexpr bool hides_block(int64_t qlo, int64_t qhi, int64_t klo, int64_t khi) const {
    if (causal && klo > qhi) return true;
    if (window > 0) {
      const int64_t nearest = klo > qhi ? klo - qhi : (khi < qlo ? qlo - khi : 0);
      if (nearest >= window) return true;
    }
    return chunk > 0 && (floor_div(klo, chunk) > floor_div(qhi, chunk) ||
                         floor_div(khi, chunk) < floor_div(qlo, chunk));
  }

  // True when every query in [qlo, qhi] sees every key in [klo, khi] (a tile with no mask).
  constexpr bool shows_block(int64_t qlo, int64_t qhi, int64_t klo, int64_t khi) const {
    if (causal && khi > qlo) return false;
    if (window > 0 && std::max(qhi - klo, khi - qlo) >= window) return false;
    if (chunk > 0) {
      const int64_t c = floor_div(klo, chunk);
      if (floor_div(khi, chunk) != c || floor_div(qlo, chunk) != c || floor_div(qhi, chunk) != c) {
        return false;
      }
    }
    return true;
  }
};

}  // namespace posenc::detail
