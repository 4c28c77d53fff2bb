// src/attention/block_mask.h - AttentionOptions::block_mask made per token for one call: document
// ids, open queries and keys (global tokens, prefix-LM keys) and the dense mask, validated once;
// the float64 reference and the simple paths test cells with visible(), the fused kernels read
// the same arrays (kernels/block_mask.h, mask-inl.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/problem.h"

namespace posenc::attn {

struct TokenMask {
  detail::MaskRule rule;
  bool active = false;                // any part of the block mask set
  std::vector<int32_t> qdoc, kdoc;    // [batch, seq_q], [batch, seq_k]; empty: no documents
  std::vector<int32_t> qopen, kopen;  // 0 / 1 per token; empty: none open
  View<const uint8_t, 3> dense;       // data null: none
  bool dense_broadcast = false;       // dense has one batch row for all
  int64_t seq_q = 0, seq_k = 0;

  bool visible(int64_t b, int64_t i, int64_t j, int64_t pq, int64_t pk) const {
    if (!active) return rule.visible(pq, pk);
    const auto qi = static_cast<std::size_t>(b * seq_q + i);
    const auto kj = static_cast<std::size_t>(b * seq_k + j);
    if (!qdoc.empty() && qdoc[qi] != kdoc[kj]) return false;
    if (dense.data != nullptr && dense(dense_broadcast ? 0 : b, i, j) == 0) return false;
    if ((!qopen.empty() && qopen[qi] != 0) || (!kopen.empty() && kopen[kj] != 0)) return true;
    return rule.visible(pq, pk);
  }
};

template <class T>
TokenMask make_token_mask(const Problem<T>& pr) {
  TokenMask m;
  m.rule = mask_rule(pr.opt);
  const BlockMask& bm = pr.opt.block_mask;
  const Dims& d = pr.d;
  m.seq_q = d.seq_q;
  m.seq_k = d.seq_k;
  if (bm.empty()) return m;
  m.active = true;
  const std::string w = "attention: block_mask.";
  const bool qd = bm.query_documents.data != nullptr, kd = bm.key_documents.data != nullptr;
  if (qd != kd) {
    fail(w + (qd ? "key_documents" : "query_documents") +
         " is missing: give query_documents and key_documents together");
  }
  if (qd) {
    require_grad(bm.query_documents, {d.batch, d.seq_q}, w + "query_documents [batch, seq_q]");
    require_grad(bm.key_documents, {d.batch, d.seq_k}, w + "key_documents [batch, seq_k]");
    m.qdoc.resize(static_cast<std::size_t>(d.batch * d.seq_q));
    m.kdoc.resize(static_cast<std::size_t>(d.batch * d.seq_k));
    for (int64_t b = 0; b < d.batch; ++b) {
      for (int64_t i = 0; i < d.seq_q; ++i) m.qdoc[b * d.seq_q + i] = bm.query_documents(b, i);
      for (int64_t j = 0; j < d.seq_k; ++j) m.kdoc[b * d.seq_k + j] = bm.key_documents(b, j);
    }
  }
  std::vector<int64_t> global = bm.global_positions;
  std::sort(global.begin(), global.end());
  const auto is_global = [&](int64_t p) {
    return std::binary_search(global.begin(), global.end(), p);
  };
  if (!global.empty()) {
    m.qopen.assign(static_cast<std::size_t>(d.batch * d.seq_q), 0);
    for (int64_t b = 0; b < d.batch; ++b)
      for (int64_t i = 0; i < d.seq_q; ++i) m.qopen[b * d.seq_q + i] = is_global(pr.qp.at(b, i));
  }
  if (!global.empty() || bm.prefix.data != nullptr) {
    if (bm.prefix.data != nullptr) {
      detail::require_data(bm.prefix, w + "prefix");
      if (!qd && bm.prefix.shape[0] != d.batch) {
        fail<ShapeError>(w + "prefix has " + std::to_string(bm.prefix.shape[0]) +
                         " entries, expected batch (" + std::to_string(d.batch) +
                         "): one prefix length per row");
      }
      for (int64_t n = 0; n < bm.prefix.shape[0]; ++n) {
        if (bm.prefix(n) < 0) {
          fail(w + "prefix[" + std::to_string(n) + "] is negative (" +
               std::to_string(bm.prefix(n)) + ")");
        }
      }
    }
    m.kopen.assign(static_cast<std::size_t>(d.batch * d.seq_k), 0);
    for (int64_t b = 0; b < d.batch; ++b) {
      for (int64_t j = 0; j < d.seq_k; ++j) {
        const int64_t pk = pr.kp.at(b, j);
        bool open = is_global(pk);
        if (bm.prefix.data != nullptr) {
          int64_t at = b;
          if (qd) {
            at = m.kdoc[b * d.seq_k + j];
            if (at < 0 || at >= bm.prefix.shape[0]) {
              fail(w + "prefix has " + std::to_string(bm.prefix.shape[0]) +
                   " entries (one per document id) but key " + std::to_string(j) + " (batch " +
                   std::to_string(b) + ") is in document " + std::to_string(at));
            }
          }
          open = open || pk < bm.prefix(at);
        }
        m.kopen[b * d.seq_k + j] = open;
      }
    }
  }
  if (bm.dense.data != nullptr) {
    detail::require_data(bm.dense, w + "dense");
    const auto& s = bm.dense.shape;
    if ((s[0] != d.batch && s[0] != 1) || s[1] != d.seq_q || s[2] != d.seq_k) {
      fail<ShapeError>(w + "dense has shape " + shape_str(s) + ", expected [" +
                       std::to_string(d.batch) + " or 1, " + std::to_string(d.seq_q) + ", " +
                       std::to_string(d.seq_k) + "] (batch or 1, seq_q, seq_k)");
    }
    m.dense = bm.dense;
    m.dense_broadcast = s[0] == 1 && d.batch != 1;
  }
  return m;
}

}  // namespace posenc::attn
