// NumPy .npy reader and writer (docs/cli.md, File conventions).
//
// Format (numpy/lib/format.py): magic "\x93NUMPY", major and minor version bytes, header length
// (2 bytes little-endian in 1.0; 4 bytes in 2.0 and 3.0), then a Python dict literal such as
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// padded with spaces and a final '\n', then the raw C-order element bytes.
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "io/io_util.h"
#include "posenc/error.h"
#include "posenc/io.h"
#include "posenc/size.h"

namespace posenc {

namespace {

constexpr unsigned char kMagic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
constexpr std::size_t kPreludeV1 = 10;  // magic, version, u16 header length
constexpr std::size_t kPreludeV2 = 12;  // magic, version, u32 header length
constexpr int64_t kMaxRank = 64;        // NumPy's NPY_MAXDIMS is 32 (64 in NumPy 2)

std::optional<DType> dtype_from_descr(const std::string& d) {
  if (d == "<f2") return DType::kF16;
  if (d == "<f4") return DType::kF32;
  if (d == "<f8") return DType::kF64;
  if (d == "<i4") return DType::kI32;
  if (d == "<i8") return DType::kI64;
  return std::nullopt;
}

// The header text for messages: printable, one line, bounded length, padding dropped.
std::string snippet(const std::string& text) {
  constexpr std::size_t kMax = 160;
  std::size_t end = text.size();
  while (end > 0 && (text[end - 1] == ' ' || text[end - 1] == '\n')) --end;
  if (end <= kMax) return io_detail::printable(text.substr(0, end));
  return io_detail::printable(text.substr(0, kMax)) + "...";
}

// The header dict, parsed.
struct NpyHeader {
  std::optional<std::string> descr;
  std::optional<bool> fortran_order;
  std::optional<std::vector<int64_t>> shape;
};

// Recursive-descent parser for the small subset of Python literal syntax NumPy writes: a dict
// with string keys whose values are strings, True/False, or tuples of non-negative integers.
class HeaderParser {
 public:
  HeaderParser(const std::string& text, const std::string& what) : s_(text), what_(what) {}

  NpyHeader parse() {
    NpyHeader h;
    skip_ws();
    expect('{');
    skip_ws();
    while (!at('}')) {
      const std::string key = parse_string("a quoted key");
      skip_ws();
      expect(':');
      skip_ws();
      if (key == "descr") {
        if (h.descr) fail("duplicate key 'descr'");
        if (at('[')) {
          // A list here is a structured dtype, which we do not read.
          throw IoError(what_ + ": unsupported dtype (structured); " +
                        "expected one of <f2 <f4 <f8 <i4 <i8");
        }
        h.descr = parse_string("a quoted dtype string");
      } else if (key == "fortran_order") {
        if (h.fortran_order) fail("duplicate key 'fortran_order'");
        h.fortran_order = parse_bool();
      } else if (key == "shape") {
        if (h.shape) fail("duplicate key 'shape'");
        h.shape = parse_shape();
      } else {
        fail("unexpected key '" + io_detail::printable(key) + "'");
      }
      skip_ws();
      if (at(',')) {
        ++pos_;
        skip_ws();
      } else if (!at('}')) {
        fail("expected ',' or '}'");
      }
    }
    ++pos_;
    skip_ws();
    if (pos_ != s_.size()) fail("unexpected text after '}'");
    if (!h.descr) fail("missing key 'descr'");
    if (!h.fortran_order) fail("missing key 'fortran_order'");
    if (!h.shape) fail("missing key 'shape'");
    return h;
  }

 private:
  [[noreturn]] void fail(const std::string& msg) const {
    throw IoError(what_ + ": malformed .npy header: " + msg + " at offset " + std::to_string(pos_) +
                  " in \"" + snippet(s_) + "\"");
  }

  bool at(char c) const { return pos_ < s_.size() && s_[pos_] == c; }

  void expect(char c) {
    if (!at(c)) fail(std::string("expected '") + c + "'");
    ++pos_;
  }

  void skip_ws() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) {
      ++pos_;
    }
  }

  // A single- or double-quoted string without escapes (NumPy never writes any).
  std::string parse_string(const char* expected) {
    if (!at('\'') && !at('"')) fail(std::string("expected ") + expected);
    const char quote = s_[pos_++];
    const std::size_t start = pos_;
    while (pos_ < s_.size() && s_[pos_] != quote) {
      if (s_[pos_] == '\\') fail("escape sequences in strings are not supported");
      ++pos_;
    }
    if (pos_ >= s_.size()) fail("unterminated string");
    std::string out = s_.substr(start, pos_ - start);
    ++pos_;
    return out;
  }

  bool parse_bool() {
    if (s_.compare(pos_, 4, "True") == 0) {
      pos_ += 4;
      return true;
    }
    if (s_.compare(pos_, 5, "False") == 0) {
      pos_ += 5;
      return false;
    }
    fail("expected True or False");
  }

  // "()", "(5,)", "(2, 3)", "(2, 3,)"; Python 2 long suffixes ("3L") are accepted.
  std::vector<int64_t> parse_shape() {
    std::vector<int64_t> dims;
    expect('(');
    skip_ws();
    while (!at(')')) {
      dims.push_back(parse_dim());
      if (static_cast<int64_t>(dims.size()) > kMaxRank) {
        fail("more than " + std::to_string(kMaxRank) + " dimensions");
      }
      skip_ws();
      if (at(',')) {
        ++pos_;
        skip_ws();
      } else if (!at(')')) {
        fail("expected ',' or ')' in shape");
      } else if (dims.size() == 1) {
        fail("a 1-element shape needs a trailing comma, as in (5,)");
      }
    }
    ++pos_;
    return dims;
  }

  int64_t parse_dim() {
    if (at('-')) {
      throw IoError(what_ + ": negative dimension in .npy shape \"" + snippet(s_) + "\"");
    }
    if (pos_ >= s_.size() || s_[pos_] < '0' || s_[pos_] > '9') fail("expected a dimension");
    int64_t v = 0;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      const int digit = s_[pos_] - '0';
      if (v > (std::numeric_limits<int64_t>::max() - digit) / 10) {
        throw IoError(what_ + ": dimension too large in .npy shape \"" + snippet(s_) + "\"");
      }
      v = v * 10 + digit;
      ++pos_;
    }
    if (at('L')) ++pos_;
    return v;
  }

  const std::string& s_;
  const std::string& what_;
  std::size_t pos_ = 0;
};

std::string shape_tuple(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (d) s += ", ";
    s += std::to_string(shape[d]);
  }
  if (shape.size() == 1) s += ",";
  return s + ")";
}

}  // namespace

NpyView parse_npy_view(const unsigned char* data, std::size_t size, const std::string& what) {
  if (size < sizeof(kMagic) || std::memcmp(data, kMagic, sizeof(kMagic)) != 0) {
    throw IoError(what + ": not a .npy file (missing \\x93NUMPY magic)");
  }
  if (size < 8) {
    throw IoError(what + ": truncated header: file has " + std::to_string(size) +
                  " bytes, no format version");
  }
  const int major = data[6];
  const int minor = data[7];
  if ((major != 1 && major != 2 && major != 3) || minor != 0) {
    throw IoError(what + ": unsupported .npy format version " + std::to_string(major) + "." +
                  std::to_string(minor) + " (expected 1.0, 2.0 or 3.0)");
  }
  const std::size_t prelude = major == 1 ? kPreludeV1 : kPreludeV2;
  if (size < prelude) {
    throw IoError(what + ": truncated header: file has " + std::to_string(size) +
                  " bytes, the .npy prelude needs " + std::to_string(prelude));
  }
  std::size_t header_len = static_cast<std::size_t>(data[8]) | (std::size_t{data[9]} << 8);
  if (major != 1) header_len |= (std::size_t{data[10]} << 16) | (std::size_t{data[11]} << 24);
  if (header_len > size - prelude) {
    throw IoError(what + ": truncated header: header length " + std::to_string(header_len) +
                  " exceeds the " + std::to_string(size - prelude) + " bytes after the prelude");
  }
  const std::string text(reinterpret_cast<const char*>(data + prelude), header_len);
  const NpyHeader h = HeaderParser(text, what).parse();

  const std::string& descr = *h.descr;
  const std::optional<DType> dtype = dtype_from_descr(descr);
  if (!dtype) {
    const std::string d = io_detail::printable(descr);
    if (!descr.empty() && descr[0] == '>') {
      throw IoError(what + ": big-endian dtype '" + d +
                    "' not supported; save little-endian data (e.g. arr.astype('<f4'))");
    }
    throw IoError(what + ": unsupported dtype '" + d + "'; expected one of <f2 <f4 <f8 <i4 <i8");
  }
  if (*h.fortran_order) {
    throw IoError(what + ": fortran_order True is not supported; save a C-order array " +
                  "(np.ascontiguousarray)");
  }
  NpyView t;
  t.dtype = *dtype;
  t.shape = *h.shape;
  int64_t numel = 0;
  int64_t nbytes = 0;
  if (!io_detail::checked_nbytes(t.shape, dtype_size(t.dtype), &numel, &nbytes)) {
    throw IoError(what + ": shape " + io_detail::dims_str(t.shape) + " of " + dtype_name(t.dtype) +
                  " overflows the element count");
  }
  const std::size_t offset = prelude + header_len;
  const std::size_t have = size - offset;
  if (static_cast<uint64_t>(nbytes) > have) {
    throw IoError(what + ": truncated: header declares " + std::to_string(nbytes) +
                  " bytes of data, file has " + std::to_string(have));
  }
  if (static_cast<uint64_t>(nbytes) < have) {
    throw IoError(what + ": trailing data: header declares " + std::to_string(nbytes) +
                  " bytes of data, file has " + std::to_string(have));
  }
  t.data = data + offset;
  t.nbytes = static_cast<std::size_t>(nbytes);
  return t;
}

Tensor parse_npy(const unsigned char* data, std::size_t size, const std::string& what) {
  return parse_npy_view(data, size, what).to_tensor();
}

NpyView map_npy(const std::string& path) {
  std::shared_ptr<const MappedFile> file = MappedFile::map(path);
  NpyView v = parse_npy_view(file->data(), file->size(), path);
  v.file = std::move(file);
  return v;
}

Tensor read_npy(const std::string& path) { return map_npy(path).to_tensor(); }

int64_t NpyView::numel() const {
  int64_t n = 0;
  int64_t bytes = 0;
  if (!io_detail::checked_nbytes(shape, 1, &n, &bytes)) {
    throw ShapeError("tensor: shape " + io_detail::dims_str(shape) +
                     " has a negative or too large dimension");
  }
  return n;
}

NpyView view_of(Tensor t) {
  auto owned = std::make_shared<const Tensor>(std::move(t));
  NpyView v;
  v.dtype = owned->dtype;
  v.shape = owned->shape;
  v.data = owned->bytes.data();
  v.nbytes = owned->bytes.size();
  v.owned = std::move(owned);
  return v;
}

Tensor NpyView::to_tensor() const {
  require_allocation((file ? file->path() + ": " : std::string()) + "copying the " +
                         io_detail::dims_str(shape) + " " + dtype_name(dtype) + " tensor",
                     static_cast<int64_t>(nbytes));
  Tensor t;
  t.dtype = dtype;
  t.shape = shape;
  if (nbytes > 0) t.bytes.assign(data, data + nbytes);
  return t;
}

namespace {

template <class T>
const T* typed(const NpyView& v, DType want) {
  if (std::endian::native != std::endian::little || v.dtype != want) return nullptr;
  if (v.nbytes == 0) {
    static const T kEmpty{};
    return &kEmpty;  // non-null: an empty tensor is present, not missing
  }
  if (reinterpret_cast<std::uintptr_t>(v.data) % alignof(T) != 0) return nullptr;
  return reinterpret_cast<const T*>(v.data);
}

}  // namespace

template <>
const float* NpyView::as<float>() const {
  return typed<float>(*this, DType::kF32);
}
template <>
const double* NpyView::as<double>() const {
  return typed<double>(*this, DType::kF64);
}
template <>
const int64_t* NpyView::as<int64_t>() const {
  return typed<int64_t>(*this, DType::kI64);
}
template <>
const int32_t* NpyView::as<int32_t>() const {
  return typed<int32_t>(*this, DType::kI32);
}

namespace {

// The prelude and padded header of a .npy holding `shape` of `descr` (the data follows).
std::vector<unsigned char> npy_header(const char* descr, const std::vector<int64_t>& shape) {
  std::string header = std::string("{'descr': '") + descr +
                       "', 'fortran_order': False, 'shape': " + shape_tuple(shape) + ", }";
  // Like NumPy: pad with spaces and a final '\n' so the data starts at a multiple of 64 bytes;
  // fall back to version 2.0 only when the header does not fit a 16-bit length.
  std::size_t prelude = kPreludeV1;
  std::size_t total = (prelude + header.size() + 1 + 63) / 64 * 64;
  if (total - prelude > 0xffff) {
    prelude = kPreludeV2;
    total = (prelude + header.size() + 1 + 63) / 64 * 64;
  }
  header.append(total - prelude - header.size() - 1, ' ');
  header += '\n';

  std::vector<unsigned char> out(total);
  std::memcpy(out.data(), kMagic, sizeof(kMagic));
  out[6] = prelude == kPreludeV1 ? 1 : 2;
  out[7] = 0;
  for (std::size_t i = 8; i < prelude; ++i) {
    out[i] = static_cast<unsigned char>(header.size() >> (8 * (i - 8)));
  }
  std::memcpy(out.data() + prelude, header.data(), header.size());
  return out;
}

// The descr of `dtype` and the byte count of `shape`, validated.
const char* checked_descr(DType dtype, const std::vector<int64_t>& shape, const std::string& what,
                          int64_t* nbytes) {
  const char* descr = dtype_npy_descr(dtype);
  if (!descr) {
    throw IoError(what + ": " + dtype_name(dtype) + " has no .npy dtype; use .safetensors");
  }
  int64_t numel = 0;
  if (!io_detail::checked_nbytes(shape, dtype_size(dtype), &numel, nbytes)) {
    throw IoError(what + ": shape " + io_detail::dims_str(shape) +
                  " has a negative or too large dimension");
  }
  return descr;
}

std::vector<unsigned char> encode(const Tensor& t, const std::string& what) {
  int64_t nbytes = 0;
  const char* descr = checked_descr(t.dtype, t.shape, what, &nbytes);
  if (static_cast<uint64_t>(nbytes) != t.bytes.size()) {
    throw IoError(what + ": " + std::to_string(t.bytes.size()) + " bytes do not match " +
                  dtype_name(t.dtype) + " x shape " + t.shape_str() + " (" +
                  std::to_string(nbytes) + " bytes)");
  }
  std::vector<unsigned char> out = npy_header(descr, t.shape);
  out.insert(out.end(), t.bytes.begin(), t.bytes.end());
  return out;
}

}  // namespace

std::vector<unsigned char> encode_npy(const Tensor& t) { return encode(t, "encode_npy"); }

void write_npy(const std::string& path, const Tensor& t) {
  int64_t nbytes = 0;
  checked_descr(t.dtype, t.shape, path, &nbytes);
  if (static_cast<uint64_t>(nbytes) != t.bytes.size()) {
    throw IoError(path + ": " + std::to_string(t.bytes.size()) + " bytes do not match " +
                  dtype_name(t.dtype) + " x shape " + t.shape_str() + " (" +
                  std::to_string(nbytes) + " bytes)");
  }
  write_npy(path, t.dtype, t.shape, t.bytes.data());
}

void write_npy(const std::string& path, DType dtype, const std::vector<int64_t>& shape,
               const void* data) {
  int64_t nbytes = 0;
  const char* descr = checked_descr(dtype, shape, path, &nbytes);
  if (std::endian::native != std::endian::little) {
    throw IoError(path + ": writing .npy files needs a little-endian host");
  }
  const std::vector<unsigned char> header = npy_header(descr, shape);
  write_file_atomic(path,
                    {{header.data(), header.size()}, {data, static_cast<std::size_t>(nbytes)}});
}

const char* dtype_npy_descr(DType t) {
  switch (t) {
    case DType::kF16:
      return "<f2";
    case DType::kF32:
      return "<f4";
    case DType::kF64:
      return "<f8";
    case DType::kI32:
      return "<i4";
    case DType::kI64:
      return "<i8";
    default:
      return nullptr;  // bfloat16 has no NumPy dtype
  }
}

}  // namespace posenc
