// src/schemes/learned.cc - learned absolute position embeddings (GPT-2, BERT; docs/learned.md).
#include "posenc/learned.h"

#include "common.h"

namespace posenc {
namespace {

void check_positions_in_table(const Positions& pos, int64_t batch, int64_t seq, int64_t rows,
                              const std::string& what) {
  try {
    pos.validate(batch, seq, what + ": positions");
  } catch (const ValueError&) {
    // The shape fits (that would be a ShapeError) but an id is out of range: report it below
    // with the table size.
  }
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < seq; ++i) {
      const int64_t p = pos.at(b, i);
      if (p < 0 || p >= rows) {
        detail::fail(what + ": position " + std::to_string(p) + " (batch " + std::to_string(b) +
                     ", token " + std::to_string(i) + ") is outside the learned table of " +
                     std::to_string(rows) + " positions; learned embeddings cannot extrapolate");
      }
    }
  }
}

}  // namespace

void add_learned(View<const float, 2> table, View<float, 3> x, const Positions* positions) {
  detail::require_data(table, "add_learned: table");
  detail::require_data(x, "add_learned: x");
  if (table.shape[1] != x.shape[2]) {
    detail::fail<ShapeError>("add_learned: table [max_positions, dim] has dim " +
                             std::to_string(table.shape[1]) + " but x [batch, seq, dim] has dim " +
                             std::to_string(x.shape[2]));
  }
  const Positions pos = positions ? *positions : Positions::offset(0);
  check_positions_in_table(pos, x.shape[0], x.shape[1], table.shape[0], "add_learned");
  for (int64_t b = 0; b < x.shape[0]; ++b) {
    for (int64_t i = 0; i < x.shape[1]; ++i) {
      const float* w = table.data + pos.at(b, i) * table.stride[0];
      float* xr = x.data + b * x.stride[0] + i * x.stride[1];
      for (int64_t k = 0; k < x.shape[2]; ++k) xr[k * x.stride[2]] += w[k * table.stride[1]];
    }
  }
}

void learned_backward(View<const float, 3> dy, View<float, 2> dtable, const Positions* positions) {
  detail::require_data(dy, "learned_backward: dy");
  detail::require_data(dtable, "learned_backward: dtable");
  if (dtable.shape[1] != dy.shape[2]) {
    detail::fail<ShapeError>("learned_backward: dtable has dim " + std::to_string(dtable.shape[1]) +
                             " but dy has dim " + std::to_string(dy.shape[2]));
  }
  const Positions pos = positions ? *positions : Positions::offset(0);
  check_positions_in_table(pos, dy.shape[0], dy.shape[1], dtable.shape[0], "learned_backward");
  for (int64_t b = 0; b < dy.shape[0]; ++b) {
    for (int64_t i = 0; i < dy.shape[1]; ++i) {
      float* g = dtable.data + pos.at(b, i) * dtable.stride[0];
      const float* d = dy.data + b * dy.stride[0] + i * dy.stride[1];
      for (int64_t k = 0; k < dy.shape[2]; ++k) g[k * dtable.stride[1]] += d[k * dy.stride[2]];
    }
  }
}

}  // namespace posenc
