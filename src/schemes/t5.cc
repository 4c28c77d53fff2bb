// src/schemes/t5.cc - T5 relative position buckets (Raffel et al. 2020, "Exploring the Limits of
// Transfer Learning", §2.1; docs/t5.md).
//
// The logarithmic part is evaluated in float32 exactly as the reference models do (the float32
// quotient n/e, a float32 log, division by log(MD/e) rounded to float32, multiplication by
// NB' - e in float32, truncation): a double log moves some bucket boundaries.
#include "posenc/t5.h"

#include <cmath>

#include "common.h"
#include "schemes/build.h"
#include "schemes/t5_term.h"

namespace posenc {
namespace {

template <bool kFloat32Log>
int64_t bucket_impl(int64_t rel, const T5BucketConfig& cfg) {
  int64_t nb = cfg.num_buckets;
  int64_t b = 0;
  int64_t n;
  if (cfg.bidirectional) {
    nb /= 2;
    if (rel > 0) b = nb;
    n = rel < 0 ? -rel : rel;
  } else {
    n = rel < 0 ? -rel : 0;
  }
  const int64_t e = nb / 2;
  if (n < e) return b + n;
  int64_t large;
  if constexpr (kFloat32Log) {
    const float q = static_cast<float>(n) / static_cast<float>(e);
    const float den = static_cast<float>(
        std::log(static_cast<double>(cfg.max_distance) / static_cast<double>(e)));
    const float v = std::log(q) / den * static_cast<float>(nb - e);
    large = e + static_cast<int64_t>(v);
  } else {
    const double v = std::log(static_cast<double>(n) / static_cast<double>(e)) /
                     std::log(static_cast<double>(cfg.max_distance) / static_cast<double>(e)) *
                     static_cast<double>(nb - e);
    large = e + static_cast<int64_t>(v);
  }
  return b + (large < nb - 1 ? large : nb - 1);
}

}  // namespace

void validate(const T5BucketConfig& cfg) {
  const int64_t min_nb = cfg.bidirectional ? 4 : 2;
  if (cfg.num_buckets < min_nb) {
    detail::fail("t5: num_buckets must be >= " + std::to_string(min_nb) + " (got " +
                 std::to_string(cfg.num_buckets) + ")");
  }
  if (cfg.bidirectional && cfg.num_buckets % 2 != 0) {
    detail::fail("t5: num_buckets must be even for bidirectional buckets (got " +
                 std::to_string(cfg.num_buckets) + ")");
  }
  const int64_t e = (cfg.bidirectional ? cfg.num_buckets / 2 : cfg.num_buckets) / 2;
  if (cfg.max_distance <= e) {
    detail::fail("t5: max_distance (" + std::to_string(cfg.max_distance) +
                 ") must exceed the exact range " + std::to_string(e) +
                 " (half of the buckets per direction)");
  }
}

int64_t t5_bucket(int64_t rel, const T5BucketConfig& cfg) { return bucket_impl<true>(rel, cfg); }

std::vector<int64_t> t5_bucket_map(const T5BucketConfig& cfg, int64_t seq_q, int64_t seq_k,
                                   const Positions* query_positions,
                                   const Positions* key_positions) {
  validate(cfg);
  if (seq_q < 0 || seq_k < 0) detail::fail("t5_bucket_map: lengths must be >= 0");
  if (seq_q > (int64_t{1} << 30) / (seq_k > 0 ? seq_k : 1)) {
    detail::fail("t5_bucket_map: seq_q x seq_k is too large to materialize");
  }
  const Positions qp =
      query_positions ? *query_positions : Positions::offset(seq_k >= seq_q ? seq_k - seq_q : 0);
  const Positions kp = key_positions ? *key_positions : Positions::offset(0);
  if (!query_positions && seq_q > seq_k) {
    detail::fail("t5_bucket_map: default positions need query length <= key length (got " +
                 std::to_string(seq_q) + " > " + std::to_string(seq_k) +
                 "); pass explicit positions");
  }
  qp.validate(1, seq_q, "t5_bucket_map: query positions");
  kp.validate(1, seq_k, "t5_bucket_map: key positions");
  std::vector<int64_t> out(static_cast<std::size_t>(
      checked_elements("t5_bucket_map", {{"seq_q", seq_q}, {"seq_k", seq_k}}, 8)));
  for (int64_t i = 0; i < seq_q; ++i) {
    for (int64_t j = 0; j < seq_k; ++j) {
      out[static_cast<std::size_t>(i * seq_k + j)] = t5_bucket(kp.at(0, j) - qp.at(0, i), cfg);
    }
  }
  return out;
}

void t5_bias_backward(const T5BucketConfig& cfg, View<const float, 3> dscore, View<float, 2> dtable,
                      const Positions* query_positions, const Positions* key_positions) {
  validate(cfg);
  detail::require_data(dscore, "t5_bias_backward: dscore");
  detail::require_data(dtable, "t5_bias_backward: dtable");
  const int64_t heads = dscore.shape[0], seq_q = dscore.shape[1], seq_k = dscore.shape[2];
  if (dtable.shape[0] != cfg.num_buckets || dtable.shape[1] != heads) {
    detail::fail<ShapeError>("t5_bias_backward: dtable has shape " + shape_str(dtable.shape) +
                             ", expected [num_buckets, heads] = [" +
                             std::to_string(cfg.num_buckets) + ", " + std::to_string(heads) + "]");
  }
  const auto buckets = t5_bucket_map(cfg, seq_q, seq_k, query_positions, key_positions);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < seq_q; ++i) {
      for (int64_t j = 0; j < seq_k; ++j) {
        const int64_t bk = buckets[static_cast<std::size_t>(i * seq_k + j)];
        dtable.data[bk * dtable.stride[0] + h * dtable.stride[1]] +=
            dscore.data[h * dscore.stride[0] + i * dscore.stride[1] + j * dscore.stride[2]];
      }
    }
  }
}

namespace ref {
int64_t t5_bucket_f64(int64_t rel, const T5BucketConfig& cfg) {
  return bucket_impl<false>(rel, cfg);
}
}  // namespace ref

namespace attn {

// The scheme from its settings, parameters and model config (build_scheme).
template <class T>
void T5Term<T>::build(detail::SchemeBuild& b, const ModelLayer*) {
  const ParamTensor* t = b.get("relative_attention_bias", {2}, "[num_buckets, heads]", true);
  T5Bias bias;
  bias.bidirectional = b.settings.bidirectional;
  if (b.model) {
    b.conflict(b.settings.num_buckets.has_value(), "num_buckets");
    b.conflict(b.settings.max_distance.has_value(), "max_distance");
    if (b.model->t5.num_buckets != t->shape[0]) {
      detail::fail<ShapeError>(b.pname("relative_attention_bias") + " has " +
                               std::to_string(t->shape[0]) + " buckets, but " +
                               b.settings.config_name + " says relative_attention_num_buckets " +
                               std::to_string(b.model->t5.num_buckets));
    }
    bias.max_distance = b.model->t5.max_distance;
    b.out.scale = 1.0;  // T5 does not scale its scores
  } else {
    if (b.settings.num_buckets && *b.settings.num_buckets != t->shape[0]) {
      detail::fail<ShapeError>(b.settings.name_of("num_buckets") + " " +
                               std::to_string(*b.settings.num_buckets) + " does not match " +
                               b.pname("relative_attention_bias") + " with " +
                               std::to_string(t->shape[0]) + " buckets");
    }
    bias.max_distance = b.settings.max_distance.value_or(128);
  }
  if (b.f64) {
    bias.table = View<const float, 2>{nullptr, {t->shape[0], t->shape[1]}, {}};
    b.out.tables64.relative_attention_bias = b.view<double, 2>(*t);
  } else {
    bias.table = b.view<float, 2>(*t);
  }
  b.learned("relative_attention_bias", *t, t->shape);
  b.out.scheme = bias;
}
template void T5Term<float>::build(detail::SchemeBuild&, const ModelLayer*);

}  // namespace attn

}  // namespace posenc
