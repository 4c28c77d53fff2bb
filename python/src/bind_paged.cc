// python/src/bind_paged.cc - paged KV caches (posenc/paged.h) for NumPy: _attention_paged and
// _rope_append (posenc/__init__.py wraps them as posenc.attention_paged / posenc.rope_append).
//
// Pages are float32 arrays, or 2-byte arrays of bf16 / f16 bits read as dtype= says (as
// posenc.attention_half takes them). A head-major pool [num_pages, heads_kv, page_size,
// head_dim] is passed to the library as the strided token-major view of the same memory (axes 1
// and 2 swapped, no copy), which the library reads exactly as the head-major pool. The scheme
// keywords are parsed by posenc.attention's parser (calls.h), so they mean the same here.
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "args.h"
#include "calls.h"
#include "posenc/paged.h"

namespace posenc::py {

namespace {

using pb::arg;

Inputs paged_inputs(const pb::object& dtype) {
  if (dtype.is_none()) return Inputs::kAuto;
  const std::string s = arg_str(dtype, "dtype");
  if (s == "bfloat16") return Inputs::kBf16;
  if (s == "float16") return Inputs::kF16;
  throw ValueError("dtype: '" + s + "' (None for float32 pages, 'bfloat16' or 'float16')");
}

// An int32 copy of an integer array (block_table, seq_lens) of `ndim` dimensions: integers only
// (TypeError for floats and booleans), each value inside int32 (ValueError naming it), so an
// invalid page index never wraps into a valid one.
pb::array_t<int32_t> int32_array(const pb::handle& obj, const char* what, int ndim) {
  if (obj.is_none()) {
    throw pb::type_error(std::string(what) + ": expected an integer array, got None");
  }
  const pb::array a = int_array<int32_t>(obj, what);
  if (a.ndim() != ndim) {
    throw ShapeError(std::string(what) + ": expected " + std::to_string(ndim) +
                     (ndim == 2 ? " dimensions [batch, max_pages]" : " dimension [batch]") +
                     ", got " + std::to_string(a.ndim()));
  }
  return pb::array_t<int32_t, pb::array::c_style | pb::array::forcecast>::ensure(a);
}

// A page pool as given (before the layout's view): an array of 4 dimensions whose dtype the call
// reads exactly: float32 for float32 pages, 2-byte elements (the bits) for half pages. Checked
// here, under the pool's own name and layout, before the attention parser sees it.
void check_pool(const pb::handle& obj, const char* what, PageLayout layout, Inputs inputs) {
  const char* want = layout == PageLayout::kTokenMajor
                         ? "[num_pages, page_size, heads_kv, head_dim] (layout='token_major')"
                         : "[num_pages, heads_kv, page_size, head_dim] (layout='head_major')";
  if (!pb::isinstance<pb::array>(obj)) {
    throw pb::type_error(std::string(what) + ": expected an array " + want + ", got " +
                         type_name(obj));
  }
  const pb::array a = pb::reinterpret_borrow<pb::array>(obj);
  if (a.ndim() != 4) {
    throw ShapeError(std::string(what) + ": expected 4 dimensions " + want + ", got " +
                     std::to_string(a.ndim()));
  }
  const pb::dtype dt = a.dtype();
  const std::string got = pb::str(dt).cast<std::string>();
  if (inputs == Inputs::kAuto && !dt.is(pb::dtype::of<float>())) {
    throw pb::type_error(std::string(what) + ": pages of dtype " + got +
                         "; float32 pages (dtype=None), or the bits of bf16 / f16 pages with "
                         "dtype='bfloat16' / 'float16'");
  }
  if (inputs != Inputs::kAuto) {
    const char kind = dt.kind();
    const bool bits = dt.itemsize() == 2 && (kind == 'u' || kind == 'i');
    const bool f16 = dt.itemsize() == 2 && kind == 'f' && inputs == Inputs::kF16;
    if (!bits && !f16) {
      throw pb::type_error(std::string(what) + ": dtype='" +
                           (inputs == Inputs::kBf16 ? "bfloat16" : "float16") +
                           "' pages must hold the half bits (uint16 / int16" +
                           (inputs == Inputs::kF16 ? ", or float16" : "") + "), got dtype " + got);
    }
  }
}

// q of a paged call: float32, or the pages' half type (2-byte bits) with half pages. A float64
// q is refused: the pages are float32 or half, and narrowing q would change the result.
void check_paged_q(const pb::handle& obj, Inputs inputs) {
  if (!pb::isinstance<pb::array>(obj)) return;  // sequences: converted to float32 by the parser
  const pb::dtype dt = pb::reinterpret_borrow<pb::array>(obj).dtype();
  const char kind = dt.kind();
  if (dt.is(pb::dtype::of<float>())) return;
  if (inputs != Inputs::kAuto && dt.itemsize() == 2 &&
      (kind == 'u' || kind == 'i' || (kind == 'f' && inputs == Inputs::kF16))) {
    return;
  }
  throw pb::type_error("q: expected float32" +
                       std::string(inputs == Inputs::kAuto ? "" : " or the pages' half bits") +
                       " (attention_paged computes in float32 from float32 or half pages), got "
                       "dtype " +
                       pb::str(dt).cast<std::string>());
}

// The pool as a [num_pages, page_size, heads_kv, head_dim] array: itself, or the head-major pool
// with axes 1 and 2 swapped (a view).
pb::object token_major(const pb::object& pool, PageLayout layout, const char* what) {
  if (layout == PageLayout::kTokenMajor) return pool;
  static const pb::object& asarray = py_attr("numpy", "asarray");
  pb::array a = asarray(pool);
  if (a.ndim() != 4) {
    throw ShapeError(std::string(what) +
                     ": expected 4 dimensions [num_pages, heads_kv, page_size, head_dim], got " +
                     std::to_string(a.ndim()));
  }
  return a.attr("swapaxes")(1, 2);
}

template <class Q, class KV, class O>
pb::object run_paged(Call& c, const pb::array_t<int32_t>& table, const pb::array_t<int32_t>& lens) {
  std::vector<pb::ssize_t> shape(c.qshape.begin(), c.qshape.end());
  pb::object out;
  View<O, 4> ov;
  if constexpr (std::is_same_v<O, float>) {
    pb::array_t<float> o = new_array<float, 4>(c.qshape);
    ov = mutable_view<float, 4>(o);
    out = std::move(o);
  } else {
    pb::array_t<uint16_t> o = checked_array<uint16_t>(shape, "the result");
    ov = view_of<O, 4>(o, "out", "");
    out = std::move(o);
  }
  const auto qv = view4<Q>(c.q, "q", "[batch, seq_q, heads_q, head_dim]");
  const auto kv = view4<KV>(c.k, "k_pages", ""), vv = view4<KV>(c.v, "v_pages", "");
  const auto tv = view_of<const int32_t, 2>(table, "block_table", "[batch, max_pages]");
  const auto lv = view_of<const int32_t, 1>(lens, "seq_lens", "[batch]");
  pb::gil_scoped_release release;
  attention_paged(qv, kv, vv, PageLayout::kTokenMajor, tv, lv, c.built.scheme, c.opt, ov, c.pq());
  return out;
}

// A pool rope_append writes: the caller's writable array itself (no copy), of 2-byte elements
// for half pages or float32.
pb::array writable_pool(const pb::object& obj, const char* what, bool half) {
  bool ok = pb::isinstance<pb::array>(obj);
  pb::array a;
  if (ok) {
    a = pb::reinterpret_borrow<pb::array>(obj);
    const char kind = a.dtype().kind();
    ok = a.writeable() &&
         (half ? a.dtype().itemsize() == 2 && (kind == 'f' || kind == 'u' || kind == 'i')
               : a.dtype().is(pb::dtype::of<float>()));
    ok = ok && reinterpret_cast<std::uintptr_t>(a.data()) % (half ? 2 : 4) == 0;
    for (pb::ssize_t d = 0; ok && d < a.ndim(); ++d) {
      ok = a.strides(d) >= 0 && a.strides(d) % (half ? 2 : 4) == 0;
    }
  }
  if (!ok) {
    throw pb::type_error(std::string(what) + ": rope_append writes the pages in place: a " +
                         "writable, aligned NumPy array of " +
                         (half ? "2-byte elements (the half bits)" : "float32"));
  }
  return a;
}

template <class KN, class KP>
void run_append(const pb::array& k_new, const pb::object& v_new, const Rope& rope,
                const pb::array& k_pages, const pb::object& v_pages,
                const pb::array_t<int32_t>& table, const pb::array_t<int32_t>& lens,
                const Positions* pos, int num_threads) {
  const auto kn = view_of<const KN, 4>(k_new, "k_new", "[batch, n_new, heads_kv, head_dim]");
  View<const KN, 4> vn{};
  if (!v_new.is_none()) {
    vn = view_of<const KN, 4>(pb::reinterpret_borrow<pb::array>(v_new), "v_new",
                              "[batch, n_new, heads_kv, head_dim]");
  }
  const auto kp = view_of<KP, 4>(k_pages, "k_pages", "[num_pages, page_size, heads_kv, head_dim]");
  View<KP, 4> vp{};
  if (!v_pages.is_none()) {
    vp = view_of<KP, 4>(pb::reinterpret_borrow<pb::array>(v_pages), "v_pages",
                        "[num_pages, page_size, heads_kv, head_dim]");
  }
  const auto tv = view_of<const int32_t, 2>(table, "block_table", "[batch, max_pages]");
  const auto lv = view_of<const int32_t, 1>(lens, "seq_lens", "[batch]");
  pb::gil_scoped_release release;
  rope_append(kn, vn, rope, kp, vp, PageLayout::kTokenMajor, tv, lv, pos, num_threads);
}

const char* kAttentionPagedDoc =
    R"doc(_attention_paged(q, k_pages, v_pages, block_table, seq_lens, scheme=None, *, layout,
dtype=None, **keywords of attention) -> out (posenc.attention_paged is the NumPy API over it).)doc";

const char* kRopeAppendDoc =
    R"doc(_rope_append(k_new, k_pages, block_table, seq_lens, *, v_new, v_pages, layout, dtype,
positions, freqs, style, rotary_dim, base, scaling, seq_len, angles, config, offset, num_threads)
(posenc.rope_append is the NumPy API over it).)doc";

}  // namespace

void bind_paged(pb::module_& m) {
  m.def(
      "_attention_paged",
      [](const pb::object& q, const pb::object& k_pages, const pb::object& v_pages,
         const pb::object& block_table, const pb::object& seq_lens, const pb::object& scheme,
         const pb::object& layout, const pb::object& dtype, const pb::kwargs& kw) {
        const Inputs inputs = paged_inputs(dtype);
        const PageLayout lay = parse_page_layout(arg_str(layout, "layout"));
        for (const char* no : {"key_positions", "out", "lse", "return_lse"}) {
          if (kw.contains(no)) {
            throw pb::type_error(std::string("attention_paged(): '") + no +
                                 "' is not available (keys sit at 0 .. seq_lens - 1; the result "
                                 "is a new array)");
          }
        }
        check_paged_q(q, inputs);
        check_pool(k_pages, "k_pages", lay, inputs);
        check_pool(v_pages, "v_pages", lay, inputs);
        const auto table = int32_array(block_table, "block_table", 2);
        const auto lens = int32_array(seq_lens, "seq_lens", 1);
        // Default query positions: the last seq_q cached tokens of each row (0 .. seq_q - 1 in an
        // empty row), as the library sets them.
        pb::dict args;
        for (auto [key, value] : kw) args[key] = value;
        static const pb::object& asarray = py_attr("numpy", "asarray");
        const pb::array qa = asarray(q);
        if ((!kw.contains("query_positions") || kw["query_positions"].is_none()) &&
            qa.ndim() == 4 && qa.shape(0) == lens.size()) {
          const int64_t batch = qa.shape(0), seq_q = qa.shape(1);
          pb::array_t<int64_t> ids(std::vector<pb::ssize_t>{batch, seq_q});
          bool ok = true;
          for (int64_t b = 0; b < batch; ++b)
            for (int64_t i = 0; i < seq_q; ++i) {
              const int64_t len = lens.at(b);
              ids.mutable_at(b, i) = len == 0 ? i : len - seq_q + i;
              ok = ok && (len == 0 || len >= seq_q);
            }
          if (ok) args["query_positions"] = ids;
        }
        Call c = parse("attention_paged", q, token_major(k_pages, lay, "k_pages"),
                       token_major(v_pages, lay, "v_pages"), scheme,
                       pb::reinterpret_borrow<pb::kwargs>(args), inputs, {},
                       {"q", "k_pages", "v_pages"});
        if (inputs == Inputs::kAuto) {
          return run_paged<float, float, float>(c, table, lens);
        }
        if (inputs == Inputs::kBf16) {
          return c.q_half ? run_paged<bf16, bf16, bf16>(c, table, lens)
                          : run_paged<float, bf16, float>(c, table, lens);
        }
        return c.q_half ? run_paged<f16, f16, f16>(c, table, lens)
                        : run_paged<float, f16, float>(c, table, lens);
      },
      arg("q"), arg("k_pages"), arg("v_pages"), arg("block_table"), arg("seq_lens"),
      arg("scheme") = pb::none(), pb::kw_only(), arg("layout") = "token_major",
      arg("dtype") = pb::none(), kAttentionPagedDoc);
  m.def(
      "_rope_append",
      [](const pb::object& k_new, const pb::object& k_pages, const pb::object& block_table,
         const pb::object& seq_lens, const pb::object& v_new, const pb::object& v_pages,
         const pb::object& layout_arg, const pb::object& dtype, const pb::object& positions,
         const pb::object& freqs, const pb::object& style, const pb::object& rotary_dim_arg,
         const pb::object& base_arg, const pb::object& scaling, const pb::object& seq_len_arg,
         const pb::object& angles_arg, const pb::object& config, const pb::object& offset_arg,
         const pb::object& num_threads_arg) {
        // Every scalar keyword through args.h, before any page is touched.
        const Inputs inputs = paged_inputs(dtype);
        const bool half = inputs != Inputs::kAuto;
        const PageLayout lay = parse_page_layout(arg_str(layout_arg, "layout"));
        const int64_t rotary_dim = arg_int(rotary_dim_arg, "rotary_dim", 0, int64_t{1} << 32);
        const double base = arg_float(base_arg, "base", /*finite=*/true, /*positive=*/true);
        std::optional<int64_t> seq_len;
        if (!seq_len_arg.is_none()) seq_len = arg_int(seq_len_arg, "seq_len", 0, kMaxPositionArg);
        const std::string angles = arg_str(angles_arg, "angles");
        const int64_t offset = arg_int(offset_arg, "offset", 0, int64_t{1} << 32);
        const int num_threads =
            static_cast<int>(arg_int(num_threads_arg, "num_threads", 0, kMaxThreads));
        if (v_new.is_none() != v_pages.is_none()) {
          throw pb::type_error("rope_append(): give both v_new and v_pages, or neither");
        }
        check_pool(k_pages, "k_pages", lay, inputs);
        if (!v_pages.is_none()) check_pool(v_pages, "v_pages", lay, inputs);
        const pb::array kp = writable_pool(token_major(k_pages, lay, "k_pages"), "k_pages", half);
        pb::object vp = pb::none();
        if (!v_pages.is_none()) {
          vp = writable_pool(token_major(v_pages, lay, "v_pages"), "v_pages", half);
        }
        const auto table = int32_array(block_table, "block_table", 2);
        const auto lens = int32_array(seq_lens, "seq_lens", 1);
        // New keys: float32, or half bits (2-byte arrays) of the pages' type.
        static const pb::object& asarray = py_attr("numpy", "asarray");
        const pb::array kn0 = asarray(k_new);
        const bool kn_half = half && kn0.dtype().itemsize() == 2;
        const auto new_array_of = [&](const pb::object& x, const char* what) -> pb::array {
          if (!kn_half) {
            // float32 (a float64 array would be rounded before its rotation: a second rounding).
            if (pb::isinstance<pb::array>(x) &&
                pb::reinterpret_borrow<pb::array>(x).dtype().is(pb::dtype::of<double>())) {
              throw pb::type_error(std::string(what) +
                                   ": float64; rope_append takes float32 new keys and values (or "
                                   "the pages' half bits), rotated once and rounded once");
            }
            return as_array<float>(x, what);
          }
          const pb::array a = asarray(x);
          if (a.dtype().itemsize() != 2) {
            throw pb::type_error(std::string(what) +
                                 ": k_new and v_new both float32 or both 2-byte (half bits)");
          }
          static const pb::object& ascontig = py_attr("numpy", "ascontiguousarray");
          return ascontig(a);
        };
        const pb::array kn = new_array_of(k_new, "k_new");
        pb::object vn = v_new.is_none() ? pb::none() : pb::object(new_array_of(v_new, "v_new"));
        if (kn.ndim() != 4) {
          throw ShapeError("k_new: expected 4 dimensions [batch, n_new, heads_kv, head_dim], got " +
                           std::to_string(kn.ndim()));
        }
        // RoPE's settings as apply_rope reads them; a length-dependent scaling at the longest
        // row unless seq_len says otherwise.
        int64_t longest = 0;
        for (pb::ssize_t b = 0; b < lens.size(); ++b) {
          longest = std::max<int64_t>(longest, lens.at(b));
        }
        const pb::array rope_x = kn_half ? as_array<float>(kn, "k_new") : kn;
        const RopeSetup r =
            rope_setup(rope_x, freqs, style, positions, false, rotary_dim, base, scaling,
                       seq_len.value_or(std::max<int64_t>(longest, 1)), angles, config);
        const Rope rope{r.freqs, r.style, offset};
        if (!half) {
          run_append<float, float>(kn, vn, rope, kp, vp, table, lens, r.pos(), num_threads);
        } else if (inputs == Inputs::kBf16) {
          if (kn_half) {
            run_append<bf16, bf16>(kn, vn, rope, kp, vp, table, lens, r.pos(), num_threads);
          } else {
            run_append<float, bf16>(kn, vn, rope, kp, vp, table, lens, r.pos(), num_threads);
          }
        } else if (kn_half) {
          run_append<f16, f16>(kn, vn, rope, kp, vp, table, lens, r.pos(), num_threads);
        } else {
          run_append<float, f16>(kn, vn, rope, kp, vp, table, lens, r.pos(), num_threads);
        }
      },
      arg("k_new"), arg("k_pages"), arg("block_table"), arg("seq_lens"), pb::kw_only(),
      arg("v_new") = pb::none(), arg("v_pages") = pb::none(), arg("layout") = "token_major",
      arg("dtype") = pb::none(), arg("positions") = pb::none(), arg("freqs") = pb::none(),
      arg("style") = pb::none(), arg("rotary_dim") = 0, arg("base") = 1e4,
      arg("scaling") = pb::none(), arg("seq_len") = pb::none(), arg("angles") = "accurate",
      arg("config") = pb::none(), arg("offset") = 0, arg("num_threads") = 0, kRopeAppendDoc);
}

}  // namespace posenc::py
