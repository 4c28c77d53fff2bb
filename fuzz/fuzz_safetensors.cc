// fuzz/fuzz_safetensors.cc - the .safetensors reader on arbitrary bytes: a valid file or a
// posenc::Error; nothing else.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz_util.h"
#include "posenc/error.h"
#include "posenc/io.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  posenc::fuzz::limit_allocations();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const std::vector<unsigned char> bytes(data, data + size);
  try {
    const posenc::SafetensorsFile f =
        posenc::parse_safetensors(bytes.data(), bytes.size(), "fuzz.safetensors");
    for (const auto& [name, t] : f.tensors) {
      if (t.dtype == posenc::DType::kI32 || t.dtype == posenc::DType::kI64) {
        (void)t.to_i64(name);
      } else {
        (void)t.to_f64(name);
      }
    }
    // Round trip: what was accepted encodes and reads back to the same tensors.
    const std::vector<unsigned char> again = posenc::encode_safetensors(f);
    const posenc::SafetensorsFile g =
        posenc::parse_safetensors(again.data(), again.size(), "again.safetensors");
    if (g.tensors.size() != f.tensors.size() || g.metadata != f.metadata) __builtin_trap();
    for (const auto& [name, t] : f.tensors) {
      const auto it = g.tensors.find(name);
      if (it == g.tensors.end() || it->second.shape != t.shape || it->second.bytes != t.bytes) {
        __builtin_trap();
      }
    }
  } catch (const posenc::Error&) {
  }
  return 0;
}
