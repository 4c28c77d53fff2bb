// fuzz/fuzz_util.h - what every posenc fuzz target shares.
#pragma once

#include <cstdlib>
#include <string>

namespace posenc::fuzz {

// A small allocation limit (posenc/size.h) so that sizes a hostile input declares are refused by
// posenc's own checks, well below where AddressSanitizer would report an allocation as too big.
inline void limit_allocations() { ::setenv("POSENC_MAX_BYTES", "64M", 0); }

}  // namespace posenc::fuzz
