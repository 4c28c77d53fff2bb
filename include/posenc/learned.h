// posenc/learned.h - learned absolute position embeddings (GPT-2 `wpe`, BERT
// `position_embeddings`; docs/learned.md).
//
//   y = x + W[p],  W [max_positions, dim].   Backward: dW[p] += dy.
// A learned table cannot extrapolate: a position outside [0, max_positions) is an error, never a
// silent clamp.
#pragma once

#include "posenc/tensor.h"

namespace posenc {

// x [batch, seq, dim] += table[position(b, i)] in place. table [max_positions, dim], any strides.
// Positions default to offset(0). Throws ShapeError on dim mismatch and ValueError (naming the
// offending position and the table size) when a position is outside the table.
void add_learned(View<const float, 2> table, View<float, 3> x,
                 const Positions* positions = nullptr);

// Gradient of add_learned with respect to the table: dtable[position(b, i)] += dy[b, i]
// (accumulates; zero dtable first for a fresh gradient). Repeated positions sum.
void learned_backward(View<const float, 3> dy, View<float, 2> dtable,
                      const Positions* positions = nullptr);

}  // namespace posenc
