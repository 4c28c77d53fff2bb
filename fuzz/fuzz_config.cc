// fuzz/fuzz_config.cc - the config.json reader on arbitrary text, and what the commands derive
// from an accepted config (its RoPE frequencies, its attention scheme): a result or a
// posenc::Error; never another exception, a crash or UB.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "posenc/config.h"
#include "posenc/error.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  posenc::fuzz::limit_allocations();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const posenc::ModelConfig cfg = posenc::parse_model_config(text, "fuzz.json");
    if (cfg.scheme == posenc::ModelScheme::kRope) {
      for (const int64_t seq_len : {int64_t{0}, int64_t{4096}, int64_t{1} << 20}) {
        try {
          (void)posenc::model_rope_frequencies(cfg, seq_len, posenc::RopeAngles::kAccurate);
        } catch (const posenc::Error&) {
        }
      }
    }
  } catch (const posenc::Error&) {
  }
  return 0;
}
