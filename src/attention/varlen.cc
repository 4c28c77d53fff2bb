// src/attention/varlen.cc - packed variable-length sequences: cu_seqlens validated and turned
// into one batch row with per-token positions and document ids (PackedSequences), the float32
// varlen entry point on the fused kernels, and the float64 oracle as the concatenation of each
// sequence's own attention.
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "posenc/attention.h"

namespace posenc {

namespace {

using detail::fail;

void check_cu(const std::vector<int64_t>& cu, int64_t total, const char* name) {
  if (cu.empty()) fail(std::string(name) + " is empty: it needs num_seqs + 1 offsets");
  if (cu.front() != 0) {
    fail(std::string(name) + "[0] must be 0 (got " + std::to_string(cu.front()) + ")");
  }
  for (std::size_t s = 1; s < cu.size(); ++s) {
    if (cu[s] < cu[s - 1]) {
      fail(std::string(name) + " must be non-decreasing: [" + std::to_string(s) +
           "] = " + std::to_string(cu[s]) + " < [" + std::to_string(s - 1) +
           "] = " + std::to_string(cu[s - 1]));
    }
  }
  if (cu.back() != total) {
    fail(std::string(name) + " ends at " + std::to_string(cu.back()) +
         " but the packed tensor has " + std::to_string(total) + " tokens");
  }
}

std::vector<int64_t> per_token(const Positions* given, int64_t total, const char* what) {
  std::vector<int64_t> ids(static_cast<std::size_t>(total));
  given->validate(1, total, what);
  for (int64_t t = 0; t < total; ++t) ids[static_cast<std::size_t>(t)] = given->at(0, t);
  return ids;
}

}  // namespace

AttentionOptions PackedSequences::options(AttentionOptions base) const {
  if (base.block_mask.query_documents.data != nullptr ||
      base.block_mask.key_documents.data != nullptr) {
    fail("attention_varlen: options already carry document ids (the packing sets them)");
  }
  base.block_mask.query_documents =
      View<const int32_t, 2>::contiguous(query_documents.data(), {1, total_q});
  base.block_mask.key_documents =
      View<const int32_t, 2>::contiguous(key_documents.data(), {1, total_k});
  return base;
}

PackedSequences pack_sequences(std::vector<int64_t> cu_seqlens_q, std::vector<int64_t> cu_seqlens_k,
                               int64_t total_q, int64_t total_k, const Positions* query_positions,
                               const Positions* key_positions) {
  check_cu(cu_seqlens_q, total_q, "cu_seqlens_q");
  check_cu(cu_seqlens_k, total_k, "cu_seqlens_k");
  if (cu_seqlens_q.size() != cu_seqlens_k.size()) {
    fail("cu_seqlens_q has " + std::to_string(cu_seqlens_q.size()) + " entries and cu_seqlens_k " +
         std::to_string(cu_seqlens_k.size()) + ": both need num_seqs + 1");
  }
  PackedSequences p;
  p.total_q = total_q;
  p.total_k = total_k;
  // reserve(1): an empty side (no query or no key token at all) still has a data pointer, so the
  // document mask counts as given on both sides.
  p.query_documents.reserve(1);
  p.key_documents.reserve(1);
  p.query_documents.resize(static_cast<std::size_t>(total_q));
  p.key_documents.resize(static_cast<std::size_t>(total_k));
  std::vector<int64_t> qpos(static_cast<std::size_t>(total_q)),
      kpos(static_cast<std::size_t>(total_k));
  const std::size_t n = cu_seqlens_q.size() - 1;
  if (n > static_cast<std::size_t>(INT32_MAX)) fail("cu_seqlens_q: too many sequences");
  for (std::size_t s = 0; s < n; ++s) {
    const int64_t q0 = cu_seqlens_q[s], q1 = cu_seqlens_q[s + 1];
    const int64_t k0 = cu_seqlens_k[s], k1 = cu_seqlens_k[s + 1];
    const int64_t lq = q1 - q0, lk = k1 - k0;
    if (!query_positions && lq > lk && lk > 0) {
      fail("attention_varlen: cu_seqlens_q / cu_seqlens_k: sequence " + std::to_string(s) +
           " has " + std::to_string(lq) + " queries and " + std::to_string(lk) +
           " keys: the default positions put queries last among the keys; pass query_positions "
           "and key_positions");
    }
    for (int64_t i = q0; i < q1; ++i) {
      p.query_documents[static_cast<std::size_t>(i)] = static_cast<int32_t>(s);
      qpos[static_cast<std::size_t>(i)] = std::max<int64_t>(lk - lq, 0) + (i - q0);
    }
    for (int64_t j = k0; j < k1; ++j) {
      p.key_documents[static_cast<std::size_t>(j)] = static_cast<int32_t>(s);
      kpos[static_cast<std::size_t>(j)] = j - k0;
    }
  }
  if (query_positions)
    qpos = per_token(query_positions, total_q, "attention_varlen: query positions");
  if (key_positions) kpos = per_token(key_positions, total_k, "attention_varlen: key positions");
  p.query_positions = Positions::per_row(std::move(qpos), 1, total_q);
  p.key_positions = Positions::per_row(std::move(kpos), 1, total_k);
  p.cu_seqlens_q = std::move(cu_seqlens_q);
  p.cu_seqlens_k = std::move(cu_seqlens_k);
  return p;
}

namespace {

void check_packed(const PackedSequences& p, int64_t total_q, int64_t total_k, int64_t out_q) {
  if (total_q != p.total_q || out_q != p.total_q || total_k != p.total_k) {
    fail<ShapeError>("attention_varlen: q has " + std::to_string(total_q) + " tokens, k " +
                     std::to_string(total_k) + ", out " + std::to_string(out_q) +
                     "; the packing has " + std::to_string(p.total_q) + " queries and " +
                     std::to_string(p.total_k) + " keys");
  }
}

template <class T>
View<T, 3> lse_batch(const View<T, 2>& lse) {
  return View<T, 3>{lse.data,
                    {1, lse.shape[0], lse.shape[1]},
                    {lse.shape[0] * lse.stride[0], lse.stride[0], lse.stride[1]}};
}

}  // namespace

void attention_varlen(View<const float, 3> q, View<const float, 3> k, View<const float, 3> v,
                      const PackedSequences& packed, const PositionScheme& scheme,
                      const AttentionOptions& options, View<float, 3> out, View<float, 2> lse) {
  check_packed(packed, q.shape[0], k.shape[0], out.shape[0]);
  const AttentionOptions opt = packed.options(options);
  if (lse.data != nullptr) {
    attention(as_batch(q), as_batch(k), as_batch(v), scheme, opt, as_batch(out), lse_batch(lse),
              &packed.query_positions, &packed.key_positions);
  } else {
    attention(as_batch(q), as_batch(k), as_batch(v), scheme, opt, as_batch(out),
              &packed.query_positions, &packed.key_positions);
  }
}

void ref::attention_varlen(View<const double, 3> q, View<const double, 3> k,
                           View<const double, 3> v, const PackedSequences& packed,
                           const PositionScheme& scheme, const AttentionOptions& options,
                           const SchemeTables& tables, View<double, 3> out, View<double, 2> lse) {
  check_packed(packed, q.shape[0], k.shape[0], out.shape[0]);
  if (!options.block_mask.empty()) {
    fail("ref::attention_varlen: options.block_mask must be empty (the sequences are the mask)");
  }
  const std::size_t n = packed.cu_seqlens_q.size() - 1;
  for (std::size_t s = 0; s < n; ++s) {
    const int64_t q0 = packed.cu_seqlens_q[s], lq = packed.cu_seqlens_q[s + 1] - q0;
    const int64_t k0 = packed.cu_seqlens_k[s], lk = packed.cu_seqlens_k[s + 1] - k0;
    if (lq == 0) continue;
    auto rows = [](auto x, int64_t at, int64_t len) {
      x.data += at * x.stride[0];
      x.shape[0] = len;
      return as_batch(x);
    };
    std::vector<int64_t> qp(static_cast<std::size_t>(lq)), kp(static_cast<std::size_t>(lk));
    for (int64_t i = 0; i < lq; ++i) qp[i] = packed.query_positions.at(0, q0 + i);
    for (int64_t j = 0; j < lk; ++j) kp[j] = packed.key_positions.at(0, k0 + j);
    const Positions pq = Positions::shared(std::move(qp)), pk = Positions::shared(std::move(kp));
    View<double, 3> l3{};
    if (lse.data != nullptr) {
      l3 = View<double, 3>{
          lse.data + q0 * lse.stride[1], {1, lse.shape[0], lq}, {0, lse.stride[0], lse.stride[1]}};
    }
    if (l3.data != nullptr) {
      attention(rows(q, q0, lq), rows(k, k0, lk), rows(v, k0, lk), scheme, options, tables,
                rows(out, q0, lq), l3, &pq, &pk);
    } else {
      attention(rows(q, q0, lq), rows(k, k0, lk), rows(v, k0, lk), scheme, options, tables,
                rows(out, q0, lq), &pq, &pk);
    }
  }
}

}  // namespace posenc
