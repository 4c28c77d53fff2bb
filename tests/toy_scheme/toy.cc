// src/schemes/toy.cc - the toy scheme built from its setting.
#include "schemes/build.h"
#include "schemes/toy_term.h"

namespace posenc::attn {

template <class T>
void ToyTerm<T>::build(detail::SchemeBuild& b, const ModelLayer*) {
  if (b.model) detail::fail("toy: no model config uses the toy scheme");
  b.out.scheme = Toy{.slope = b.settings.toy_slope.value_or(0.5)};
}
template void ToyTerm<float>::build(detail::SchemeBuild&, const ModelLayer*);

}  // namespace posenc::attn
