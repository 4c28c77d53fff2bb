// bench/harness.cc - see harness.h.
//
// Size: about 1,200 lines, one file because the timing, the baselines (bandwidth, sgemm, naive
// attention; the FMA peak is in fma_peak.cc, compiled per SIMD target), the attention and RoPE
// workloads and the suite are the one harness behind `posenc bench`; each section is marked, and
// the suite at the end names every entry.
#include "harness.h"

#include <cblas.h>
#include <malloc.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

#include "engine.h"
#include "kernels/bf16_dot.h"
#include "kernels/parallel.h"
#include "kernels/simd.h"
#include "posenc/alibi.h"
#include "posenc/attention.h"
#include "posenc/error.h"
#include "posenc/half.h"
#include "posenc/paged.h"
#include "posenc/rope.h"
#include "posenc/schemes.h"

#ifdef _OPENMP
#include <omp.h>
#endif

// GCC: compile the softmax row for AVX2 and AVX-512 too and pick one at load time, as the
// frameworks' vectorized softmax does; the rest of the baseline is OpenBLAS (dispatched too).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define POSENC_BENCH_CLONES __attribute__((target_clones("default", "avx2", "avx512f")))
#else
#define POSENC_BENCH_CLONES
#endif

namespace posenc::bench {
namespace {

// ---------------------------------------------------------------------------------------------
// Memory and threads.

// Threads: kernels/parallel.h (for_each_thread for the bandwidth baselines, parallel_for with a
// grain for row loops).
using kernels::for_each_thread;
template <class F>
void parallel_rows(int64_t n, int threads, int64_t grain, F&& f) {
  kernels::parallel_for(n, threads, std::forward<F>(f), grain);
}

// Uniform floats in [-1, 1) from splitmix64: cheap enough for gigabytes of inputs.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  float uniform() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<float>(z >> 40) * 0x1p-23f - 1.0f;
  }
  void fill(float* x, int64_t n, float amplitude = 1.0f) {
    for (int64_t i = 0; i < n; ++i) x[i] = amplitude * uniform();
  }

 private:
  uint64_t state_;
};

// Keeps a computed value alive without the compiler proving it unused.
volatile float g_sink = 0;

// ---------------------------------------------------------------------------------------------
// Kernels of the baselines.

// Sum with 16 independent lanes: vectorizes without -ffast-math and keeps many loads in flight.
float sum_floats(const float* x, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += x[i + j];
  }
  for (; i < n; ++i) acc[0] += x[i];
  float s = 0;
  for (float a : acc) s += a;
  return s;
}

// exp(x) for x <= 0 within a few ulp (Cephes expf: Cody-Waite reduction by ln 2, degree-6
// polynomial, exponent by bit construction; below -87 the result flushes to 0). Plain arithmetic
// without branches so that loops over it vectorize; always_inline because GCC does not inline
// ordinary functions into the target clones below.
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (|t| < 2^22)
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  int32_t biased = static_cast<int32_t>(n) + 127;
  biased = biased < 0 ? 0 : biased;
  return p * std::bit_cast<float>(biased << 23);
}

// Softmax of row[0, visible) in place, row[visible, n) = 0 (masked). visible == 0: all 0.
// Max and sum over 16 independent lanes (vectorizable without -ffast-math).
POSENC_BENCH_CLONES
void softmax_row(float* row, int64_t visible, int64_t n) {
  int64_t j = 0;
  if (visible > 0) {
    float lanes[16];
    for (float& m : lanes) m = row[0];
    for (; j + 16 <= visible; j += 16) {
      for (int l = 0; l < 16; ++l) lanes[l] = lanes[l] < row[j + l] ? row[j + l] : lanes[l];
    }
    for (; j < visible; ++j) lanes[0] = lanes[0] < row[j] ? row[j] : lanes[0];
    float m = lanes[0];
    for (float x : lanes) m = m < x ? x : m;
    for (j = 0; j < visible; ++j) row[j] = exp_nonpositive(row[j] - m);
    for (float& a : lanes) a = 0;
    for (j = 0; j + 16 <= visible; j += 16) {
      for (int l = 0; l < 16; ++l) lanes[l] += row[j + l];
    }
    for (; j < visible; ++j) lanes[0] += row[j];
    float sum = 0;
    for (float a : lanes) sum += a;
    const float inv = 1.0f / sum;
    for (j = 0; j < visible; ++j) row[j] *= inv;
  }
  for (j = visible < 0 ? 0 : visible; j < n; ++j) row[j] = 0.0f;
}

blasint blas_int(int64_t v) { return static_cast<blasint>(v); }

// sgemm reads a head as a matrix with unit-stride rows of head_dim and leading dimension
// stride[1] (the seq stride).
void require_gemm_view(const View<const float, 4>& x, const char* what) {
  if (x.shape[3] > 1 && x.stride[3] != 1) {
    throw ShapeError(std::string("naive_attention: ") + what +
                     ": head_dim must be contiguous (stride " + std::to_string(x.stride[3]) + ")");
  }
  if (x.shape[1] > 1 && x.stride[1] < x.shape[3]) {
    throw ShapeError(std::string("naive_attention: ") + what + ": seq stride (" +
                     std::to_string(x.stride[1]) + ") must be >= head_dim (" +
                     std::to_string(x.shape[3]) + ")");
  }
}

// ---------------------------------------------------------------------------------------------
// /proc/self/status.

// The value of a "Vm...:   1234 kB" line in KiB, or -1.
int64_t status_kib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.compare(0, field.size(), field) == 0 && line.size() > field.size() &&
        line[field.size()] == ':') {
      std::istringstream rest(line.substr(field.size() + 1));
      int64_t kib = -1;
      rest >> kib;
      return kib;
    }
  }
  return -1;
}

// Resets VmHWM to the current RSS (Linux >= 4.0). False when not possible.
bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  if (!out) return false;
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

std::string dims_name(int64_t a, int64_t b, int64_t c) {
  return std::to_string(a) + "x" + std::to_string(b) + "x" + std::to_string(c);
}

template <class T>
View<T, 4> view4(T* data, int64_t b, int64_t l, int64_t h, int64_t d) {
  return View<T, 4>::contiguous(data, {b, l, h, d});
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Timing.

TimingOptions quick_timing() {
  TimingOptions o;
  o.warmup = 1;
  o.min_total_s = 0.1;
  o.min_reps = 2;
  return o;
}

namespace {

Timing summarize(std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  const std::size_t n = samples.size();
  Timing t;
  t.reps = static_cast<int>(n);
  t.min_s = samples.front();
  t.median_s = n % 2 ? samples[n / 2] : 0.5 * (samples[n / 2 - 1] + samples[n / 2]);
  return t;
}

}  // namespace

Timing measure(const std::function<void()>& fn, const TimingOptions& options) {
  using Clock = std::chrono::steady_clock;
  for (int i = 0; i < options.warmup; ++i) fn();
  std::vector<double> samples;
  double total = 0;
  const int max_reps = std::max(options.max_reps, 1);
  while (static_cast<int>(samples.size()) < max_reps &&
         (total < options.min_total_s || static_cast<int>(samples.size()) < options.min_reps)) {
    const auto t0 = Clock::now();
    fn();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    samples.push_back(s);
    total += s;
  }
  return summarize(std::move(samples));
}

PairTiming measure_pair(const std::function<void()>& a, const std::function<void()>& b,
                        const TimingOptions& options) {
  using Clock = std::chrono::steady_clock;
  for (int i = 0; i < options.warmup; ++i) {
    a();
    b();
  }
  auto timed = [](const std::function<void()>& fn) {
    const auto t0 = Clock::now();
    fn();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  std::vector<double> sa, sb, ratios;
  double total = 0;
  const int min_pairs = std::max(options.min_reps, 5);
  const int max_pairs = std::max(options.max_reps, 1);
  while (static_cast<int>(sa.size()) < max_pairs &&
         (total < 2 * options.min_total_s || static_cast<int>(sa.size()) < min_pairs)) {
    sa.push_back(timed(a));
    sb.push_back(timed(b));
    ratios.push_back(sb.back() / sa.back());
    total += sa.back() + sb.back();
  }
  PairTiming p;
  p.a = summarize(sa);
  p.b = summarize(sb);
  std::sort(ratios.begin(), ratios.end());
  const std::size_t n = ratios.size();
  p.ratio = n % 2 ? ratios[n / 2] : 0.5 * (ratios[n / 2 - 1] + ratios[n / 2]);
  return p;
}

int resolve_threads(int requested) { return kernels::resolve_threads(requested); }

std::string simd_target() { return kernels::simd_target_name(); }
std::string simd_targets_available() { return kernels::simd_targets_available(); }

void set_blas_threads(int threads) { openblas_set_num_threads(std::max(threads, 1)); }

std::string blas_config() {
  const char* c = openblas_get_config();  // "OpenBLAS 0.3.21 DYNAMIC_ARCH ..."
  return c == nullptr ? "OpenBLAS" : c;
}

double ratio(const Result& r, const Result& baseline) {
  const double a = r.rate();
  const double b = baseline.rate();
  return a > 0 && b > 0 ? a / b : 0.0;
}

bool compares_with_fma_peak(const Result& r) {
  return !r.is_bandwidth() && r.flops > 0 && r.name != "fma_peak";
}

std::vector<RatioField> ratio_fields(const Result& r, const std::map<std::string, Result>& done) {
  std::vector<RatioField> fields;
  for (std::size_t i = 0; i < r.baselines.size(); ++i) {
    const auto it = done.find(r.baselines[i]);
    if (it == done.end()) continue;
    fields.push_back(
        {i == 0 ? "ratio" : "ratio_" + r.baselines[i], r.baselines[i], ratio(r, it->second)});
  }
  if (compares_with_fma_peak(r)) {
    const auto it = done.find("fma_peak");
    if (it != done.end()) fields.push_back({"vs_fma_peak", "fma_peak", ratio(r, it->second)});
  }
  return fields;
}

// ---------------------------------------------------------------------------------------------
// Baselines.

Result bench_copy_bandwidth(int threads, int64_t bytes, const TimingOptions& options) {
  threads = resolve_threads(threads);
  const int64_t chunk = bytes / threads / 64 * 64;  // bytes per thread
  const int64_t floats = chunk / 4;
  Buffer src(floats * threads);
  Buffer dst(floats * threads);
  for_each_thread(threads, [&](int t) {
    std::memset(src.data() + t * floats, 1, static_cast<std::size_t>(chunk));
    std::memset(dst.data() + t * floats, 0, static_cast<std::size_t>(chunk));
  });
  Result r;
  r.name = "copy_bandwidth";
  r.threads = threads;
  r.bytes = 2.0 * static_cast<double>(chunk) * threads;
  r.timing = measure(
      [&] {
        for_each_thread(threads, [&](int t) {
          std::memcpy(dst.data() + t * floats, src.data() + t * floats,
                      static_cast<std::size_t>(chunk));
        });
      },
      options);
  r.extra.emplace_back("buffer_mb", static_cast<double>(chunk) * threads / (1 << 20));
  return r;
}

Result bench_read_bandwidth(int threads, int64_t bytes, const TimingOptions& options) {
  threads = resolve_threads(threads);
  const int64_t floats = bytes / threads / 64 * 16;  // per thread, multiple of 16
  Buffer x(floats * threads);
  for_each_thread(threads,
                  [&](int t) { Rng(uint64_t(t) + 1).fill(x.data() + t * floats, floats); });
  std::vector<float> partial(static_cast<std::size_t>(threads) * 16);  // padded to 64 bytes
  Result r;
  r.name = "read_bandwidth";
  r.threads = threads;
  r.bytes = 4.0 * static_cast<double>(floats) * threads;
  r.timing = measure(
      [&] {
        for_each_thread(threads, [&](int t) {
          partial[static_cast<std::size_t>(t) * 16] = sum_floats(x.data() + t * floats, floats);
        });
        float s = 0;
        for (int t = 0; t < threads; ++t) s += partial[static_cast<std::size_t>(t) * 16];
        g_sink = s;
      },
      options);
  r.extra.emplace_back("buffer_mb", r.bytes / (1 << 20));
  return r;
}

Result bench_sgemm(int threads, int64_t n, const TimingOptions& options) {
  threads = resolve_threads(threads);
  Buffer a(n * n), b(n * n), c(n * n);
  Rng rng(7);
  rng.fill(a.data(), n * n);
  rng.fill(b.data(), n * n);
  std::fill(c.data(), c.data() + n * n, 0.0f);
  set_blas_threads(threads);
  Result r;
  r.name = "sgemm";
  r.threads = threads;
  r.flops = 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
  const blasint bn = blas_int(n);
  r.timing = measure(
      [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, bn, bn, bn, 1.0f, a.data(), bn,
                    b.data(), bn, 0.0f, c.data(), bn);
      },
      options);
  r.extra.emplace_back("n", static_cast<double>(n));
  r.info.emplace_back("blas", blas_config());
  // OpenBLAS's worker threads keep spinning for a while after a call; left alone they would
  // steal cycles from the entries measured next. Back to one thread, and let them park.
  set_blas_threads(1);
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  return r;
}

void naive_attention(View<const float, 4> q, View<const float, 4> k, View<const float, 4> v,
                     bool causal, double scale, View<float, 4> out, int threads) {
  require_gemm_view(q, "q");
  require_gemm_view(k, "k");
  require_gemm_view(v, "v");
  require_gemm_view(out, "out");
  const int64_t batch = q.shape[0], lq = q.shape[1], hq = q.shape[2], d = q.shape[3];
  const int64_t lk = k.shape[1], hkv = k.shape[2];
  if (k.shape[0] != batch || v.shape[0] != batch || v.shape[1] != lk || v.shape[2] != hkv ||
      k.shape[3] != d || v.shape[3] != d || hkv < 1 || hq % hkv != 0 || out.shape != q.shape) {
    throw ShapeError("naive_attention: q " + shape_str(q.shape) + ", k " + shape_str(k.shape) +
                     ", v " + shape_str(v.shape) + ", out " + shape_str(out.shape) +
                     " do not fit [batch, seq, heads, head_dim] with kv heads dividing q heads");
  }
  if (batch == 0 || lq == 0 || hq == 0 || d == 0) return;
  threads = resolve_threads(threads);
  // One thread pool: OpenMP threads each run a single-threaded sgemm on a block of query rows.
  // (Multithreaded OpenBLAS, a second pool of spinning pthreads, fights the OpenMP threads of
  // the softmax: 5x slower at 2 threads. Eager frameworks run BLAS and softmax on one pool.)
  set_blas_threads(1);
  constexpr int64_t kRows = 128;
  const int64_t blocks = (lq + kRows - 1) / kRows;
  const int64_t group = hq / hkv;
  // Scores of every head, [heads_q, seq_q, seq_k]: the tensor eager attention materializes.
  Buffer scores(hq * lq * lk);
  for (int64_t b = 0; b < batch; ++b) {
    parallel_rows(hq * blocks, threads, 1, [&](int64_t item) {
      const int64_t h = item / blocks, i0 = item % blocks * kRows;
      const int64_t rows = std::min(kRows, lq - i0);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, blas_int(rows), blas_int(lk),
                  blas_int(d), static_cast<float>(scale), &q(b, i0, h, 0), blas_int(q.stride[1]),
                  &k(b, 0, h / group, 0), blas_int(k.stride[1]), 0.0f,
                  scores.data() + (h * lq + i0) * lk, blas_int(lk));
    });
    parallel_rows(hq * lq, threads, 8, [&](int64_t row) {
      const int64_t i = row % lq;
      const int64_t visible = causal ? std::clamp<int64_t>(lk - lq + i + 1, 0, lk) : lk;
      softmax_row(scores.data() + row * lk, visible, lk);
    });
    parallel_rows(hq * blocks, threads, 1, [&](int64_t item) {
      const int64_t h = item / blocks, i0 = item % blocks * kRows;
      const int64_t rows = std::min(kRows, lq - i0);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, blas_int(rows), blas_int(d),
                  blas_int(lk), 1.0f, scores.data() + (h * lq + i0) * lk, blas_int(lk),
                  &v(b, 0, h / group, 0), blas_int(v.stride[1]), 0.0f, &out(b, i0, h, 0),
                  blas_int(out.stride[1]));
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Workloads.

double attention_flops(const AttentionShape& s) {
  double cells = static_cast<double>(s.seq_q) * static_cast<double>(s.seq_k);
  if (s.causal) {
    if (s.seq_q == s.seq_k) {
      cells *= 0.5;
    } else {
      cells = 0;  // count the visible cells: query i sees keys j <= seq_k - seq_q + i
      for (int64_t i = 0; i < s.seq_q; ++i) {
        cells += static_cast<double>(std::clamp<int64_t>(s.seq_k - s.seq_q + i + 1, 0, s.seq_k));
      }
    }
  }
  return 4.0 * cells * static_cast<double>(s.head_dim) * static_cast<double>(s.heads_q) *
         static_cast<double>(s.batch);
}

double kv_bytes(const AttentionShape& s) {
  return 2.0 * 4.0 * static_cast<double>(s.batch) * static_cast<double>(s.seq_k) *
         static_cast<double>(s.heads_kv) * static_cast<double>(s.head_dim);
}

const std::vector<std::string>& scheme_names() {
  static const std::vector<std::string> names = posenc::scheme_names();
  return names;
}

View<const float, 4> dout_view(const float* dout, const AttentionShape& s) {
  return View<const float, 4>::contiguous(dout, {s.batch, s.seq_q, s.heads_q, s.head_dim});
}

struct AttentionWorkload::Storage {
  Buffer q, k, v, out;
  std::vector<float> table_a, table_b, table_c;
  PositionScheme scheme;
  // Backward: lse, dout, the gradients (allocated on first use).
  Buffer lse, dout, dq, dk, dv;
  std::vector<float> grad_a, grad_b, grad_c;
  AttentionGrads grads;
  bool bf16 = false;  // q, k, v and dout rounded to bf16 values (round_to_bf16)
};

namespace {
void round_bf16(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = to_float(bf16_from_float(x[i]));
}
}  // namespace

void AttentionWorkload::round_to_bf16() {
  Storage& st = *storage_;
  st.bf16 = true;
  for (Buffer* b : {&st.q, &st.k, &st.v}) round_bf16(b->data(), static_cast<int64_t>(b->size()));
}

AttentionWorkload::AttentionWorkload(const AttentionShape& shape, const std::string& scheme,
                                     uint64_t seed)
    : shape_(shape), scheme_name_(scheme), storage_(std::make_unique<Storage>()) {
  const auto& names = scheme_names();
  if (std::find(names.begin(), names.end(), scheme) == names.end()) {
    throw ValueError("bench: unknown scheme '" + scheme + "'");
  }
  const AttentionShape& s = shape_;
  Storage& st = *storage_;
  const int64_t nq = s.batch * s.seq_q * s.heads_q * s.head_dim;
  const int64_t nkv = s.batch * s.seq_k * s.heads_kv * s.head_dim;
  st.q = Buffer(nq);
  st.k = Buffer(nkv);
  st.v = Buffer(nkv);
  st.out = Buffer(nq);
  Rng rng(seed);
  rng.fill(st.q.data(), nq);
  rng.fill(st.k.data(), nkv);
  rng.fill(st.v.data(), nkv);
  std::fill(st.out.data(), st.out.data() + nq, 0.0f);

  const int64_t h = s.heads_q, d = s.head_dim;
  auto table = [&](std::vector<float>& t, int64_t n, float amplitude) {
    t.resize(static_cast<std::size_t>(n));
    rng.fill(t.data(), n, amplitude);
    return t.data();
  };
  if (scheme == "none") {
    st.scheme = NoPositions{};
  } else if (scheme == "rope") {
    RopeConfig cfg;
    cfg.head_dim = d;
    st.scheme = Rope{rope_frequencies(cfg), RopeStyle::kHalf};
  } else if (scheme == "alibi") {
    st.scheme = Alibi{alibi_slopes(AlibiConfig{.heads = h}), 8.0};
  } else if (scheme == "t5") {
    const int64_t buckets = 32;
    const float* t = table(st.table_a, buckets * h, 1.0f);
    st.scheme = T5Bias{View<const float, 2>::contiguous(t, {buckets, h}), 128, std::nullopt};
  } else if (scheme == "shaw") {
    const int64_t rows = 2 * 16 + 1;
    const float* rk = table(st.table_a, rows * d, 0.5f);
    const float* rv = table(st.table_b, rows * d, 0.5f);
    st.scheme = Shaw{shaw_table(View<const float, 2>::contiguous(rk, {rows, d})),
                     shaw_table(View<const float, 2>::contiguous(rv, {rows, d}))};
  } else if (scheme == "deberta") {
    DebertaBuckets buckets;
    buckets.max_relative_positions = 512;
    buckets.position_buckets = 256;
    // DeBERTa-v3 checkpoints compute the transposed p2c index (include/posenc/deberta.h).
    buckets.p2c = DebertaP2c::kModel;
    const int64_t rows = 2 * buckets.span();
    const float* pk = table(st.table_a, rows * h * d, 0.5f);
    const float* pq = table(st.table_b, rows * h * d, 0.5f);
    st.scheme = DeBERTa{View<const float, 3>::contiguous(pk, {rows, h, d}),
                        View<const float, 3>::contiguous(pq, {rows, h, d}), buckets};
  } else {  // xl
    const int64_t d_model = h * d;
    const float* u = table(st.table_a, h * d, 0.1f);
    const float* w = table(st.table_b, h * d, 0.1f);
    const float* r_net =
        table(st.table_c, h * d * d_model, 1.0f / std::sqrt(static_cast<float>(d_model)));
    st.scheme = TransformerXL{View<const float, 2>::contiguous(u, {h, d}),
                              View<const float, 2>::contiguous(w, {h, d}),
                              View<const float, 2>::contiguous(r_net, {h * d, d_model}), 1e4};
  }
}

AttentionWorkload::~AttentionWorkload() = default;

const PositionScheme& AttentionWorkload::scheme() const { return storage_->scheme; }

View<const float, 4> AttentionWorkload::q() const {
  return view4<const float>(storage_->q.data(), shape_.batch, shape_.seq_q, shape_.heads_q,
                            shape_.head_dim);
}
View<const float, 4> AttentionWorkload::k() const {
  return view4<const float>(storage_->k.data(), shape_.batch, shape_.seq_k, shape_.heads_kv,
                            shape_.head_dim);
}
View<const float, 4> AttentionWorkload::v() const {
  return view4<const float>(storage_->v.data(), shape_.batch, shape_.seq_k, shape_.heads_kv,
                            shape_.head_dim);
}
View<float, 4> AttentionWorkload::out() {
  return view4<float>(storage_->out.data(), shape_.batch, shape_.seq_q, shape_.heads_q,
                      shape_.head_dim);
}

double AttentionWorkload::input_output_bytes() const {
  return 4.0 *
         static_cast<double>(2 * storage_->q.size() + storage_->k.size() + storage_->v.size());
}

void AttentionWorkload::run(int threads) {
  AttentionOptions opt;
  opt.causal = shape_.causal;
  opt.num_threads = resolve_threads(threads);
  attention(q(), k(), v(), scheme(), opt, out());
}

void AttentionWorkload::run_backward(int threads) {
  Storage& st = *storage_;
  const AttentionShape& s = shape_;
  AttentionOptions opt;
  opt.causal = s.causal;
  opt.num_threads = resolve_threads(threads);
  const int64_t nq = s.batch * s.seq_q * s.heads_q * s.head_dim;
  const int64_t nkv = s.batch * s.seq_k * s.heads_kv * s.head_dim;
  if (st.dq.size() == 0) {
    st.lse = Buffer(s.batch * s.heads_q * s.seq_q);
    st.dout = Buffer(nq);
    st.dq = Buffer(nq);
    st.dk = Buffer(nkv);
    st.dv = Buffer(nkv);
    Rng(7).fill(st.dout.data(), nq);
    if (st.bf16) round_bf16(st.dout.data(), nq);
    attention(q(), k(), v(), scheme(), opt, out(),
              View<float, 3>::contiguous(st.lse.data(), {s.batch, s.heads_q, s.seq_q}));
    AttentionGrads& g = st.grads;
    g.dq = view4<float>(st.dq.data(), s.batch, s.seq_q, s.heads_q, s.head_dim);
    g.dk = view4<float>(st.dk.data(), s.batch, s.seq_k, s.heads_kv, s.head_dim);
    g.dv = view4<float>(st.dv.data(), s.batch, s.seq_k, s.heads_kv, s.head_dim);
    auto like = [](std::vector<float>& buf, const auto& table) {
      buf.assign(static_cast<std::size_t>(table.numel()), 0.0f);
      using V = std::remove_cv_t<std::remove_reference_t<decltype(table)>>;
      return View<float, V{}.shape.size()>::contiguous(buf.data(), table.shape);
    };
    if (const auto* t = std::get_if<T5Bias>(&st.scheme)) {
      g.drelative_attention_bias = like(st.grad_a, t->table);
    } else if (std::holds_alternative<Alibi>(st.scheme)) {
      st.grad_a.assign(static_cast<std::size_t>(s.heads_q), 0.0f);
      g.dslopes = View<float, 1>::contiguous(st.grad_a.data(), {s.heads_q});
    } else if (const auto* sh = std::get_if<Shaw>(&st.scheme)) {
      g.drel_k = like(st.grad_a, sh->rel_k);
      g.drel_v = like(st.grad_b, sh->rel_v);
    } else if (const auto* x = std::get_if<TransformerXL>(&st.scheme)) {
      g.dr_w_bias = like(st.grad_a, x->r_w_bias);
      g.dr_r_bias = like(st.grad_b, x->r_r_bias);
      g.dr_net = like(st.grad_c, x->r_net);
    } else if (const auto* db = std::get_if<DeBERTa>(&st.scheme)) {
      g.dpos_key = like(st.grad_a, db->pos_key);
      g.dpos_query = like(st.grad_b, db->pos_query);
    }
  }
  const auto lse = View<const float, 3>::contiguous(st.lse.data(), {s.batch, s.heads_q, s.seq_q});
  attention_backward(q(), k(), v(), out(), lse, dout_view(st.dout.data(), s), scheme(), opt,
                     st.grads);
}

double AttentionWorkload::backward_bytes() const {
  const AttentionShape& s = shape_;
  const double nq = static_cast<double>(s.batch * s.seq_q * s.heads_q * s.head_dim);
  const double nkv = static_cast<double>(s.batch * s.seq_k * s.heads_kv * s.head_dim);
  return 4.0 * (4 * nq + 4 * nkv + static_cast<double>(s.batch * s.heads_q * s.seq_q));
}

void AttentionWorkload::run_naive(int threads) {
  naive_attention(q(), k(), v(), shape_.causal,
                  1.0 / std::sqrt(static_cast<double>(shape_.head_dim)), out(), threads);
}

std::string attention_name(const std::string& scheme, const AttentionShape& s) {
  return "attention_" + scheme + (s.causal ? "_causal" : "_bidir") + "_L" +
         std::to_string(s.seq_k) + "_H" + std::to_string(s.heads_q) + "_D" +
         std::to_string(s.head_dim);
}

Result bench_attention(const std::string& scheme, const AttentionShape& shape, int threads,
                       const TimingOptions& options, int64_t fma_steps) {
  threads = resolve_threads(threads);
  AttentionWorkload w(shape, scheme);
  Result r;
  r.name = attention_name(scheme, shape);
  r.threads = threads;
  r.flops = attention_flops(shape);
  r.baselines = {"sgemm"};
  if (scheme == "none" && fma_steps > 0) {
    // The FMA peak in alternation: on a shared machine its speed and the attention's drift
    // together, which a ratio to the fma_peak entry, timed minutes apart, does not see.
    const FmaCall fma = fma_peak_call(threads, fma_steps);
    const PairTiming pt = measure_pair(
        fma.run, [&] { w.run(threads); }, options);
    r.timing = pt.b;
    r.extra.emplace_back("vs_fma_peak_paired", r.flops / fma.flops / pt.ratio);
    r.extra.emplace_back("fma_peak_median_s", pt.a.median_s);
    return r;
  }
  if (scheme == "none") {
    r.timing = measure([&] { w.run(threads); }, options);
    return r;
  }
  // The scheme's cost over no positions: timed against a no-position run in alternation.
  AttentionWorkload none(shape, "none");
  const PairTiming pt = measure_pair([&] { none.run(threads); }, [&] { w.run(threads); }, options);
  r.timing = pt.b;
  r.extra.emplace_back("vs_none", pt.ratio);
  r.extra.emplace_back("none_median_s", pt.a.median_s);
  return r;
}

Result bench_attention_backward(const std::string& scheme, const AttentionShape& shape, int threads,
                                const TimingOptions& options) {
  threads = resolve_threads(threads);
  AttentionWorkload w(shape, scheme);
  Result r;
  r.name = "attention_backward_" + attention_name(scheme, shape).substr(sizeof("attention_") - 1);
  r.threads = threads;
  r.flops = 2.5 * attention_flops(shape);
  r.baselines = {"sgemm"};
  w.run_backward(threads);  // forward, dout, buffers
  // Backward over forward of the same scheme, in alternation.
  const PairTiming fwd =
      measure_pair([&] { w.run(threads); }, [&] { w.run_backward(threads); }, options);
  r.timing = fwd.b;
  r.extra.emplace_back("vs_forward", fwd.ratio);
  r.extra.emplace_back("forward_median_s", fwd.a.median_s);
  if (scheme != "none") {
    AttentionWorkload none(shape, "none");
    none.run_backward(threads);
    const PairTiming pt = measure_pair([&] { none.run_backward(threads); },
                                       [&] { w.run_backward(threads); }, options);
    r.extra.emplace_back("vs_none", pt.ratio);
    r.extra.emplace_back("none_median_s", pt.a.median_s);
  }
  return r;
}

Result bench_attention_backward_bf16(const AttentionShape& shape, int threads,
                                     const TimingOptions& options) {
  threads = resolve_threads(threads);
  AttentionWorkload f32(shape, "none"), b16(shape, "none");
  b16.round_to_bf16();
  Result r;
  r.name = "attention_backward_" + attention_name("none", shape).substr(sizeof("attention_") - 1) +
           "_bf16";
  r.threads = threads;
  r.flops = 2.5 * attention_flops(shape);
  r.baselines = {"sgemm"};
  f32.run_backward(threads);  // forwards, douts, buffers
  b16.run_backward(threads);
  const PairTiming pt =
      measure_pair([&] { f32.run_backward(threads); }, [&] { b16.run_backward(threads); }, options);
  r.timing = pt.b;
  r.extra.emplace_back("vs_float32", pt.ratio);
  r.extra.emplace_back("float32_median_s", pt.a.median_s);
  r.extra.emplace_back("bf16_dot", kernels::bf16_dot_prefill() ? 1.0 : 0.0);
  return r;
}

Result bench_naive_attention(const AttentionShape& shape, int threads,
                             const TimingOptions& options) {
  threads = resolve_threads(threads);
  AttentionWorkload w(shape, "none");
  Result r;
  r.name = attention_name("naive", shape);
  r.threads = threads;
  r.flops = attention_flops(shape);
  r.baselines = {"sgemm"};
  r.timing = measure([&] { w.run_naive(threads); }, options);
  r.extra.emplace_back("scores_mb", 4.0 * static_cast<double>(shape.heads_q * shape.seq_q) *
                                        static_cast<double>(shape.seq_k) / (1 << 20));
  return r;
}

Result bench_decode(const AttentionShape& shape, int threads, const TimingOptions& options) {
  threads = resolve_threads(threads);
  AttentionWorkload w(shape, "none");
  Result r;
  r.name = "decode_gqa_" + std::to_string(shape.heads_q) + "x" + std::to_string(shape.heads_kv) +
           "_L" + std::to_string(shape.seq_k) + "_D" + std::to_string(shape.head_dim);
  r.threads = threads;
  r.bytes = kv_bytes(shape);
  r.baselines = {"read_bandwidth", "copy_bandwidth"};  // the decode target is read bandwidth
  r.timing = measure([&] { w.run(threads); }, options);
  return r;
}

// Peak memory of one call of `call` after `setup` (which allocates the workload's buffers):
// peak_mb over the state before setup, workspace_mb over the state before the call,
// inputs_outputs_mb from `inputs_outputs_bytes` (asked after setup).
Result measure_peak_memory(Result r, const std::function<void()>& setup,
                           const std::function<void()>& call,
                           const std::function<double()>& inputs_outputs_bytes) {
  constexpr double kMiB = 1 << 20;
#ifdef __GLIBC__
  // Start from a trimmed heap so freed memory malloc still holds cannot hide an allocation.
  malloc_trim(0);
#endif
  const int64_t base_kib = status_kib("VmRSS");
  if (base_kib < 0 || !reset_peak_rss() || status_kib("VmHWM") < 0) {
    throw Error("bench: cannot reset the peak resident set (/proc/self/clear_refs)");
  }
  setup();
#ifdef __GLIBC__
  malloc_trim(0);
#endif
  const int64_t before_call_kib = status_kib("VmRSS");
  reset_peak_rss();
  TimingOptions once;
  once.warmup = 0;
  once.min_reps = 1;
  once.max_reps = 1;
  once.min_total_s = 0;
  r.timing = measure(call, once);
  const int64_t peak_kib = status_kib("VmHWM");
  r.extra.emplace_back("peak_mb", static_cast<double>(peak_kib - base_kib) * 1024 / kMiB);
  r.extra.emplace_back("inputs_outputs_mb", inputs_outputs_bytes() / kMiB);
  r.extra.emplace_back("workspace_mb",
                       static_cast<double>(peak_kib - before_call_kib) * 1024 / kMiB);
  return r;
}

Result bench_peak_memory_attention(const AttentionShape& shape, int threads) {
  threads = resolve_threads(threads);
  Result r;
  r.name = "peak_memory_" + attention_name("none", shape);
  r.threads = threads;
  r.flops = attention_flops(shape);
  r.baselines = {"sgemm"};
  std::unique_ptr<AttentionWorkload> w;
  r = measure_peak_memory(
      r, [&] { w = std::make_unique<AttentionWorkload>(shape, "none"); }, [&] { w->run(threads); },
      [&] { return w->input_output_bytes(); });
  r.extra.emplace_back("naive_scores_mb", 4.0 * static_cast<double>(shape.batch) *
                                              static_cast<double>(shape.heads_q) *
                                              static_cast<double>(shape.seq_q) *
                                              static_cast<double>(shape.seq_k) / (1 << 20));
  return r;
}

Result bench_peak_memory_attention_backward(const AttentionShape& shape, int threads,
                                            const std::string& scheme) {
  threads = resolve_threads(threads);
  Result r;
  r.name = "peak_memory_attention_backward_" +
           attention_name(scheme, shape).substr(sizeof("attention_") - 1);
  r.threads = threads;
  r.flops = 2.5 * attention_flops(shape);
  r.baselines = {"sgemm"};
  std::unique_ptr<AttentionWorkload> w;
  // Setup runs the forward and allocates every buffer (first backward call); the second call
  // is measured.
  r = measure_peak_memory(
      r,
      [&] {
        w = std::make_unique<AttentionWorkload>(shape, scheme);
        w->run_backward(threads);
      },
      [&] { w->run_backward(threads); }, [&] { return w->backward_bytes(); });
  return r;
}

// The rope_neox workload: x [1, seq, heads, head_dim] random, base 1e4, positions 0.. .
struct RopeWorkload {
  int64_t n;
  Buffer x;
  RopeFrequencies freqs;
  Positions pos = Positions::offset(0);
  View<float, 4> xv;
  RopeWorkload(int64_t seq, int64_t heads, int64_t head_dim)
      : n(seq * heads * head_dim),
        x(n),
        freqs(rope_frequencies(RopeConfig{.head_dim = head_dim, .base = 1e4}, seq)),
        xv(view4<float>(x.data(), 1, seq, heads, head_dim)) {
    Rng(3).fill(x.data(), n);
  }
};

Result bench_rope(int64_t seq, int64_t heads, int64_t head_dim, int threads,
                  const TimingOptions& options) {
  threads = resolve_threads(threads);
  RopeWorkload rw(seq, heads, head_dim);
  const int64_t n = rw.n;
  const RopeFrequencies& freqs = rw.freqs;
  const Positions& pos = rw.pos;
  const View<float, 4> xv = rw.xv;
  Result r;
  r.name = "rope_neox_" + dims_name(seq, heads, head_dim);
  r.threads = threads;
  r.bytes = 2.0 * 4.0 * static_cast<double>(n);
  r.baselines = {"copy_bandwidth"};
  r.timing =
      measure([&] { apply_rope(freqs, RopeStyle::kHalf, xv, &pos, Direction::kForward, threads); },
              options);
  return r;
}

// ---------------------------------------------------------------------------------------------
// Half precision.

namespace {

template <class H>
std::vector<H> to_half(View<const float, 4> x) {
  std::vector<H> out(static_cast<std::size_t>(x.numel()));
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = from_float<H>(x.data[i]);
  return out;
}

// The workload's q, k, v in H, and an H output: one attention call per run().
template <class H>
struct HalfAttention {
  AttentionWorkload& w;
  std::vector<H> q, k, v, out;
  explicit HalfAttention(AttentionWorkload& work)
      : w(work),
        q(to_half<H>(work.q())),
        k(to_half<H>(work.k())),
        v(to_half<H>(work.v())),
        out(q.size()) {}
  void run(int threads) {
    const AttentionShape& s = w.shape();
    AttentionOptions opt;
    opt.causal = s.causal;
    opt.num_threads = threads;
    const std::array<int64_t, 4> qs{s.batch, s.seq_q, s.heads_q, s.head_dim},
        ks{s.batch, s.seq_k, s.heads_kv, s.head_dim};
    attention(View<const H, 4>::contiguous(q.data(), qs),
              View<const H, 4>::contiguous(k.data(), ks),
              View<const H, 4>::contiguous(v.data(), ks), w.scheme(), opt,
              View<H, 4>::contiguous(out.data(), qs));
  }
};

template <class H>
Result half_attention_entry(Result r, AttentionWorkload& w, int threads,
                            const TimingOptions& options) {
  HalfAttention<H> h(w);
  const PairTiming pt = measure_pair([&] { w.run(threads); }, [&] { h.run(threads); }, options);
  r.timing = pt.b;
  r.extra.emplace_back("vs_float32", pt.ratio);
  r.extra.emplace_back("float32_median_s", pt.a.median_s);
  return r;
}

void require_half(const std::string& dtype) {
  if (dtype != "bf16" && dtype != "f16") {
    throw Error("bench: half dtype must be bf16 or f16 (got '" + dtype + "')");
  }
}

}  // namespace

Result bench_attention_half(const std::string& dtype, const AttentionShape& shape, int threads,
                            const TimingOptions& options) {
  require_half(dtype);
  threads = resolve_threads(threads);
  AttentionWorkload w(shape, "none");
  Result r;
  r.name = attention_name("none", shape) + "_" + dtype;
  r.threads = threads;
  r.flops = attention_flops(shape);
  r.baselines = {"sgemm"};
  return dtype == "bf16" ? half_attention_entry<bf16>(std::move(r), w, threads, options)
                         : half_attention_entry<f16>(std::move(r), w, threads, options);
}

Result bench_decode_half(const std::string& dtype, const AttentionShape& shape, int threads,
                         const TimingOptions& options) {
  require_half(dtype);
  threads = resolve_threads(threads);
  AttentionWorkload w(shape, "none");
  Result r;
  r.name = "decode_gqa_" + std::to_string(shape.heads_q) + "x" + std::to_string(shape.heads_kv) +
           "_L" + std::to_string(shape.seq_k) + "_D" + std::to_string(shape.head_dim) + "_" + dtype;
  r.threads = threads;
  r.bytes = kv_bytes(shape) / 2;  // two bytes per element
  r.baselines = {"read_bandwidth", "copy_bandwidth"};
  if (dtype != "bf16") return half_attention_entry<f16>(std::move(r), w, threads, options);
  r = half_attention_entry<bf16>(std::move(r), w, threads, options);
  // bf16: whether the scores came from vdpbf16ps (AVX512_BF16, an AVX3 target) and, when they
  // did, the time against the widening kernel on the same data (vs_widening, paired).
  const int64_t rows = (shape.heads_q / shape.heads_kv * shape.seq_q + 3) / 4 * 4;
  const bool dot = rows <= 8 && kernels::bf16_dot_used(rows) && simd_target().rfind("AVX3", 0) == 0;
  r.extra.emplace_back("bf16_dot", dot ? 1.0 : 0.0);
  if (dot) {
    HalfAttention<bf16> h(w);
    const PairTiming pt = measure_pair(
        [&] {
          kernels::set_bf16_dot_for_test(0);  // the widening kernel
          h.run(threads);
          kernels::set_bf16_dot_for_test(-1);
        },
        [&] { h.run(threads); }, options);
    r.extra.emplace_back("vs_widening", pt.ratio);
    r.extra.emplace_back("widening_median_s", pt.a.median_s);
  }
  return r;
}

Result bench_rope_half(const std::string& dtype, int64_t seq, int64_t heads, int64_t head_dim,
                       int threads, const TimingOptions& options) {
  require_half(dtype);
  threads = resolve_threads(threads);
  RopeWorkload rw(seq, heads, head_dim);
  const int64_t n = rw.n;
  const RopeFrequencies& freqs = rw.freqs;
  const Positions& pos = rw.pos;
  const View<float, 4> xv = rw.xv;
  Result r;
  r.name = "rope_neox_" + dims_name(seq, heads, head_dim) + "_" + dtype;
  r.threads = threads;
  r.bytes = 2.0 * 2.0 * static_cast<double>(n);
  r.baselines = {"copy_bandwidth"};
  auto run = [&](auto tag) {
    using H = decltype(tag);
    std::vector<H> h = to_half<H>(xv);
    const auto hv = View<H, 4>::contiguous(h.data(), xv.shape);
    const PairTiming pt = measure_pair(
        [&] { apply_rope(freqs, RopeStyle::kHalf, xv, &pos, Direction::kForward, threads); },
        [&] { apply_rope(freqs, RopeStyle::kHalf, hv, hv, &pos, Direction::kForward, threads); },
        options);
    r.timing = pt.b;
    r.extra.emplace_back("vs_float32", pt.ratio);
    r.extra.emplace_back("float32_median_s", pt.a.median_s);
  };
  if (dtype == "bf16") {
    run(bf16{});
  } else {
    run(f16{});
  }
  return r;
}

Result bench_decode_paged(const std::string& dtype, const AttentionShape& shape, int64_t page_size,
                          bool head_major, int threads, const TimingOptions& options) {
  require_half(dtype);
  threads = resolve_threads(threads);
  if (page_size < 1 || shape.seq_k % page_size != 0) {
    throw Error("bench: page_size must divide seq_k");
  }
  AttentionWorkload w(shape, "none");
  const PageLayout layout = head_major ? PageLayout::kHeadMajor : PageLayout::kTokenMajor;
  Result r;
  r.name = "decode_paged_gqa_" + std::to_string(shape.heads_q) + "x" +
           std::to_string(shape.heads_kv) + "_L" + std::to_string(shape.seq_k) + "_D" +
           std::to_string(shape.head_dim) + "_" + dtype + "_" + page_layout_name(layout) + "_page" +
           std::to_string(page_size);
  r.threads = threads;
  r.bytes = kv_bytes(shape) / 2;
  r.baselines = {"read_bandwidth", "copy_bandwidth"};
  const auto run = [&](auto tag) {
    using H = decltype(tag);
    HalfAttention<H> h(w);  // the contiguous token-major cache, and the same keys in pages
    const AttentionShape& s = shape;
    const int64_t per_row = s.seq_k / page_size, pages = s.batch * per_row;
    const int64_t hk = s.heads_kv, dim = s.head_dim;
    std::vector<int32_t> table(static_cast<std::size_t>(pages)),
        lens(static_cast<std::size_t>(s.batch), static_cast<int32_t>(s.seq_k));
    // Pages in a shuffled order, as an engine's pool hands them out.
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), std::mt19937_64(7));
    std::vector<H> kp(h.k.size()), vp(h.v.size());
    const std::array<int64_t, 4> pool = head_major
                                            ? std::array<int64_t, 4>{pages, hk, page_size, dim}
                                            : std::array<int64_t, 4>{pages, page_size, hk, dim};
    const auto kpv = View<H, 4>::contiguous(kp.data(), pool);
    const auto vpv = View<H, 4>::contiguous(vp.data(), pool);
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t j = 0; j < s.seq_k; ++j)
        for (int64_t g = 0; g < hk; ++g) {
          const int64_t page = table[static_cast<std::size_t>(b * per_row + j / page_size)];
          const int64_t slot = j % page_size;
          H* kd = head_major ? &kpv(page, g, slot, 0) : &kpv(page, slot, g, 0);
          H* vd = head_major ? &vpv(page, g, slot, 0) : &vpv(page, slot, g, 0);
          const std::size_t at = static_cast<std::size_t>(((b * s.seq_k + j) * hk + g) * dim);
          std::copy_n(h.k.data() + at, dim, kd);
          std::copy_n(h.v.data() + at, dim, vd);
        }
    std::vector<H> out(h.out.size());
    const std::array<int64_t, 4> qs{s.batch, s.seq_q, s.heads_q, dim};
    AttentionOptions opt;
    opt.causal = s.causal;
    opt.num_threads = threads;
    const auto tv = View<const int32_t, 2>::contiguous(table.data(), {s.batch, per_row});
    const auto lv = View<const int32_t, 1>::contiguous(lens.data(), {s.batch});
    const PairTiming pt =
        measure_pair([&] { h.run(threads); },
                     [&] {
                       attention_paged(View<const H, 4>::contiguous(h.q.data(), qs),
                                       View<const H, 4>(kpv), View<const H, 4>(vpv), layout, tv, lv,
                                       w.scheme(), opt, View<H, 4>::contiguous(out.data(), qs));
                     },
                     options);
    r.timing = pt.b;
    r.extra.emplace_back("vs_contiguous", pt.ratio);
    r.extra.emplace_back("contiguous_median_s", pt.a.median_s);
  };
  if (dtype == "bf16") {
    run(bf16{});
  } else {
    run(f16{});
  }
  return r;
}

Result bench_decode_head_major(const AttentionShape& shape, int threads,
                               const TimingOptions& options) {
  threads = resolve_threads(threads);
  AttentionWorkload w(shape, "none");
  const AttentionShape& s = shape;
  Result r;
  r.name = "decode_head_major_gqa_" + std::to_string(s.heads_q) + "x" + std::to_string(s.heads_kv) +
           "_L" + std::to_string(s.seq_k) + "_D" + std::to_string(s.head_dim);
  r.threads = threads;
  r.bytes = kv_bytes(s);
  r.baselines = {"read_bandwidth", "copy_bandwidth"};
  // The same keys and values in [batch, heads_kv, seq_k, head_dim] buffers, viewed as
  // [batch, seq_k, heads_kv, head_dim].
  const int64_t hk = s.heads_kv, dim = s.head_dim;
  std::vector<float> kh(static_cast<std::size_t>(s.batch * s.seq_k * hk * dim)), vh(kh.size());
  const View<const float, 4> k = w.k(), v = w.v();
  const View<float, 4> kv{
      kh.data(), {s.batch, s.seq_k, hk, dim}, {s.seq_k * hk * dim, dim, s.seq_k * dim, 1}};
  const View<float, 4> vv{vh.data(), kv.shape, kv.stride};
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t j = 0; j < s.seq_k; ++j)
      for (int64_t g = 0; g < hk; ++g) {
        std::copy_n(&k(b, j, g, 0), dim, &kv(b, j, g, 0));
        std::copy_n(&v(b, j, g, 0), dim, &vv(b, j, g, 0));
      }
  AttentionOptions opt;
  opt.causal = s.causal;
  opt.num_threads = threads;
  const PairTiming pt =
      measure_pair([&] { w.run(threads); },
                   [&] { attention(w.q(), kv, vv, w.scheme(), opt, w.out()); }, options);
  r.timing = pt.b;
  r.extra.emplace_back("vs_token_major", pt.ratio);
  r.extra.emplace_back("token_major_median_s", pt.a.median_s);
  return r;
}

// ---------------------------------------------------------------------------------------------
// Suite.

std::vector<Entry> suite(const SuiteOptions& options) {
  const int threads = resolve_threads(options.threads);
  const bool quick = options.quick;
  const TimingOptions timing = quick ? quick_timing() : TimingOptions{};
  const int64_t buffer = int64_t{quick ? 64 : 256} << 20;
  const int64_t fma_steps = int64_t{1} << (quick ? 20 : 22);
  const int64_t gemm_n = quick ? 1024 : 4096;
  const int64_t rope_seq = quick ? 1024 : 4096;
  const int64_t attn_seq = quick ? 512 : 4096;
  const int64_t decode_seq = quick ? 4096 : 32768;
  const int64_t peak_seq = quick ? 2048 : 32768;

  AttentionShape attn;
  attn.seq_q = attn.seq_k = attn_seq;
  attn.heads_q = attn.heads_kv = 8;
  attn.head_dim = 128;
  attn.causal = true;
  AttentionShape decode;
  decode.seq_q = 1;
  decode.seq_k = decode_seq;
  decode.heads_q = 32;
  decode.heads_kv = 8;
  decode.head_dim = 128;
  decode.causal = true;
  AttentionShape peak = attn;
  peak.seq_q = peak.seq_k = peak_seq;

  std::vector<Entry> all;
  all.push_back({"copy_bandwidth", [=] { return bench_copy_bandwidth(threads, buffer, timing); }});
  all.push_back({"read_bandwidth", [=] { return bench_read_bandwidth(threads, buffer, timing); }});
  all.push_back({"fma_peak", [=] { return bench_fma_peak(threads, fma_steps, timing); }});
  all.push_back({"sgemm", [=] { return bench_sgemm(threads, gemm_n, timing); }});
  if (bf16_dot_peak_available()) {
    // As many steps as fma_peak: twice the products per instruction, when it issues as often.
    all.push_back(
        {"bf16_dot_peak", [=] { return bench_bf16_dot_peak(threads, fma_steps, timing); }});
  }
  all.push_back({"rope_neox_" + dims_name(rope_seq, 32, 128),
                 [=] { return bench_rope(rope_seq, 32, 128, threads, timing); }});
  for (const std::string& s : scheme_names()) {
    all.push_back({attention_name(s, attn),
                   [=] { return bench_attention(s, attn, threads, timing, fma_steps); }});
  }
  all.push_back({attention_name("naive", attn),
                 [=] { return bench_naive_attention(attn, threads, timing); }});
  all.push_back({"decode_gqa_32x8_L" + std::to_string(decode_seq) + "_D128",
                 [=] { return bench_decode(decode, threads, timing); }});
  for (const char* dtype : {"bf16", "f16"}) {
    const std::string t = dtype;
    all.push_back({"decode_gqa_32x8_L" + std::to_string(decode_seq) + "_D128_" + t,
                   [=] { return bench_decode_half(t, decode, threads, timing); }});
  }
  // GQA groups of 8 (Llama-3-70B's 64 query heads over 8 kv heads): 8 query rows per kv head,
  // where the AVX512_BF16 scores are used (kernels/bf16_dot.h).
  AttentionShape decode8 = decode;
  decode8.heads_q = 64;
  all.push_back({"decode_gqa_64x8_L" + std::to_string(decode_seq) + "_D128_bf16",
                 [=] { return bench_decode_half("bf16", decode8, threads, timing); }});
  // Paged KV caches: bf16 pages of 16 tokens, head-major, against the contiguous token-major
  // bf16 decode (vs_contiguous); a head-major contiguous float32 cache against the token-major
  // one (vs_token_major).
  const std::string dshape = "gqa_32x8_L" + std::to_string(decode_seq) + "_D128";
  all.push_back({"decode_paged_" + dshape + "_bf16_head_major_page16",
                 [=] { return bench_decode_paged("bf16", decode, 16, true, threads, timing); }});
  all.push_back({"decode_head_major_" + dshape,
                 [=] { return bench_decode_head_major(decode, threads, timing); }});
  all.push_back({attention_name("none", attn) + "_bf16",
                 [=] { return bench_attention_half("bf16", attn, threads, timing); }});
  all.push_back({"rope_neox_" + dims_name(rope_seq, 32, 128) + "_bf16",
                 [=] { return bench_rope_half("bf16", rope_seq, 32, 128, threads, timing); }});
  all.push_back({"peak_memory_" + attention_name("none", peak),
                 [=] { return bench_peak_memory_attention(peak, threads); }});
  for (const std::string& s : scheme_names()) {
    all.push_back({"attention_backward_" + attention_name(s, attn).substr(10),
                   [=] { return bench_attention_backward(s, attn, threads, timing); }});
  }
  all.push_back({"attention_backward_" + attention_name("none", attn).substr(10) + "_bf16",
                 [=] { return bench_attention_backward_bf16(attn, threads, timing); }});
  for (const char* scheme : {"none", "rope"}) {
    const std::string s = scheme;
    all.push_back({"peak_memory_attention_backward_" + attention_name(s, peak).substr(10),
                   [=] { return bench_peak_memory_attention_backward(peak, threads, s); }});
  }
  // What engines feed attention (engine.h): packed sequences, soft-capping, document masks.
  const int64_t varlen_docs = quick ? 8 : 16, varlen_len = quick ? 128 : 256;
  all.push_back({"varlen_causal_" + std::to_string(varlen_docs) + "x" + std::to_string(varlen_len) +
                     "_H8_D128",
                 [=] { return bench_varlen(varlen_docs, varlen_len, threads, timing); }});
  all.push_back({"attention_softcap_causal_L" + std::to_string(attn_seq) + "_H8_D128",
                 [=] { return bench_softcap(attn_seq, threads, timing); }});
  const int64_t mask_docs = quick ? 16 : 64;
  all.push_back({"document_mask_" + std::to_string(mask_docs) + "x128_H2_D128",
                 [=] { return bench_document_mask(mask_docs, 128, threads, timing); }});

  if (options.filter.empty()) return all;
  // Comma-separated alternatives: a substring of the name, or "=NAME" for that name only.
  std::vector<std::string> alternatives;
  for (std::size_t at = 0; at <= options.filter.size();) {
    const std::size_t end = std::min(options.filter.find(',', at), options.filter.size());
    if (end > at) alternatives.push_back(options.filter.substr(at, end - at));
    at = end + 1;
  }
  const auto selected = [&](const std::string& name) {
    return std::any_of(alternatives.begin(), alternatives.end(), [&](const std::string& a) {
      return a[0] == '=' ? name == a.substr(1) : name.find(a) != std::string::npos;
    });
  };
  std::vector<Entry> kept;
  for (auto& e : all) {
    if (selected(e.name)) kept.push_back(std::move(e));
  }
  return kept;
}

}  // namespace posenc::bench
