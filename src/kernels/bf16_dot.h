// src/kernels/bf16_dot.h - decoding scores with the processor's bf16 dot-product instruction.
//
// On x86-64 processors with AVX512_BF16 (Zen 4, Sapphire Rapids and later) `vdpbf16ps` multiplies
// pairs of bf16 values and adds both products to a float32 accumulator. Products of two bf16
// values are exact in float32 (8 + 8 significant bits), so the instruction computes the same
// terms as widening both operands to float32 and using fused multiply-adds; only the summation
// order differs (pairs of adjacent elements per lane), and, as the instruction is defined,
// subnormal inputs are read as zero and subnormal sums flushed to zero. Decoding from a bf16
// cache with a bf16 query uses it for the q . k scores when the processor has it and the shape
// gains from it (bf16_dot_policy; the kernel below is compiled for AVX512_BF16 in its own
// translation unit and called only after the run-time check); values, softmax and accumulation
// stay as in the float32 kernel. See docs/precision.md.
#pragma once

#include <cstdint>

namespace posenc::kernels {

// Rows the decoding kernels fetch into L2 ahead of their use, one per key while they work on
// the other operand (the values of a tile during its scores, the next tile's keys during its
// values): each pass then finds its rows in L2 instead of restarting the hardware prefetcher on
// every tile, which made a decoding step read a bf16 cache much more slowly (measured on
// AVX-512). On AVX2 a pass fetching its own rows a few keys ahead measured faster instead
// (kStreamHalfDecode in attention_hwy.cc; figures in docs/performance.md).
struct PrefetchRows {
  const char* p = nullptr;  // row 0
  int64_t n = 0;            // rows
  int64_t stride = 0;       // bytes between rows
  int64_t hstride = 0;      // bytes between heads of a row
  int64_t heads = 0, bytes = 0;
  // A paged cache (FusedAttentionParams::pages): row i is key first + i of block-table row
  // `pages`, at p + pages[key / page_size] * page_stride + (key % page_size) * stride.
  const int32_t* pages = nullptr;
  int64_t first = 0, page_size = 1, page_stride = 0;
};

// Fetches [p, p + bytes) into L2, a cache line at a time.
__attribute__((always_inline)) inline void prefetch_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, 2);
}

// The same as prefetch_l2, as an instruction the compiler must keep: GCC 12 at -O3 dropped the
// __builtin_prefetch of prefetch_l2 from some callers (an address chosen between two tensors by a
// condition, among others), leaving those fetches silently out of the binary.
__attribute__((always_inline)) inline void fetch_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) {
#if defined(__x86_64__) || defined(__i386__)
    asm volatile("prefetcht1 %0" : : "m"(*(c + b)));
#else
    __builtin_prefetch(c + b, 0, 2);
#endif
  }
}

// Fetches row i (nothing past the last row) into L2. Always inlined: declared outside the SIMD
// targets' code, it was otherwise compiled into the AVX2 decoding loops in a way that made bf16
// and f16 decoding markedly slower (docs/performance.md, Measured design choices).
__attribute__((always_inline)) inline const char* prefetch_address(const PrefetchRows& a,
                                                                   int64_t i) {
  if (a.pages == nullptr) return a.p + i * a.stride;
  const int64_t key = a.first + i;
  return a.p + a.pages[key / a.page_size] * a.page_stride + (key % a.page_size) * a.stride;
}
__attribute__((always_inline)) inline void prefetch_row(const PrefetchRows& a, int64_t i) {
  if (i >= a.n) return;
  const char* row = prefetch_address(a, i);
  if (a.hstride == a.bytes) {  // the heads of a row are one run
    prefetch_l2(row, a.heads * a.bytes);
    return;
  }
  for (int64_t g = 0; g < a.heads; ++g) prefetch_l2(row + g * a.hstride, a.bytes);
}
// Fetches head g of row i only (passes that read a cache head by head).
__attribute__((always_inline)) inline void prefetch_row_head(const PrefetchRows& a, int64_t i,
                                                             int64_t g) {
  if (i < a.n) prefetch_l2(prefetch_address(a, i) + g * a.hstride, a.bytes);
}

// True when this build has the kernel and the processor and the OS support AVX512_BF16.
bool bf16_dot_supported();
// Whether this build holds the AVX512_BF16 kernel at all (the compiler could target it).
bool bf16_dot_compiled();

// When decoding uses these scores (POSENC_BF16_DOT: unset or "auto", "1", "0"):
//   kAuto: when each kv head has 8 query-row slots (5 to 8 rows: a GQA group of 5 to 8 heads
//     at one token, or of 3 or 4 heads at two tokens), where the scores are a large part of the
//     work: there it measured faster than the widening kernel, while with 4 rows per kv head
//     and a cache in DRAM the widening kernel's slower score pass hides more of the memory
//     traffic and wins (figures in docs/precision.md and docs/performance.md).
//   kOn: in every decoding shape with a bf16 query and cache.
//   kOff: never (kOff too where the processor lacks AVX512_BF16).
enum class Bf16Dot { kOff, kAuto, kOn };
Bf16Dot bf16_dot_policy();
// Whether decoding with rows_per_kv_head query-row slots (a multiple of 4) uses these scores.
bool bf16_dot_used(int64_t rows_per_kv_head);
// For tests and benchmarks: 0 kOff, 1 kOn, 2 kAuto, -1 back to the environment's choice.
void set_bf16_dot_for_test(int mode);
// Whether decoding with these scores fetches the tile's values (and the next tile's keys) into
// L2 ahead of their use, as the widening kernel does: not on Intel processors, where it
// measured faster without; on AMD, turning the widening kernel's prefetch off made it much
// slower, so AMD keeps it (figures in docs/performance.md).
bool bf16_dot_prefetch();

// S[g * rows_per_head + r][c] (rows s_stride floats apart) = q_{g, r} . k_{c, g} for kv heads
// g < heads, rows r < rows_per_head (a multiple of 4) and keys c < nk; columns c in
// [nk, RoundUp(nk, 4)) may be written with anything. q: bf16 bits, row (g * rows_per_head + r)
// at qb + row * q_stride, dim values then zeros up to RoundUp(dim, 32) (q_stride >= that).
// k: bf16 bits, key c of head g at k + c * kstride + g * hstride (dim values; nothing past them
// is read). part: scratch of heads * rows_per_head * 16 floats. Row r of the
// ahead rows is fetched while key r is read. Call only when bf16_dot_supported().
void decode_scores_bf16_dot(const uint16_t* qb, int64_t q_stride, int64_t dim,
                            int64_t rows_per_head, int64_t heads, const uint16_t* k,
                            int64_t kstride, int64_t hstride, int64_t nk, float* s,
                            int64_t s_stride, float* part, const PrefetchRows& ahead);

// ---- Prefill: the score tiles of the fused kernel (attention_hwy.cc) ----
//
// The same instruction on the key tiles of prefill: a tile's keys as pairs of adjacent dims
// (kt[p * 64 + c] holds the bf16 bits of k_c[2p] in its low half and of k_c[2p + 1] in its high
// half), so that one vdpbf16ps with q_r's pair p broadcast adds q_r[2p] k_c[2p] + q_r[2p + 1]
// k_c[2p + 1] to the scores of 16 keys: half the instructions of the float32 broadcast-FMA
// micro-kernel for the same products, each exact in float32.

// Whether prefill with a bf16 query and bf16 keys (not rotated in the kernel) or float32 ones
// holding bf16 values, and the backward whose q, k, v and dout all hold bf16 values
// (FusedAttentionParams::bf16_operands), compute their score tiles with vdpbf16ps (the
// backward: S = Q K^T and dP = dO V^T): the processor has it and
// POSENC_BF16_DOT is 1. Not under auto: on the Intel processor measured (Emerald Rapids) the
// instruction adds bf16 products at half the rate of float32 FMAs (bf16_dot_chains: `posenc
// bench`'s bf16_dot_peak), and both paths measured slower than the float32 products
// (docs/performance.md); they have not been measured on AMD's, whose vdpbf16ps has the FMA's
// throughput with twice the products.
bool bf16_dot_prefill();

// S[r][c] = q_r . k_c for rows r < rows_pad (a multiple of 4) and keys c < 64: q as bf16 bits,
// row r at qb + r * q_stride (dim values, then a zero up to an even count); kt as above, for
// p < (dim + 1) / 2. S rows ss floats apart. cols (may be null): per row, how many leading keys
// it needs; a block of 4 rows then computes only the vectors of 16 keys its rows need and leaves
// the others unwritten. Call only when bf16_dot_supported().
void prefill_scores_bf16_dot(const uint16_t* qb, int64_t q_stride, int64_t dim, const uint32_t* kt,
                             int64_t rows_pad, float* s, int64_t ss, const int32_t* cols);

// kt (as above, 64 keys) from a transposed float32 tile kt32[x * 64 + c] whose values are bf16
// values widened (so the bits are kept exactly); a zero pairs an odd dim's last one.
void pack_bf16_pairs(const float* kt32, int64_t dim, uint32_t* kt);

// ---- The instruction's own rate (`posenc bench`'s bf16_dot_peak) ----

// Independent vdpbf16ps accumulator chains, c_i <- c_i + a0 b0 + a1 b1 in every lane, as
// fma_peak runs float32 FMA chains: how many pairs of bf16 products per second this processor
// can add, the bound of every bf16 product kernel on it.
inline constexpr int kBf16DotChains = 16;  // of AVX-512's 32 registers, as fma_peak's chains
inline constexpr int64_t kBf16DotLanes = 16;
// Runs the chains for `iterations` steps, every bf16 factor `factor_bits` (a bf16's bits); each
// step adds 2 factor^2 to every lane. Returns the sum of the chains' lanes (keep it: it is what
// makes the steps observable). Call only when bf16_dot_supported().
float bf16_dot_chains(int64_t iterations, uint16_t factor_bits);

}  // namespace posenc::kernels
