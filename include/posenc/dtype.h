// posenc/dtype.h - the element types posenc reads, computes in and writes: one enum for files
// (posenc/io.h), the half-precision entry points and the kernels' parameter structs.
#pragma once

#include <cstdint>

namespace posenc {

// kF16: IEEE binary16; kBF16: bfloat16 (the top half of a float32); kF32, kF64: IEEE binary32 and
// binary64; kI32, kI64: little-endian integers (position ids).
enum class DType : uint8_t { kF16, kBF16, kF32, kF64, kI32, kI64 };

}  // namespace posenc
