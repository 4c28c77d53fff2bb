// posenc/size.h - checked sizes and the allocation limit.
//
// Every buffer posenc allocates from a caller's sizes (a table of length x dim, a bucket map of
// Lq x Lk, a tensor read from a file) is sized through these helpers: the product is formed in
// int64 with overflow detection, and a result larger than max_allocation_bytes() is refused with
// a SizeError naming the arguments and the bytes they would need, before anything is allocated.
//
// The limit is the machine's physical memory, or POSENC_MAX_BYTES when that environment variable
// holds a positive integer (bytes; a K, M, G or T suffix multiplies by 1024^n).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

namespace posenc {

// The most worker threads any posenc call starts. A larger request is an error at the CLI and
// is clamped in the library (libgomp places per-thread start data on the caller's stack, so a
// huge team overflows it).
inline constexpr int kMaxThreads = 1024;

// a * b and a + b, or nullopt when the result does not fit int64.
std::optional<int64_t> checked_mul(int64_t a, int64_t b);
std::optional<int64_t> checked_add(int64_t a, int64_t b);

// The allocation limit in bytes (see above). Reads the environment on every call.
int64_t max_allocation_bytes();

// One named factor of a size: {"--length", 1024} or {"seq_q", n}.
struct SizeFactor {
  const char* name;
  int64_t value;
};

// The element count of `factors` (their product), checked: throws SizeError when a factor is
// negative, the product times `element_bytes` overflows int64, or the bytes exceed
// max_allocation_bytes(). `what` names the buffer, e.g. "sinusoidal: the float32 table". The
// message reads, e.g.
//   "sinusoidal: the float32 table: --length (1099511627776) x --dim (16777216) x 4 bytes =
//    4398046511104 bytes (4 TiB), more than the limit of 15.6 GiB (physical memory; set
//    POSENC_MAX_BYTES to change it)"
int64_t checked_elements(const std::string& what, std::initializer_list<SizeFactor> factors,
                         int64_t element_bytes);

// Throws SizeError unless `bytes` (already known not to overflow) fits the limit.
void require_allocation(const std::string& what, int64_t bytes);

// "4 TiB", "15.6 GiB", "312 bytes".
std::string format_bytes(int64_t bytes);

}  // namespace posenc
