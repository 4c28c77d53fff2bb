// posenc/io.h - tensor files: NumPy .npy and .safetensors (SPEC §9).
//
// Nothing else in posenc reads or writes bytes. Readers validate everything (magic, header,
// dtype, shape, declared size against the real size, offsets) and throw IoError with a message
// that names the file and the problem. Writers are atomic: the data goes to a temporary file in
// the destination's folder which is renamed over the destination only once complete, so a failed
// write never leaves a partial or stale file behind.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "posenc/tensor.h"

namespace posenc {

enum class DType { kF16, kBF16, kF32, kF64, kI32, kI64 };

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

// .npy (format versions 1.0, 2.0 and 3.0; dtypes <f2 <f4 <f8 <i4 <i8 only, so no big-endian or
// |-prefixed single-byte types; C order only). The writer emits version 1.0 like np.save (2.0
// only for a header over 64 KiB) and throws IoError for bfloat16, which NumPy lacks.
Tensor read_npy(const std::string& path);
Tensor parse_npy(const unsigned char* data, std::size_t size, const std::string& what);
std::vector<unsigned char> encode_npy(const Tensor& t);
void write_npy(const std::string& path, const Tensor& t);  // atomic

// .safetensors: 8-byte little-endian header length, JSON header, data. Tensors F16, BF16, F32,
// F64, I32, I64. Offsets must lie inside the data, match dtype x shape and not overlap.
struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;  // "__metadata__"
};
SafetensorsFile read_safetensors(const std::string& path);
SafetensorsFile parse_safetensors(const unsigned char* data, std::size_t size,
                                  const std::string& what);
std::vector<unsigned char> encode_safetensors(const SafetensorsFile& f);
void write_safetensors(const std::string& path, const SafetensorsFile& f);  // atomic

// Whole-file helpers. read_file throws IoError (missing, unreadable, larger than max_bytes).
std::vector<unsigned char> read_file(const std::string& path,
                                     std::size_t max_bytes = std::size_t{1} << 36);
void write_file_atomic(const std::string& path, const unsigned char* data, std::size_t size);

}  // namespace posenc
