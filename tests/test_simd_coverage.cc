// tests/test_simd_coverage.cc - which SIMD targets this build holds and which of them the tests
// can run on this processor.
//
// The kernels are compiled for every Highway target of the CPU family and dispatched at run time
// to the best one the processor supports; the per-target tests (test_rope_kernel, test_half,
// test_attention_fused, ...) loop over the targets supported here. A target this processor lacks
// (the 512-bit AVX3 on an AVX2 machine) is compiled but cannot run, and Highway has no emulation
// of it, so the suite prints the coverage for the log:
//
//   SimdCoverage: compiled: AVX3 AVX2 SSE4 SSSE3 SCALAR
//   SimdCoverage: run here: AVX2 SSE4 SSSE3 SCALAR
//   SimdCoverage: compiled, skipped (this CPU lacks them): AVX3
//   SimdCoverage: AVX512_BF16 dot kernel: compiled, skipped (this CPU lacks AVX512_BF16)
//
// POSENC_REQUIRE_TARGETS="AVX3 AVX2" (names as above) makes the test fail unless those targets
// run here: for a CI runner that is meant to cover the 512-bit targets.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "hwy/highway.h"
#include "hwy/targets.h"
#include "kernels/bf16_dot.h"
#include "kernels/simd.h"

namespace {

// The target bits in `mask`, best first (Highway: lower bits are better targets).
std::vector<int64_t> bits_of(int64_t mask) {
  std::vector<int64_t> out;
  for (int i = 0; i < 63; ++i) {
    const int64_t bit = int64_t{1} << i;
    if ((mask & bit) != 0) out.push_back(bit);
  }
  return out;
}

std::string names(const std::vector<int64_t>& bits) {
  std::string s;
  for (const int64_t b : bits) {
    if (!s.empty()) s += ' ';
    s += hwy::TargetName(b);
  }
  return s.empty() ? "(none)" : s;
}

std::vector<std::string> split_words(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

struct RestoreDispatch {
  ~RestoreDispatch() { posenc::kernels::set_simd_target_for_test(0); }
};

}  // namespace

TEST(SimdCoverage, ReportsCompiledRunAndSkippedTargets) {
  const std::vector<int64_t> compiled = bits_of(HWY_TARGETS);
  const std::vector<int64_t> run = hwy::SupportedAndGeneratedTargets();
  std::vector<int64_t> skipped;
  for (const int64_t b : compiled) {
    bool found = false;
    for (const int64_t r : run) found = found || r == b;
    if (!found) skipped.push_back(b);
  }
  const bool bf16_compiled = posenc::kernels::bf16_dot_compiled();
  const bool bf16_run = posenc::kernels::bf16_dot_supported();
  std::cout << "SimdCoverage: compiled: " << names(compiled) << "\n"
            << "SimdCoverage: run here: " << names(run) << "\n"
            << "SimdCoverage: compiled, skipped (this CPU lacks them): " << names(skipped) << "\n"
            << "SimdCoverage: AVX512_BF16 dot kernel: "
            << (!bf16_compiled ? "not compiled"
                : bf16_run     ? "compiled, run here"
                               : "compiled, skipped (this CPU lacks AVX512_BF16)")
            << std::endl;
  RecordProperty("compiled", names(compiled));
  RecordProperty("run", names(run));
  RecordProperty("skipped", names(skipped));

  ASSERT_FALSE(run.empty()) << "no compiled target is supported by this CPU";
  // The tests' target loops can select each target, and dispatch then reports that target.
  RestoreDispatch restore;
  for (const int64_t b : run) {
    posenc::kernels::set_simd_target_for_test(b);
    EXPECT_EQ(posenc::kernels::simd_target_name(), hwy::TargetName(b));
  }
#if HWY_ARCH_X86_64 && !defined(HWY_COMPILE_ONLY_STATIC)
  // The 512-bit kernels are built even where they cannot run here: a change to the build that
  // dropped them would hide them from every AVX-512 user's dispatch. (The sanitizer build
  // compiles this machine's target alone, HWY_COMPILE_ONLY_STATIC.)
  EXPECT_NE(HWY_TARGETS & HWY_AVX3, 0) << "AVX3 is not compiled: " << names(compiled);
  EXPECT_NE(HWY_TARGETS & HWY_AVX2, 0) << "AVX2 is not compiled: " << names(compiled);
#endif
  // A runner meant to cover some targets says so; missing ones fail here.
  if (const char* req = std::getenv("POSENC_REQUIRE_TARGETS"); req != nullptr) {
    for (const std::string& want : split_words(req)) {
      bool ran = false;
      for (const int64_t b : run) ran = ran || want == hwy::TargetName(b);
      if (want == "AVX512_BF16") ran = bf16_run;
      EXPECT_TRUE(ran) << "POSENC_REQUIRE_TARGETS names " << want
                       << ", which does not run here (run here: " << names(run) << ")";
    }
  }
}
