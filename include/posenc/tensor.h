// posenc/tensor.h - non-owning strided views and token positions.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "posenc/error.h"

namespace posenc {

// Non-owning strided view of a rank-R tensor. Strides are in elements (not bytes) and may be
// zero (broadcast) for read-only inputs. Layouts are named where a view is taken, e.g.
// q [batch, seq_q, heads_q, head_dim].
template <class T, std::size_t R>
struct View {
  T* data = nullptr;
  std::array<int64_t, R> shape{};
  std::array<int64_t, R> stride{};

  // A row-major (C order) view of `data` with the given shape.
  static View contiguous(T* data, const std::array<int64_t, R>& shape) {
    View v;
    v.data = data;
    v.shape = shape;
    int64_t s = 1;
    for (std::size_t d = R; d-- > 0;) {
      v.stride[d] = s;
      s *= shape[d];
    }
    return v;
  }

  int64_t numel() const {
    int64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }

  // Element access by full index.
  template <class... I>
  T& operator()(I... idx) const {
    static_assert(sizeof...(I) == R, "View: wrong number of indices");
    const int64_t ids[] = {static_cast<int64_t>(idx)...};
    int64_t off = 0;
    for (std::size_t d = 0; d < R; ++d) off += ids[d] * stride[d];
    return data[off];
  }

  // True when the last dimension is unit-stride (what optimized kernels need).
  bool last_dim_contiguous() const { return R == 0 || shape[R - 1] <= 1 || stride[R - 1] == 1; }

  // Implicit conversion to a read-only view.
  operator View<const T, R>() const requires(!std::is_const_v<T>) {
    return View<const T, R>{data, shape, stride};
  }
};

// Returns "[a, b, c]" for messages.
template <std::size_t R>
std::string shape_str(const std::array<int64_t, R>& shape) {
  std::string s = "[";
  for (std::size_t d = 0; d < R; ++d) {
    if (d) s += ", ";
    s += std::to_string(shape[d]);
  }
  return s + "]";
}

// Largest accepted position. Angles p*w are formed in double precision, whose relative error
// 2^-53 is about p * 1e-16 rad: 1e-8 rad at 2^28, 1e-4 at 2^40, 1e-2 at 2^48, beyond which the
// encodings carry no usable information.
inline constexpr int64_t kMaxPosition = int64_t{1} << 48;

// Where each token sits. Three forms:
//   Positions::offset(k)            token i at position k + i (default; KV-cache offsets),
//   Positions::shared(ids)          ids [seq], the same for every batch row,
//   Positions::per_row(ids, b, l)   ids [batch, seq] row-major.
// Ids may be non-contiguous (left padding, packed sequences) and must lie in
// [0, kMaxPosition]. Copies the ids; cheap to pass by const reference; thread-safe to read.
class Positions {
 public:
  enum class Kind { kOffset, kShared, kPerRow };

  Positions() = default;
  static Positions offset(int64_t start);
  static Positions shared(std::vector<int64_t> ids);
  static Positions per_row(std::vector<int64_t> ids, int64_t batch, int64_t seq);

  Kind kind() const { return kind_; }
  // Position of token `i` in batch row `b` (no bounds check; call validate first).
  int64_t at(int64_t b, int64_t i) const {
    switch (kind_) {
      case Kind::kOffset:
        return start_ + i;
      case Kind::kShared:
        return ids_[static_cast<std::size_t>(i)];
      default:
        return ids_[static_cast<std::size_t>(b * seq_ + i)];
    }
  }
  // Throws ShapeError/ValueError unless these positions cover `batch` rows of `seq` tokens with
  // every position in [0, kMaxPosition]. `what` names the argument in messages.
  void validate(int64_t batch, int64_t seq, const std::string& what) const;
  // Largest position over `batch` x `seq` tokens (-1 when empty).
  int64_t max_position(int64_t batch, int64_t seq) const;

 private:
  Kind kind_ = Kind::kOffset;
  int64_t start_ = 0;
  int64_t batch_ = 0;
  int64_t seq_ = 0;
  std::vector<int64_t> ids_;
};

}  // namespace posenc
