// tests/attention_cases.h - random attention problems with owned parameter tables for every
// scheme, shared by the attention tests.
#pragma once

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "posenc/posenc.h"

namespace cases {

inline const std::vector<std::string> kSchemes = {"none", "rope", "alibi",  "t5",
                                                  "shaw", "xl",   "deberta"};

// Owns the tables behind a PositionScheme.
struct SchemeBox {
  std::vector<float> a, b, c;
  posenc::PositionScheme scheme;
};

inline std::vector<float> randn_f(std::mt19937_64& rng, int64_t n, double sd = 1.0) {
  std::normal_distribution<double> nd(0.0, sd);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = static_cast<float>(nd(rng));
  return v;
}

// Scheme `name` for heads_q heads of head_dim; variant picks sub-options (shared/per-head Shaw
// tables, bucketed DeBERTa, interleaved RoPE with partial rotary, ...).
inline std::unique_ptr<SchemeBox> make_scheme(const std::string& name, int64_t heads, int64_t dim,
                                              std::mt19937_64& rng, int variant = 0) {
  using namespace posenc;
  auto box = std::make_unique<SchemeBox>();
  if (name == "none") {
    box->scheme = NoPositions{};
  } else if (name == "rope") {
    const int64_t r = (variant % 2 == 1 && dim >= 4) ? (dim / 2) / 2 * 2 : dim / 2 * 2;
    box->scheme = Rope{rope_frequencies({.head_dim = dim, .rotary_dim = r, .base = 10000.0}),
                       variant % 2 ? RopeStyle::kInterleaved : RopeStyle::kHalf};
  } else if (name == "alibi") {
    box->scheme = Alibi{.max_bias = variant % 2 ? 16.0 : 8.0};
  } else if (name == "t5") {
    const int64_t nb = variant % 2 ? 16 : 32;
    box->a = randn_f(rng, nb * heads);
    box->scheme = T5Bias{.table = View<const float, 2>::contiguous(box->a.data(), {nb, heads}),
                         .max_distance = variant % 2 ? 20 : 128};
  } else if (name == "shaw") {
    const int64_t k = variant % 2 ? 1 : 3;
    const int64_t th = variant % 2 ? heads : 1;
    box->a = randn_f(rng, (2 * k + 1) * th * dim, 0.5);
    box->b = randn_f(rng, (2 * k + 1) * th * dim, 0.5);
    box->scheme = Shaw{View<const float, 3>::contiguous(box->a.data(), {2 * k + 1, th, dim}),
                       View<const float, 3>::contiguous(box->b.data(), {2 * k + 1, th, dim})};
  } else if (name == "xl") {
    const int64_t dm = 10;
    box->a = randn_f(rng, 2 * heads * dim, 0.5);
    box->b = randn_f(rng, heads * dim * dm, 0.3);
    box->scheme =
        TransformerXL{View<const float, 2>::contiguous(box->a.data(), {heads, dim}),
                      View<const float, 2>::contiguous(box->a.data() + heads * dim, {heads, dim}),
                      View<const float, 2>::contiguous(box->b.data(), {heads * dim, dm})};
  } else if (name == "deberta") {
    DebertaBuckets cfg = variant % 2
                             ? DebertaBuckets{.max_relative_positions = 24, .position_buckets = 8}
                             : DebertaBuckets{.max_relative_positions = 5};
    cfg.p2c = variant >= 2 ? DebertaP2c::kModel : DebertaP2c::kPaper;
    const int64_t k = cfg.span();
    box->a = randn_f(rng, 2 * k * heads * dim, 0.5);
    box->b = randn_f(rng, 2 * k * heads * dim, 0.5);
    box->scheme =
        DeBERTa{View<const float, 3>::contiguous(box->a.data(), {2 * k, heads, dim}),
                View<const float, 3>::contiguous(box->b.data(), {2 * k, heads, dim}), cfg};
  }
  return box;
}

}  // namespace cases
