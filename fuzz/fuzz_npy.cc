// fuzz/fuzz_npy.cc - the .npy reader on arbitrary bytes: it returns a valid view or throws
// posenc::Error; nothing else (no other exception, no out-of-bounds read, no UB).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz_util.h"
#include "posenc/error.h"
#include "posenc/io.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  posenc::fuzz::limit_allocations();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  // A copy of exactly `size` bytes: ASan then catches a read one past the end.
  const std::vector<unsigned char> bytes(data, data + size);
  try {
    const posenc::NpyView v = posenc::parse_npy_view(bytes.data(), bytes.size(), "fuzz.npy");
    // The view must lie inside the input and match dtype x shape.
    if (v.nbytes > 0 && (v.data < bytes.data() || v.data + v.nbytes > bytes.data() + size)) {
      __builtin_trap();
    }
    if (static_cast<std::size_t>(v.numel()) *
            static_cast<std::size_t>(posenc::dtype_size(v.dtype)) !=
        v.nbytes) {
      __builtin_trap();
    }
    const posenc::Tensor t = v.to_tensor();
    if (t.dtype == posenc::DType::kI32 || t.dtype == posenc::DType::kI64) {
      (void)t.to_i64("fuzz.npy");
    } else {
      (void)t.to_f32("fuzz.npy");
    }
    // What posenc writes, it reads back identically.
    const std::vector<unsigned char> again = posenc::encode_npy(t);
    const posenc::Tensor u = posenc::parse_npy(again.data(), again.size(), "again.npy");
    if (u.shape != t.shape || u.bytes != t.bytes) __builtin_trap();
  } catch (const posenc::Error&) {
  }
  return 0;
}
