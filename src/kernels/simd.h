// src/kernels/simd.h - SIMD target selection shared by the Highway kernels.
//
// Highway compiles each kernel for every target of this CPU family and dispatches once per
// public call to the best one the CPU supports. POSENC_SIMD_TARGET (environment) restricts the
// choice for tests and benchmarks: a Highway target name such as "AVX3", "AVX2", "SSE4",
// "SSSE3", "EMU128" or "SCALAR"; unknown names are an error. simd_target_name() reports the
// target in use (`posenc bench` prints it).
#pragma once

#include <string>

namespace posenc::kernels {

// Applies POSENC_SIMD_TARGET once (first call); returns the name of the target that dispatch
// will use (asks the CPU: a few microseconds, more under a hypervisor).
std::string simd_target_name();

// Applies POSENC_SIMD_TARGET once, before a kernel's first dispatch; afterwards one atomic load.
void apply_simd_target_env();

// Names of every target compiled into this binary that this CPU supports.
std::string simd_targets_available();

// For tests: restrict dispatch to one Highway target bit (0 = no restriction).
void set_simd_target_for_test(long long target_bit);

}  // namespace posenc::kernels
