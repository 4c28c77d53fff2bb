// src/attention/paged.cc - attention over a paged KV cache and rope_append (posenc/paged.h).
//
// attention_paged validates the pages, the block table and the lengths, then hands the fused
// kernel views of the page pools (batch stride = page stride) plus the block table and the
// per-row lengths (kernels::FusedAttentionParams, "Paged KV cache"): the kernel reads the pages
// in place, page by page inside its key loop, never gathering the cache. Calls outside the
// kernel's domain (query temperature, a strided head_dim, positions too sparse for its tables, a
// non-finite result to report) take the reference route: each row's keys gathered into
// contiguous tensors and attention() on them, which defines the result.
#include "posenc/paged.h"

#include <algorithm>
#include <string>
#include <vector>

#include "attention/half.h"
#include "common.h"
#include "core/problem.h"
#include "kernels/parallel.h"
#include "posenc/size.h"

namespace posenc {
namespace paged_detail {

using detail::fail;

std::string at_str(int64_t b) {
  std::string s(1, '[');
  s += std::to_string(b);
  s += ']';
  return s;
}

// A validated paged cache: the pools' dimensions, dense copies of the block table and lengths.
struct Pages {
  int64_t batch = 0, num_pages = 0, page_size = 0, heads_kv = 0, head_dim = 0, max_pages = 0;
  int64_t slot_stride = 0, head_stride = 0, page_stride = 0;
  int64_t max_len = 0;
  std::vector<int32_t> table;  // [batch, max_pages]
  std::vector<int32_t> lens;   // [batch]
};

// Checks a pool against the layout; fills the geometry.
template <class T>
void read_pool(const View<T, 4>& pool, PageLayout layout, const std::string& name, Pages& pg) {
  detail::require_data(pool, name);
  const bool tok = layout == PageLayout::kTokenMajor;
  pg.num_pages = pool.shape[0];
  pg.page_size = tok ? pool.shape[1] : pool.shape[2];
  pg.heads_kv = tok ? pool.shape[2] : pool.shape[1];
  pg.head_dim = pool.shape[3];
  pg.page_stride = pool.stride[0];
  pg.slot_stride = tok ? pool.stride[1] : pool.stride[2];
  pg.head_stride = tok ? pool.stride[2] : pool.stride[1];
  const char* want = tok ? "[num_pages, page_size, heads_kv, head_dim] (token_major)"
                         : "[num_pages, heads_kv, page_size, head_dim] (head_major)";
  if (pg.page_size < 1 || pg.heads_kv < 1 || pg.head_dim < 1) {
    fail<ShapeError>(name + " " + shape_str(pool.shape) + " must be " + want +
                     " with page_size, heads_kv and head_dim >= 1");
  }
}

// Block table and lengths: shapes, lengths in [0, max_pages * page_size] (and >= n_min), the
// entries of pages in use inside [0, num_pages).
void read_table(const View<const int32_t, 2>& block_table, const View<const int32_t, 1>& seq_lens,
                int64_t batch, int64_t n_min, const std::string& fn, Pages& pg) {
  detail::require_data(block_table, fn + ": block_table");
  detail::require_data(seq_lens, fn + ": seq_lens");
  if (block_table.shape[0] != batch) {
    fail<ShapeError>(fn + ": block_table " + shape_str(block_table.shape) +
                     " must be [batch, max_pages] with batch " + std::to_string(batch));
  }
  if (seq_lens.shape[0] != batch) {
    fail<ShapeError>(fn + ": seq_lens " + shape_str(seq_lens.shape) +
                     " must be [batch] with batch " + std::to_string(batch));
  }
  pg.batch = batch;
  pg.max_pages = block_table.shape[1];
  pg.table.assign(static_cast<std::size_t>(batch * pg.max_pages), 0);
  pg.lens.assign(static_cast<std::size_t>(batch), 0);
  pg.max_len = 0;
  const int64_t cap = pg.max_pages * pg.page_size;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = seq_lens(b);
    if (len < 0) {
      fail(fn + ": seq_lens" + at_str(b) + " = " + std::to_string(len) + " is negative");
    }
    if (len > cap) {
      fail(fn + ": seq_lens" + at_str(b) + " = " + std::to_string(len) +
           " exceeds max_pages * page_size = " + std::to_string(pg.max_pages) + " * " +
           std::to_string(pg.page_size) + " = " + std::to_string(cap));
    }
    if (len < n_min) {
      fail(fn + ": seq_lens" + at_str(b) + " = " + std::to_string(len) +
           " is less than the number of new tokens (" + std::to_string(n_min) +
           "): seq_lens counts them");
    }
    pg.lens[static_cast<std::size_t>(b)] = static_cast<int32_t>(len);
    pg.max_len = std::max(pg.max_len, len);
    const int64_t used = (len + pg.page_size - 1) / pg.page_size;
    for (int64_t p = 0; p < used; ++p) {
      const int64_t page = block_table(b, p);
      if (page < 0 || page >= pg.num_pages) {
        fail(fn + ": block_table" + at_str(b) + at_str(p) + " = " + std::to_string(page) +
             " is outside [0, num_pages = " + std::to_string(pg.num_pages) + ")");
      }
      pg.table[static_cast<std::size_t>(b * pg.max_pages + p)] = static_cast<int32_t>(page);
    }
  }
}

// The pool as a [batch, max_len, heads_kv, head_dim] view whose batch stride is the page stride:
// what the kernel reads through the block table. The strides are the pool's own (k_pages and
// v_pages may be laid out differently: each is read through its own strides).
template <class T>
View<const float, 4> key_view(const View<T, 4>& pool, PageLayout layout, const Pages& pg) {
  const bool tok = layout == PageLayout::kTokenMajor;
  View<const float, 4> v;
  v.data = reinterpret_cast<const float*>(pool.data);  // storage bits; never read as float here
  v.shape = {pg.batch, pg.max_len, pg.heads_kv, pg.head_dim};
  v.stride = {pool.stride[0], tok ? pool.stride[1] : pool.stride[2],
              tok ? pool.stride[2] : pool.stride[1], pool.stride[3]};
  return v;
}

// Element (page, slot, head, 0) of a pool.
template <class T>
T* slot_row(const View<T, 4>& pool, PageLayout layout, int64_t page, int64_t slot, int64_t head) {
  return layout == PageLayout::kTokenMajor ? &pool(page, slot, head, 0)
                                           : &pool(page, head, slot, 0);
}

template <class T>
DType dtype_of() {
  if constexpr (std::is_same_v<T, bf16>) {
    return DType::kBF16;
  } else if constexpr (std::is_same_v<T, f16>) {
    return DType::kF16;
  } else {
    return DType::kF32;
  }
}

template <class Q, class KV, class O>
void attention_paged_impl(View<const Q, 4> q, View<const KV, 4> k_pages, View<const KV, 4> v_pages,
                          PageLayout layout, View<const int32_t, 2> block_table,
                          View<const int32_t, 1> seq_lens, const PositionScheme& scheme,
                          const AttentionOptions& options, View<O, 4> out,
                          const Positions* query_positions) {
  const std::string fn = "attention_paged";
  detail::require_data(q, fn + ": q");
  detail::require_data(out, fn + ": out");
  Pages pg;
  read_pool(k_pages, layout, fn + ": k_pages", pg);
  if (v_pages.shape != k_pages.shape) {
    fail<ShapeError>(fn + ": k_pages " + shape_str(k_pages.shape) + " and v_pages " +
                     shape_str(v_pages.shape) + " must have the same shape");
  }
  detail::require_data(v_pages, fn + ": v_pages");
  Pages vg;
  read_pool(v_pages, layout, fn + ": v_pages", vg);
  const int64_t batch = q.shape[0], seq_q = q.shape[1], heads_q = q.shape[2];
  if (q.shape[3] != pg.head_dim) {
    fail<ShapeError>(fn + ": q " + shape_str(q.shape) + " and k_pages " + shape_str(k_pages.shape) +
                     " differ in head_dim");
  }
  if (heads_q < 1 || heads_q % pg.heads_kv != 0) {
    fail<ShapeError>(fn + ": k_pages: kv heads (" + std::to_string(pg.heads_kv) +
                     ") must divide q heads (" + std::to_string(heads_q) + ")");
  }
  if (out.shape != q.shape) {
    fail<ShapeError>(fn + ": out " + shape_str(out.shape) + " must have q's shape " +
                     shape_str(q.shape));
  }
  read_table(block_table, seq_lens, batch, 0, fn, pg);
  // seq_lens may name far more keys than the pool holds (a page can be listed many times): what
  // the call allocates per key is checked against the allocation limit before anything is made.
  checked_elements(fn + ": the key positions [batch, max(seq_lens)]",
                   {{"batch", batch}, {"max(seq_lens)", pg.max_len}}, 2 * sizeof(int64_t));
  checked_elements(
      fn + ": a row's keys and values gathered [max(seq_lens), heads_kv, head_dim]",
      {{"max(seq_lens)", pg.max_len}, {"heads_kv", pg.heads_kv}, {"head_dim", pg.head_dim}},
      2 * static_cast<int64_t>(sizeof(KV)));

  // Query positions: seq_lens[b] - seq_q + i by default; 0 .. seq_q - 1 in an empty row, whose
  // queries see no key (out 0 where allowed, else the error below).
  Positions qdefault;
  if (query_positions == nullptr) {
    std::vector<int64_t> ids(static_cast<std::size_t>(batch * seq_q));
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = pg.lens[static_cast<std::size_t>(b)];
      if (len == 0) {
        for (int64_t i = 0; i < seq_q; ++i) ids[static_cast<std::size_t>(b * seq_q + i)] = i;
        continue;
      }
      if (len < seq_q) {
        fail(fn + ": seq_lens" + at_str(b) + " = " + std::to_string(len) + " is less than seq_q (" +
             std::to_string(seq_q) +
             "): the default query positions are the last seq_q cached tokens; pass "
             "query_positions");
      }
      for (int64_t i = 0; i < seq_q; ++i)
        ids[static_cast<std::size_t>(b * seq_q + i)] = len - seq_q + i;
    }
    qdefault = Positions::per_row(std::move(ids), batch, seq_q);
    query_positions = &qdefault;
  }
  query_positions->validate(batch, seq_q, fn + ": query positions");

  // Queries that see no key: an error unless allowed (or sinks), as in attention().
  if (!options.allow_fully_masked && options.sinks.data == nullptr) {
    const detail::MaskRule mask = attn::mask_rule(options);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = pg.lens[static_cast<std::size_t>(b)];
      for (int64_t i = 0; i < seq_q; ++i) {
        const int64_t pq = query_positions->at(b, i);
        const auto [lo, hi] = mask.key_range(pq);
        if (len == 0 || std::max<int64_t>(lo, 0) > std::min<int64_t>(hi, len - 1)) {
          fail(fn + ": query " + std::to_string(i) + " (batch " + std::to_string(b) +
               ", position " + std::to_string(pq) + ", seq_lens " + std::to_string(len) +
               ") sees no key under the mask; allow_fully_masked gives 0 for such rows");
        }
      }
    }
  }
  if (batch == 0 || seq_q == 0) return;

  // The fused kernel on the pages in place: the whole batch, else (DeBERTa's tables need one
  // distance range for every row) row by row; a row it cannot take has its keys gathered and
  // goes through attention().
  const auto fused = [&](int64_t b0, int64_t nb) {
    if (options.query_temperature) return false;
    int64_t max_len = 0;
    for (int64_t b = b0; b < b0 + nb; ++b) {
      max_len = std::max<int64_t>(max_len, pg.lens[static_cast<std::size_t>(b)]);
    }
    if (max_len == 0) return false;
    Pages part = pg;
    part.batch = nb;
    part.max_len = max_len;
    detail::StorageViews s;
    s.q = View<const float, 4>{reinterpret_cast<const float*>(q.data + b0 * q.stride[0]),
                               {nb, seq_q, heads_q, pg.head_dim},
                               q.stride};
    s.k = key_view(k_pages, layout, part);
    s.v = key_view(v_pages, layout, part);
    s.out = View<float, 4>{reinterpret_cast<float*>(out.data + b0 * out.stride[0]),
                           {nb, seq_q, heads_q, pg.head_dim},
                           out.stride};
    s.q_type = dtype_of<Q>();
    s.kv_type = dtype_of<KV>();
    s.out_type = dtype_of<O>();
    const detail::PagedKeys paged{pg.table.data() + b0 * pg.max_pages, pg.max_pages, pg.page_size,
                                  pg.lens.data() + b0};
    Positions rows;
    const Positions* pos = query_positions;
    if (nb != batch) {
      std::vector<int64_t> ids(static_cast<std::size_t>(nb * seq_q));
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t i = 0; i < seq_q; ++i) {
          ids[static_cast<std::size_t>(b * seq_q + i)] = query_positions->at(b0 + b, i);
        }
      rows = Positions::per_row(std::move(ids), nb, seq_q);
      pos = &rows;
    }
    return detail::attention_fused_storage(s, scheme, options, pos, nullptr, &paged);
  };
  if (fused(0, batch)) return;

  const int64_t hk = pg.heads_kv, dim = pg.head_dim;
  for (int64_t b = 0; b < batch; ++b) {
    if (batch > 1 && fused(b, 1)) continue;
    const int64_t len = pg.lens[static_cast<std::size_t>(b)];
    std::vector<KV> kb(static_cast<std::size_t>(len * hk * dim)), vb(kb.size());
    for (int64_t j = 0; j < len; ++j) {
      const int64_t page = pg.table[static_cast<std::size_t>(b * pg.max_pages + j / pg.page_size)];
      for (int64_t h = 0; h < hk; ++h) {
        const KV* ks = slot_row(k_pages, layout, page, j % pg.page_size, h);
        const KV* vs = slot_row(v_pages, layout, page, j % pg.page_size, h);
        for (int64_t c = 0; c < dim; ++c) {
          kb[static_cast<std::size_t>((j * hk + h) * dim + c)] = ks[c * k_pages.stride[3]];
          vb[static_cast<std::size_t>((j * hk + h) * dim + c)] = vs[c * v_pages.stride[3]];
        }
      }
    }
    std::vector<int64_t> ids(static_cast<std::size_t>(seq_q));
    for (int64_t i = 0; i < seq_q; ++i)
      ids[static_cast<std::size_t>(i)] = query_positions->at(b, i);
    const Positions row_pos = Positions::shared(std::move(ids));
    View<const Q, 4> qb = q;
    qb.data = q.data + b * q.stride[0];
    qb.shape[0] = 1;
    View<O, 4> ob = out;
    ob.data = out.data + b * out.stride[0];
    ob.shape[0] = 1;
    const auto kv = View<const KV, 4>::contiguous(kb.data(), {1, len, hk, dim});
    const auto vv = View<const KV, 4>::contiguous(vb.data(), {1, len, hk, dim});
    attention(qb, kv, vv, scheme, options, ob, &row_pos);
  }
}

template <class KN, class KP>
void rope_append_impl(View<const KN, 4> k_new, View<const KN, 4> v_new, const Rope& rope,
                      View<KP, 4> k_pages, View<KP, 4> v_pages, PageLayout layout,
                      View<const int32_t, 2> block_table, View<const int32_t, 1> seq_lens,
                      const Positions* positions, int num_threads) {
  const std::string fn = "rope_append";
  detail::require_data(k_new, fn + ": k_new");
  const bool values = v_new.data != nullptr || v_new.numel() > 0;
  Pages pg;
  read_pool(k_pages, layout, fn + ": k_pages", pg);
  const int64_t batch = k_new.shape[0], n_new = k_new.shape[1];
  if (k_new.shape[2] != pg.heads_kv || k_new.shape[3] != pg.head_dim) {
    fail<ShapeError>(fn + ": k_new " + shape_str(k_new.shape) +
                     " must be [batch, n_new, heads_kv, head_dim] with the heads and head_dim of "
                     "k_pages " +
                     shape_str(k_pages.shape));
  }
  if (values) {
    detail::require_data(v_new, fn + ": v_new");
    if (v_new.shape != k_new.shape) {
      fail<ShapeError>(fn + ": v_new " + shape_str(v_new.shape) + " must have k_new's shape " +
                       shape_str(k_new.shape));
    }
    if (v_pages.shape != k_pages.shape) {
      fail<ShapeError>(fn + ": v_pages " + shape_str(v_pages.shape) + " must have k_pages' shape " +
                       shape_str(k_pages.shape));
    }
    detail::require_data(v_pages, fn + ": v_pages");
  }
  if (num_threads < 0) fail(fn + ": num_threads must be >= 0");
  const int64_t rot = rope.freqs.rotary_dim();
  if (rope.offset < 0 || rope.offset + rot > pg.head_dim) {
    fail<ShapeError>(fn + ": rope offset (" + std::to_string(rope.offset) + ") + rotary_dim (" +
                     std::to_string(rot) + ") exceeds head_dim (" + std::to_string(pg.head_dim) +
                     ")");
  }
  read_table(block_table, seq_lens, batch, n_new, fn, pg);
  Positions pdefault;
  if (positions == nullptr) {
    std::vector<int64_t> ids(static_cast<std::size_t>(batch * n_new));
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < n_new; ++i) {
        ids[static_cast<std::size_t>(b * n_new + i)] =
            pg.lens[static_cast<std::size_t>(b)] - n_new + i;
      }
    pdefault = Positions::per_row(std::move(ids), batch, n_new);
    positions = &pdefault;
  }
  positions->validate(batch, n_new, fn + ": positions");
  if (batch == 0 || n_new == 0) return;

  // The new keys widened to float32 (exact), rotated once as apply_rope does, then rounded once
  // into their slots.
  const int64_t hk = pg.heads_kv, dim = pg.head_dim;
  std::vector<float> kf(static_cast<std::size_t>(batch * n_new * hk * dim));
  const auto kv = View<float, 4>::contiguous(kf.data(), {batch, n_new, hk, dim});
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < n_new; ++i)
      for (int64_t h = 0; h < hk; ++h)
        for (int64_t c = 0; c < dim; ++c) kv(b, i, h, c) = to_float(k_new(b, i, h, c));
  if (rot > 0) {
    attn::rotate_heads<float>(rope, View<const float, 4>(kv), kv, positions, Direction::kForward,
                              num_threads);
  }
  kernels::parallel_for(batch * n_new, kernels::resolve_threads(num_threads), [&](int64_t w) {
    const int64_t b = w / n_new, i = w % n_new;
    const int64_t j = pg.lens[static_cast<std::size_t>(b)] - n_new + i;
    const int64_t page = pg.table[static_cast<std::size_t>(b * pg.max_pages + j / pg.page_size)];
    const int64_t slot = j % pg.page_size;
    for (int64_t h = 0; h < hk; ++h) {
      KP* kd = slot_row(k_pages, layout, page, slot, h);
      for (int64_t c = 0; c < dim; ++c) kd[c * k_pages.stride[3]] = from_float<KP>(kv(b, i, h, c));
      if (!values) continue;
      KP* vd = slot_row(v_pages, layout, page, slot, h);
      for (int64_t c = 0; c < dim; ++c) {
        vd[c * v_pages.stride[3]] = from_float<KP>(to_float(v_new(b, i, h, c)));
      }
    }
  });
}

}  // namespace paged_detail

using paged_detail::attention_paged_impl;
using paged_detail::rope_append_impl;

void attention_paged(View<const float, 4> q, View<const float, 4> k_pages,
                     View<const float, 4> v_pages, PageLayout layout,
                     View<const int32_t, 2> block_table, View<const int32_t, 1> seq_lens,
                     const PositionScheme& scheme, const AttentionOptions& options,
                     View<float, 4> out, const Positions* query_positions) {
  attention_paged_impl(q, k_pages, v_pages, layout, block_table, seq_lens, scheme, options, out,
                       query_positions);
}
void attention_paged(View<const float, 4> q, View<const bf16, 4> k_pages,
                     View<const bf16, 4> v_pages, PageLayout layout,
                     View<const int32_t, 2> block_table, View<const int32_t, 1> seq_lens,
                     const PositionScheme& scheme, const AttentionOptions& options,
                     View<float, 4> out, const Positions* query_positions) {
  attention_paged_impl(q, k_pages, v_pages, layout, block_table, seq_lens, scheme, options, out,
                       query_positions);
}
void attention_paged(View<const float, 4> q, View<const f16, 4> k_pages, View<const f16, 4> v_pages,
                     PageLayout layout, View<const int32_t, 2> block_table,
                     View<const int32_t, 1> seq_lens, const PositionScheme& scheme,
                     const AttentionOptions& options, View<float, 4> out,
                     const Positions* query_positions) {
  attention_paged_impl(q, k_pages, v_pages, layout, block_table, seq_lens, scheme, options, out,
                       query_positions);
}
void attention_paged(View<const bf16, 4> q, View<const bf16, 4> k_pages,
                     View<const bf16, 4> v_pages, PageLayout layout,
                     View<const int32_t, 2> block_table, View<const int32_t, 1> seq_lens,
                     const PositionScheme& scheme, const AttentionOptions& options,
                     View<bf16, 4> out, const Positions* query_positions) {
  attention_paged_impl(q, k_pages, v_pages, layout, block_table, seq_lens, scheme, options, out,
                       query_positions);
}
void attention_paged(View<const f16, 4> q, View<const f16, 4> k_pages, View<const f16, 4> v_pages,
                     PageLayout layout, View<const int32_t, 2> block_table,
                     View<const int32_t, 1> seq_lens, const PositionScheme& scheme,
                     const AttentionOptions& options, View<f16, 4> out,
                     const Positions* query_positions) {
  attention_paged_impl(q, k_pages, v_pages, layout, block_table, seq_lens, scheme, options, out,
                       query_positions);
}

void rope_append(View<const float, 4> k_new, View<const float, 4> v_new, const Rope& rope,
                 View<float, 4> k_pages, View<float, 4> v_pages, PageLayout layout,
                 View<const int32_t, 2> block_table, View<const int32_t, 1> seq_lens,
                 const Positions* positions, int num_threads) {
  rope_append_impl(k_new, v_new, rope, k_pages, v_pages, layout, block_table, seq_lens, positions,
                   num_threads);
}
void rope_append(View<const float, 4> k_new, View<const float, 4> v_new, const Rope& rope,
                 View<bf16, 4> k_pages, View<bf16, 4> v_pages, PageLayout layout,
                 View<const int32_t, 2> block_table, View<const int32_t, 1> seq_lens,
                 const Positions* positions, int num_threads) {
  rope_append_impl(k_new, v_new, rope, k_pages, v_pages, layout, block_table, seq_lens, positions,
                   num_threads);
}
void rope_append(View<const float, 4> k_new, View<const float, 4> v_new, const Rope& rope,
                 View<f16, 4> k_pages, View<f16, 4> v_pages, PageLayout layout,
                 View<const int32_t, 2> block_table, View<const int32_t, 1> seq_lens,
                 const Positions* positions, int num_threads) {
  rope_append_impl(k_new, v_new, rope, k_pages, v_pages, layout, block_table, seq_lens, positions,
                   num_threads);
}
void rope_append(View<const bf16, 4> k_new, View<const bf16, 4> v_new, const Rope& rope,
                 View<bf16, 4> k_pages, View<bf16, 4> v_pages, PageLayout layout,
                 View<const int32_t, 2> block_table, View<const int32_t, 1> seq_lens,
                 const Positions* positions, int num_threads) {
  rope_append_impl(k_new, v_new, rope, k_pages, v_pages, layout, block_table, seq_lens, positions,
                   num_threads);
}
void rope_append(View<const f16, 4> k_new, View<const f16, 4> v_new, const Rope& rope,
                 View<f16, 4> k_pages, View<f16, 4> v_pages, PageLayout layout,
                 View<const int32_t, 2> block_table, View<const int32_t, 1> seq_lens,
                 const Positions* positions, int num_threads) {
  rope_append_impl(k_new, v_new, rope, k_pages, v_pages, layout, block_table, seq_lens, positions,
                   num_threads);
}

const char* page_layout_name(PageLayout layout) {
  return layout == PageLayout::kTokenMajor ? "token_major" : "head_major";
}

PageLayout parse_page_layout(const std::string& name) {
  if (name == "token_major") return PageLayout::kTokenMajor;
  if (name == "head_major") return PageLayout::kHeadMajor;
  detail::fail("layout: unknown page layout '" + name + "' (token_major, head_major)");
}

}  // namespace posenc
