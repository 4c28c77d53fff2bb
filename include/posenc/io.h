// posenc/io.h - tensor files: NumPy .npy and .safetensors (docs/cli.md, File conventions).
//
// Nothing else in posenc reads or writes bytes. Readers validate everything (magic, header,
// dtype, shape, declared size against the real size, offsets) and throw IoError with a message
// that names the file and the problem. Writers are atomic: the data goes to a temporary file in
// the destination's folder which is renamed over the destination only once complete, so a failed
// write never leaves a partial or stale file behind.
//
// Hostile input (docs/reliability.md): inputs must be regular files (FIFOs, devices, sockets and
// directories are refused by name, without blocking) no larger than their header declares plus a
// bounded slack; .npy files are memory-mapped read-only rather than copied. Outputs must be new
// names or existing regular files (a symlink, FIFO or device is refused, never replaced); a
// file-size limit (EFBIG) or a full disk fails the write with the temporary file removed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "posenc/dtype.h"
#include "posenc/tensor.h"

namespace posenc {

// "float32", "int64", ... (NumPy's names, for messages; files store "<f4" / "F32") and the
// element size in bytes.
const char* dtype_name(DType t);
int64_t dtype_size(DType t);
// The safetensors dtype name ("F32", "BF16", ...).
const char* dtype_safetensors_name(DType t);
// The .npy descr ("<f4", ...); nullptr for bfloat16, which NumPy has no dtype for.
const char* dtype_npy_descr(DType t);

// An owning dense tensor in C order, little-endian element bytes.
struct Tensor {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;

  // Element count (1 for a scalar); throws ShapeError on a negative or overflowing shape.
  int64_t numel() const;
  std::string shape_str() const;  // "[2, 3]"

  // Element conversions. to_f32/to_f64 accept every float dtype (f16 and bf16 widen exactly);
  // to_i64 accepts int32/int64. They throw IoError on other dtypes, or when `bytes` does not
  // hold exactly dtype x shape, naming `what`.
  std::vector<float> to_f32(const std::string& what = "tensor") const;
  std::vector<double> to_f64(const std::string& what = "tensor") const;
  std::vector<int64_t> to_i64(const std::string& what = "tensor") const;

  // Throw ShapeError unless values.size() equals the shape's element count.
  static Tensor from_f32(std::vector<int64_t> shape, const std::vector<float>& values);
  static Tensor from_f64(std::vector<int64_t> shape, const std::vector<double>& values);
  static Tensor from_i64(std::vector<int64_t> shape, const std::vector<int64_t>& values);
};

// A whole regular file mapped read-only into memory (zero copy). The mapping lives as long as the
// last shared_ptr to it. Thread-safe to read. If another process truncates the file while it is
// mapped, reading the lost pages raises SIGBUS: posenc reads its inputs, it does not lock them.
class MappedFile {
 public:
  // Throws IoError: missing or unreadable, not a regular file (named: "a FIFO", "a character
  // device", ...), or larger than `max_bytes`.
  static std::shared_ptr<const MappedFile> map(const std::string& path,
                                               std::size_t max_bytes = std::size_t{1} << 40);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const unsigned char* data() const { return data_; }
  std::size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile() = default;
  const unsigned char* data_ = nullptr;
  std::size_t size_ = 0;
  void* map_ = nullptr;  // nullptr for an empty file
  std::string path_;
};

// A .npy tensor whose element bytes stay where they are (in a mapped file or a caller's buffer).
struct NpyView {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const unsigned char* data = nullptr;  // dtype x shape bytes, little-endian, C order
  std::size_t nbytes = 0;
  std::shared_ptr<const MappedFile> file;  // keeps `data` alive (null when parsed from a buffer)
  std::shared_ptr<const Tensor> owned;     // or this tensor does (view_of)

  int64_t numel() const;
  // The elements as T (float for kF32, double for kF64, int64_t for kI64, int32_t for kI32)
  // without a copy, or nullptr when the dtype differs, the host is big-endian or `data` is not
  // aligned for T (NumPy and posenc align the data to 64 bytes; a hand-made header may not).
  template <class T>
  const T* as() const;
  // An owning copy.
  Tensor to_tensor() const;
  // Element conversions straight from the mapped bytes, as Tensor's (IoError naming `what`).
  std::vector<float> to_f32(const std::string& what = "tensor") const;
  std::vector<double> to_f64(const std::string& what = "tensor") const;
  std::vector<int64_t> to_i64(const std::string& what = "tensor") const;
};

// A view of an owned tensor (kept alive by the view), e.g. one read from a .safetensors file.
NpyView view_of(Tensor t);

// .npy (format versions 1.0, 2.0 and 3.0; dtypes <f2 <f4 <f8 <i4 <i8 only, so no big-endian or
// |-prefixed single-byte types; C order only). The writer emits version 1.0 like np.save (2.0
// only for a header over 64 KiB) and throws IoError for bfloat16, which NumPy lacks.
// map_npy maps the file and validates it (the file must hold exactly the declared data);
// read_npy copies the elements out of that mapping into an owning Tensor.
NpyView map_npy(const std::string& path);
Tensor read_npy(const std::string& path);
NpyView parse_npy_view(const unsigned char* data, std::size_t size, const std::string& what);
Tensor parse_npy(const unsigned char* data, std::size_t size, const std::string& what);
std::vector<unsigned char> encode_npy(const Tensor& t);
void write_npy(const std::string& path, const Tensor& t);  // atomic
// Writes `data` (dtype x shape bytes, host order) as a .npy without copying it (atomic).
void write_npy(const std::string& path, DType dtype, const std::vector<int64_t>& shape,
               const void* data);

// .safetensors: 8-byte little-endian header length, JSON header, data. Tensors F16, BF16, F32,
// F64, I32, I64. Offsets must lie inside the data, match dtype x shape and not overlap; names
// (and keys inside every object of the header) must be unique; the data section may exceed the
// tensors' bytes by at most kSafetensorsSlack bytes (padding, gaps).
struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;  // "__metadata__"
};
inline constexpr std::size_t kSafetensorsSlack = std::size_t{1} << 16;
SafetensorsFile read_safetensors(const std::string& path);
SafetensorsFile parse_safetensors(const unsigned char* data, std::size_t size,
                                  const std::string& what);
std::vector<unsigned char> encode_safetensors(const SafetensorsFile& f);
void write_safetensors(const std::string& path, const SafetensorsFile& f);  // atomic
// A tensor to write by reference: dtype x shape bytes (host order, little-endian hosts) at data.
struct TensorRef {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};
// Writes the tensors (sorted by name) straight from their memory, without assembling the file in
// memory first (atomic, like the overload above).
void write_safetensors(const std::string& path, const std::map<std::string, TensorRef>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Whole-file helpers. read_file throws IoError (missing, unreadable, not a regular file, larger
// than max_bytes).
std::vector<unsigned char> read_file(const std::string& path,
                                     std::size_t max_bytes = std::size_t{1} << 36);
// Atomic write of the concatenation of `parts` (or of one buffer). The temporary file is
// ".<name>.tmpXXXXXX" beside `path`, with <name> shortened so the temporary name always fits the
// folder's file-name limit. Throws IoError when `path` exists and is not a regular file, and on
// any write error (EFBIG names the file-size limit), removing the temporary file.
struct ByteSpan {
  const void* data;
  std::size_t size;
};
void write_file_atomic(const std::string& path, const std::vector<ByteSpan>& parts);
void write_file_atomic(const std::string& path, const unsigned char* data, std::size_t size);
// Throws IoError unless `path` is absent or a regular file (what write_file_atomic may replace);
// lets a command refuse a bad --out before it computes anything.
void check_output_path(const std::string& path);

}  // namespace posenc
