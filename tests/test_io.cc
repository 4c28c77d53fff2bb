// Tests for posenc/io.h: .npy and .safetensors readers/writers, f16/bf16 widening, whole-file
// helpers and the atomic writer.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "posenc/error.h"
#include "posenc/io.h"
#include "posenc/size.h"

namespace posenc {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<unsigned char>;

static_assert(std::endian::native == std::endian::little, "these tests build raw LE bytes");

// ---------------------------------------------------------------------------------------------
// Helpers.

// Runs `f` and returns the IoError message, or a marker when it threw something else or nothing.
std::string io_error_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const IoError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<not an IoError: ") + e.what() + ">";
  }
  return "<no exception>";
}

// Expects `stmt` to throw IoError whose one-line message contains `part`.
#define EXPECT_IO_ERROR(stmt, part)                                          \
  do {                                                                       \
    const std::string msg_ = io_error_message([&] { stmt; });                \
    EXPECT_NE(msg_.find(part), std::string::npos) << "message: " << msg_;    \
    EXPECT_EQ(msg_.find('\n'), std::string::npos) << "multi-line: " << msg_; \
    EXPECT_NE(msg_.rfind("<", 0), 0u) << "expected IoError, got " << msg_;   \
  } while (0)

template <class T>
Bytes bytes_of(const std::vector<T>& v) {
  Bytes b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

Bytes concat(Bytes a, const Bytes& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

Bytes str_bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }

// A deterministic byte pattern (bit patterns, not necessarily meaningful values).
Bytes pattern(std::size_t n, unsigned seed) {
  Bytes b(n);
  uint32_t x = 2463534242u ^ seed;
  for (auto& c : b) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    c = static_cast<unsigned char>(x);
  }
  return b;
}

Tensor make_tensor(DType dtype, std::vector<int64_t> shape, unsigned seed = 1) {
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.bytes = pattern(static_cast<std::size_t>(t.numel() * dtype_size(dtype)), seed);
  return t;
}

void expect_same(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.shape, b.shape);
  EXPECT_EQ(a.bytes, b.bytes);
}

// A .npy file with the given raw header text (no padding added) and data.
Bytes make_npy(const std::string& header, const Bytes& data, int major = 1, int minor = 0) {
  Bytes b = {0x93,
             'N',
             'U',
             'M',
             'P',
             'Y',
             static_cast<unsigned char>(major),
             static_cast<unsigned char>(minor)};
  const std::size_t len_bytes = major == 1 ? 2 : 4;
  for (std::size_t i = 0; i < len_bytes; ++i) {
    b.push_back(static_cast<unsigned char>(header.size() >> (8 * i)));
  }
  return concat(concat(b, str_bytes(header)), data);
}

// A .safetensors file with the given JSON header text and data section.
Bytes make_st(const std::string& header, const Bytes& data) {
  Bytes b;
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) b.push_back(static_cast<unsigned char>(n >> (8 * i)));
  return concat(concat(b, str_bytes(header)), data);
}

Tensor parse_npy_bytes(const Bytes& b, const std::string& what = "x.npy") {
  return parse_npy(b.data(), b.size(), what);
}

SafetensorsFile parse_st_bytes(const Bytes& b, const std::string& what = "p.safetensors") {
  return parse_safetensors(b.data(), b.size(), what);
}

// A fresh directory under $POSENC_TEST_TMP (or the system temp dir), removed afterwards.
class TempDir {
 public:
  TempDir() {
    const char* env = std::getenv("POSENC_TEST_TMP");
    const fs::path base = env && *env ? fs::path(env) : fs::temp_directory_path();
    fs::create_directories(base);
    std::string tmpl = (base / "posenc_io_XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed in " + base.string());
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const fs::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  // Names of everything in the directory, sorted.
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(path_)) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  fs::path path_;
};

Bytes slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

const std::vector<DType> kAllDTypes = {DType::kF16, DType::kBF16, DType::kF32,
                                       DType::kF64, DType::kI32,  DType::kI64};
const std::vector<DType> kNpyDTypes = {DType::kF16, DType::kF32, DType::kF64, DType::kI32,
                                       DType::kI64};
const std::vector<std::vector<int64_t>> kShapes = {{}, {1}, {5}, {2, 3, 4}, {0}, {3, 0, 2}, {7, 1}};

// ---------------------------------------------------------------------------------------------
// DType and Tensor.

TEST(DTypeTest, NamesAndSizes) {
  EXPECT_STREQ(dtype_name(DType::kF16), "float16");
  EXPECT_STREQ(dtype_name(DType::kBF16), "bfloat16");
  EXPECT_STREQ(dtype_name(DType::kF32), "float32");
  EXPECT_STREQ(dtype_name(DType::kF64), "float64");
  EXPECT_STREQ(dtype_name(DType::kI32), "int32");
  EXPECT_STREQ(dtype_name(DType::kI64), "int64");
  EXPECT_EQ(dtype_size(DType::kF16), 2);
  EXPECT_EQ(dtype_size(DType::kBF16), 2);
  EXPECT_EQ(dtype_size(DType::kF32), 4);
  EXPECT_EQ(dtype_size(DType::kF64), 8);
  EXPECT_EQ(dtype_size(DType::kI32), 4);
  EXPECT_EQ(dtype_size(DType::kI64), 8);
}

TEST(TensorTest, NumelAndShapeStr) {
  Tensor t;
  EXPECT_EQ(t.numel(), 1);  // scalar
  EXPECT_EQ(t.shape_str(), "[]");
  t.shape = {2, 3, 4};
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.shape_str(), "[2, 3, 4]");
  t.shape = {int64_t{1} << 40, 0, int64_t{1} << 20};
  EXPECT_EQ(t.numel(), 0);
  // Like NumPy, the nonzero dimensions of an empty shape must not overflow either.
  t.shape = {int64_t{1} << 62, 0, int64_t{1} << 40};
  EXPECT_THROW(t.numel(), Error);
  t.shape = {-1, 3};
  EXPECT_THROW(t.numel(), Error);
  t.shape = {int64_t{1} << 62, int64_t{1} << 62};
  EXPECT_THROW(t.numel(), Error);
}

TEST(TensorTest, FromAndToValues) {
  const std::vector<float> f = {1.5f, -2.0f, 0.0f, 3.25f, -0.0f, 1e30f};
  const Tensor tf = Tensor::from_f32({2, 3}, f);
  EXPECT_EQ(tf.dtype, DType::kF32);
  EXPECT_EQ(tf.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(tf.bytes, bytes_of(f));
  EXPECT_EQ(tf.to_f32(), f);
  const std::vector<double> fd = tf.to_f64();
  for (std::size_t i = 0; i < f.size(); ++i) EXPECT_EQ(fd[i], static_cast<double>(f[i]));

  const std::vector<double> d = {0.1, -1e300, 2.5};
  const Tensor td = Tensor::from_f64({3}, d);
  EXPECT_EQ(td.dtype, DType::kF64);
  EXPECT_EQ(td.to_f64(), d);
  const std::vector<float> df = td.to_f32();
  EXPECT_EQ(df[0], 0.1f);
  EXPECT_TRUE(std::isinf(df[1]) && df[1] < 0);

  const std::vector<int64_t> i = {0, -1, std::numeric_limits<int64_t>::max(),
                                  std::numeric_limits<int64_t>::min()};
  const Tensor ti = Tensor::from_i64({4}, i);
  EXPECT_EQ(ti.dtype, DType::kI64);
  EXPECT_EQ(ti.to_i64(), i);

  Tensor t32;
  t32.dtype = DType::kI32;
  t32.shape = {3};
  t32.bytes = bytes_of(std::vector<int32_t>{-7, 2147483647, -2147483647 - 1});
  EXPECT_EQ(t32.to_i64(), (std::vector<int64_t>{-7, 2147483647, -2147483648LL}));

  // Scalars and empty tensors.
  EXPECT_EQ(Tensor::from_f32({}, {4.0f}).to_f32(), std::vector<float>{4.0f});
  EXPECT_TRUE(Tensor::from_f32({0, 3}, {}).to_f32().empty());

  // Wrong value count.
  EXPECT_THROW(Tensor::from_f32({2, 3}, {1.0f}), Error);
  EXPECT_THROW(Tensor::from_i64({-1}, {}), Error);

  // Wrong dtype or inconsistent bytes: IoError naming `what`.
  EXPECT_IO_ERROR(ti.to_f32("ids"), "ids: expected a floating-point tensor, got int64");
  EXPECT_IO_ERROR(tf.to_i64("positions"), "positions: expected an integer tensor");
  Tensor bad = tf;
  bad.bytes.pop_back();
  EXPECT_IO_ERROR(bad.to_f32("w"), "w: 23 bytes do not match float32 x shape [2, 3] (24 bytes)");
}

// Independent oracle: the IEEE formula evaluated in double.
double half_formula(uint16_t h) {
  const int sign = h >> 15;
  const int exp = (h >> 10) & 31;
  const int mant = h & 1023;
  double mag;
  if (exp == 0) {
    mag = std::ldexp(static_cast<double>(mant), -24);
  } else if (exp == 31) {
    mag = mant ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else {
    mag = std::ldexp(1.0 + mant / 1024.0, exp - 15);
  }
  return sign ? -mag : mag;
}

double bf16_formula(uint16_t h) {
  const int sign = h >> 15;
  const int exp = (h >> 7) & 255;
  const int mant = h & 127;
  double mag;
  if (exp == 0) {
    mag = std::ldexp(static_cast<double>(mant), -133);
  } else if (exp == 255) {
    mag = mant ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else {
    mag = std::ldexp(1.0 + mant / 128.0, exp - 127);
  }
  return sign ? -mag : mag;
}

Tensor u16_tensor(DType dtype, const std::vector<uint16_t>& bits) {
  Tensor t;
  t.dtype = dtype;
  t.shape = {static_cast<int64_t>(bits.size())};
  t.bytes = bytes_of(bits);
  return t;
}

TEST(HalfTest, KnownF16BitPatterns) {
  const std::vector<uint16_t> bits = {0x0000, 0x8000, 0x3c00, 0xc000, 0x7bff, 0x0001,
                                      0x03ff, 0x0400, 0x3555, 0x7c00, 0xfc00, 0x7e00};
  const std::vector<float> f = u16_tensor(DType::kF16, bits).to_f32();
  EXPECT_EQ(f[0], 0.0f);
  EXPECT_FALSE(std::signbit(f[0]));
  EXPECT_EQ(f[1], 0.0f);
  EXPECT_TRUE(std::signbit(f[1]));
  EXPECT_EQ(f[2], 1.0f);
  EXPECT_EQ(f[3], -2.0f);
  EXPECT_EQ(f[4], 65504.0f);
  EXPECT_EQ(f[5], std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(f[6], std::ldexp(1023.0f, -24));
  EXPECT_EQ(f[7], std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_EQ(f[8], 0.333251953125f);
  EXPECT_TRUE(std::isinf(f[9]) && f[9] > 0);
  EXPECT_TRUE(std::isinf(f[10]) && f[10] < 0);
  EXPECT_TRUE(std::isnan(f[11]));
}

TEST(HalfTest, AllF16PatternsExact) {
  std::vector<uint16_t> bits(65536);
  for (uint32_t i = 0; i < 65536; ++i) bits[i] = static_cast<uint16_t>(i);
  const Tensor t = u16_tensor(DType::kF16, bits);
  const std::vector<float> f = t.to_f32();
  const std::vector<double> d = t.to_f64();
  for (uint32_t i = 0; i < 65536; ++i) {
    const double want = half_formula(static_cast<uint16_t>(i));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f[i]) && std::isnan(d[i])) << std::hex << i;
      // The payload survives widening.
      EXPECT_EQ((std::bit_cast<uint32_t>(f[i]) >> 13) & 0x3ffu, i & 0x3ffu) << std::hex << i;
    } else {
      EXPECT_EQ(static_cast<double>(f[i]), want) << std::hex << i;
      EXPECT_EQ(d[i], want) << std::hex << i;
      EXPECT_EQ(std::signbit(f[i]), (i & 0x8000u) != 0) << std::hex << i;
    }
  }
}

TEST(HalfTest, KnownBf16BitPatterns) {
  const std::vector<uint16_t> bits = {0x3f80, 0xc040, 0x7f80, 0xff80, 0x7fc0,
                                      0x0001, 0x8000, 0x7f7f, 0x3eab};
  const std::vector<float> f = u16_tensor(DType::kBF16, bits).to_f32();
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_EQ(f[1], -3.0f);
  EXPECT_TRUE(std::isinf(f[2]) && f[2] > 0);
  EXPECT_TRUE(std::isinf(f[3]) && f[3] < 0);
  EXPECT_TRUE(std::isnan(f[4]));
  EXPECT_EQ(f[5], std::ldexp(1.0f, -133));  // float32 subnormal
  EXPECT_TRUE(f[6] == 0.0f && std::signbit(f[6]));
  EXPECT_EQ(f[7], std::ldexp(255.0f, 120));  // largest finite bf16
  EXPECT_EQ(f[8], 0.333984375f);
}

TEST(HalfTest, AllBf16PatternsExact) {
  std::vector<uint16_t> bits(65536);
  for (uint32_t i = 0; i < 65536; ++i) bits[i] = static_cast<uint16_t>(i);
  const Tensor t = u16_tensor(DType::kBF16, bits);
  const std::vector<float> f = t.to_f32();
  const std::vector<double> d = t.to_f64();
  for (uint32_t i = 0; i < 65536; ++i) {
    const double want = bf16_formula(static_cast<uint16_t>(i));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f[i]) && std::isnan(d[i])) << std::hex << i;
    } else {
      EXPECT_EQ(static_cast<double>(f[i]), want) << std::hex << i;
      EXPECT_EQ(d[i], want) << std::hex << i;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// .npy

TEST(NpyTest, RoundTripEveryDTypeAndShape) {
  TempDir dir;
  unsigned seed = 0;
  for (DType dtype : kNpyDTypes) {
    for (const auto& shape : kShapes) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " rank " + std::to_string(shape.size()));
      const Tensor t = make_tensor(dtype, shape, ++seed);
      const Bytes enc = encode_npy(t);
      expect_same(parse_npy_bytes(enc), t);
      const std::string path = dir.file(std::to_string(seed) + ".npy");
      write_npy(path, t);
      EXPECT_EQ(slurp(path), enc);
      expect_same(read_npy(path), t);
    }
  }
}

TEST(NpyTest, WriterLayoutMatchesNumPy) {
  const Tensor t = Tensor::from_f32({2, 3}, {1, 2, 3, 4, 5, 6});
  const Bytes b = encode_npy(t);
  ASSERT_GE(b.size(), 10u);
  EXPECT_EQ(Bytes(b.begin(), b.begin() + 8), (Bytes{0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0}));
  const std::size_t header_len = b[8] | (std::size_t{b[9]} << 8);
  EXPECT_EQ((10 + header_len) % 64, 0u);
  EXPECT_EQ(b.size(), 10 + header_len + 24);
  const std::string header(b.begin() + 10,
                           b.begin() + 10 + static_cast<std::ptrdiff_t>(header_len));
  const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  EXPECT_EQ(header.substr(0, dict.size()), dict);
  EXPECT_EQ(header.back(), '\n');
  EXPECT_EQ(header.find_first_not_of(' ', dict.size()), header.size() - 1);

  auto header_of = [](const Tensor& x) {
    const Bytes e = encode_npy(x);
    const std::size_t n = e[8] | (std::size_t{e[9]} << 8);
    return std::string(e.begin() + 10, e.begin() + 10 + static_cast<std::ptrdiff_t>(n));
  };
  EXPECT_NE(header_of(Tensor::from_f64({5}, {1, 2, 3, 4, 5})).find("'descr': '<f8'"),
            std::string::npos);
  EXPECT_NE(header_of(Tensor::from_f64({5}, {1, 2, 3, 4, 5})).find("'shape': (5,)"),
            std::string::npos);
  EXPECT_NE(header_of(Tensor::from_i64({}, {7})).find("'shape': ()"), std::string::npos);
  EXPECT_NE(header_of(make_tensor(DType::kF16, {0, 2})).find("'descr': '<f2'"), std::string::npos);
  EXPECT_NE(header_of(make_tensor(DType::kI32, {1})).find("'descr': '<i4'"), std::string::npos);

  // bfloat16 has no NumPy dtype.
  EXPECT_IO_ERROR(encode_npy(make_tensor(DType::kBF16, {2})), "bfloat16");
  TempDir dir;
  EXPECT_IO_ERROR(write_npy(dir.file("b.npy"), make_tensor(DType::kBF16, {2})),
                  dir.file("b.npy") + ": bfloat16");
  EXPECT_TRUE(dir.entries().empty());
  // Inconsistent tensors are refused.
  Tensor bad = t;
  bad.bytes.resize(20);
  EXPECT_IO_ERROR(encode_npy(bad), "20 bytes do not match float32 x shape [2, 3] (24 bytes)");
}

TEST(NpyTest, AcceptsHeaderVariants) {
  const Bytes d6 = bytes_of(std::vector<float>{1, 2, 3, 4, 5, 6});
  const std::vector<std::string> headers = {
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}",
      "{'shape': (2, 3), 'fortran_order': False, 'descr': '<f4'}",
      "{'fortran_order':False,'shape':(2,3),'descr':'<f4',}",
      "  {  \"descr\" : \"<f4\" ,\n 'fortran_order' : False , 'shape' : ( 2 , 3 , ) , }  \n",
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2L, 3L), }",
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }" + std::string(40, ' ') + "\n",
  };
  for (const auto& h : headers) {
    SCOPED_TRACE(h);
    const Tensor t = parse_npy_bytes(make_npy(h, d6));
    EXPECT_EQ(t.dtype, DType::kF32);
    EXPECT_EQ(t.shape, (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(t.bytes, d6);
  }
  const Tensor one = parse_npy_bytes(make_npy(
      "{'descr': '<i8', 'fortran_order': False, 'shape': (1,), }", bytes_of<int64_t>({9})));
  EXPECT_EQ(one.shape, std::vector<int64_t>{1});
  EXPECT_EQ(one.to_i64(), std::vector<int64_t>{9});
  const Tensor scalar = parse_npy_bytes(
      make_npy("{'descr': '<f8', 'fortran_order': False, 'shape': (), }", bytes_of<double>({2.5})));
  EXPECT_TRUE(scalar.shape.empty());
  EXPECT_EQ(scalar.to_f64(), std::vector<double>{2.5});
  const Tensor empty =
      parse_npy_bytes(make_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 0), }", {}));
  EXPECT_EQ(empty.shape, (std::vector<int64_t>{3, 0}));
  EXPECT_TRUE(empty.bytes.empty());
}

TEST(NpyTest, AcceptsVersions2And3) {
  const Bytes d = bytes_of(std::vector<int32_t>{1, -2, 3});
  for (int major : {2, 3}) {
    const Tensor t = parse_npy_bytes(
        make_npy("{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }\n", d, major));
    EXPECT_EQ(t.dtype, DType::kI32);
    EXPECT_EQ(t.to_i64(), (std::vector<int64_t>{1, -2, 3}));
  }
}

const char kGoodHeader[] = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }\n";

TEST(NpyTest, RejectsBadMagicAndVersion) {
  const Bytes data = bytes_of(std::vector<float>(6, 1.0f));
  Bytes b = make_npy(kGoodHeader, data);
  b[1] = 'X';
  EXPECT_IO_ERROR(parse_npy_bytes(b, "in.npy"), "in.npy: not a .npy file");
  EXPECT_IO_ERROR(parse_npy_bytes(str_bytes("PK\x03\x04 zip file")), "not a .npy file");
  EXPECT_IO_ERROR(parse_npy_bytes({}), "not a .npy file");
  EXPECT_IO_ERROR(parse_npy_bytes(make_npy(kGoodHeader, data, 4)),
                  "x.npy: unsupported .npy format version 4.0");
  EXPECT_IO_ERROR(parse_npy_bytes(make_npy(kGoodHeader, data, 1, 1)),
                  "unsupported .npy format version 1.1");
  EXPECT_IO_ERROR(parse_npy_bytes(make_npy(kGoodHeader, data, 0)), "format version 0.0");
}

TEST(NpyTest, RejectsTruncationAtEveryCut) {
  const Bytes full = encode_npy(Tensor::from_f32({2, 3}, {1, 2, 3, 4, 5, 6}));
  for (std::size_t cut = 0; cut < full.size(); ++cut) {
    SCOPED_TRACE("cut at " + std::to_string(cut));
    const Bytes b(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(cut));
    const std::string msg = io_error_message([&] { parse_npy_bytes(b, "cut.npy"); });
    EXPECT_EQ(msg.rfind("cut.npy: ", 0), 0u) << msg;
    if (cut < 6) {
      EXPECT_NE(msg.find("not a .npy file"), std::string::npos) << msg;
    }
    if (cut >= 6 && cut < 128) {
      EXPECT_NE(msg.find("truncated header"), std::string::npos) << msg;
    }
    if (cut >= 128) {
      EXPECT_NE(msg.find("truncated: header declares 24 bytes of data, file has " +
                         std::to_string(cut - 128)),
                std::string::npos)
          << msg;
    }
  }
  // Version 2.0 prelude cut inside the 4-byte length.
  const Bytes v2 = make_npy(kGoodHeader, bytes_of(std::vector<float>(6)), 2);
  EXPECT_IO_ERROR(parse_npy_bytes(Bytes(v2.begin(), v2.begin() + 11)), "truncated header");
}

TEST(NpyTest, RejectsDataSizeMismatch) {
  EXPECT_IO_ERROR(parse_npy_bytes(make_npy(kGoodHeader, Bytes(20)), "a.npy"),
                  "a.npy: truncated: header declares 24 bytes of data, file has 20");
  EXPECT_IO_ERROR(parse_npy_bytes(make_npy(kGoodHeader, Bytes(25)), "a.npy"),
                  "a.npy: trailing data: header declares 24 bytes of data, file has 25");
  EXPECT_IO_ERROR(
      parse_npy_bytes(make_npy("{'descr': '<f8', 'fortran_order': False, 'shape': (), }", {})),
      "header declares 8 bytes of data, file has 0");
  EXPECT_IO_ERROR(parse_npy_bytes(make_npy(
                      "{'descr': '<f8', 'fortran_order': False, 'shape': (0,), }", Bytes(8))),
                  "trailing data: header declares 0 bytes of data, file has 8");
}

TEST(NpyTest, RejectsMalformedHeaders) {
  struct Case {
    std::string header;
    std::string part;
  };
  const std::vector<Case> cases = {
      {"", "malformed .npy header: expected '{'"},
      {"descr: '<f4'", "malformed .npy header"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), ", "malformed .npy header"},
      {"{'descr': '<f4', 'fortran_order': False}", "missing key 'shape'"},
      {"{'shape': (2, 3), 'fortran_order': False}", "missing key 'descr'"},
      {"{'descr': '<f4', 'shape': (2, 3)}", "missing key 'fortran_order'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'extra': 1}",
       "unexpected key 'extra'"},
      {"{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (6,)}",
       "duplicate key 'descr'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)} junk", "after '}'"},
      {"{'descr': '<f4', 'fortran_order': 0, 'shape': (2, 3)}", "expected True or False"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': [2, 3]}", "expected '('"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (6)}", "trailing comma"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2 3)}", "expected ',' or ')'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, x)}", "expected a dimension"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2.0, 3)}", "expected ',' or ')'"},
      {"{'descr: '<f4', 'fortran_order': False, 'shape': (2, 3)}", "malformed .npy header"},
      {"{'descr': '<f4, 'fortran_order': False, 'shape': (2, 3)}", "malformed .npy header"},
      {"{'descr': '<f4' 'fortran_order': False, 'shape': (2, 3)}", "expected ',' or '}'"},
      {"{descr: '<f4', 'fortran_order': False, 'shape': (2, 3)}", "expected a quoted key"},
      {"{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2, 3)}", "unsupported dtype"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,)}",
       "dimension too large"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.header);
    EXPECT_IO_ERROR(parse_npy_bytes(make_npy(c.header, Bytes(24)), "h.npy"), "h.npy: ");
    EXPECT_IO_ERROR(parse_npy_bytes(make_npy(c.header, Bytes(24)), "h.npy"), c.part);
  }
  // Control characters in the header are escaped so the message stays one line.
  EXPECT_IO_ERROR(parse_npy_bytes(make_npy("{'descr':\n\x01 '<f4'}", Bytes(24))), "\\x01");
}

TEST(NpyTest, RejectsUnsupportedDTypesAndLayouts) {
  auto header = [](const std::string& descr, const std::string& shape, bool fortran = false) {
    return "{'descr': '" + descr + "', 'fortran_order': " + (fortran ? "True" : "False") +
           ", 'shape': " + shape + ", }";
  };
  EXPECT_IO_ERROR(parse_npy_bytes(make_npy(header(">f4", "(2, 3)"), Bytes(24)), "be.npy"),
                  "be.npy: big-endian dtype '>f4' not supported");
  EXPECT_IO_ERROR(parse_npy_bytes(make_npy(header(">i8", "(3,)"), Bytes(24))), "big-endian");
  for (const std::string descr :
       {"<c8", "|O", "<U5", "|u1", "|b1", "|i1", "<u4", "<f16", "f4", "=f4", "<m8[s]", "|V2"}) {
    SCOPED_TRACE(descr);
    EXPECT_IO_ERROR(parse_npy_bytes(make_npy(header(descr, "(3,)"), Bytes(24)), "d.npy"),
                    "d.npy: unsupported dtype '" + descr + "'");
  }
  EXPECT_IO_ERROR(parse_npy_bytes(make_npy(header("<f4", "(2, 3)", true), Bytes(24))),
                  "fortran_order True is not supported");
  EXPECT_IO_ERROR(parse_npy_bytes(make_npy(header("<f4", "(2, -3)"), Bytes(24)), "n.npy"),
                  "n.npy: negative dimension");
  EXPECT_IO_ERROR(parse_npy_bytes(make_npy(header("<f4", "(-1,)"), Bytes(4))),
                  "negative dimension");
}

TEST(NpyTest, RejectsHugeDeclaredSizesWithoutAllocating) {
  auto header = [](const std::string& shape) {
    return "{'descr': '<f8', 'fortran_order': False, 'shape': " + shape + ", }";
  };
  const std::string big = std::to_string(int64_t{1} << 62);
  EXPECT_IO_ERROR(
      parse_npy_bytes(make_npy(header("(" + big + ", " + big + ")"), Bytes(8)), "huge.npy"),
      "huge.npy: shape [4611686018427387904, 4611686018427387904] of float64 "
      "overflows the element count");
  // Fits in int64 elements but not in bytes.
  EXPECT_IO_ERROR(parse_npy_bytes(make_npy(header("(" + big + ",)"), Bytes(8))), "overflows");
  EXPECT_IO_ERROR(parse_npy_bytes(make_npy(header("(9223372036854775807,)"), Bytes(8))),
                  "overflows");
  // Representable but far larger than the file.
  EXPECT_IO_ERROR(parse_npy_bytes(make_npy(header("(1000000, 1000000)"), Bytes(8))),
                  "truncated: header declares 8000000000000 bytes of data, file has 8");
  // Exactly at the int64 limit of bytes.
  EXPECT_IO_ERROR(parse_npy_bytes(make_npy(header("(1152921504606846975,)"), Bytes(8))),
                  "truncated: header declares 9223372036854775800 bytes");
}

TEST(NpyTest, ReadErrorsNameThePath) {
  TempDir dir;
  const std::string missing = dir.file("missing.npy");
  EXPECT_IO_ERROR(read_npy(missing), missing + ": cannot open (No such file or directory)");
  const std::string bad = dir.file("bad.npy");
  std::ofstream(bad) << "not numpy";
  EXPECT_IO_ERROR(read_npy(bad), bad + ": not a .npy file");
}

// Round trips through NumPy itself, with the interpreter the Python tests use.
bool have_numpy() {
  return std::system(POSENC_TEST_PYTHON " -c 'import numpy' >/dev/null 2>&1") == 0;
}

TEST(NpyTest, InteropWithNumPy) {
  if (!have_numpy()) GTEST_SKIP() << POSENC_TEST_PYTHON " with numpy not available";
  TempDir dir;
  // Ours -> numpy.load.
  write_npy(dir.file("a.npy"), Tensor::from_f32({2, 3}, {0, 1, 2, 3, 4, 5}));
  write_npy(dir.file("b.npy"), Tensor::from_f64({}, {2.5}));
  write_npy(dir.file("c.npy"), Tensor::from_i64({4}, {-1, 0, 1, 1LL << 40}));
  write_npy(dir.file("d.npy"), Tensor::from_f32({3, 0, 2}, {}));
  Tensor h = u16_tensor(DType::kF16, {0x3c00, 0xc000, 0x0001});
  write_npy(dir.file("e.npy"), h);
  Tensor i32;
  i32.dtype = DType::kI32;
  i32.shape = {2, 1};
  i32.bytes = bytes_of(std::vector<int32_t>{7, -8});
  write_npy(dir.file("f.npy"), i32);
  const std::string check = dir.file("check.py");
  std::ofstream(check) << R"(import sys, numpy as np
d = sys.argv[1]
def same(name, want):
    got = np.load(d + '/' + name)
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape)
    assert np.array_equal(got, want), (name, got)
same('a.npy', np.arange(6, dtype='<f4').reshape(2, 3))
same('b.npy', np.array(2.5, dtype='<f8'))
same('c.npy', np.array([-1, 0, 1, 1 << 40], dtype='<i8'))
same('d.npy', np.zeros((3, 0, 2), dtype='<f4'))
same('e.npy', np.array([1, -2, 2.0**-24], dtype='<f2'))
same('f.npy', np.array([[7], [-8]], dtype='<i4'))
# numpy -> ours
np.save(d + '/g.npy', np.arange(24, dtype='<f8').reshape(2, 3, 4))
np.save(d + '/h.npy', np.float32(1.5))
np.save(d + '/i.npy', np.arange(5, dtype='<i4'))
np.save(d + '/j.npy', np.zeros((0, 4), dtype='<f2'))
np.save(d + '/k.npy', np.arange(6, dtype='<f4').reshape(2, 3).T)  # Fortran order
np.save(d + '/l.npy', np.arange(3, dtype='>f4'))
np.lib.format.write_array(open(d + '/m.npy', 'wb'), np.arange(3, dtype='<i8'), version=(2, 0))
np.lib.format.write_array(open(d + '/n.npy', 'wb'), np.arange(3, dtype='<i8'), version=(3, 0))
)";
  const std::string cmd = POSENC_TEST_PYTHON " " + check + " " + dir.path().string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;

  const Tensor g = read_npy(dir.file("g.npy"));
  EXPECT_EQ(g.dtype, DType::kF64);
  EXPECT_EQ(g.shape, (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(g.to_f64()[23], 23.0);
  const Tensor hh = read_npy(dir.file("h.npy"));
  EXPECT_TRUE(hh.shape.empty());
  EXPECT_EQ(hh.to_f32(), std::vector<float>{1.5f});
  EXPECT_EQ(read_npy(dir.file("i.npy")).to_i64(), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  const Tensor j = read_npy(dir.file("j.npy"));
  EXPECT_EQ(j.dtype, DType::kF16);
  EXPECT_EQ(j.shape, (std::vector<int64_t>{0, 4}));
  EXPECT_IO_ERROR(read_npy(dir.file("k.npy")), "fortran_order True");
  EXPECT_IO_ERROR(read_npy(dir.file("l.npy")), "big-endian dtype '>f4'");
  EXPECT_EQ(read_npy(dir.file("m.npy")).to_i64(), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(read_npy(dir.file("n.npy")).to_i64(), (std::vector<int64_t>{0, 1, 2}));
}

// ---------------------------------------------------------------------------------------------
// .safetensors

SafetensorsFile sample_file() {
  SafetensorsFile f;
  unsigned seed = 100;
  for (DType dtype : kAllDTypes) {
    for (std::size_t s = 0; s < kShapes.size(); ++s) {
      f.tensors["t_" + std::string(dtype_name(dtype)) + "_" + std::to_string(s)] =
          make_tensor(dtype, kShapes[s], ++seed);
    }
  }
  f.metadata["format"] = "pt";
  f.metadata["note"] = "héllo \"quoted\"";
  return f;
}

void expect_same(const SafetensorsFile& a, const SafetensorsFile& b) {
  EXPECT_EQ(a.metadata, b.metadata);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (const auto& [name, t] : a.tensors) {
    SCOPED_TRACE(name);
    ASSERT_EQ(b.tensors.count(name), 1u);
    expect_same(t, b.tensors.at(name));
  }
}

TEST(SafetensorsTest, RoundTripEveryDTypeAndShape) {
  const SafetensorsFile f = sample_file();
  const Bytes enc = encode_safetensors(f);
  expect_same(parse_st_bytes(enc), f);

  TempDir dir;
  const std::string path = dir.file("params.safetensors");
  write_safetensors(path, f);
  EXPECT_EQ(slurp(path), enc);
  expect_same(read_safetensors(path), f);

  // Empty file: no tensors, no metadata.
  const Bytes none = encode_safetensors({});
  const SafetensorsFile back = parse_st_bytes(none);
  EXPECT_TRUE(back.tensors.empty());
  EXPECT_TRUE(back.metadata.empty());
}

// Writing tensors by reference gives the bytes of the owning writer, and checks the same things.
TEST(SafetensorsTest, WriteByReferenceMatchesTheOwningWriter) {
  SafetensorsFile f = sample_file();
  f.metadata["scheme"] = "rope";
  std::map<std::string, TensorRef> refs;
  for (const auto& [name, t] : f.tensors) refs[name] = TensorRef{t.dtype, t.shape, t.bytes.data()};
  TempDir dir;
  const std::string path = dir.file("refs.safetensors");
  write_safetensors(path, refs, f.metadata);
  EXPECT_EQ(slurp(path), encode_safetensors(f));

  std::map<std::string, TensorRef> bad;
  bad["__metadata__"] = TensorRef{DType::kF32, {1}, f.tensors.begin()->second.bytes.data()};
  const std::string other = dir.file("bad.safetensors");
  EXPECT_IO_ERROR(write_safetensors(other, bad), "reserved");
  bad.clear();
  bad["x"] = TensorRef{DType::kF32, {2, 3}, nullptr};
  EXPECT_IO_ERROR(write_safetensors(other, bad), "tensor 'x' has no data");
  bad["x"] = TensorRef{DType::kF32, {-1}, nullptr};
  EXPECT_IO_ERROR(write_safetensors(other, bad), "negative or too large");
  EXPECT_FALSE(std::filesystem::exists(other));
}

TEST(SafetensorsTest, WriterLayout) {
  SafetensorsFile f;
  f.tensors["b"] = Tensor::from_f32({2}, {1, 2});
  f.tensors["a"] = Tensor::from_i64({}, {3});
  f.tensors["c"] = make_tensor(DType::kBF16, {3});
  Bytes b = encode_safetensors(f);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(b[static_cast<std::size_t>(i)]) << (8 * i);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_EQ(b.size(), 8 + n + 8 + 8 + 6);
  const std::string header(b.begin() + 8, b.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  const std::string want = R"({"a":{"data_offsets":[0,8],"dtype":"I64","shape":[]},)"
                           R"("b":{"data_offsets":[8,16],"dtype":"F32","shape":[2]},)"
                           R"("c":{"data_offsets":[16,22],"dtype":"BF16","shape":[3]}})";
  EXPECT_EQ(header.substr(0, want.size()), want);
  EXPECT_EQ(header.find_first_not_of(' ', want.size()), std::string::npos);
  EXPECT_EQ(header.find("__metadata__"), std::string::npos);  // omitted when empty
  // Data follows in name order.
  EXPECT_EQ(Bytes(b.begin() + 8 + static_cast<std::ptrdiff_t>(n),
                  b.begin() + 16 + static_cast<std::ptrdiff_t>(n)),
            f.tensors["a"].bytes);

  f.metadata["k"] = "v";
  b = encode_safetensors(f);
  const std::string with_meta(b.begin() + 8, b.end());
  EXPECT_NE(with_meta.find(R"("__metadata__":{"k":"v"})"), std::string::npos);
}

TEST(SafetensorsTest, WriterRejectsBadInput) {
  SafetensorsFile f;
  f.tensors["__metadata__"] = Tensor::from_f32({1}, {1});
  EXPECT_IO_ERROR(encode_safetensors(f), "reserved");
  f.tensors.clear();
  Tensor bad = Tensor::from_f32({2, 3}, {1, 2, 3, 4, 5, 6});
  bad.bytes.resize(12);
  f.tensors["rel_k"] = bad;
  EXPECT_IO_ERROR(encode_safetensors(f),
                  "tensor 'rel_k': 12 bytes do not match F32 x shape [2, 3] (24 bytes)");
  TempDir dir;
  const std::string path = dir.file("out.safetensors");
  EXPECT_IO_ERROR(write_safetensors(path, f), path + ": tensor 'rel_k'");
  EXPECT_TRUE(dir.entries().empty());
  // Names must be valid UTF-8 for JSON.
  f.tensors.clear();
  f.tensors["\xff\xfe"] = Tensor::from_f32({1}, {1});
  EXPECT_IO_ERROR(encode_safetensors(f), "cannot encode the header");
}

TEST(SafetensorsTest, AcceptsForeignLayouts) {
  // Key order, whitespace, gaps between tensors and extra keys are tolerated.
  const Bytes data = concat(bytes_of(std::vector<float>{1, 2, 3}), bytes_of<int32_t>({-5}));
  const std::string header =
      R"(  { "y" : {"shape":[1],"data_offsets":[12,16],"dtype":"I32"},
            "__metadata__": {"format": "pt"},
            "x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12], "extra": true} }  )";
  const SafetensorsFile f = parse_st_bytes(make_st(header, data));
  EXPECT_EQ(f.metadata.at("format"), "pt");
  EXPECT_EQ(f.tensors.at("x").to_f32(), (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(f.tensors.at("y").to_i64(), std::vector<int64_t>{-5});
  // Empty tensors may sit anywhere, even inside another tensor's range.
  const SafetensorsFile g =
      parse_st_bytes(make_st(R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                             R"("e":{"dtype":"F64","shape":[0,7],"data_offsets":[8,8]}})",
                             Bytes(16)));
  EXPECT_EQ(g.tensors.at("e").shape, (std::vector<int64_t>{0, 7}));
  EXPECT_TRUE(g.tensors.at("e").bytes.empty());
}

TEST(SafetensorsTest, RejectsDuplicateKeys) {
  // nlohmann keeps the last of duplicate keys; a repeated tensor name must be an error instead.
  const Bytes data = bytes_of(std::vector<float>{1, 2});
  EXPECT_IO_ERROR(parse_st_bytes(make_st(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                         R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                                         data)),
                  "p.safetensors: malformed header: duplicate tensor name 'a'");
  // Inside a tensor's object and inside the metadata too.
  EXPECT_IO_ERROR(
      parse_st_bytes(
          make_st(R"({"a":{"dtype":"F32","dtype":"I32","shape":[1],"data_offsets":[0,4]}})", data)),
      "duplicate key 'dtype'");
  EXPECT_IO_ERROR(parse_st_bytes(make_st(R"({"__metadata__":{"k":"1","k":"2"}})", {})),
                  "duplicate key 'k'");
  // The same key in different objects is fine.
  const SafetensorsFile f =
      parse_st_bytes(make_st(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                             R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                             data));
  EXPECT_EQ(f.tensors.size(), 2u);
}

TEST(SafetensorsTest, DataSectionIsBoundedByTheHeader) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  // Up to kSafetensorsSlack unused bytes are accepted; one more is an error.
  EXPECT_NO_THROW(parse_st_bytes(make_st(header, Bytes(4 + kSafetensorsSlack))));
  EXPECT_IO_ERROR(parse_st_bytes(make_st(header, Bytes(5 + kSafetensorsSlack))),
                  "the data section has 65541 bytes, but the tensors declare only 4");
}

TEST(SafetensorsTest, RejectsTruncationAtEveryCut) {
  SafetensorsFile f;
  f.tensors["a"] = Tensor::from_f32({2, 3}, {1, 2, 3, 4, 5, 6});
  f.tensors["b"] = Tensor::from_i64({2}, {1, 2});
  const Bytes full = encode_safetensors(f);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i)
    n |= static_cast<uint64_t>(full[static_cast<std::size_t>(i)]) << (8 * i);
  for (std::size_t cut = 0; cut < full.size(); ++cut) {
    SCOPED_TRACE("cut at " + std::to_string(cut));
    const Bytes b(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(cut));
    const std::string msg = io_error_message([&] { parse_st_bytes(b, "cut.safetensors"); });
    EXPECT_EQ(msg.rfind("cut.safetensors: ", 0), 0u) << msg;
    if (cut < 8 + n) {
      EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
    } else {
      EXPECT_NE(msg.find("lie outside the data section"), std::string::npos) << msg;
    }
  }
}

TEST(SafetensorsTest, RejectsBadHeaderLength) {
  EXPECT_IO_ERROR(parse_st_bytes(Bytes(5), "s.safetensors"), "s.safetensors: truncated");
  Bytes huge = make_st("{}", {});
  huge[3] = 0x10;  // 256 MiB + 2
  EXPECT_IO_ERROR(parse_st_bytes(huge), "exceeds the limit of 104857600 bytes");
  Bytes all_ones(16, 0xff);
  EXPECT_IO_ERROR(parse_st_bytes(all_ones), "exceeds the limit");
  Bytes longer = make_st("{}", {});
  longer[0] = 3;  // header length 3 > 2 bytes present
  EXPECT_IO_ERROR(parse_st_bytes(longer), "truncated: header length 3 exceeds the 2 bytes");
  EXPECT_IO_ERROR(parse_st_bytes(make_st("", {})), "malformed JSON header");
  // A .npy file is not a .safetensors file.
  EXPECT_IO_ERROR(parse_st_bytes(encode_npy(Tensor::from_f32({1}, {1}))), "exceeds the limit");
}

TEST(SafetensorsTest, RejectsMalformedHeaders) {
  struct Case {
    std::string header;
    std::size_t data;
    std::string part;
  };
  const std::vector<Case> cases = {
      {"{", 0, "malformed JSON header"},
      {"not json", 0, "malformed JSON header"},
      {R"({"x": 1,})", 0, "malformed JSON header"},
      {"[1, 2]", 0, "expected a JSON object, got array"},
      {"\"str\"", 0, "expected a JSON object, got string"},
      {R"({"__metadata__": [1]})", 0, "__metadata__ must be an object"},
      {R"({"__metadata__": {"k": 1}})", 0, "__metadata__ 'k' must be a string"},
      {R"({"x": [1, 2]})", 0, "tensor 'x': expected an object"},
      {R"({"x": {"shape": [1], "data_offsets": [0, 4]}})", 4, "tensor 'x': missing \"dtype\""},
      {R"({"x": {"dtype": "F32", "data_offsets": [0, 4]}})", 4, "missing \"shape\""},
      {R"({"x": {"dtype": "F32", "shape": [1]}})", 4, "missing \"data_offsets\""},
      {R"({"x": {"dtype": 32, "shape": [1], "data_offsets": [0, 4]}})", 4,
       "dtype must be a string"},
      {R"({"x": {"dtype": "F32", "shape": 1, "data_offsets": [0, 4]}})", 4,
       "shape must be an array of non-negative integers, got 1"},
      {R"({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4,
       "shape must be an array of non-negative integers, got [-1]"},
      {R"({"x": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}})", 4,
       "shape must be an array"},
      {R"({"x": {"dtype": "F32", "shape": ["1"], "data_offsets": [0, 4]}})", 4,
       "shape must be an array"},
      {R"({"x": {"dtype": "F32", "shape": [9223372036854775808], "data_offsets": [0, 4]}})", 4,
       "shape must be an array"},
      {R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", 4,
       "data_offsets must be [begin, end]"},
      {R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}})", 8,
       "data_offsets must be [begin, end]"},
      {R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", 4,
       "data_offsets must be [begin, end]"},
      {R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": {"a": 0}}})", 4,
       "data_offsets must be [begin, end]"},
      {R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", 8,
       "tensor 'x': data_offsets [8, 4] has begin > end"},
      {R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 6,
       "tensor 'x': data_offsets [4, 8] lie outside the data section of 6 bytes"},
      {R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 18446744073709551615]}})", 6,
       "lie outside the data section"},
      {"{\"x\\n\": 5}", 0, "tensor 'x\\x0a': expected an object"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.header);
    EXPECT_IO_ERROR(parse_st_bytes(make_st(c.header, Bytes(c.data)), "m.safetensors"),
                    "m.safetensors: ");
    EXPECT_IO_ERROR(parse_st_bytes(make_st(c.header, Bytes(c.data))), c.part);
  }
}

TEST(SafetensorsTest, RejectsDeeplyNestedValuesWithoutRecursing) {
  const std::string deep = std::string(1000000, '[') + std::string(1000000, ']');
  EXPECT_IO_ERROR(parse_st_bytes(make_st(R"({"x": )" + deep + "}", {})),
                  "tensor 'x': expected an object with dtype, shape and data_offsets, got a JSON "
                  "array");
  EXPECT_IO_ERROR(parse_st_bytes(make_st(R"({"x": {"dtype": "F32", "data_offsets": [0, 0], )"
                                         R"("shape": )" +
                                             deep + "}}",
                                         {})),
                  "shape must be an array of non-negative integers, got a JSON array");
}

TEST(SafetensorsTest, RejectsUnsupportedDTypes) {
  for (const std::string dtype :
       {"I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "I16", "U16", "U32", "U64", "C64", "f32", ""}) {
    SCOPED_TRACE(dtype);
    const std::string h =
        R"({"w": {"dtype": ")" + dtype + R"(", "shape": [4], "data_offsets": [0, 4]}})";
    EXPECT_IO_ERROR(parse_st_bytes(make_st(h, Bytes(4)), "q.safetensors"),
                    "q.safetensors: tensor 'w': unsupported dtype '" + dtype + "'");
  }
}

TEST(SafetensorsTest, RejectsSizeMismatch) {
  EXPECT_IO_ERROR(
      parse_st_bytes(
          make_st(R"({"rel_k": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 12]}})",
                  Bytes(24)),
          "params.safetensors"),
      "params.safetensors: tensor 'rel_k': data_offsets [0, 12] do not match dtype F32 x shape "
      "[2, 3] (24 bytes)");
  EXPECT_IO_ERROR(
      parse_st_bytes(
          make_st(R"({"s": {"dtype": "BF16", "shape": [], "data_offsets": [0, 4]}})", Bytes(4))),
      "tensor 's': data_offsets [0, 4] do not match dtype BF16 x shape [] (2 bytes)");
  EXPECT_IO_ERROR(
      parse_st_bytes(
          make_st(R"({"e": {"dtype": "I64", "shape": [0], "data_offsets": [0, 8]}})", Bytes(8))),
      "do not match dtype I64 x shape [0] (0 bytes)");
}

TEST(SafetensorsTest, RejectsHugeDeclaredSizes) {
  const std::string big = std::to_string(int64_t{1} << 62);
  EXPECT_IO_ERROR(
      parse_st_bytes(make_st(R"({"h": {"dtype": "F32", "shape": [)" + big + ", " + big +
                                 R"(], "data_offsets": [0, 4]}})",
                             Bytes(4)),
                     "big.safetensors"),
      "big.safetensors: tensor 'h': shape [4611686018427387904, 4611686018427387904] of F32 "
      "overflows the element count");
  EXPECT_IO_ERROR(parse_st_bytes(make_st(R"({"h": {"dtype": "F64", "shape": [)" + big +
                                             R"(], "data_offsets": [0, 4]}})",
                                         Bytes(4))),
                  "overflows");
  // Consistent offsets and shape, both far beyond the file.
  EXPECT_IO_ERROR(parse_st_bytes(make_st(R"({"h": {"dtype": "F32", "shape": [1000000, 1000000], )"
                                         R"("data_offsets": [0, 4000000000000]}})",
                                         Bytes(4))),
                  "lie outside the data section of 4 bytes");
}

TEST(SafetensorsTest, RejectsOverlappingTensors) {
  const std::string h = R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},)"
                        R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}})";
  EXPECT_IO_ERROR(parse_st_bytes(make_st(h, Bytes(20)), "o.safetensors"),
                  "o.safetensors: tensors 'a' (data_offsets [0, 16]) and 'b' (data_offsets "
                  "[12, 20]) overlap");
  // Identical ranges.
  const std::string same = R"({"a": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]},)"
                           R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})";
  EXPECT_IO_ERROR(parse_st_bytes(make_st(same, Bytes(8))), "overlap");
  // Containment, listed in the other order.
  const std::string inside = R"({"a": {"dtype": "F16", "shape": [1], "data_offsets": [4, 6]},)"
                             R"( "z": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})";
  EXPECT_IO_ERROR(parse_st_bytes(make_st(inside, Bytes(8))), "overlap");
  // Adjacent ranges are fine.
  const std::string adjacent = R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
                               R"( "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})";
  EXPECT_EQ(parse_st_bytes(make_st(adjacent, Bytes(8))).tensors.size(), 2u);
}

TEST(SafetensorsTest, ReadErrorsNameThePath) {
  TempDir dir;
  const std::string missing = dir.file("nope.safetensors");
  EXPECT_IO_ERROR(read_safetensors(missing), missing + ": cannot open");
}

// ---------------------------------------------------------------------------------------------
// read_file / write_file_atomic

TEST(FileTest, ReadFile) {
  TempDir dir;
  const std::string path = dir.file("data.bin");
  const Bytes content = pattern(3000, 7);
  write_file_atomic(path, content.data(), content.size());
  EXPECT_EQ(read_file(path), content);
  EXPECT_EQ(read_file(path, 3000), content);
  EXPECT_IO_ERROR(read_file(path, 2999), path + ": file is larger than the limit of 2999 bytes");
  EXPECT_IO_ERROR(read_file(dir.file("none")), dir.file("none") + ": cannot open");
  EXPECT_IO_ERROR(read_file(dir.path().string()), dir.path().string() + ": is a directory");
  // Empty file.
  write_file_atomic(dir.file("empty"), nullptr, 0);
  EXPECT_TRUE(read_file(dir.file("empty")).empty());
  // Inputs must be regular files: devices and FIFOs are refused by name, without reading (a
  // FIFO without a writer would otherwise block, /dev/zero never end).
  if (fs::exists("/dev/zero")) {
    EXPECT_IO_ERROR(read_file("/dev/zero"), "/dev/zero: is a character device, not a regular file");
    EXPECT_IO_ERROR(MappedFile::map("/dev/zero"), "/dev/zero: is a character device");
  }
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0600), 0);
  EXPECT_IO_ERROR(read_file(dir.file("fifo")), dir.file("fifo") + ": is a FIFO");
  EXPECT_IO_ERROR(read_npy(dir.file("fifo")), dir.file("fifo") + ": is a FIFO");
  EXPECT_IO_ERROR(read_safetensors(dir.file("fifo")), dir.file("fifo") + ": is a FIFO");
}

TEST(FileTest, MappedFileIsTheFile) {
  TempDir dir;
  const Bytes content = pattern(10000, 3);
  write_file_atomic(dir.file("m.bin"), content.data(), content.size());
  const std::shared_ptr<const MappedFile> m = MappedFile::map(dir.file("m.bin"));
  ASSERT_EQ(m->size(), content.size());
  EXPECT_TRUE(std::equal(content.begin(), content.end(), m->data()));
  EXPECT_EQ(m->path(), dir.file("m.bin"));
  EXPECT_IO_ERROR(MappedFile::map(dir.file("m.bin"), 9999), "larger than the limit of 9999");
  write_file_atomic(dir.file("empty"), nullptr, 0);
  EXPECT_EQ(MappedFile::map(dir.file("empty"))->size(), 0u);
}

TEST(FileTest, AtomicWriteIntoMissingDirectoryLeavesNothing) {
  TempDir dir;
  const std::string path = dir.file("no/such/dir/out.npy");
  EXPECT_IO_ERROR(write_npy(path, Tensor::from_f32({1}, {1})), path + ": ");
  EXPECT_TRUE(dir.entries().empty());
  const Bytes b = {1, 2, 3};
  EXPECT_IO_ERROR(write_file_atomic(path, b.data(), b.size()), "No such file or directory");
  EXPECT_TRUE(dir.entries().empty());
  EXPECT_IO_ERROR(write_file_atomic(dir.file("sub/"), b.data(), b.size()), "not a file name");
  EXPECT_IO_ERROR(write_file_atomic("", b.data(), b.size()), "empty output path");
  EXPECT_TRUE(dir.entries().empty());
}

TEST(FileTest, AtomicWriteReplacesAndLeavesNoTempFiles) {
  TempDir dir;
  const std::string path = dir.file("out.safetensors");
  const Bytes first = pattern(5000, 1);
  const Bytes second = pattern(17, 2);
  write_file_atomic(path, first.data(), first.size());
  EXPECT_EQ(slurp(path), first);
  write_file_atomic(path, second.data(), second.size());  // shorter: no stale tail
  EXPECT_EQ(slurp(path), second);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"out.safetensors"});

  // A destination that is not a regular file (here a directory) is refused, and nothing is left.
  fs::create_directory(dir.path() / "adir");
  fs::create_directory(dir.path() / "adir" / "inner");
  EXPECT_IO_ERROR(write_file_atomic(dir.file("adir"), first.data(), first.size()),
                  dir.file("adir") + ": exists and is a directory");
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"adir", "out.safetensors"}));

  // Relative paths write into the current directory.
  const fs::path cwd = fs::current_path();
  fs::current_path(dir.path());
  write_file_atomic("rel.bin", second.data(), second.size());
  fs::current_path(cwd);
  EXPECT_EQ(slurp(dir.file("rel.bin")), second);
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"adir", "out.safetensors", "rel.bin"}));
}

TEST(FileTest, AtomicWritePermissions) {
  TempDir dir;
  const mode_t mask = ::umask(022);
  ::umask(mask);
  const std::string path = dir.file("p.bin");
  const Bytes b = {1};
  write_file_atomic(path, b.data(), b.size());
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0666 & ~mask);  // as if created by open(), not mkstemp's 0600
  // Overwriting keeps the existing file's mode.
  ASSERT_EQ(::chmod(path.c_str(), 0640), 0);
  write_file_atomic(path, b.data(), b.size());
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0640u);
}

TEST(FileTest, FailedWriteRemovesTemporaryFile) {
  // A file size limit makes write() fail half way (EFBIG); run it in a child process so the
  // limit does not leak into other tests.
  TempDir dir;
  const std::string path = dir.file("big.bin");
  const Bytes old = {4, 5, 6};
  write_file_atomic(path, old.data(), old.size());
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::signal(SIGXFSZ, SIG_IGN);
    rlimit lim{};
    lim.rlim_cur = lim.rlim_max = 4096;
    if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) ::_exit(3);
    const Bytes big(100000, 1);
    const std::string msg =
        io_error_message([&] { write_file_atomic(path, big.data(), big.size()); });
    ::_exit(msg.rfind(path + ": file too large: the process's file-size limit", 0) == 0 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "child did not see the expected IoError";
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"big.bin"});
  EXPECT_EQ(slurp(path), old);  // the destination is untouched
}

TEST(FileTest, AtomicWriteIntoReadOnlyDirectory) {
  if (::geteuid() == 0) GTEST_SKIP() << "root ignores directory permissions";
  TempDir dir;
  const fs::path ro = dir.path() / "ro";
  fs::create_directory(ro);
  const Bytes old = {9, 9};
  write_file_atomic((ro / "f.bin").string(), old.data(), old.size());
  fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec);
  const Bytes b = {1, 2, 3};
  EXPECT_IO_ERROR(write_file_atomic((ro / "f.bin").string(), b.data(), b.size()),
                  "cannot create a temporary file");
  fs::permissions(ro, fs::perms::owner_all);
  EXPECT_EQ(slurp((ro / "f.bin").string()), old);  // untouched
}

// ---------------------------------------------------------------------------------------------
// Zero-copy .npy reads and streamed writes

TEST(NpyViewTest, MappedFloat32IsTheFilesBytes) {
  TempDir dir;
  const std::vector<float> v = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, 8.0f};
  write_npy(dir.file("x.npy"), DType::kF32, {2, 3}, v.data());
  const NpyView m = map_npy(dir.file("x.npy"));
  EXPECT_EQ(m.dtype, DType::kF32);
  EXPECT_EQ(m.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(m.numel(), 6);
  ASSERT_NE(m.file, nullptr);
  const float* p = m.as<float>();
  ASSERT_NE(p, nullptr);
  // No copy: the elements live inside the mapping, 64-byte aligned like np.save's.
  EXPECT_EQ(reinterpret_cast<const unsigned char*>(p), m.file->data() + m.file->size() - 24);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 64, 0u);
  EXPECT_EQ(std::vector<float>(p, p + 6), v);
  EXPECT_EQ(m.as<double>(), nullptr);  // another dtype: no typed view
  EXPECT_EQ(m.to_tensor().to_f32(), v);
  EXPECT_EQ(read_npy(dir.file("x.npy")).to_f32(), v);
}

TEST(NpyViewTest, MisalignedDataHasNoTypedView) {
  // A hand-made header of odd length puts the data at an odd offset: still readable by copy.
  const std::string h = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }";
  const Bytes file = make_npy(h + std::string((h.size() % 2 == 0) ? 1 : 2, ' '),
                              bytes_of(std::vector<float>{1, 2}));
  const NpyView m = parse_npy_view(file.data(), file.size(), "odd.npy");
  if ((reinterpret_cast<std::uintptr_t>(m.data) % alignof(float)) != 0) {
    EXPECT_EQ(m.as<float>(), nullptr);
  }
  EXPECT_EQ(m.to_tensor().to_f32(), (std::vector<float>{1, 2}));
}

TEST(NpyViewTest, EmptyTensorsHaveNonNullViews) {
  TempDir dir;
  write_npy(dir.file("e.npy"), Tensor::from_f32({0, 4}, {}));
  const NpyView m = map_npy(dir.file("e.npy"));
  EXPECT_EQ(m.numel(), 0);
  EXPECT_NE(m.as<float>(), nullptr);
}

TEST(NpyViewTest, StreamedWriteEqualsEncode) {
  TempDir dir;
  const Tensor t = Tensor::from_i64({3}, {1, -2, 3});
  write_npy(dir.file("a.npy"), DType::kI64, t.shape, t.to_i64().data());
  EXPECT_EQ(slurp(dir.file("a.npy")), encode_npy(t));
  EXPECT_IO_ERROR(write_npy(dir.file("b.npy"), DType::kBF16, {1}, t.bytes.data()), "bfloat16");
  EXPECT_TRUE(!fs::exists(dir.file("b.npy")));
}

// ---------------------------------------------------------------------------------------------
// Checked sizes (posenc/size.h)

TEST(SizeTest, CheckedArithmetic) {
  const int64_t max = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(checked_mul(3, 4), 12);
  EXPECT_EQ(checked_mul(int64_t{1} << 31, int64_t{1} << 31), int64_t{1} << 62);
  EXPECT_EQ(checked_mul(int64_t{1} << 32, int64_t{1} << 31), std::nullopt);
  EXPECT_EQ(checked_mul(-1, std::numeric_limits<int64_t>::min()), std::nullopt);
  EXPECT_EQ(checked_add(max - 1, 1), max);
  EXPECT_EQ(checked_add(max, 1), std::nullopt);
}

TEST(SizeTest, CheckedElementsNamesTheFactors) {
  EXPECT_EQ(checked_elements("t", {{"a", 3}, {"b", 5}}, 4), 15);
  EXPECT_EQ(checked_elements("t", {{"a", 0}, {"b", int64_t{1} << 62}}, 8), 0);  // empty
  try {
    checked_elements("sinusoidal: the table", {{"--length", int64_t{1} << 40}, {"--dim", 1 << 24}},
                     4);
    ADD_FAILURE() << "no SizeError";
  } catch (const SizeError& e) {
    EXPECT_STREQ(e.what(),
                 "sinusoidal: the table: --length (1099511627776) x --dim (16777216) x 4 bytes "
                 "overflows a 64-bit size");
  }
  try {
    checked_elements("m", {{"n", -2}}, 1);
    ADD_FAILURE() << "no SizeError";
  } catch (const SizeError& e) {
    EXPECT_NE(std::string(e.what()).find("n must be >= 0 (got -2)"), std::string::npos);
  }
}

TEST(SizeTest, LimitComesFromTheEnvironment) {
  const char* old = std::getenv("POSENC_MAX_BYTES");
  const std::string saved = old ? old : "";
  ::setenv("POSENC_MAX_BYTES", "2K", 1);
  EXPECT_EQ(max_allocation_bytes(), 2048);
  EXPECT_EQ(checked_elements("t", {{"n", 512}}, 4), 512);
  try {
    checked_elements("t", {{"n", 513}}, 4);
    ADD_FAILURE() << "no SizeError";
  } catch (const SizeError& e) {
    EXPECT_STREQ(e.what(),
                 "t: n (513) x 4 bytes = 2052 bytes (2 KiB), more than the limit of 2 KiB "
                 "(POSENC_MAX_BYTES)");
  }
  ::setenv("POSENC_MAX_BYTES", "12x", 1);
  EXPECT_THROW(max_allocation_bytes(), ValueError);
  ::unsetenv("POSENC_MAX_BYTES");
  EXPECT_GT(max_allocation_bytes(), int64_t{1} << 20);  // physical memory
  if (old) ::setenv("POSENC_MAX_BYTES", saved.c_str(), 1);
}

}  // namespace
}  // namespace posenc
