// src/kernels/simd.cc - POSENC_SIMD_TARGET and target names (see simd.h).
#include "kernels/simd.h"

#include <cstdlib>
#include <mutex>

#include "hwy/highway.h"
#include "hwy/targets.h"
#include "posenc/error.h"

namespace posenc::kernels {
namespace {

void apply_env_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("POSENC_SIMD_TARGET");
    if (env == nullptr || *env == '\0') return;
    const std::string want = env;
    for (const int64_t bit : hwy::SupportedAndGeneratedTargets()) {
      if (want == hwy::TargetName(bit)) {
        hwy::SetSupportedTargetsForTest(bit);
        return;
      }
    }
    throw ValueError("POSENC_SIMD_TARGET: '" + want + "' is not a supported target here (" +
                     simd_targets_available() + ")");
  });
}

}  // namespace

void apply_simd_target_env() { apply_env_once(); }

std::string simd_targets_available() {
  std::string s;
  for (const int64_t bit : hwy::SupportedAndGeneratedTargets()) {
    if (!s.empty()) s.push_back(' ');
    s.append(hwy::TargetName(bit));
  }
  return s;
}

std::string simd_target_name() {
  apply_env_once();
  // The best supported target is the lowest set bit (Highway orders targets best-first).
  const auto targets = hwy::SupportedAndGeneratedTargets();
  return targets.empty() ? "none" : hwy::TargetName(targets.front());
}

void set_simd_target_for_test(long long target_bit) {
  apply_env_once();
  hwy::SetSupportedTargetsForTest(target_bit);
}

}  // namespace posenc::kernels
