// src/size.cc - checked size arithmetic and the allocation limit (posenc/size.h).
#include "posenc/size.h"

#include <sys/resource.h>
#include <unistd.h>

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "posenc/error.h"

namespace posenc {

namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

int64_t physical_memory() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return kInt64Max;
  const std::optional<int64_t> bytes = checked_mul(pages, page);
  return bytes ? *bytes : kInt64Max;
}

// POSENC_MAX_BYTES: a positive integer with an optional K, M, G or T suffix (powers of 1024).
std::optional<int64_t> env_limit() {
  const char* s = std::getenv("POSENC_MAX_BYTES");
  if (s == nullptr || *s == '\0') return std::nullopt;
  const char* end = s + std::strlen(s);
  int64_t v = 0;
  const auto [p, ec] = std::from_chars(s, end, v);
  if (ec != std::errc() || v <= 0) {
    throw ValueError(std::string("POSENC_MAX_BYTES must be a positive integer of bytes, with an ") +
                     "optional K, M, G or T suffix (got '" + s + "')");
  }
  int shift = 0;
  if (p != end) {
    if (p + 1 != end) throw ValueError(std::string("POSENC_MAX_BYTES: bad suffix in '") + s + "'");
    switch (*p) {
      case 'K':
      case 'k':
        shift = 10;
        break;
      case 'M':
      case 'm':
        shift = 20;
        break;
      case 'G':
      case 'g':
        shift = 30;
        break;
      case 'T':
      case 't':
        shift = 40;
        break;
      default:
        throw ValueError(std::string("POSENC_MAX_BYTES: bad suffix in '") + s + "'");
    }
  }
  if (v > (kInt64Max >> shift)) return kInt64Max;
  return v << shift;
}

std::string limit_origin() {
  const char* s = std::getenv("POSENC_MAX_BYTES");
  if (s != nullptr && *s != '\0') return "POSENC_MAX_BYTES";
  return "physical memory; set POSENC_MAX_BYTES to change it";
}

}  // namespace

std::optional<int64_t> checked_mul(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

std::optional<int64_t> checked_add(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

int64_t max_allocation_bytes() {
  if (const std::optional<int64_t> v = env_limit()) return *v;
  return physical_memory();
}

std::string format_bytes(int64_t bytes) {
  static const char* const kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return std::to_string(bytes) + (bytes == 1 ? " byte" : " bytes");
  double v = static_cast<double>(bytes);
  int u = -1;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, v < 10 ? "%.3g %s" : "%.4g %s", v, kUnits[u]);
  return buf;
}

namespace {

// `prefix` + " <bytes> bytes (<human>), more than the limit of ..." when over the limit.
void check_limit(const std::string& prefix, int64_t bytes) {
  const int64_t limit = max_allocation_bytes();
  if (bytes > limit) {
    throw SizeError(prefix + " " + std::to_string(bytes) + " bytes (" + format_bytes(bytes) +
                    "), more than the limit of " + format_bytes(limit) + " (" + limit_origin() +
                    ")");
  }
}

}  // namespace

void require_allocation(const std::string& what, int64_t bytes) {
  check_limit(what + " needs", bytes);
}

int64_t checked_elements(const std::string& what, std::initializer_list<SizeFactor> factors,
                         int64_t element_bytes) {
  std::string expr;
  for (const SizeFactor& f : factors) {
    expr +=
        (expr.empty() ? "" : " x ") + std::string(f.name) + " (" + std::to_string(f.value) + ")";
  }
  const std::string bytes_expr =
      expr + " x " + std::to_string(element_bytes) + (element_bytes == 1 ? " byte" : " bytes");
  int64_t n = 1;
  bool overflow = false;
  bool empty = false;
  for (const SizeFactor& f : factors) {
    if (f.value < 0) {
      throw SizeError(what + ": " + f.name + " must be >= 0 (got " + std::to_string(f.value) + ")");
    }
    if (f.value == 0) empty = true;
    if (!overflow) {
      const std::optional<int64_t> m = checked_mul(n, f.value);
      if (m) {
        n = *m;
      } else {
        overflow = true;
      }
    }
  }
  // Like NumPy, a zero dimension makes the buffer empty whatever the others are.
  if (empty) return 0;
  const std::optional<int64_t> bytes = overflow ? std::nullopt : checked_mul(n, element_bytes);
  if (!bytes) {
    throw SizeError(what + ": " + bytes_expr + " overflows a 64-bit size");
  }
  check_limit(what + ": " + bytes_expr + " =", *bytes);
  return n;
}

}  // namespace posenc
