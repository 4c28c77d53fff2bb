// src/kernels/float_env.h - the floating-point environment of a kernel's work items.
//
// FlushSubnormalResults: for its scope, results of float arithmetic below the smallest normal
// magnitude (2^-126 in float32) are replaced by zero of the same sign on x86 (MXCSR's
// flush-to-zero bit; inputs are still read as they are). The backward's products of P and dS
// meet such values wherever probabilities fall below 2^-126 (ALiBi's far keys: a band of
// distances per head), and each subnormal result costs a microcode assist of about a hundred
// cycles on current x86 cores: an ALiBi backward ran 5 x slower than one without positions.
// The result differs from the subnormal one by less than 2^-126 in magnitude. The previous
// mode is restored when the scope ends, on the same thread. Elsewhere (no x86): nothing.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace posenc::kernels {

class FlushSubnormalResults {
 public:
#if defined(__x86_64__) || defined(__i386__)
  FlushSubnormalResults() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFlushToZero); }
  ~FlushSubnormalResults() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFlushToZero = 0x8000;  // MXCSR bit 15 (FTZ)
  unsigned saved_;
#else
  FlushSubnormalResults() {}  // user-provided: a scope guard, not an unused variable
#endif

 public:
  FlushSubnormalResults(const FlushSubnormalResults&) = delete;
  FlushSubnormalResults& operator=(const FlushSubnormalResults&) = delete;
};

}  // namespace posenc::kernels
