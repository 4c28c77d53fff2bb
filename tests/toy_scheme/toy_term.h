// src/schemes/toy_term.h - the toy scheme's attention term: the bias after the scale, one table by
// distance for the fused kernels (the distance-bias kernel form). The interface: schemes/term.h.
#pragma once

#include "posenc/toy.h"
#include "schemes/bias_table.h"
#include "schemes/term.h"

namespace posenc::attn {

template <class T>
struct ToyTerm : NoTerm<T> {
  static constexpr bool kDistanceTables = true;
  double slope = 0.5;

  void prepare(const Toy& t, TermInputs<T>&) { slope = t.slope; }

  void score(const Cell<T>& c, T&, T& bias) const {
    bias = static_cast<T>(toy_bias(slope, c.pq, c.pk));
  }

  bool fill_kernel(KernelInputs& in) const {
    fill_bias_table(in, [&](int64_t, int64_t delta) {
      return static_cast<float>(-slope * static_cast<double>(delta < 0 ? -delta : delta));
    });
    return true;
  }

  static void build(detail::SchemeBuild& b, const ModelLayer* layer);
};

}  // namespace posenc::attn
