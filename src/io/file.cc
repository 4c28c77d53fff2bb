// Whole-file reads, atomic writes, and the owning Tensor's element conversions (SPEC §9).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "io/io_util.h"
#include "posenc/error.h"
#include "posenc/io.h"

namespace posenc {

// ---------------------------------------------------------------------------------------------
// DType and Tensor.

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF16:
      return "float16";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF32:
      return "float32";
    case DType::kF64:
      return "float64";
    case DType::kI32:
      return "int32";
    case DType::kI64:
      return "int64";
  }
  return "unknown";
}

int64_t dtype_size(DType t) {
  switch (t) {
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF64:
    case DType::kI64:
      return 8;
  }
  return 0;
}

// Helpers shared with npy.cc and safetensors.cc (io/io_util.h).
namespace io_detail {

std::string printable(const std::string& s) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      out += "\\x";
      out += kHex[u >> 4];
      out += kHex[u & 15];
    } else {
      out += c;
    }
  }
  return out;
}

std::string dims_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (d) s += ", ";
    s += std::to_string(shape[d]);
  }
  return s + "]";
}

bool checked_nbytes(const std::vector<int64_t>& shape, int64_t itemsize, int64_t* numel,
                    int64_t* nbytes) {
  // Like NumPy: zero-sized dimensions make the tensor empty, but the product of the other
  // dimensions times the item size must still be representable.
  int64_t bytes = itemsize;
  bool empty = false;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (d == 0) {
      empty = true;
      continue;
    }
    if (bytes > std::numeric_limits<int64_t>::max() / d) return false;
    bytes *= d;
  }
  if (empty) bytes = 0;
  *nbytes = bytes;
  *numel = itemsize > 0 ? bytes / itemsize : 0;
  return true;
}

}  // namespace io_detail

namespace {

// Little-endian element access that works on any host and any alignment.
template <class U>
U load_le(const unsigned char* p) {
  U v = 0;
  for (std::size_t i = 0; i < sizeof(U); ++i) {
    v = static_cast<U>(v | (static_cast<U>(p[i]) << (8 * i)));
  }
  return v;
}

// IEEE binary16 -> binary32, exact for every input.
float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in float32.
    const float mag = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -mag : mag;
  }
  if (exp == 31) {
    // Inf (mant == 0) or NaN; keep the payload.
    return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

// bfloat16 is the top half of a binary32.
float bf16_to_float(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

template <class U>
void store_le(unsigned char* p, U v) {
  for (std::size_t i = 0; i < sizeof(U); ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

}  // namespace

int64_t Tensor::numel() const {
  int64_t n = 0;
  int64_t nbytes = 0;
  if (!io_detail::checked_nbytes(shape, 1, &n, &nbytes)) {
    throw ShapeError("tensor: shape " + io_detail::dims_str(shape) +
                     " has a negative or too large dimension");
  }
  return n;
}

std::string Tensor::shape_str() const { return io_detail::dims_str(shape); }

namespace {

// Checks that `t.bytes` holds exactly dtype x shape and returns the element count.
std::size_t checked_count(const Tensor& t, const std::string& what) {
  int64_t n = 0;
  int64_t nbytes = 0;
  if (!io_detail::checked_nbytes(t.shape, dtype_size(t.dtype), &n, &nbytes)) {
    throw IoError(what + ": shape " + t.shape_str() + " has a negative or too large dimension");
  }
  if (static_cast<uint64_t>(nbytes) != t.bytes.size()) {
    throw IoError(what + ": " + std::to_string(t.bytes.size()) + " bytes do not match " +
                  dtype_name(t.dtype) + " x shape " + t.shape_str() + " (" +
                  std::to_string(nbytes) + " bytes)");
  }
  return static_cast<std::size_t>(n);
}

template <class Out>
std::vector<Out> float_values(const Tensor& t, const std::string& what) {
  const std::size_t n = checked_count(t, what);
  const unsigned char* p = t.bytes.data();
  std::vector<Out> out(n);
  switch (t.dtype) {
    case DType::kF16:
      for (std::size_t i = 0; i < n; ++i) {
        out[i] = static_cast<Out>(half_to_float(load_le<uint16_t>(p + 2 * i)));
      }
      break;
    case DType::kBF16:
      for (std::size_t i = 0; i < n; ++i) {
        out[i] = static_cast<Out>(bf16_to_float(load_le<uint16_t>(p + 2 * i)));
      }
      break;
    case DType::kF32:
      for (std::size_t i = 0; i < n; ++i) {
        out[i] = static_cast<Out>(std::bit_cast<float>(load_le<uint32_t>(p + 4 * i)));
      }
      break;
    case DType::kF64:
      for (std::size_t i = 0; i < n; ++i) {
        out[i] = static_cast<Out>(std::bit_cast<double>(load_le<uint64_t>(p + 8 * i)));
      }
      break;
    default:
      throw IoError(what + ": expected a floating-point tensor, got " + dtype_name(t.dtype));
  }
  return out;
}

template <class In, class U>
Tensor from_values(DType dtype, std::vector<int64_t> shape, const std::vector<In>& values,
                   const char* fn) {
  int64_t n = 0;
  int64_t nbytes = 0;
  if (!io_detail::checked_nbytes(shape, static_cast<int64_t>(sizeof(In)), &n, &nbytes)) {
    throw ShapeError(std::string(fn) + ": shape " + io_detail::dims_str(shape) +
                     " has a negative or too large dimension");
  }
  if (static_cast<uint64_t>(n) != values.size()) {
    throw ShapeError(std::string(fn) + ": " + std::to_string(values.size()) +
                     " values do not match shape " + io_detail::dims_str(shape) + " (" +
                     std::to_string(n) + " elements)");
  }
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.bytes.resize(static_cast<std::size_t>(nbytes));
  for (std::size_t i = 0; i < values.size(); ++i) {
    store_le<U>(t.bytes.data() + sizeof(In) * i, std::bit_cast<U>(values[i]));
  }
  return t;
}

}  // namespace

std::vector<float> Tensor::to_f32(const std::string& what) const {
  return float_values<float>(*this, what);
}

std::vector<double> Tensor::to_f64(const std::string& what) const {
  return float_values<double>(*this, what);
}

std::vector<int64_t> Tensor::to_i64(const std::string& what) const {
  const std::size_t n = checked_count(*this, what);
  const unsigned char* p = bytes.data();
  std::vector<int64_t> out(n);
  if (dtype == DType::kI32) {
    for (std::size_t i = 0; i < n; ++i) {
      out[i] = std::bit_cast<int32_t>(load_le<uint32_t>(p + 4 * i));
    }
  } else if (dtype == DType::kI64) {
    for (std::size_t i = 0; i < n; ++i) {
      out[i] = std::bit_cast<int64_t>(load_le<uint64_t>(p + 8 * i));
    }
  } else {
    throw IoError(what + ": expected an integer tensor (int32 or int64), got " + dtype_name(dtype));
  }
  return out;
}

Tensor Tensor::from_f32(std::vector<int64_t> shape, const std::vector<float>& values) {
  return from_values<float, uint32_t>(DType::kF32, std::move(shape), values, "from_f32");
}

Tensor Tensor::from_f64(std::vector<int64_t> shape, const std::vector<double>& values) {
  return from_values<double, uint64_t>(DType::kF64, std::move(shape), values, "from_f64");
}

Tensor Tensor::from_i64(std::vector<int64_t> shape, const std::vector<int64_t>& values) {
  return from_values<int64_t, uint64_t>(DType::kI64, std::move(shape), values, "from_i64");
}

// ---------------------------------------------------------------------------------------------
// Files.

namespace {

std::string errno_text(int err) { return std::strerror(err); }

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Closes now and reports the error, if any.
  int close() {
    const int fd = fd_;
    fd_ = -1;
    return ::close(fd) == 0 ? 0 : errno;
  }

 private:
  int fd_;
};

// The process umask without changing it (reading it through umask() is not thread-safe).
mode_t current_umask() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Umask:", 0) == 0) {
      return static_cast<mode_t>(std::strtoul(line.c_str() + 6, nullptr, 8) & 0777u);
    }
  }
  return 022;
}

}  // namespace

std::vector<unsigned char> read_file(const std::string& path, std::size_t max_bytes) {
  int fd_raw;
  do {
    fd_raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd_raw < 0 && errno == EINTR);
  if (fd_raw < 0) throw IoError(path + ": cannot open (" + errno_text(errno) + ")");
  Fd fd(fd_raw);

  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    throw IoError(path + ": cannot stat (" + errno_text(errno) + ")");
  }
  if (S_ISDIR(st.st_mode)) throw IoError(path + ": cannot read (Is a directory)");
  const auto too_large = [&] {
    return IoError(path + ": file is larger than the limit of " + std::to_string(max_bytes) +
                   " bytes");
  };
  // Read until end of file rather than trusting st_size: the file may change underneath us, and
  // pipes have no size. One spare byte detects growth without a second allocation.
  constexpr std::size_t kChunk = std::size_t{1} << 20;
  std::vector<unsigned char> data;
  if (S_ISREG(st.st_mode)) {
    if (static_cast<uint64_t>(st.st_size) > max_bytes) throw too_large();
    data.resize(static_cast<std::size_t>(st.st_size) + 1);
  } else {
    data.resize(kChunk);
  }
  std::size_t used = 0;
  for (;;) {
    if (used == data.size()) data.resize(used + std::max(kChunk, used / 2));
    const ssize_t got = ::read(fd.get(), data.data() + used, data.size() - used);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw IoError(path + ": read error (" + errno_text(errno) + ")");
    }
    if (got == 0) break;
    used += static_cast<std::size_t>(got);
    if (used > max_bytes) throw too_large();
  }
  data.resize(used);
  return data;
}

void write_file_atomic(const std::string& path, const unsigned char* data, std::size_t size) {
  if (path.empty()) throw IoError("write: empty output path");
  const std::size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  if (name.empty() || name == "." || name == "..") {
    throw IoError(path + ": not a file name");
  }
  std::string tmp = (slash == std::string::npos ? std::string() : dir) + "." + name + ".tmpXXXXXX";
  std::vector<char> tmpl(tmp.begin(), tmp.end());
  tmpl.push_back('\0');
  const int fd_raw = ::mkstemp(tmpl.data());
  if (fd_raw < 0) {
    throw IoError(path + ": cannot create a temporary file in " + dir + " (" + errno_text(errno) +
                  ")");
  }
  tmp.assign(tmpl.data());
  Fd fd(fd_raw);
  const auto fail = [&](const std::string& what, int err) {
    ::unlink(tmp.c_str());
    return IoError(path + ": " + what + " (" + errno_text(err) + ")");
  };

  // mkstemp creates mode 0600; give the file the mode an ordinary create would, or keep the
  // mode of the file it replaces.
  struct stat st;
  mode_t mode = 0666 & ~current_umask();
  if (::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) mode = st.st_mode & 07777;
  if (::fchmod(fd.get(), mode) != 0) throw fail("cannot set permissions", errno);

  std::size_t done = 0;
  while (done < size) {
    const std::size_t want = std::min<std::size_t>(size - done, std::size_t{1} << 30);
    const ssize_t put = ::write(fd.get(), data + done, want);
    if (put < 0) {
      if (errno == EINTR) continue;
      throw fail("write error", errno);
    }
    if (put == 0) throw fail("write error", EIO);
    done += static_cast<std::size_t>(put);
  }
  if (const int err = fd.close(); err != 0) throw fail("write error on close", err);
  if (::rename(tmp.c_str(), path.c_str()) != 0) throw fail("cannot rename into place", errno);
}

}  // namespace posenc
