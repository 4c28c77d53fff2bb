// tests/test_tensor.cc - View (strides, element access) and Positions (the three forms, validation,
// max_position), docs/attention.md.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "posenc/error.h"
#include "posenc/tensor.h"
#include "test_util.h"

namespace {

using posenc::kMaxPosition;
using posenc::Positions;
using posenc::ShapeError;
using posenc::ValueError;
using posenc::View;
using posenc_test::Rng;

// Runs `f`, expects it to throw E, and returns the message (empty if it did not throw).
template <class E, class F>
std::string thrown_message(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw the wrong exception type: " << e.what();
    return {};
  }
  ADD_FAILURE() << "did not throw";
  return {};
}

// ----------------------------------------------------------------------------------------------
// View

TEST(View, ContiguousStridesAreRowMajor) {
  float buf[2 * 3 * 5] = {};
  const auto v = View<float, 3>::contiguous(buf, {2, 3, 5});
  EXPECT_EQ(v.data, buf);
  EXPECT_EQ(v.stride[0], 15);
  EXPECT_EQ(v.stride[1], 5);
  EXPECT_EQ(v.stride[2], 1);
  EXPECT_EQ(v.numel(), 30);
  // operator() addresses element (b, i, k) at b*15 + i*5 + k.
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t i = 0; i < 3; ++i) {
      for (int64_t k = 0; k < 5; ++k) EXPECT_EQ(&v(b, i, k), buf + (b * 15 + i * 5 + k));
    }
  }
  const auto v1 = View<float, 1>::contiguous(buf, {7});
  EXPECT_EQ(v1.stride[0], 1);
  const auto v4 = View<float, 4>::contiguous(buf, {1, 2, 1, 3});
  const std::array<int64_t, 4> want = {6, 3, 3, 1};
  EXPECT_EQ(v4.stride, want);
  EXPECT_EQ((View<float, 2>::contiguous(buf, {0, 4}).numel()), 0);
}

TEST(View, LastDimContiguous) {
  float buf[64] = {};
  EXPECT_TRUE((View<float, 2>::contiguous(buf, {4, 8}).last_dim_contiguous()));
  View<float, 2> strided{buf, {4, 8}, {16, 2}};
  EXPECT_FALSE(strided.last_dim_contiguous());
  // A transposed view: last dim has stride 4.
  View<float, 2> transposed{buf, {8, 4}, {1, 8}};
  EXPECT_FALSE(transposed.last_dim_contiguous());
  // A last dimension of size 1 (or 0) is contiguous whatever its stride.
  View<float, 2> column{buf, {8, 1}, {8, 5}};
  EXPECT_TRUE(column.last_dim_contiguous());
  // Padded rows (slice of a bigger buffer) keep the last dim contiguous.
  View<float, 2> padded{buf, {4, 5}, {8, 1}};
  EXPECT_TRUE(padded.last_dim_contiguous());
}

TEST(View, ConstConversionKeepsLayout) {
  float buf[24] = {};
  View<float, 3> v{buf + 1, {2, 3, 2}, {12, 4, 1}};
  View<const float, 3> c = v;
  EXPECT_EQ(c.data, v.data);
  EXPECT_EQ(c.shape, v.shape);
  EXPECT_EQ(c.stride, v.stride);
  v(1, 2, 1) = 5.0f;
  EXPECT_EQ(c(1, 2, 1), 5.0f);
}

TEST(View, ShapeStr) {
  EXPECT_EQ(posenc::shape_str(std::array<int64_t, 3>{2, 0, 17}), "[2, 0, 17]");
  EXPECT_EQ(posenc::shape_str(std::array<int64_t, 1>{5}), "[5]");
}

// The helper used by the other suites: a padded, permuted view sits inside its buffer and the
// sentinel check notices a stray write.
TEST(View, StridedHelperIsNonContiguous) {
  posenc_test::Strided<float, 3> t({2, 3, 4}, /*pad=*/2, {2, 0, 1}, /*inner_step=*/2);
  const auto v = t.view();
  EXPECT_FALSE(v.last_dim_contiguous());
  std::vector<float> vals(24);
  for (std::size_t i = 0; i < vals.size(); ++i) vals[i] = static_cast<float>(i);
  t.set(vals);
  EXPECT_EQ(t.values(), vals);
  EXPECT_EQ(v(1, 2, 3), 23.0f);
  EXPECT_TRUE(t.outside_untouched());
  v.data[-1] = 0.0f;  // just before the first element: outside the tensor
  EXPECT_FALSE(t.outside_untouched());
}

// ----------------------------------------------------------------------------------------------
// Positions

TEST(Positions, DefaultIsOffsetZero) {
  const Positions p;
  EXPECT_EQ(p.kind(), Positions::Kind::kOffset);
  for (int64_t b = 0; b < 3; ++b) {
    for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(p.at(b, i), i);
  }
}

TEST(Positions, OffsetAt) {
  for (int64_t start : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1} << 20, kMaxPosition - 9}) {
    SCOPED_TRACE("start " + std::to_string(start));
    const auto p = Positions::offset(start);
    EXPECT_EQ(p.kind(), Positions::Kind::kOffset);
    for (int64_t b = 0; b < 3; ++b) {
      for (int64_t i = 0; i < 10; ++i) EXPECT_EQ(p.at(b, i), start + i);
    }
    EXPECT_NO_THROW(p.validate(3, 10, "x"));
    EXPECT_EQ(p.max_position(3, 10), start + 9);
  }
}

TEST(Positions, SharedAt) {
  Rng rng(posenc_test::test_seed(), 1);
  SCOPED_TRACE(posenc_test::seed_trace());
  for (int64_t seq : {1, 2, 3, 7, 130}) {
    SCOPED_TRACE("seq " + std::to_string(seq));
    std::vector<int64_t> ids(static_cast<std::size_t>(seq));
    for (auto& id : ids) id = rng.integer(0, int64_t{1} << 40);
    const auto p = Positions::shared(ids);
    EXPECT_EQ(p.kind(), Positions::Kind::kShared);
    for (int64_t b = 0; b < 4; ++b) {
      for (int64_t i = 0; i < seq; ++i) EXPECT_EQ(p.at(b, i), ids[static_cast<std::size_t>(i)]);
    }
    EXPECT_NO_THROW(p.validate(4, seq, "x"));
    EXPECT_EQ(p.max_position(4, seq), *std::max_element(ids.begin(), ids.end()));
  }
}

TEST(Positions, PerRowAt) {
  Rng rng(posenc_test::test_seed(), 2);
  SCOPED_TRACE(posenc_test::seed_trace());
  const int64_t batch = 3, seq = 7;
  std::vector<int64_t> ids(static_cast<std::size_t>(batch * seq));
  for (auto& id : ids) id = rng.integer(0, 1000);
  const auto p = Positions::per_row(ids, batch, seq);
  EXPECT_EQ(p.kind(), Positions::Kind::kPerRow);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < seq; ++i) {
      EXPECT_EQ(p.at(b, i), ids[static_cast<std::size_t>(b * seq + i)]) << b << ", " << i;
    }
  }
  EXPECT_NO_THROW(p.validate(batch, seq, "x"));
  EXPECT_EQ(p.max_position(batch, seq), *std::max_element(ids.begin(), ids.end()));
}

TEST(Positions, LeftPaddedAndPackedIds) {
  // Left padding (row 0 starts late) and a packed row (two sequences restarting at 0).
  const auto p = Positions::per_row({0, 0, 0, 1, 2, /**/ 0, 1, 2, 0, 1}, 2, 5);
  EXPECT_NO_THROW(p.validate(2, 5, "q"));
  EXPECT_EQ(p.at(0, 4), 2);
  EXPECT_EQ(p.at(1, 3), 0);
  EXPECT_EQ(p.max_position(2, 5), 2);
}

TEST(Positions, OffsetOutOfRangeThrows) {
  EXPECT_THROW(Positions::offset(-1), ValueError);
  EXPECT_THROW(Positions::offset(kMaxPosition + 1), ValueError);
  EXPECT_NO_THROW(Positions::offset(kMaxPosition));
  // The last token may sit at exactly 2^48 but not beyond.
  EXPECT_NO_THROW(Positions::offset(kMaxPosition - 4).validate(1, 5, "x"));
  const std::string msg = thrown_message<ValueError>(
      [] { Positions::offset(kMaxPosition - 4).validate(1, 6, "my_arg"); });
  EXPECT_NE(msg.find("my_arg"), std::string::npos) << msg;
  // An empty sequence has no positions to check.
  EXPECT_NO_THROW(Positions::offset(kMaxPosition).validate(1, 0, "x"));
}

TEST(Positions, SharedWrongLengthIsShapeError) {
  const auto p = Positions::shared({0, 1, 2});
  EXPECT_THROW(p.validate(1, 4, "x"), ShapeError);
  EXPECT_THROW(p.validate(1, 2, "x"), ShapeError);
  // Shared ids are valid for any batch.
  EXPECT_NO_THROW(p.validate(9, 3, "x"));
  const std::string msg = thrown_message<ShapeError>([&] { p.validate(2, 4, "keys"); });
  EXPECT_NE(msg.find("keys"), std::string::npos) << msg;
  EXPECT_NE(msg.find('3'), std::string::npos) << msg;
  EXPECT_NE(msg.find('4'), std::string::npos) << msg;
}

TEST(Positions, PerRowWrongShapeIsShapeError) {
  EXPECT_THROW(Positions::per_row({0, 1, 2, 3, 4}, 2, 3), ShapeError);
  EXPECT_THROW(Positions::per_row({}, -1, 0), ShapeError);
  const auto p = Positions::per_row({0, 1, 2, 3, 4, 5}, 2, 3);
  EXPECT_THROW(p.validate(3, 2, "x"), ShapeError);  // same count, transposed
  EXPECT_THROW(p.validate(1, 3, "x"), ShapeError);  // wrong batch
  EXPECT_THROW(p.validate(2, 4, "x"), ShapeError);  // wrong seq
  EXPECT_NO_THROW(p.validate(2, 3, "x"));
}

TEST(Positions, IdsOutsideRangeAreValueErrors) {
  for (int64_t bad : {int64_t{-1}, int64_t{-5}, kMaxPosition + 1, int64_t{1} << 62}) {
    SCOPED_TRACE("id " + std::to_string(bad));
    const auto shared = Positions::shared({0, bad, 2});
    const std::string msg = thrown_message<ValueError>([&] { shared.validate(1, 3, "ids"); });
    EXPECT_NE(msg.find(std::to_string(bad)), std::string::npos) << msg;
    const auto per_row = Positions::per_row({0, 1, 2, 3, 4, bad}, 2, 3);
    EXPECT_THROW(per_row.validate(2, 3, "ids"), ValueError);
  }
  EXPECT_NO_THROW(Positions::shared({kMaxPosition, 0}).validate(1, 2, "ids"));
}

TEST(Positions, MaxPositionOfEmptyIsMinusOne) {
  EXPECT_EQ(Positions::offset(5).max_position(0, 3), -1);
  EXPECT_EQ(Positions::offset(5).max_position(2, 0), -1);
  EXPECT_EQ(Positions::shared({}).max_position(2, 0), -1);
  EXPECT_EQ(Positions::per_row({}, 0, 4).max_position(0, 4), -1);
}

TEST(Positions, CopiesTheIds) {
  std::vector<int64_t> ids = {4, 5, 6};
  const auto p = Positions::shared(ids);
  ids[1] = 100;
  EXPECT_EQ(p.at(0, 1), 5);
  const Positions copy = p;
  EXPECT_EQ(copy.at(3, 2), 6);
}

}  // namespace
