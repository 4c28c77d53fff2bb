// posenc/xl.h - Transformer-XL relative attention (Dai et al. 2019; docs/transformer-xl.md).
//
//   delta = pos_q - pos_k;  R(delta) = [sin(delta w_0 ..), cos(delta w_0 ..)], w_i = base^(-2i/Dm)
//   r(delta) = W_r R(delta) reshaped [H, D]   (W_r = r_net [H*D, Dm])
//   s_ij = scale * ((q_i + u) . k_j + (q_i + v) . r(delta_ij))     u = r_w_bias, v = r_r_bias
// Indexed by distance directly: the reference code's rel_shift is only right under a causal mask;
// this is right with and without one, and with a memory segment (seq_k > seq_q).
#pragma once

#include <cstdint>
#include <vector>

#include "posenc/tensor.h"

namespace posenc {

struct TransformerXL {
  View<const float, 2> r_w_bias;  // u [heads_q, head_dim]
  View<const float, 2> r_r_bias;  // v [heads_q, head_dim]
  View<const float, 2> r_net;     // W_r [heads_q * head_dim, d_model], d_model even
  double base = 1e4;
};

// R(delta) of width d_model (even), concat layout, in double.
std::vector<double> xl_sinusoid(int64_t delta, int64_t d_model, double base = 1e4);

}  // namespace posenc
