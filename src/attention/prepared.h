// src/attention/prepared.h - a scheme made ready for one call: the scale, the sinks and the
// scheme's term (src/schemes/*_term.h), validated against the call and precomputed once (O(L) or
// O(L·K)). Parameter tables are views of T: the scheme's float32 views for T = float; for
// T = double (the oracle) the float64 tables of ref::SchemeTables when given, else the float32
// ones widened.
#pragma once

#include <cmath>
#include <deque>
#include <string>
#include <variant>
#include <vector>

#include "core/problem.h"
#include "posenc/schemes.h"
#include "schemes/alibi_term.h"
#include "schemes/deberta_term.h"
#include "schemes/rope_term.h"
#include "schemes/shaw_term.h"
#include "schemes/t5_term.h"
#include "schemes/term.h"
#include "schemes/xl_term.h"

namespace posenc::attn {

// The terms in PositionScheme's order.
template <class T>
using SchemeTerm = std::variant<NoTerm<T>, RopeTerm<T>, AlibiTerm<T>, T5Term<T>, ShawTerm<T>,
                                XlTerm<T>, DebertaTerm<T>>;
static_assert(std::variant_size_v<SchemeTerm<float>> == std::variant_size_v<PositionScheme>);

template <class T>
struct Prepared {
  double scale = 1.0;
  // Attention sinks [heads_q] (AttentionOptions::sinks, or ref::SchemeTables::sinks for the
  // oracle); empty: none.
  std::vector<T> sinks;
  SchemeTerm<T> term;
  // The q and k the simple paths' scores read when not the inputs (RoPE: rotated, contiguous
  // [B, L, H, D]).
  std::vector<T> q_rot, k_rot;
  // Tables widened to T (the oracle without float64 tables); deque: stable addresses.
  std::deque<std::vector<T>> widened;

  Prepared() = default;
  Prepared(Prepared&&) = default;
  Prepared(const Prepared&) = delete;
};

// Rejects float64 tables that the scheme does not have (ref::SchemeTables).
inline void check_tables_belong(const PositionScheme& scheme, const ref::SchemeTables& t) {
  const SchemeInfo& info = scheme_info(scheme.index());
  auto check = [&](const void* data, const char* name) {
    if (data == nullptr) return;
    for (const SchemeParamInfo& p : info.params) {
      if (p.name == name) return;
    }
    fail("ref::attention: float64 table " + std::string(name) + " is not a parameter of scheme " +
         info.name);
  };
  check(t.relative_attention_bias.data, "relative_attention_bias");
  check(t.rel_k.data, "rel_k");
  check(t.rel_v.data, "rel_v");
  check(t.r_w_bias.data, "r_w_bias");
  check(t.r_r_bias.data, "r_r_bias");
  check(t.r_net.data, "r_net");
  check(t.pos_key.data, "pos_key");
  check(t.pos_query.data, "pos_query");
}

// The index of alternative S in PositionScheme.
template <class S, std::size_t I = 0>
constexpr std::size_t variant_index() {
  if constexpr (std::is_same_v<std::variant_alternative_t<I, PositionScheme>, S>) {
    return I;
  } else {
    return variant_index<S, I + 1>();
  }
}

// simple_path: also build what only the simple (non-fused) paths use (RoPE's rotated copies of q
// and k, Transformer-XL's projected distance table).
template <class T>
Prepared<T> prepare(const PositionScheme& scheme, const AttentionOptions& opt, const Dims& d,
                    const View<const T, 4>& q, const View<const T, 4>& k, const Positions& qp,
                    const Positions& kp, bool simple_path = true,
                    const ref::SchemeTables* tables = nullptr) {
  Prepared<T> p;
  if (tables) check_tables_belong(scheme, *tables);
  // 1 / sqrt(terms * head_dim): the score sums `terms` dot products of that length.
  const int terms = std::visit(
      [](const auto& s) {
        using S = std::decay_t<decltype(s)>;
        return std::variant_alternative_t<variant_index<S>(), SchemeTerm<T>>::kScoreTerms;
      },
      scheme);
  p.scale = opt.scale.value_or(1.0 / std::sqrt(terms * static_cast<double>(d.head_dim)));
  if (tables != nullptr && tables->sinks.data != nullptr) {
    require_table_shape(tables->sinks, {d.heads_q}, "attention: sinks (float64) [heads_q]");
    for (int64_t h = 0; h < d.heads_q; ++h) p.sinks.push_back(static_cast<T>(tables->sinks(h)));
  } else if (opt.sinks.data != nullptr) {
    require_table_shape(opt.sinks, {d.heads_q}, "attention: sinks [heads_q]");
    for (int64_t h = 0; h < d.heads_q; ++h) p.sinks.push_back(static_cast<T>(opt.sinks(h)));
  }
  TermInputs<T> in{opt, d, q, k, qp, kp, simple_path, tables, p.widened, p.q_rot, p.k_rot};
  // The term of the scheme's alternative: the same index in both variants.
  std::visit(
      [&](const auto& s) {
        using S = std::decay_t<decltype(s)>;
        constexpr std::size_t kIndex = variant_index<S>();
        auto& term = p.term.template emplace<kIndex>();
        term.prepare(s, in);
      },
      scheme);
  return p;
}

}  // namespace posenc::attn
