// Paged KV caches (posenc/paged.h): attention_paged against attention() on the same keys
// gathered into contiguous tensors (bit for bit where the reduction order is the same) and
// against the float64 oracle, on random block tables (shuffled pages, unused slots and pages
// filled with NaN so that a read outside the row's keys shows), page sizes 1, 3, 16, both
// layouts, every scheme, GQA, windows, sinks, float32 / bf16 / f16; rope_append; bad inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention_cases.h"
#include "hwy/targets.h"
#include "kernels/simd.h"
#include "posenc/posenc.h"
#include "test_util.h"

using namespace posenc;

namespace {

template <class T>
T cast(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return from_float<T>(x);
  }
}

// A paged cache of T built from per-row contiguous keys and values ([len, heads, dim] each).
template <class T>
struct PagedCache {
  int64_t page_size = 0, heads = 0, dim = 0, num_pages = 0, max_pages = 0;
  PageLayout layout = PageLayout::kTokenMajor;
  std::vector<T> k, v;
  std::vector<int32_t> table, lens;

  std::array<int64_t, 4> pool_shape() const {
    return layout == PageLayout::kTokenMajor
               ? std::array<int64_t, 4>{num_pages, page_size, heads, dim}
               : std::array<int64_t, 4>{num_pages, heads, page_size, dim};
  }
  View<const T, 4> kview() const { return View<const T, 4>::contiguous(k.data(), pool_shape()); }
  View<const T, 4> vview() const { return View<const T, 4>::contiguous(v.data(), pool_shape()); }
  View<T, 4> kmut() { return View<T, 4>::contiguous(k.data(), pool_shape()); }
  View<T, 4> vmut() { return View<T, 4>::contiguous(v.data(), pool_shape()); }
  View<const int32_t, 2> tview() const {
    return View<const int32_t, 2>::contiguous(table.data(), {int64_t(lens.size()), max_pages});
  }
  View<const int32_t, 1> lview() const {
    return View<const int32_t, 1>::contiguous(lens.data(), {int64_t(lens.size())});
  }
  int64_t at(int64_t page, int64_t slot, int64_t h) const {
    return layout == PageLayout::kTokenMajor ? ((page * page_size + slot) * heads + h) * dim
                                             : ((page * heads + h) * page_size + slot) * dim;
  }
  // Key j of row b, head h.
  int64_t key_at(int64_t b, int64_t j, int64_t h) const {
    return at(table[b * max_pages + j / page_size], j % page_size, h);
  }
};

// Pages for rows of lengths `lens` (with `spare` extra pages), shuffled, every element NaN until
// written; table entries past a row's pages are -1.
template <class T>
PagedCache<T> empty_cache(const std::vector<int32_t>& lens, int64_t heads, int64_t dim,
                          int64_t page_size, PageLayout layout, std::mt19937_64& rng,
                          int64_t spare_table = 1) {
  PagedCache<T> c;
  c.page_size = page_size, c.heads = heads, c.dim = dim, c.layout = layout, c.lens = lens;
  int64_t need = 0, most = 0;
  for (int32_t len : lens) {
    need += (len + page_size - 1) / page_size;
    most = std::max<int64_t>(most, (len + page_size - 1) / page_size);
  }
  c.num_pages = need + 2;
  c.max_pages = most + spare_table;
  std::vector<int32_t> ids(static_cast<size_t>(c.num_pages));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  c.table.assign(static_cast<size_t>(lens.size() * c.max_pages), -1);
  int64_t next = 0;
  for (size_t b = 0; b < lens.size(); ++b)
    for (int64_t p = 0; p < (lens[b] + page_size - 1) / page_size; ++p)
      c.table[b * c.max_pages + p] = ids[static_cast<size_t>(next++)];
  const T nan = cast<T>(std::numeric_limits<float>::quiet_NaN());
  c.k.assign(static_cast<size_t>(c.num_pages * page_size * heads * dim), nan);
  c.v = c.k;
  return c;
}

// Random keys and values in a cache, and the same per row contiguous ([len, heads, dim]).
template <class T>
struct Filled {
  PagedCache<T> cache;
  std::vector<std::vector<T>> krow, vrow;
};

template <class T>
Filled<T> random_cache(const std::vector<int32_t>& lens, int64_t heads, int64_t dim,
                       int64_t page_size, PageLayout layout, std::mt19937_64& rng) {
  Filled<T> f{empty_cache<T>(lens, heads, dim, page_size, layout, rng), {}, {}};
  std::normal_distribution<double> nd(0.0, 1.0);
  for (size_t b = 0; b < lens.size(); ++b) {
    f.krow.emplace_back(static_cast<size_t>(lens[b] * heads * dim));
    f.vrow.emplace_back(f.krow.back().size());
    for (int64_t j = 0; j < lens[b]; ++j)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t x = 0; x < dim; ++x) {
          const T kx = cast<T>(static_cast<float>(nd(rng)));
          const T vx = cast<T>(static_cast<float>(nd(rng)));
          f.krow[b][(j * heads + h) * dim + x] = kx;
          f.vrow[b][(j * heads + h) * dim + x] = vx;
          f.cache.k[f.cache.key_at(b, j, h) + x] = kx;
          f.cache.v[f.cache.key_at(b, j, h) + x] = vx;
        }
  }
  return f;
}

template <class T>
std::vector<T> random_vec(int64_t n, std::mt19937_64& rng) {
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<T> v(static_cast<size_t>(n));
  for (auto& x : v) x = cast<T>(static_cast<float>(nd(rng)));
  return v;
}

template <class T>
bool same_bits_vec(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double(a[i]) - b[i]));
  return m;
}

const PageLayout kLayouts[] = {PageLayout::kTokenMajor, PageLayout::kHeadMajor};

// Equal row lengths: attention_paged equals attention() on the gathered [batch, L, H, D] keys bit
// for bit (same shape, so the same tiles, splits and order), for storage Q / KV / O.
template <class Q, class KV, class O>
void check_equal_lengths(int64_t batch, int64_t seq_q, int64_t heads_q, int64_t heads_kv,
                         int64_t dim, int32_t len, int64_t page_size, PageLayout layout,
                         const PositionScheme& scheme, const AttentionOptions& opt,
                         std::mt19937_64& rng, const std::string& what) {
  SCOPED_TRACE(what + " page_size " + std::to_string(page_size) + " " + page_layout_name(layout) +
               " len " + std::to_string(len) + " seq_q " + std::to_string(seq_q));
  const std::vector<int32_t> lens(static_cast<size_t>(batch), len);
  auto f = random_cache<KV>(lens, heads_kv, dim, page_size, layout, rng);
  std::vector<KV> kc, vc;
  for (int64_t b = 0; b < batch; ++b) {
    kc.insert(kc.end(), f.krow[b].begin(), f.krow[b].end());
    vc.insert(vc.end(), f.vrow[b].begin(), f.vrow[b].end());
  }
  const auto q = random_vec<Q>(batch * seq_q * heads_q * dim, rng);
  const std::array<int64_t, 4> qs{batch, seq_q, heads_q, dim}, ks{batch, len, heads_kv, dim};
  std::vector<O> got(q.size()), want(q.size());
  attention_paged(View<const Q, 4>::contiguous(q.data(), qs), f.cache.kview(), f.cache.vview(),
                  layout, f.cache.tview(), f.cache.lview(), scheme, opt,
                  View<O, 4>::contiguous(got.data(), qs));
  attention(View<const Q, 4>::contiguous(q.data(), qs),
            View<const KV, 4>::contiguous(kc.data(), ks),
            View<const KV, 4>::contiguous(vc.data(), ks), scheme, opt,
            View<O, 4>::contiguous(want.data(), qs));
  EXPECT_TRUE(same_bits_vec(got, want));
}

// Rows of different lengths against the float64 oracle on each row's gathered keys: error at
// most 2 x the simple float32 path's + 1e-6 (float32 cache).
void check_ragged(const std::vector<int32_t>& lens, int64_t seq_q, int64_t heads_q,
                  int64_t heads_kv, int64_t dim, int64_t page_size, PageLayout layout,
                  const PositionScheme& scheme, const AttentionOptions& opt, std::mt19937_64& rng,
                  const std::string& what) {
  SCOPED_TRACE(what + " page_size " + std::to_string(page_size) + " " + page_layout_name(layout));
  const int64_t batch = static_cast<int64_t>(lens.size());
  auto f = random_cache<float>(lens, heads_kv, dim, page_size, layout, rng);
  const auto q = random_vec<float>(batch * seq_q * heads_q * dim, rng);
  const std::array<int64_t, 4> qs{batch, seq_q, heads_q, dim};
  std::vector<float> got(q.size());
  attention_paged(View<const float, 4>::contiguous(q.data(), qs), f.cache.kview(), f.cache.vview(),
                  layout, f.cache.tview(), f.cache.lview(), scheme, opt,
                  View<float, 4>::contiguous(got.data(), qs));
  const int64_t row = seq_q * heads_q * dim;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens[b];
    std::vector<int64_t> ids(static_cast<size_t>(seq_q));
    for (int64_t i = 0; i < seq_q; ++i) ids[i] = len - seq_q + i;
    const Positions pos = Positions::shared(ids);
    const std::array<int64_t, 4> q1{1, seq_q, heads_q, dim}, k1{1, len, heads_kv, dim};
    std::vector<double> qd(q.begin() + b * row, q.begin() + (b + 1) * row);
    std::vector<double> kd(f.krow[b].begin(), f.krow[b].end()),
        vd(f.vrow[b].begin(), f.vrow[b].end());
    std::vector<double> oracle(static_cast<size_t>(row));
    ref::attention(View<const double, 4>::contiguous(qd.data(), q1),
                   View<const double, 4>::contiguous(kd.data(), k1),
                   View<const double, 4>::contiguous(vd.data(), k1), scheme, opt,
                   View<double, 4>::contiguous(oracle.data(), q1), &pos);
    std::vector<float> naive(static_cast<size_t>(row));
    attention_naive(View<const float, 4>::contiguous(q.data() + b * row, q1),
                    View<const float, 4>::contiguous(f.krow[b].data(), k1),
                    View<const float, 4>::contiguous(f.vrow[b].data(), k1), scheme, opt,
                    View<float, 4>::contiguous(naive.data(), q1), &pos);
    const std::vector<float> mine(got.begin() + b * row, got.begin() + (b + 1) * row);
    const double tol = 2 * max_abs_diff(naive, oracle) + 1e-6;
    EXPECT_LE(max_abs_diff(mine, oracle), tol) << "row " << b << " len " << len;
  }
}

}  // namespace

// Every scheme, both layouts, page sizes 1, 3, 16: decoding (one query, GQA 4/2: the dot path)
// and chunked prefill (7 queries x 2 heads per kv head: the tile path), bit for bit.
TEST(PagedAttention, EqualLengthsBitForBitEveryScheme) {
  std::mt19937_64 rng(7);
  for (const auto& name : cases::kSchemes) {
    const auto box = cases::make_scheme(name, 4, 24, rng, 1);
    for (const PageLayout layout : kLayouts)
      for (const int64_t ps : {1, 3, 16}) {
        check_equal_lengths<float, float, float>(2, 1, 4, 2, 24, 77, ps, layout, box->scheme,
                                                 {.causal = true}, rng, name + " decode");
        check_equal_lengths<float, float, float>(2, 7, 4, 2, 24, 150, ps, layout, box->scheme,
                                                 {.causal = true}, rng, name + " prefill");
      }
  }
}

// Half-precision caches (float32 q and out) and all-bf16 / all-f16 calls, windows, sinks, MQA,
// and head_dim 128 with a cache long enough for the decoding split (4096+ keys).
TEST(PagedAttention, EqualLengthsBitForBitHalfAndOptions) {
  std::mt19937_64 rng(11);
  const auto rope = cases::make_scheme("rope", 8, 64, rng, 0);
  const auto alibi = cases::make_scheme("alibi", 8, 64, rng, 0);
  std::vector<float> sinks = {0.5f, -1.0f, 2.0f, 0.0f, 1.0f, -0.5f, 0.25f, 3.0f};
  const AttentionOptions causal{.causal = true};
  const AttentionOptions window{.causal = true, .window = 40};
  AttentionOptions with_sinks{.causal = true};
  with_sinks.sinks = View<const float, 1>::contiguous(sinks.data(), {8});
  for (const PageLayout layout : kLayouts)
    for (const int64_t ps : {3, 16}) {
      check_equal_lengths<float, bf16, float>(2, 1, 8, 2, 64, 200, ps, layout, rope->scheme, causal,
                                              rng, "f32/bf16 rope");
      check_equal_lengths<float, f16, float>(2, 2, 8, 2, 64, 129, ps, layout, alibi->scheme, window,
                                             rng, "f32/f16 alibi window");
      check_equal_lengths<bf16, bf16, bf16>(1, 1, 8, 1, 64, 100, ps, layout, NoPositions{},
                                            with_sinks, rng, "bf16 mqa sinks");
      check_equal_lengths<f16, f16, f16>(2, 3, 8, 4, 64, 65, ps, layout, rope->scheme, causal, rng,
                                         "f16 rope");
    }
  for (const PageLayout layout : kLayouts) {
    check_equal_lengths<float, float, float>(1, 1, 8, 2, 128, 5000, 16, layout, rope->scheme,
                                             causal, rng, "split f32");
    check_equal_lengths<float, bf16, float>(1, 1, 8, 2, 128, 4500, 16, layout, NoPositions{},
                                            causal, rng, "split bf16");
  }
}

// The same on every compiled SIMD target supported here, at 1 and 3 threads.
TEST(PagedAttention, EveryCompiledSimdTargetAndThreads) {
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    kernels::set_simd_target_for_test(target);
    std::mt19937_64 rng(3);
    const auto rope = cases::make_scheme("rope", 4, 20, rng, 1);
    for (const int threads : {1, 3})
      for (const PageLayout layout : kLayouts) {
        const AttentionOptions opt{.causal = true, .num_threads = threads};
        check_equal_lengths<float, float, float>(2, 1, 4, 2, 20, 70, 3, layout, rope->scheme, opt,
                                                 rng, "f32");
        check_equal_lengths<float, bf16, float>(2, 1, 4, 1, 20, 70, 16, layout, NoPositions{}, opt,
                                                rng, "bf16");
        check_equal_lengths<float, f16, float>(1, 1, 4, 4, 20, 70, 1, layout, NoPositions{}, opt,
                                               rng, "f16");
      }
  }
  kernels::set_simd_target_for_test(0);
}

// Rows of different lengths (odd, shorter than a page, longer than a tile, one long enough for
// the decoding split) against the float64 oracle, every scheme.
TEST(PagedAttention, RaggedRowsAgainstOracle) {
  std::mt19937_64 rng(5);
  for (const auto& name : cases::kSchemes) {
    const auto box = cases::make_scheme(name, 4, 16, rng, 0);
    for (const PageLayout layout : kLayouts)
      for (const int64_t ps : {1, 3, 16}) {
        check_ragged({37, 1, 130, 64}, 1, 4, 2, 16, ps, layout, box->scheme, {.causal = true}, rng,
                     name + " decode");
        check_ragged({9, 70, 20}, 5, 4, 1, 16, ps, layout, box->scheme,
                     {.causal = true, .window = 12}, rng, name + " chunk window");
      }
  }
  const auto rope = cases::make_scheme("rope", 8, 32, rng, 0);
  check_ragged({4500, 17, 300}, 1, 8, 2, 32, 16, PageLayout::kHeadMajor, rope->scheme,
               {.causal = true}, rng, "split ragged");
  check_ragged({50, 3}, 2, 4, 2, 16, 16, PageLayout::kTokenMajor, NoPositions{}, {}, rng,
               "bidirectional");
}

// A row with no keys: 0 when allowed, an error otherwise; with sinks well defined (0).
TEST(PagedAttention, EmptyRows) {
  std::mt19937_64 rng(9);
  auto f = random_cache<float>({0, 5}, 2, 8, 4, PageLayout::kTokenMajor, rng);
  const auto q = random_vec<float>(2 * 1 * 2 * 8, rng);
  const std::array<int64_t, 4> qs{2, 1, 2, 8};
  std::vector<float> out(q.size(), 7.0f);
  const auto qv = View<const float, 4>::contiguous(q.data(), qs);
  const auto ov = View<float, 4>::contiguous(out.data(), qs);
  const std::vector<int64_t> qpos = {0, 4};
  const Positions pos = Positions::per_row(qpos, 2, 1);
  EXPECT_THROW(
      attention_paged(qv, f.cache.kview(), f.cache.vview(), PageLayout::kTokenMajor,
                      f.cache.tview(), f.cache.lview(), NoPositions{}, {.causal = true}, ov, &pos),
      ValueError);
  attention_paged(qv, f.cache.kview(), f.cache.vview(), PageLayout::kTokenMajor, f.cache.tview(),
                  f.cache.lview(), NoPositions{}, {.causal = true, .allow_fully_masked = true}, ov,
                  &pos);
  for (int64_t x = 0; x < 16; ++x) EXPECT_EQ(out[x], 0.0f);
  for (int64_t x = 16; x < 32; ++x) EXPECT_TRUE(std::isfinite(out[x]) && out[x] != 7.0f);
  // Every row empty.
  std::vector<int32_t> zero = {0, 0};
  EXPECT_NO_THROW(attention_paged(qv, f.cache.kview(), f.cache.vview(), PageLayout::kTokenMajor,
                                  f.cache.tview(),
                                  View<const int32_t, 1>::contiguous(zero.data(), {2}),
                                  NoPositions{}, {.allow_fully_masked = true}, ov, &pos));
  for (float x : out) EXPECT_EQ(x, 0.0f);
}

// rope_append: unrotated keys appended with RoPE, then attention with NoPositions on q rotated by
// apply_rope, equals attention with the Rope scheme on the unrotated keys (float32: bit for bit),
// and the pages hold apply_rope's bits (bf16, f16: rounded once).
TEST(PagedAttention, RopeAppendBothConventions) {
  std::mt19937_64 rng(21);
  const int64_t heads_q = 4, heads_kv = 2, dim = 32;
  const Rope rope{rope_frequencies({.head_dim = dim, .rotary_dim = 16, .base = 10000.0}),
                  RopeStyle::kHalf, 8};
  for (const PageLayout layout : kLayouts)
    for (const int64_t ps : {1, 3, 16}) {
      SCOPED_TRACE(std::string(page_layout_name(layout)) + " page_size " + std::to_string(ps));
      const std::vector<int32_t> lens = {45, 20};
      // Unrotated keys in a cache (the kernel rotates), and the same keys appended with RoPE in
      // two steps (a prefill of len - 3 tokens, then 3 decoded ones) to a second cache.
      auto f = random_cache<float>(lens, heads_kv, dim, ps, layout, rng);
      auto g = f.cache;
      std::fill(g.k.begin(), g.k.end(), std::numeric_limits<float>::quiet_NaN());
      std::fill(g.v.begin(), g.v.end(), std::numeric_limits<float>::quiet_NaN());
      for (const int64_t step : {0, 1}) {
        const int64_t n = step == 0 ? 17 : 3;  // rows hold lens - 3 after the first step
        std::vector<int32_t> now = lens;
        for (auto& l : now) l -= step == 0 ? 3 : 0;
        std::vector<float> kn(2 * n * heads_kv * dim), vn(kn.size());
        for (int64_t b = 0; b < 2; ++b)
          for (int64_t i = 0; i < n; ++i) {
            const int64_t j = now[b] - n + i;
            std::copy_n(&f.krow[b][j * heads_kv * dim], heads_kv * dim,
                        &kn[(b * n + i) * heads_kv * dim]);
            std::copy_n(&f.vrow[b][j * heads_kv * dim], heads_kv * dim,
                        &vn[(b * n + i) * heads_kv * dim]);
          }
        const std::array<int64_t, 4> ns{2, n, heads_kv, dim};
        // First step: write only the last 17 of each row's lens - 3 tokens; the earlier ones
        // below, with explicit positions.
        rope_append(View<const float, 4>::contiguous(kn.data(), ns),
                    View<const float, 4>::contiguous(vn.data(), ns), rope, g.kmut(), g.vmut(),
                    layout, g.tview(), View<const int32_t, 1>::contiguous(now.data(), {2}));
      }
      // The remaining early tokens (row 0: 0 .. 24), appended with explicit positions and a
      // shortened length.
      {
        const int64_t n = 25;
        std::vector<float> kn(n * heads_kv * dim), vn(kn.size());
        std::copy_n(f.krow[0].data(), kn.size(), kn.data());
        std::copy_n(f.vrow[0].data(), vn.size(), vn.data());
        std::vector<int32_t> now = {25};
        std::vector<int64_t> ids(n);
        std::iota(ids.begin(), ids.end(), 0);
        const Positions pos = Positions::shared(ids);
        std::vector<int32_t> table(g.table.begin(), g.table.begin() + g.max_pages);
        const std::array<int64_t, 4> ns{1, n, heads_kv, dim};
        rope_append(View<const float, 4>::contiguous(kn.data(), ns),
                    View<const float, 4>::contiguous(vn.data(), ns), rope, g.kmut(), g.vmut(),
                    layout, View<const int32_t, 2>::contiguous(table.data(), {1, g.max_pages}),
                    View<const int32_t, 1>::contiguous(now.data(), {1}), &pos);
      }
      // Row 1 has 20 tokens: 17 + 3 written; row 0: 25 + 17 + 3 = 45.
      const int64_t seq_q = 2;
      const auto q = random_vec<float>(2 * seq_q * heads_q * dim, rng);
      const std::array<int64_t, 4> qs{2, seq_q, heads_q, dim};
      std::vector<float> a(q.size()), b(q.size()), qr(q.size());
      attention_paged(View<const float, 4>::contiguous(q.data(), qs), f.cache.kview(),
                      f.cache.vview(), layout, f.cache.tview(), f.cache.lview(), rope,
                      {.causal = true}, View<float, 4>::contiguous(a.data(), qs));
      // q rotated at its positions (lens - seq_q + i), dims [8, 24).
      std::vector<int64_t> qids = {43, 44, 18, 19};
      const Positions qpos = Positions::per_row(qids, 2, seq_q);
      std::copy(q.begin(), q.end(), qr.begin());
      View<float, 4> part = View<float, 4>::contiguous(qr.data(), qs);
      part.data += 8;
      part.shape[3] = dim - 8;
      apply_rope(rope.freqs, rope.style, part, &qpos);
      attention_paged(View<const float, 4>::contiguous(qr.data(), qs), g.kview(), g.vview(), layout,
                      g.tview(), f.cache.lview(), NoPositions{}, {.causal = true},
                      View<float, 4>::contiguous(b.data(), qs));
      EXPECT_TRUE(same_bits_vec(a, b));
      // The values were copied as they are.
      for (int64_t row = 0; row < 2; ++row)
        for (int64_t j = 0; j < lens[row]; ++j)
          for (int64_t h = 0; h < heads_kv; ++h)
            for (int64_t x = 0; x < dim; ++x)
              ASSERT_EQ(g.v[g.key_at(row, j, h) + x], f.vrow[row][(j * heads_kv + h) * dim + x]);
    }
}

// Half pages: rope_append rounds once, to apply_rope's half-precision bits.
template <class KN, class KP>
void check_append_bits(PageLayout layout) {
  std::mt19937_64 rng(4);
  const int64_t heads = 3, dim = 16, n = 5;
  const Rope rope{rope_frequencies({.head_dim = dim, .base = 10000.0}), RopeStyle::kInterleaved};
  auto c = empty_cache<KP>({9, 5}, heads, dim, 4, layout, rng);
  const auto kn = random_vec<KN>(2 * n * heads * dim, rng);
  const auto vn = random_vec<KN>(kn.size(), rng);
  const std::array<int64_t, 4> ns{2, n, heads, dim};
  rope_append(View<const KN, 4>::contiguous(kn.data(), ns),
              View<const KN, 4>::contiguous(vn.data(), ns), rope, c.kmut(), c.vmut(), layout,
              c.tview(), c.lview());
  // apply_rope on the widened keys at positions lens - n + i, rounded once.
  std::vector<float> kf(kn.size());
  for (size_t i = 0; i < kn.size(); ++i) kf[i] = to_float(kn[i]);
  const std::vector<int64_t> ids = {4, 5, 6, 7, 8, 0, 1, 2, 3, 4};
  const Positions pos = Positions::per_row(ids, 2, n);
  apply_rope(rope.freqs, rope.style, View<float, 4>::contiguous(kf.data(), ns), &pos);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t x = 0; x < dim; ++x) {
          const int64_t src = ((b * n + i) * heads + h) * dim + x;
          const int64_t at = c.key_at(b, ids[b * n + i], h) + x;
          const KP want = from_float<KP>(kf[src]);
          ASSERT_EQ(std::memcmp(&c.k[at], &want, sizeof(KP)), 0) << b << " " << i << " " << x;
          const KP vwant = from_float<KP>(to_float(vn[src]));
          ASSERT_EQ(std::memcmp(&c.v[at], &vwant, sizeof(KP)), 0);
        }
}

TEST(PagedAttention, RopeAppendRoundsOnce) {
  for (const PageLayout layout : kLayouts) {
    check_append_bits<float, bf16>(layout);
    check_append_bits<float, f16>(layout);
    check_append_bits<bf16, bf16>(layout);
    check_append_bits<f16, f16>(layout);
    check_append_bits<float, float>(layout);
  }
}

// Bad inputs: clear errors naming the argument.
TEST(PagedAttention, BadInputs) {
  std::mt19937_64 rng(2);
  auto f = random_cache<float>({10, 6}, 2, 8, 4, PageLayout::kTokenMajor, rng);
  auto& c = f.cache;
  const auto q = random_vec<float>(2 * 1 * 4 * 8, rng);
  const std::array<int64_t, 4> qs{2, 1, 4, 8};
  std::vector<float> out(q.size());
  const auto qv = View<const float, 4>::contiguous(q.data(), qs);
  const auto ov = View<float, 4>::contiguous(out.data(), qs);
  auto run = [&](View<const int32_t, 2> table, View<const int32_t, 1> lens) {
    attention_paged(qv, c.kview(), c.vview(), PageLayout::kTokenMajor, table, lens, NoPositions{},
                    {.causal = true}, ov);
  };
  auto expect_msg = [](auto&& f, const std::string& part) {
    try {
      f();
      ADD_FAILURE() << "no error, expected: " << part;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  EXPECT_NO_THROW(run(c.tview(), c.lview()));
  auto table = c.table;
  table[1] = static_cast<int32_t>(c.num_pages);
  expect_msg(
      [&] {
        run(View<const int32_t, 2>::contiguous(table.data(), {2, c.max_pages}), c.lview());
      },
      "block_table[0][1]");
  table[1] = -1;
  EXPECT_THROW(run(View<const int32_t, 2>::contiguous(table.data(), {2, c.max_pages}), c.lview()),
               ValueError);
  std::vector<int32_t> lens = {-1, 6};
  expect_msg([&] { run(c.tview(), View<const int32_t, 1>::contiguous(lens.data(), {2})); },
             "seq_lens[0] = -1 is negative");
  lens = {10, static_cast<int32_t>(c.max_pages * 4 + 1)};
  expect_msg([&] { run(c.tview(), View<const int32_t, 1>::contiguous(lens.data(), {2})); },
             "exceeds max_pages * page_size");
  expect_msg([&] { run(c.tview(), View<const int32_t, 1>::contiguous(c.lens.data(), {1})); },
             "seq_lens");
  expect_msg(
      [&] {
        run(View<const int32_t, 2>::contiguous(c.table.data(), {1, c.max_pages}), c.lview());
      },
      "block_table");
  // Shapes: head_dim, heads ratio, v_pages, out.
  std::vector<float> q3(2 * 3 * 8);
  expect_msg(
      [&] {
        attention_paged(View<const float, 4>::contiguous(q3.data(), {2, 1, 3, 8}), c.kview(),
                        c.vview(), PageLayout::kTokenMajor, c.tview(), c.lview(), NoPositions{}, {},
                        View<float, 4>::contiguous(q3.data(), {2, 1, 3, 8}));
      },
      "must divide q heads");
  std::vector<float> q6(2 * 4 * 6);
  expect_msg(
      [&] {
        attention_paged(View<const float, 4>::contiguous(q6.data(), {2, 1, 4, 6}), c.kview(),
                        c.vview(), PageLayout::kTokenMajor, c.tview(), c.lview(), NoPositions{}, {},
                        View<float, 4>::contiguous(q6.data(), {2, 1, 4, 6}));
      },
      "differ in head_dim");
  auto vbad = c.vview();
  vbad.shape[0] -= 1;
  expect_msg(
      [&] {
        attention_paged(qv, c.kview(), vbad, PageLayout::kTokenMajor, c.tview(), c.lview(),
                        NoPositions{}, {}, ov);
      },
      "v_pages");
  // A query before any key (default positions need seq_lens >= seq_q).
  std::vector<float> q5(2 * 7 * 4 * 8), o5(q5.size());
  expect_msg(
      [&] {
        attention_paged(View<const float, 4>::contiguous(q5.data(), {2, 7, 4, 8}), c.kview(),
                        c.vview(), PageLayout::kTokenMajor, c.tview(), c.lview(), NoPositions{}, {},
                        View<float, 4>::contiguous(o5.data(), {2, 7, 4, 8}));
      },
      "seq_lens[1] = 6 is less than seq_q");
  // rope_append: n_new > seq_lens, shape mismatch.
  const Rope rope{rope_frequencies({.head_dim = 8, .base = 10000.0})};
  std::vector<float> kn(2 * 7 * 2 * 8);
  const auto knv = View<const float, 4>::contiguous(kn.data(), {2, 7, 2, 8});
  expect_msg(
      [&] {
        rope_append(knv, knv, rope, c.kmut(), c.vmut(), PageLayout::kTokenMajor, c.tview(),
                    c.lview());
      },
      "seq_lens[1] = 6 is less than the number of new tokens");
  const auto kbad = View<const float, 4>::contiguous(kn.data(), {2, 1, 3, 8});
  expect_msg(
      [&] {
        rope_append(kbad, {}, rope, c.kmut(), c.vmut(), PageLayout::kTokenMajor, c.tview(),
                    c.lview());
      },
      "k_new");
  EXPECT_EQ(parse_page_layout("head_major"), PageLayout::kHeadMajor);
  EXPECT_THROW(parse_page_layout("rows"), ValueError);
}

// The gathered route (query temperature; pools whose head_dim is strided) equals attention() on
// each row's gathered keys, and a row the kernel cannot take in a batch (DeBERTa over rows of
// different lengths) runs alone on its pages.
TEST(PagedAttention, GatheredAndRowByRowRoutes) {
  std::mt19937_64 rng(17);
  const std::vector<int32_t> lens = {30, 12};
  const int64_t heads_q = 4, heads_kv = 2, dim = 8, seq_q = 2;
  auto f = random_cache<float>(lens, heads_kv, dim, 4, PageLayout::kTokenMajor, rng);
  const auto q = random_vec<float>(2 * seq_q * heads_q * dim, rng);
  const std::array<int64_t, 4> qs{2, seq_q, heads_q, dim};
  const int64_t row = seq_q * heads_q * dim;
  const auto deberta = cases::make_scheme("deberta", heads_q, dim, rng, 1);
  AttentionOptions temp{.causal = true};
  temp.query_temperature = AttentionTemperature{.floor_scale = 4, .attn_scale = 0.5};
  // A pool with head_dim stride 2 (every other float of a bigger buffer).
  std::vector<float> wide_k(f.cache.k.size() * 2), wide_v(wide_k.size());
  for (size_t i = 0; i < f.cache.k.size(); ++i) wide_k[2 * i] = f.cache.k[i];
  for (size_t i = 0; i < f.cache.v.size(); ++i) wide_v[2 * i] = f.cache.v[i];
  auto strided = [&](std::vector<float>& w) {
    auto v = View<const float, 4>::contiguous(w.data(), f.cache.pool_shape());
    for (auto& s : v.stride) s *= 2;
    return v;
  };
  struct Case {
    const char* what;
    const PositionScheme* scheme;
    AttentionOptions opt;
    bool strided;
  };
  const PositionScheme none = NoPositions{};
  for (const Case& c : {Case{"temperature", &none, temp, false},
                        Case{"strided head_dim", &none, {.causal = true}, true},
                        Case{"deberta ragged", &deberta->scheme, {.causal = true}, false}}) {
    SCOPED_TRACE(c.what);
    std::vector<float> got(q.size());
    attention_paged(View<const float, 4>::contiguous(q.data(), qs),
                    c.strided ? strided(wide_k) : f.cache.kview(),
                    c.strided ? strided(wide_v) : f.cache.vview(), PageLayout::kTokenMajor,
                    f.cache.tview(), f.cache.lview(), *c.scheme, c.opt,
                    View<float, 4>::contiguous(got.data(), qs));
    for (int64_t b = 0; b < 2; ++b) {
      const std::array<int64_t, 4> q1{1, seq_q, heads_q, dim}, k1{1, lens[b], heads_kv, dim};
      std::vector<float> want(static_cast<size_t>(row));
      attention(View<const float, 4>::contiguous(q.data() + b * row, q1),
                View<const float, 4>::contiguous(f.krow[b].data(), k1),
                View<const float, 4>::contiguous(f.vrow[b].data(), k1), *c.scheme, c.opt,
                View<float, 4>::contiguous(want.data(), q1));
      EXPECT_TRUE(same_bits_vec(
          std::vector<float>(got.begin() + b * row, got.begin() + (b + 1) * row), want))
          << "row " << b;
    }
  }
}

namespace {

// f() throws E whose message holds every one of `parts`.
template <class E, class F>
void expect_error(F f, std::initializer_list<const char*> parts) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const E& e) {
    for (const char* p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

// An environment variable set for a scope.
struct ScopedEnv {
  std::string name, old;
  bool had;
  ScopedEnv(const char* n, const char* value) : name(n), had(std::getenv(n) != nullptr) {
    if (had) old = std::getenv(n);
    ::setenv(n, value, 1);
  }
  ~ScopedEnv() {
    if (had) {
      ::setenv(name.c_str(), old.c_str(), 1);
    } else {
      ::unsetenv(name.c_str());
    }
  }
};

}  // namespace

// A block table exactly as wide as the longest row's pages (no spare column), half caches, rows
// whose last key tile is partial: the decode kernel's look-ahead at the next key tile must not
// read a table entry past the row's pages (AddressSanitizer reads the table's heap buffer here).
TEST(PagedAttention, TableWithoutSpareColumnHalfDecode) {
  std::mt19937_64 rng(41);
  for (const PageLayout layout : kLayouts) {
    for (const int64_t page_size : {16, 5}) {
      SCOPED_TRACE(std::string(page_layout_name(layout)) + " page_size " +
                   std::to_string(page_size));
      const std::vector<int32_t> lens = {20, 7, 150};
      Filled<bf16> f{
          empty_cache<bf16>(lens, 2, 32, page_size, layout, rng, /*spare_table=*/0), {}, {}};
      for (auto& x : f.cache.k) x = cast<bf16>(0.25f);
      for (auto& x : f.cache.v) x = cast<bf16>(1.0f);
      // The table on the heap at its exact size, so an entry past it is outside the buffer.
      const auto table = std::make_unique<int32_t[]>(f.cache.table.size());
      std::copy(f.cache.table.begin(), f.cache.table.end(), table.get());
      const auto tv = View<const int32_t, 2>::contiguous(
          table.get(), {static_cast<int64_t>(lens.size()), f.cache.max_pages});
      const std::array<int64_t, 4> qs{3, 1, 8, 32};
      const auto q = random_vec<bf16>(3 * 8 * 32, rng);
      std::vector<bf16> out(q.size());
      attention_paged(View<const bf16, 4>::contiguous(q.data(), qs), f.cache.kview(),
                      f.cache.vview(), layout, tv, f.cache.lview(), NoPositions{}, {.causal = true},
                      View<bf16, 4>::contiguous(out.data(), qs));
      // Every value is 1: so is every output.
      for (const bf16 x : out) EXPECT_EQ(to_float(x), 1.0f);
    }
  }
}

// k_pages and v_pages laid out differently (v a slice of a wider pool, k contiguous, and the
// reverse): each pool is read through its own strides, equal to contiguous copies bit for bit.
TEST(PagedAttention, KeyAndValuePoolsWithTheirOwnStrides) {
  std::mt19937_64 rng(43);
  const std::vector<int32_t> lens = {20, 7};
  const int64_t heads_kv = 2, dim = 32, page_size = 16;
  for (const PageLayout layout : kLayouts) {
    SCOPED_TRACE(page_layout_name(layout));
    auto f = random_cache<float>(lens, heads_kv, dim, page_size, layout, rng);
    // The same pools inside ones twice as wide in head_dim.
    const auto shape = f.cache.pool_shape();
    std::vector<float> wide_k(f.cache.k.size() * 2, std::nanf("")),
        wide_v(f.cache.v.size() * 2, std::nanf(""));
    for (size_t i = 0; i < f.cache.k.size(); ++i) {
      wide_k[(i / dim) * 2 * dim + i % dim] = f.cache.k[i];
      wide_v[(i / dim) * 2 * dim + i % dim] = f.cache.v[i];
    }
    const std::array<int64_t, 4> wstride{shape[1] * shape[2] * 2 * dim, shape[2] * 2 * dim, 2 * dim,
                                         1};
    const View<const float, 4> wk{wide_k.data(), shape, wstride}, wv{wide_v.data(), shape, wstride};
    const std::array<int64_t, 4> qs{2, 1, 4, dim};
    const auto q = random_vec<float>(2 * 4 * dim, rng);
    const auto qv = View<const float, 4>::contiguous(q.data(), qs);
    std::vector<float> want(q.size()), got(q.size());
    attention_paged(qv, f.cache.kview(), f.cache.vview(), layout, f.cache.tview(), f.cache.lview(),
                    NoPositions{}, {.causal = true}, View<float, 4>::contiguous(want.data(), qs));
    for (int which = 0; which < 2; ++which) {
      attention_paged(qv, which == 0 ? f.cache.kview() : wk, which == 0 ? wv : f.cache.vview(),
                      layout, f.cache.tview(), f.cache.lview(), NoPositions{}, {.causal = true},
                      View<float, 4>::contiguous(got.data(), qs));
      EXPECT_TRUE(same_bits_vec(got, want)) << (which == 0 ? "strided v" : "strided k");
    }
  }
}

// An empty row under the default query positions: 0 where allowed (allow_fully_masked or sinks),
// an error naming the row otherwise; seq_lens far beyond what the pool holds is refused by size
// before anything is allocated.
TEST(PagedAttention, EmptyRowDefaultPositionsAndSizeLimit) {
  std::mt19937_64 rng(47);
  auto f = random_cache<float>({0, 5}, 2, 8, 4, PageLayout::kTokenMajor, rng);
  const std::array<int64_t, 4> qs{2, 1, 2, 8};
  const auto q = random_vec<float>(2 * 2 * 8, rng);
  const auto qv = View<const float, 4>::contiguous(q.data(), qs);
  std::vector<float> out(q.size(), 7.0f);
  const auto ov = View<float, 4>::contiguous(out.data(), qs);
  expect_error<ValueError>(
      [&] {
        attention_paged(qv, f.cache.kview(), f.cache.vview(), PageLayout::kTokenMajor,
                        f.cache.tview(), f.cache.lview(), NoPositions{}, {}, ov);
      },
      {"batch 0", "sees no key"});
  attention_paged(qv, f.cache.kview(), f.cache.vview(), PageLayout::kTokenMajor, f.cache.tview(),
                  f.cache.lview(), NoPositions{}, {.allow_fully_masked = true}, ov);
  for (int64_t x = 0; x < 16; ++x) EXPECT_EQ(out[x], 0.0f);
  for (int64_t x = 16; x < 32; ++x) EXPECT_TRUE(std::isfinite(out[x]) && out[x] != 7.0f);

  // One page listed 2^26 times: seq_lens 2^28 keys of a pool of 5 pages of 4 keys.
  const int64_t max_pages = int64_t{1} << 26;
  std::vector<int32_t> table(static_cast<size_t>(max_pages), 0);
  std::vector<int32_t> lens = {1 << 28};
  const std::array<int64_t, 4> q1{1, 1, 2, 8};
  std::vector<float> o1(16);
  ScopedEnv limit("POSENC_MAX_BYTES", "64M");
  expect_error<SizeError>(
      [&] {
        attention_paged(View<const float, 4>::contiguous(q.data(), q1), f.cache.kview(),
                        f.cache.vview(), PageLayout::kTokenMajor,
                        View<const int32_t, 2>::contiguous(table.data(), {1, max_pages}),
                        View<const int32_t, 1>::contiguous(lens.data(), {1}), NoPositions{}, {},
                        View<float, 4>::contiguous(o1.data(), q1));
      },
      {"max(seq_lens)", "268435456", "POSENC_MAX_BYTES"});
}

// A soft-cap that rounds to 0 (or to a subnormal) in float32 still caps: equal to the float64
// reference within float32's tolerance, forward and through the backward.
TEST(PagedAttention, SoftcapBelowFloat32Range) {
  std::mt19937_64 rng(53);
  const std::array<int64_t, 4> s{1, 6, 2, 8};
  const auto q = random_vec<float>(96, rng), k = random_vec<float>(96, rng),
             v = random_vec<float>(96, rng);
  std::vector<double> qd(q.begin(), q.end()), kd(k.begin(), k.end()), vd(v.begin(), v.end());
  for (const double cap : {1e-300, 1e-50, 1e-40, 1e-30, 1e300}) {
    SCOPED_TRACE(cap);
    const AttentionOptions opt{.causal = true, .softcap = cap};
    std::vector<float> out(96);
    std::vector<double> want(96);
    attention(View<const float, 4>::contiguous(q.data(), s),
              View<const float, 4>::contiguous(k.data(), s),
              View<const float, 4>::contiguous(v.data(), s), NoPositions{}, opt,
              View<float, 4>::contiguous(out.data(), s));
    ref::attention(View<const double, 4>::contiguous(qd.data(), s),
                   View<const double, 4>::contiguous(kd.data(), s),
                   View<const double, 4>::contiguous(vd.data(), s), NoPositions{}, opt,
                   View<double, 4>::contiguous(want.data(), s));
    EXPECT_LE(max_abs_diff(out, want), 1e-6);
  }
}
