// src/schemes/shaw.cc - the Shaw et al. scheme's builder (Shaw, Uszkoreit, Vaswani 2018,
// "Self-Attention with Relative Position Representations"; docs/shaw.md): its tables rel_k and
// rel_v, per head or shared by the heads.
#include <algorithm>
#include <string>
#include <vector>

#include "common.h"
#include "schemes/build.h"
#include "schemes/shaw_term.h"

namespace posenc::attn {

// The scheme from its settings and parameters (build_scheme).
template <class T>
void ShawTerm<T>::build(detail::SchemeBuild& b, const ModelLayer*) {
  const std::string layout = "[2K+1, head_dim] or [2K+1, heads, head_dim]";
  const ParamTensor* rk = b.get("rel_k", {2, 3}, layout, true);
  const ParamTensor* rv = b.get("rel_v", {2, 3}, layout, false);
  // [2K+1, D] is a table shared by the heads: [2K+1, 1, D] with a zero head stride.
  auto as3 = [&](const ParamTensor& t, auto tag) {
    using E = decltype(tag);
    if (t.shape.size() == 3) return b.view<E, 3>(t);
    const View<const E, 2> v2 = b.view<E, 2>(t);
    return View<const E, 3>{
        v2.data, {v2.shape[0], 1, v2.shape[1]}, {v2.stride[0], 0, v2.stride[1]}};
  };
  auto heads = [](const ParamTensor& t) { return t.shape.size() == 3 ? t.shape[1] : int64_t{1}; };
  // One shared table with one per-head table: the shared one is broadcast over the heads (the
  // library wants both with the same number of table heads).
  const bool mixed = rv && heads(*rk) != heads(*rv);
  const int64_t th = rv ? std::max(heads(*rk), heads(*rv)) : heads(*rk);
  auto grad_shape = [&](const ParamTensor& t) {
    return std::vector<int64_t>{t.shape[0], mixed ? th : heads(t), t.shape.back()};
  };
  auto broadcast = [&](auto v) {
    if (mixed && v.shape[1] == 1) {
      v.shape[1] = th;
      v.stride[1] = 0;
    }
    return v;
  };
  Shaw shaw;
  if (b.f64) {
    b.out.tables64.rel_k = broadcast(as3(*rk, double{}));
    if (rv) b.out.tables64.rel_v = broadcast(as3(*rv, double{}));
    shaw.rel_k = View<const float, 3>{nullptr, b.out.tables64.rel_k.shape, {}};
  } else {
    shaw.rel_k = broadcast(as3(*rk, float{}));
    if (rv) shaw.rel_v = broadcast(as3(*rv, float{}));
  }
  b.learned("rel_k", *rk, grad_shape(*rk), mixed && heads(*rk) == 1);
  if (rv) b.learned("rel_v", *rv, grad_shape(*rv), mixed && heads(*rv) == 1);
  b.out.scheme = shaw;
}
template void ShawTerm<float>::build(detail::SchemeBuild&, const ModelLayer*);

}  // namespace posenc::attn
