// bench/harness.h - timing, baselines and workloads of `posenc bench` and the bench_* binaries.
//
// Every number is put next to what this machine can do anyway:
//   copy_bandwidth   memcpy of a buffer larger than the caches; GB/s = 2 x bytes / s (read+write)
//   read_bandwidth   sum-reduce of a large float buffer; GB/s = bytes / s
//   fma_peak         the float32 FMA peak: independent FMA chains at the widest vector width
//                    Highway dispatches to, one set of chains per thread (bench/fma_peak.cc);
//                    GFLOP/s = 2 x lanes x chains x iterations x threads / s
//   sgemm            OpenBLAS cblas_sgemm, N x N x N; GFLOP/s = 2 N^3 / s
//   bf16_dot_peak    fma_peak for AVX512_BF16's vdpbf16ps, where the processor has it;
//                    GFLOP/s = 4 x 16 lanes x chains x iterations x threads / s
//   attention_naive  the materialized float32 attention eager frameworks run: per (batch, head)
//                    S = scale Q K^T (sgemm), causal mask, row softmax, O = P V (sgemm)
// Bandwidth-bound items (RoPE, decode) are compared to a bandwidth baseline, compute-bound ones
// (attention) to sgemm, and every compute-bound one to fma_peak too (vs_fma_peak, ratio_fields).
// Attention FLOPs are the useful ones: 4 Lq Lk D H, halved when causal (the masked half is not
// work), whatever the implementation computes.
//
// Not thread-safe: the measurements set OpenBLAS's global thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "posenc/attention.h"
#include "posenc/error.h"
#include "posenc/tensor.h"

namespace posenc::bench {

// 64-byte aligned, uninitialized float storage (first touch happens where it is filled), as
// the entries' inputs and outputs are allocated (PyTorch's CPU tensors are 64-byte aligned too).
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(int64_t count) : count_(count) {
    const std::size_t bytes =
        (static_cast<std::size_t>(std::max<int64_t>(count, 1)) * 4 + 63) / 64 * 64;
    data_ = static_cast<float*>(std::aligned_alloc(64, bytes));
    if (data_ == nullptr) {
      throw ValueError("bench: cannot allocate " + std::to_string(bytes) + " B");
    }
  }
  ~Buffer() { std::free(data_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), count_(o.count_) {}
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(count_, o.count_);
    return *this;
  }
  float* data() const { return data_; }
  int64_t size() const { return count_; }

 private:
  float* data_ = nullptr;
  int64_t count_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Timing.

struct TimingOptions {
  int warmup = 1;            // untimed calls first (page faults, thread start-up)
  double min_total_s = 0.5;  // keep repeating until the timed calls add up to this...
  int min_reps = 3;          // ...and at least this many were made
  int max_reps = 1000;
};

// TimingOptions for `--quick` (one warmup, ~0.1 s, at least 2 reps).
TimingOptions quick_timing();

struct Timing {
  double median_s = 0;
  double min_s = 0;
  int reps = 0;
};

// Calls fn warmup + N times (N adaptive, see TimingOptions) and returns the median and the
// minimum of the N timed calls (steady clock, wall time).
Timing measure(const std::function<void()>& fn, const TimingOptions& options = {});

// Two workloads timed in alternation (a, b, a, b, ...; at least 5 pairs, options otherwise as
// for measure), so that both see the same machine state: on a shared machine the speed drifts
// between runs by more than the differences worth measuring. ratio = median over the pairs of
// time(b) / time(a).
struct PairTiming {
  Timing a, b;
  double ratio = 0;
};
PairTiming measure_pair(const std::function<void()>& a, const std::function<void()>& b,
                        const TimingOptions& options = {});

// ---------------------------------------------------------------------------------------------
// Results.

// One measured entry. `bytes` (memory traffic per call) makes it bandwidth-bound and reported
// in GB/s, `flops` (useful FLOPs per call) compute-bound and reported in GFLOP/s.
struct Result {
  std::string name;
  Timing timing;
  int threads = 1;
  double bytes = 0;
  double flops = 0;
  // Names of the entries to compare with, the main one first (empty = none).
  std::vector<std::string> baselines;
  std::vector<std::pair<std::string, double>> extra;      // more numeric fields, e.g. peak_mb
  std::vector<std::pair<std::string, std::string>> info;  // more text fields, e.g. blas

  bool is_bandwidth() const { return bytes > 0; }
  double gbps() const { return bytes / timing.median_s * 1e-9; }
  double gflops() const { return flops / timing.median_s * 1e-9; }
  // GB/s or GFLOP/s (whichever applies).
  double rate() const { return is_bandwidth() ? gbps() : gflops(); }
};

// Threads to use: `requested` if > 0, else all OpenMP offers (1 without OpenMP).
int resolve_threads(int requested);

// The Highway target posenc's kernels dispatch to (after POSENC_SIMD_TARGET), and every target
// compiled in that this CPU supports (src/kernels/simd.h).
std::string simd_target();
std::string simd_targets_available();

// OpenBLAS: set its thread count; its build description (openblas_get_config()).
void set_blas_threads(int threads);
std::string blas_config();

// ---------------------------------------------------------------------------------------------
// Baselines.

// memcpy of `bytes` (rounded down to a multiple of 64 per thread) split over `threads` threads.
Result bench_copy_bandwidth(int threads, int64_t bytes, const TimingOptions& options);
// Sum of bytes / 4 floats, split over `threads` threads.
Result bench_read_bandwidth(int threads, int64_t bytes, const TimingOptions& options);
// C = A B, all n x n float32, OpenBLAS with `threads` threads.
Result bench_sgemm(int threads, int64_t n, const TimingOptions& options);

// The FMA chains fma_peak runs on this CPU (Highway dynamic dispatch, after POSENC_SIMD_TARGET).
struct FmaChains {
  std::string target;  // the Highway target, e.g. "AVX3", "AVX2"
  int64_t lanes = 0;   // float32 lanes per vector
  int chains = 0;      // independent accumulator vectors per thread (16 on AVX-512, 12 on AVX2)
};
FmaChains fma_chains();
// FLOPs of `iterations` steps of the chains on `threads` threads: each step is one FMA (2 FLOPs)
// per lane of every chain, 2 x lanes x chains x iterations x threads.
double fma_peak_flops(int64_t lanes, int chains, int64_t iterations, int threads);
// "fma_peak": every thread runs its own chains for `iterations` steps, the threads started
// together in one OpenMP region; a call's time is the region's, which ends with the slowest
// thread. flops: fma_peak_flops. Extra fields lanes, chains, iterations; info target (the
// Highway target the chains ran on).
Result bench_fma_peak(int threads, int64_t iterations, const TimingOptions& options);
// One call of fma_peak's chains (what bench_fma_peak times) and what it computes, for timing a
// workload in alternation with the peak (bench_attention's vs_fma_peak_paired).
struct FmaCall {
  std::function<void()> run;
  double flops = 0;
  int64_t target = 0, lanes = 0;
  int chains = 0;
};
FmaCall fma_peak_call(int threads, int64_t iterations);

// "bf16_dot_peak", on processors with AVX512_BF16 only: every thread runs 16 independent chains
// of vdpbf16ps (16 lanes, each step two bf16 products and two additions per lane) for
// `iterations` steps, timed as fma_peak. Its vs_fma_peak is the rate at which this processor
// adds bf16 products over the rate of float32 FMAs: the most a bf16 product kernel on the
// instruction can gain over a float32 one. Extra fields lanes, chains, iterations; info
// instruction. Throws ValueError where bf16_dot_peak_available() is false.
bool bf16_dot_peak_available();
// 4 x 16 lanes x 16 chains x iterations x threads.
double bf16_dot_peak_flops(int64_t iterations, int threads);
Result bench_bf16_dot_peak(int threads, int64_t iterations, const TimingOptions& options);

// The naive materialized float32 attention (what PyTorch eager does), no positional terms:
// per (batch, head) S = scale Q K^T [seq_q, seq_k] with sgemm, causal mask (key j visible from
// query i iff j <= seq_k - seq_q + i), row softmax in float, out = P V with sgemm. Heads share
// kv heads as in posenc::attention (GQA). Last dims contiguous, seq and heads strides
// arbitrary; out must not overlap the inputs. Uses `threads` OpenMP threads, each running
// single-threaded sgemm on blocks of query rows, and one [heads_q, seq_q, seq_k] score buffer
// (per batch row). A row with no visible key (only when seq_q > seq_k) is 0.
void naive_attention(View<const float, 4> q, View<const float, 4> k, View<const float, 4> v,
                     bool causal, double scale, View<float, 4> out, int threads);

// ---------------------------------------------------------------------------------------------
// Workloads.

// Shapes of an attention call: q [batch, seq_q, heads_q, head_dim], k and v
// [batch, seq_k, heads_kv, head_dim].
struct AttentionShape {
  int64_t batch = 1;
  int64_t seq_q = 0;
  int64_t seq_k = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;
  bool causal = true;
};

// Useful FLOPs of one call: 4 Lq Lk D Hq per batch row (QK^T and PV), times the visible
// fraction of the score matrix when causal (about 1/2 for square shapes, exact count).
double attention_flops(const AttentionShape& shape);
// Bytes of k and v (what a decode step must read).
double kv_bytes(const AttentionShape& shape);

// Scheme names accepted by AttentionWorkload: every scheme of the registry (posenc/schemes.h).
const std::vector<std::string>& scheme_names();

// Random q, k, v (uniform in [-1, 1], fixed seed), an output, and the scheme's parameters:
//   rope     half style (NeoX), base 1e4
//   alibi    alibi_slopes() for heads_q heads, max_bias 8
//   t5       random table [32, heads_q], max_distance 128
//   shaw     K = 16, shared random rel_k and rel_v [33, head_dim]
//   deberta  position_buckets 256, max_relative_positions 512: random tables [512, heads_q, D]
//   xl       random r_w_bias, r_r_bias [heads_q, D], r_net [heads_q D, heads_q D]
// Throws ValueError on an unknown scheme.
class AttentionWorkload {
 public:
  AttentionWorkload(const AttentionShape& shape, const std::string& scheme, uint64_t seed = 1);
  ~AttentionWorkload();
  AttentionWorkload(const AttentionWorkload&) = delete;
  AttentionWorkload& operator=(const AttentionWorkload&) = delete;

  const AttentionShape& shape() const { return shape_; }
  const std::string& scheme_name() const { return scheme_name_; }
  const PositionScheme& scheme() const;
  View<const float, 4> q() const;
  View<const float, 4> k() const;
  View<const float, 4> v() const;
  View<float, 4> out();
  // Bytes of q, k, v and out.
  double input_output_bytes() const;

  // posenc::attention into out().
  void run(int threads);
  // naive_attention into out() (positional terms ignored: for scheme "none").
  void run_naive(int threads);

  // The backward: the first call runs the forward once (out and lse) and draws dout; every call
  // runs posenc::attention_backward into dq, dk, dv and every parameter gradient of the scheme.
  void run_backward(int threads);
  // Bytes of q, k, v, out, lse, dout and every gradient.
  double backward_bytes() const;
  // Rounds q, k and v, and the dout the first run_backward draws, to bf16 values (the widened
  // operands of bf16 training). Call before the first run or run_backward.
  void round_to_bf16();

 private:
  struct Storage;
  AttentionShape shape_;
  std::string scheme_name_;
  std::unique_ptr<Storage> storage_;
};

// "attention_<scheme>_<causal|bidir>_L<seq_k>_H<heads_q>_D<head_dim>" (seq_q == seq_k).
std::string attention_name(const std::string& scheme, const AttentionShape& shape);

// posenc::attention with `scheme` (flops: attention_flops; baseline sgemm). Scheme "none" with
// fma_steps > 0 is timed in alternation with fma_peak's chains of that many steps: extra fields
// vs_fma_peak_paired (its FLOP rate over the chains', the median over the pairs, so that both
// see the same machine) and fma_peak_median_s.
Result bench_attention(const std::string& scheme, const AttentionShape& shape, int threads,
                       const TimingOptions& options, int64_t fma_steps = 0);
// The no-position backward on bf16 values (round_to_bf16: bf16 training, whose operands reach
// the backward widened to float32): "attention_backward_none_..._bf16", timed in alternation with
// the float32 backward on the unrounded data (extra fields vs_float32, float32_median_s) and
// bf16_dot (1 when POSENC_BF16_DOT lets its score tiles use vdpbf16ps).
Result bench_attention_backward_bf16(const AttentionShape& shape, int threads,
                                     const TimingOptions& options);
// posenc::attention_backward with `scheme`: "attention_backward_<scheme>_...", flops 2.5 x
// attention_flops (FlashAttention-2's count: five products instead of two), baseline sgemm.
// Extra fields: vs_forward (backward time / forward time, timed in alternation), and for
// schemes other than none vs_none (backward time / backward time of no positions, in
// alternation) and none_median_s.
Result bench_attention_backward(const std::string& scheme, const AttentionShape& shape, int threads,
                                const TimingOptions& options);
// naive_attention, named "attention_naive_..." (flops: attention_flops; baseline sgemm).
Result bench_naive_attention(const AttentionShape& shape, int threads,
                             const TimingOptions& options);
// One decode step, scheme none: "decode_gqa_<Hq>x<Hkv>_L<seq_k>_D<head_dim>" (seq_q = 1;
// bytes: kv_bytes; baselines copy_bandwidth, then read_bandwidth: decode only reads).
Result bench_decode(const AttentionShape& shape, int threads, const TimingOptions& options);

// Half precision (bf16 / f16): `dtype` "bf16" or "f16" appended to the float32 entry's name.
// bench_attention_half: q, k, v and out in the half type, scheme none ("attention_none_..._bf16");
// bench_decode_half: one decode step from a half KV cache, q and out half too
// ("decode_gqa_..._bf16", bytes: the half KV cache; baselines as bench_decode);
// bench_rope_half: rope_neox on a half tensor ("rope_neox_..._bf16", bytes: read + write in the
// half type; baseline copy_bandwidth). Each has vs_float32: its time over the float32 entry of
// the same shape, timed in alternation, and float32_median_s.
Result bench_attention_half(const std::string& dtype, const AttentionShape& shape, int threads,
                            const TimingOptions& options);
Result bench_decode_half(const std::string& dtype, const AttentionShape& shape, int threads,
                         const TimingOptions& options);
Result bench_rope_half(const std::string& dtype, int64_t seq, int64_t heads, int64_t head_dim,
                       int threads, const TimingOptions& options);

// Paged KV caches (posenc/paged.h), one decode step, scheme none, q and out in the cache's type:
// bench_decode_paged: "decode_paged_gqa_<Hq>x<Hkv>_L<seq_k>_D<head_dim>_<dtype>_<layout>_page<n>"
// (pages of `page_size` tokens in `layout`, shuffled in the pool; bytes: the cache) with
// vs_contiguous: its time over the contiguous token-major decode of the same dtype (the
// decode_gqa_..._<dtype> workload), timed in alternation, and contiguous_median_s.
// bench_decode_head_major: float32, k and v [batch, seq_k, heads_kv, head_dim] views of
// [batch, heads_kv, seq_k, head_dim] buffers ("decode_head_major_gqa_..."), with vs_token_major
// against decode_gqa_... (the token-major cache), timed in alternation, and token_major_median_s.
Result bench_decode_paged(const std::string& dtype, const AttentionShape& shape, int64_t page_size,
                          bool head_major, int threads, const TimingOptions& options);
Result bench_decode_head_major(const AttentionShape& shape, int threads,
                               const TimingOptions& options);

// Peak memory of one posenc::attention call, scheme none: "peak_memory_attention_none_...".
// Measured from the process's resident set (VmHWM reset through /proc/self/clear_refs), in MiB:
//   peak_mb             peak RSS growth over allocating q, k, v, out and the call
//   inputs_outputs_mb   bytes of q, k, v and out
//   workspace_mb        peak RSS growth during the call itself (what attention allocates)
//   naive_scores_mb     what the materialized path allocates for its scores (Hq Lq Lk floats)
// One timed call (median_s = min_s), flops as bench_attention. Throws posenc::Error when the
// kernel offers no way to reset the peak (no /proc/self/clear_refs).
Result bench_peak_memory_attention(const AttentionShape& shape, int threads);

// Peak memory of one posenc::attention_backward call, scheme `scheme` ("none" or "rope"):
// "peak_memory_attention_backward_<scheme>_...", fields as bench_peak_memory_attention
// (inputs_outputs_mb: q, k, v, out, lse, dout, dq, dk, dv).
Result bench_peak_memory_attention_backward(const AttentionShape& shape, int threads,
                                            const std::string& scheme = "none");

// RoPE in place on x [1, seq, heads, head_dim], half style (NeoX), base 1e4, positions offset 0:
// "rope_neox_<seq>x<heads>x<head_dim>", bytes 2 x size (read + write), baseline copy_bandwidth.
Result bench_rope(int64_t seq, int64_t heads, int64_t head_dim, int threads,
                  const TimingOptions& options);

// ---------------------------------------------------------------------------------------------
// The `posenc bench` suite.

struct SuiteOptions {
  int threads = 0;     // 0 = all available
  bool quick = false;  // smaller sizes, shorter timing: seconds instead of minutes
  // Entries to run ("" = all): comma-separated alternatives; an entry runs when its name
  // contains one of them, or equals one written "=NAME" (that name only, not the longer names
  // it starts). "fma_peak,sgemm,=attention_none_causal_L512_H8_D128" runs exactly three.
  std::string filter;
};

// A named entry of the suite, run on demand.
struct Entry {
  std::string name;
  std::function<Result()> run;
};

// The entries in order, baselines first (copy_bandwidth, read_bandwidth, fma_peak, sgemm, then
// bf16_dot_peak where the processor has AVX512_BF16, rope,
// attention per scheme, naive attention, decode, peak memory, backward per scheme, backward
// peak memory). Full sizes: 256 MiB buffers, fma_peak 2^22 steps per call,
// sgemm 4096, rope [1, 4096, 32, 128], attention [1, 4096, 8, 128] causal, decode q [1, 1, 32,
// 128] k, v [1, 32768, 8, 128], peak memory at 32768 tokens. Quick: 64 MiB, 2^20 steps, sgemm
// 1024, rope [1, 1024, 32, 128], attention at 512 tokens, decode at 4096, peak memory at 2048
// (the names say the sizes).
std::vector<Entry> suite(const SuiteOptions& options);

// Rate of `r` divided by the rate of `baseline` (0 when either is not positive).
double ratio(const Result& r, const Result& baseline);

// Whether `r` is compared with fma_peak: compute-bound (GFLOP/s) and not fma_peak itself.
bool compares_with_fma_peak(const Result& r);

// One ratio `posenc bench` reports: `key` is the output field, `baseline` the entry compared
// with, `value` the rate of the entry over the baseline's.
struct RatioField {
  std::string key;
  std::string baseline;
  double value = 0;
};
// The ratios of `r` to the entries measured before it in the same run (`done`, by name), in
// output order: "ratio" for the first of r.baselines and "ratio_<name>" for the others, then
// "vs_fma_peak" (GFLOP/s over fma_peak's) when compares_with_fma_peak(r). A baseline that did
// not run is left out.
std::vector<RatioField> ratio_fields(const Result& r, const std::map<std::string, Result>& done);

}  // namespace posenc::bench
