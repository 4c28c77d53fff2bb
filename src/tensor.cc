// src/tensor.cc - Positions.
#include "posenc/tensor.h"

#include <algorithm>

#include "common.h"

namespace posenc {

Positions Positions::offset(int64_t start) {
  if (start < 0 || start > kMaxPosition) {
    detail::fail("positions: offset must be in [0, 2^48] (got " + std::to_string(start) + ")");
  }
  Positions p;
  p.kind_ = Kind::kOffset;
  p.start_ = start;
  return p;
}

Positions Positions::shared(std::vector<int64_t> ids) {
  Positions p;
  p.kind_ = Kind::kShared;
  p.seq_ = static_cast<int64_t>(ids.size());
  p.ids_ = std::move(ids);
  return p;
}

Positions Positions::per_row(std::vector<int64_t> ids, int64_t batch, int64_t seq) {
  if (batch < 0 || seq < 0 || static_cast<int64_t>(ids.size()) != batch * seq) {
    detail::fail<ShapeError>("positions: " + std::to_string(ids.size()) +
                             " ids do not form [batch, seq] = [" + std::to_string(batch) + ", " +
                             std::to_string(seq) + "]");
  }
  Positions p;
  p.kind_ = Kind::kPerRow;
  p.batch_ = batch;
  p.seq_ = seq;
  p.ids_ = std::move(ids);
  return p;
}

void Positions::validate(int64_t batch, int64_t seq, const std::string& what) const {
  switch (kind_) {
    case Kind::kOffset:
      if (seq > 0 && start_ + seq - 1 > kMaxPosition) {
        detail::fail(what + ": positions up to " + std::to_string(start_ + seq - 1) +
                     " exceed the maximum 2^48");
      }
      return;
    case Kind::kShared:
      if (seq_ != seq) {
        detail::fail<ShapeError>(what + ": " + std::to_string(seq_) +
                                 " position ids given for a sequence of " + std::to_string(seq));
      }
      break;
    case Kind::kPerRow:
      if (seq_ != seq || batch_ != batch) {
        detail::fail<ShapeError>(what + ": position ids of shape [" + std::to_string(batch_) +
                                 ", " + std::to_string(seq_) + "] given for [batch, seq] = [" +
                                 std::to_string(batch) + ", " + std::to_string(seq) + "]");
      }
      break;
  }
  for (std::size_t i = 0; i < ids_.size(); ++i) {
    if (ids_[i] < 0 || ids_[i] > kMaxPosition) {
      detail::fail(what + ": position id " + std::to_string(ids_[i]) + " at index " +
                   std::to_string(i) + " is outside [0, 2^48]");
    }
  }
}

int64_t Positions::max_position(int64_t batch, int64_t seq) const {
  if (batch <= 0 || seq <= 0) return -1;
  if (kind_ == Kind::kOffset) return start_ + seq - 1;
  return ids_.empty() ? -1 : *std::max_element(ids_.begin(), ids_.end());
}

}  // namespace posenc
