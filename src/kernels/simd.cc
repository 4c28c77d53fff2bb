// src/kernels/simd.cc - POSENC_SIMD_TARGET and target names (see simd.h).
#include "kernels/simd.h"

#include <atomic>
#include <cstdlib>
#include <mutex>

#include "hwy/highway.h"
#include "hwy/targets.h"
#include "kernels/bf16_dot.h"
#include "posenc/error.h"

namespace posenc::kernels {
namespace {

Bf16Dot bf16_dot_env();

void apply_env_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    bf16_dot_env();  // POSENC_BF16_DOT checked on every processor, used only where supported
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

// ---------------------------------------------------------------------------------------------
// AVX512_BF16 (bf16_dot.h). This file is compiled without AVX-512 flags: the check below runs
// on any processor.

namespace {

std::atomic<int> g_bf16_dot_test_mode{-1};

Bf16Dot bf16_dot_env() {
  static const Bf16Dot policy = [] {
    const char* env = std::getenv("POSENC_BF16_DOT");
    if (env == nullptr || *env == '\0') return Bf16Dot::kAuto;
    const std::string v = env;
    if (v == "auto") return Bf16Dot::kAuto;
    if (v == "0") return Bf16Dot::kOff;
    if (v == "1") return Bf16Dot::kOn;
    throw ValueError("POSENC_BF16_DOT: '" + v + "' is not auto, 0 or 1");
  }();
  return policy;
}

}  // namespace

bool bf16_dot_supported() {
#if defined(POSENC_HAVE_BF16_DOT) && (defined(__x86_64__) || defined(__i386__))
  // libgcc's CPU model reports AVX-512 features only when the OS saves the zmm state.
  static const bool have =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bf16");
  return have;
#else
  return false;
#endif
}

bool bf16_dot_compiled() {
#if defined(POSENC_HAVE_BF16_DOT)
  return true;
#else
  return false;
#endif
}

Bf16Dot bf16_dot_policy() {
  if (!bf16_dot_supported()) return Bf16Dot::kOff;
  switch (g_bf16_dot_test_mode.load(std::memory_order_relaxed)) {
    case 0:
      return Bf16Dot::kOff;
    case 1:
      return Bf16Dot::kOn;
    case 2:
      return Bf16Dot::kAuto;
    default:
      return bf16_dot_env();
  }
}

bool bf16_dot_used(int64_t rows_per_kv_head) {
  const Bf16Dot p = bf16_dot_policy();
  return p == Bf16Dot::kOn || (p == Bf16Dot::kAuto && rows_per_kv_head >= 8);
}

bool bf16_dot_prefill() { return bf16_dot_policy() == Bf16Dot::kOn; }

bool bf16_dot_prefetch() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool prefetch = !__builtin_cpu_is("intel");
  return prefetch;
#else
  return true;
#endif
}

void set_bf16_dot_for_test(int mode) {
  g_bf16_dot_test_mode.store(mode >= 0 && mode <= 2 ? mode : -1, std::memory_order_relaxed);
}

}  // namespace posenc::kernels
