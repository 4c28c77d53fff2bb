// Whole-file reads, atomic writes, and the owning Tensor's element conversions
// (docs/cli.md, File conventions).
#include <fcntl.h>
#include <sys/mman.h>
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
#include "posenc/half.h"
#include "posenc/io.h"
#include "posenc/size.h"

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

// IEEE binary16 and bfloat16 -> binary32, exact for every input (posenc/half.h).
float half_to_float(uint16_t h) { return to_float(f16{h}); }
float bf16_to_float(uint16_t h) { return to_float(bf16{h}); }

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

// Element bytes of some dtype and shape (a Tensor's or an NpyView's), not owned.
struct Raw {
  DType dtype;
  const std::vector<int64_t>& shape;
  const unsigned char* data;
  std::size_t size;
};

// Checks that `r` holds exactly dtype x shape and returns the element count; the output buffer
// of that many `out_bytes`-byte elements must fit the allocation limit.
std::size_t checked_count(const Raw& r, const std::string& what, int64_t out_bytes) {
  int64_t n = 0;
  int64_t nbytes = 0;
  if (!io_detail::checked_nbytes(r.shape, dtype_size(r.dtype), &n, &nbytes)) {
    throw IoError(what + ": shape " + io_detail::dims_str(r.shape) +
                  " has a negative or too large dimension");
  }
  if (static_cast<uint64_t>(nbytes) != r.size) {
    throw IoError(what + ": " + std::to_string(r.size) + " bytes do not match " +
                  dtype_name(r.dtype) + " x shape " + io_detail::dims_str(r.shape) + " (" +
                  std::to_string(nbytes) + " bytes)");
  }
  checked_elements(what + ": converting", {{"elements", n}}, out_bytes);
  return static_cast<std::size_t>(n);
}

template <class Out>
std::vector<Out> float_values(const Raw& r, const std::string& what) {
  const std::size_t n = checked_count(r, what, sizeof(Out));
  const unsigned char* p = r.data;
  std::vector<Out> out(n);
  switch (r.dtype) {
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
      throw IoError(what + ": expected a floating-point tensor, got " + dtype_name(r.dtype));
  }
  return out;
}

std::vector<int64_t> int_values(const Raw& r, const std::string& what) {
  if (r.dtype != DType::kI32 && r.dtype != DType::kI64) {
    throw IoError(what + ": expected an integer tensor (int32 or int64), got " +
                  dtype_name(r.dtype));
  }
  const std::size_t n = checked_count(r, what, 8);
  const unsigned char* p = r.data;
  std::vector<int64_t> out(n);
  if (r.dtype == DType::kI32) {
    for (std::size_t i = 0; i < n; ++i) {
      out[i] = std::bit_cast<int32_t>(load_le<uint32_t>(p + 4 * i));
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) {
      out[i] = std::bit_cast<int64_t>(load_le<uint64_t>(p + 8 * i));
    }
  }
  return out;
}

Raw raw(const Tensor& t) { return {t.dtype, t.shape, t.bytes.data(), t.bytes.size()}; }
Raw raw(const NpyView& v) { return {v.dtype, v.shape, v.data, v.nbytes}; }

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
  return float_values<float>(raw(*this), what);
}

std::vector<double> Tensor::to_f64(const std::string& what) const {
  return float_values<double>(raw(*this), what);
}

std::vector<int64_t> Tensor::to_i64(const std::string& what) const {
  return int_values(raw(*this), what);
}

std::vector<float> NpyView::to_f32(const std::string& what) const {
  return float_values<float>(raw(*this), what);
}

std::vector<double> NpyView::to_f64(const std::string& what) const {
  return float_values<double>(raw(*this), what);
}

std::vector<int64_t> NpyView::to_i64(const std::string& what) const {
  return int_values(raw(*this), what);
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

// The kind of a non-regular file, for messages.
const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

// Opens `path` for reading, refusing anything but a regular file no larger than `max_bytes`.
// O_NONBLOCK: opening a FIFO without a writer must not hang before fstat can refuse it.
int open_regular(const std::string& path, std::size_t max_bytes, std::size_t* size) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) throw IoError(path + ": cannot open (" + errno_text(errno) + ")");
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw IoError(path + ": cannot stat (" + errno_text(err) + ")");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw IoError(path + ": is " + file_kind(st.st_mode) +
                  ", not a regular file; inputs must be regular files with a known size");
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    throw IoError(path + ": file is larger than the limit of " + std::to_string(max_bytes) +
                  " bytes (it has " + std::to_string(st.st_size) + ")");
  }
  *size = static_cast<std::size_t>(st.st_size);
  return fd;
}

}  // namespace

std::vector<unsigned char> read_file(const std::string& path, std::size_t max_bytes) {
  std::size_t size = 0;
  Fd fd(open_regular(path, max_bytes, &size));
  require_allocation(path + ": reading the file", static_cast<int64_t>(size));
  // One spare byte detects a file that grew since fstat.
  std::vector<unsigned char> data(size + 1);
  std::size_t used = 0;
  for (;;) {
    const ssize_t got = ::read(fd.get(), data.data() + used, data.size() - used);
    if (got < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      throw IoError(path + ": read error (" + errno_text(errno) + ")");
    }
    if (got == 0) break;
    used += static_cast<std::size_t>(got);
    if (used > size) throw IoError(path + ": the file grew while it was read");
  }
  data.resize(used);
  return data;
}

std::shared_ptr<const MappedFile> MappedFile::map(const std::string& path, std::size_t max_bytes) {
  std::size_t size = 0;
  Fd fd(open_regular(path, max_bytes, &size));
  std::shared_ptr<MappedFile> m(new MappedFile());
  m->path_ = path;
  if (size > 0) {
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (p == MAP_FAILED) throw IoError(path + ": cannot map the file (" + errno_text(errno) + ")");
    m->map_ = p;
    m->data_ = static_cast<const unsigned char*>(p);
    m->size_ = size;
    // Inputs are read front to back once.
    ::madvise(p, size, MADV_SEQUENTIAL);
  }
  return m;
}

MappedFile::~MappedFile() {
  if (map_ != nullptr) ::munmap(map_, size_);
}

namespace {

// Throws IoError when `path` exists and is not a regular file (lstat: a symlink counts).
void require_replaceable(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    throw IoError(path + ": exists and is " + file_kind(st.st_mode) +
                  "; outputs only create or replace regular files");
  }
}

// The longest file name the folder `dir` accepts (NAME_MAX, usually 255).
std::size_t name_max(const std::string& dir) {
  const long n = ::pathconf(dir.c_str(), _PC_NAME_MAX);
  return n > 0 ? static_cast<std::size_t>(n) : 255;
}

std::string write_error_text(int err, std::size_t size) {
  if (err == EFBIG) {
    return "file too large: the process's file-size limit (ulimit -f) is below the " +
           std::to_string(size) + " bytes to write";
  }
  if (err == ENOSPC) return "no space left on the device for " + std::to_string(size) + " bytes";
  return "write error (" + errno_text(err) + ")";
}

}  // namespace

void check_output_path(const std::string& path) {
  if (path.empty()) throw IoError("write: empty output path");
  require_replaceable(path);
}

void write_file_atomic(const std::string& path, const unsigned char* data, std::size_t size) {
  write_file_atomic(path, std::vector<ByteSpan>{{data, size}});
}

void write_file_atomic(const std::string& path, const std::vector<ByteSpan>& parts) {
  if (path.empty()) throw IoError("write: empty output path");
  const std::size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  if (name.empty() || name == "." || name == "..") {
    throw IoError(path + ": not a file name");
  }
  require_replaceable(path);
  std::size_t size = 0;
  for (const ByteSpan& p : parts) size += p.size;
  // "." + stem + ".tmpXXXXXX" within the folder's name limit.
  constexpr std::size_t kFixed = 1 + 10;  // "." and ".tmpXXXXXX"
  const std::size_t limit = name_max(dir);
  const std::string stem =
      name.substr(0, limit > kFixed ? std::min(name.size(), limit - kFixed) : 0);
  std::string tmp = (slash == std::string::npos ? std::string() : dir) + "." + stem + ".tmpXXXXXX";
  std::vector<char> tmpl(tmp.begin(), tmp.end());
  tmpl.push_back('\0');
  const int fd_raw = ::mkstemp(tmpl.data());
  if (fd_raw < 0) {
    throw IoError(path + ": cannot create a temporary file in " + dir + " (" + errno_text(errno) +
                  ")");
  }
  tmp.assign(tmpl.data());
  Fd fd(fd_raw);
  const auto fail = [&](const std::string& what) {
    ::unlink(tmp.c_str());
    return IoError(path + ": " + what);
  };

  // mkstemp creates mode 0600; give the file the mode an ordinary create would, or keep the
  // mode of the file it replaces.
  struct stat st;
  mode_t mode = 0666 & ~current_umask();
  if (::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) mode = st.st_mode & 07777;
  if (::fchmod(fd.get(), mode) != 0) {
    throw fail("cannot set permissions (" + errno_text(errno) + ")");
  }

  for (const ByteSpan& part : parts) {
    const auto* bytes = static_cast<const unsigned char*>(part.data);
    std::size_t done = 0;
    while (done < part.size) {
      const std::size_t want = std::min<std::size_t>(part.size - done, std::size_t{1} << 30);
      const ssize_t put = ::write(fd.get(), bytes + done, want);
      if (put < 0) {
        if (errno == EINTR) continue;
        throw fail(write_error_text(errno, size));
      }
      if (put == 0) throw fail(write_error_text(EIO, size));
      done += static_cast<std::size_t>(put);
    }
  }
  if (const int err = fd.close(); err != 0) throw fail(write_error_text(err, size));
  // Checked again: a symlink or FIFO may have appeared while we wrote.
  try {
    require_replaceable(path);
  } catch (const IoError&) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    throw fail("cannot rename into place (" + errno_text(errno) + ")");
  }
}

}  // namespace posenc
