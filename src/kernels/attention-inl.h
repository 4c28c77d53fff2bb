// src/kernels/attention-inl.h - micro-kernels shared by the fused attention forward
// (attention_hwy.cc) and backward (attention_backward_hwy.cc): score tiles S = Q . Kt, the
// P . V accumulation and a dot product, per Highway target.
//
// Included once per target by the kernels' .cc files after hwy/foreach_target.h (the guard
// below re-expands for each target).
#if defined(POSENC_KERNELS_ATTENTION_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef POSENC_KERNELS_ATTENTION_INL_H_
#undef POSENC_KERNELS_ATTENTION_INL_H_
#else
#define POSENC_KERNELS_ATTENTION_INL_H_
#endif

#include <algorithm>
#include <cstdint>

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DI = hn::RebindToSigned<DF>;

// Keys per tile: a multiple of every target's lane count (<= 16 floats).
constexpr int64_t kTileK = 64;

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Targets with 16 vector registers of 8 floats (AVX2) also run the score and P.V micro-kernels
// on blocks of 6 rows (12 accumulators).
constexpr bool kSixRows = HWY_MAX_BYTES == 32 && HWY_TARGET != HWY_SCALAR;

// S[r][c] = sum_{k < dim} Qp[r][k] * Kt[k][c] for r < rows_pad (multiple of 4), c < kTileK; Qp
// rows qs floats apart (0: dim), S rows ss apart; accumulate: S += instead of S =.
HWY_INLINE void ScoresTile(const float* HWY_RESTRICT qp, int64_t dim, const float* HWY_RESTRICT kt,
                           int64_t rows_pad, float* HWY_RESTRICT s, int64_t ss = kTileK,
                           int64_t qs = 0, bool accumulate = false) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  if (qs == 0) qs = dim;
  // Column chunk: 4 vectors when registers allow (AVX-512: 32 registers), else 2.
  const int64_t cv = HWY_MAX_BYTES >= 64 ? 4 : 2;
  const int64_t chunk = cv * n;
  int64_t r = 0;
  if constexpr (kSixRows) {
    // 6 rows x 2 vectors: 12 accumulators (of 16 registers), so that 12 independent chains of
    // fused multiply-adds cover their latency; the rest in blocks of 4. Each score is the same
    // chain in k order either way.
    for (const int64_t end = rows_pad / 12 * 12; r < end; r += 6) {
      const float* q0 = qp + r * qs;
      for (int64_t c0 = 0; c0 < kTileK; c0 += 2 * n) {
        hn::Vec<DF> a[6][2];
        float* s0 = s + r * ss + c0;
        HWY_UNROLL(6)
        for (int64_t i = 0; i < 6; ++i) {
          a[i][0] = accumulate ? hn::LoadU(d, s0 + i * ss) : hn::Zero(d);
          a[i][1] = accumulate ? hn::LoadU(d, s0 + i * ss + n) : hn::Zero(d);
        }
        for (int64_t k = 0; k < dim; ++k) {
          const float* kr = kt + k * kTileK + c0;
          const auto k0 = hn::Load(d, kr), k1 = hn::Load(d, kr + n);
          HWY_UNROLL(6)
          for (int64_t i = 0; i < 6; ++i) {
            const auto b = hn::Set(d, q0[i * qs + k]);
            a[i][0] = hn::MulAdd(b, k0, a[i][0]);
            a[i][1] = hn::MulAdd(b, k1, a[i][1]);
          }
        }
        HWY_UNROLL(6)
        for (int64_t i = 0; i < 6; ++i) {
          hn::StoreU(a[i][0], d, s0 + i * ss);
          hn::StoreU(a[i][1], d, s0 + i * ss + n);
        }
      }
    }
  }
  for (; r < rows_pad; r += 4) {
    const float* q0 = qp + r * qs;
    for (int64_t c0 = 0; c0 < kTileK; c0 += chunk) {
      const int64_t nv = std::min<int64_t>(cv, (kTileK - c0) / n);
      auto a00 = hn::Zero(d), a01 = hn::Zero(d), a02 = hn::Zero(d), a03 = hn::Zero(d);
      auto a10 = hn::Zero(d), a11 = hn::Zero(d), a12 = hn::Zero(d), a13 = hn::Zero(d);
      auto a20 = hn::Zero(d), a21 = hn::Zero(d), a22 = hn::Zero(d), a23 = hn::Zero(d);
      auto a30 = hn::Zero(d), a31 = hn::Zero(d), a32 = hn::Zero(d), a33 = hn::Zero(d);
      float* s0 = s + r * ss + c0;
      if (accumulate) {
        a00 = hn::LoadU(d, s0), a10 = hn::LoadU(d, s0 + ss);
        a20 = hn::LoadU(d, s0 + 2 * ss), a30 = hn::LoadU(d, s0 + 3 * ss);
        a01 = hn::LoadU(d, s0 + n), a11 = hn::LoadU(d, s0 + ss + n);
        a21 = hn::LoadU(d, s0 + 2 * ss + n), a31 = hn::LoadU(d, s0 + 3 * ss + n);
        if (nv == 4) {
          a02 = hn::LoadU(d, s0 + 2 * n), a12 = hn::LoadU(d, s0 + ss + 2 * n);
          a22 = hn::LoadU(d, s0 + 2 * ss + 2 * n), a32 = hn::LoadU(d, s0 + 3 * ss + 2 * n);
          a03 = hn::LoadU(d, s0 + 3 * n), a13 = hn::LoadU(d, s0 + ss + 3 * n);
          a23 = hn::LoadU(d, s0 + 2 * ss + 3 * n), a33 = hn::LoadU(d, s0 + 3 * ss + 3 * n);
        }
      }
      if (nv == 4) {
        for (int64_t k = 0; k < dim; ++k) {
          const float* kr = kt + k * kTileK + c0;
          const auto k0 = hn::Load(d, kr), k1 = hn::Load(d, kr + n), k2 = hn::Load(d, kr + 2 * n),
                     k3 = hn::Load(d, kr + 3 * n);
          const auto b0 = hn::Set(d, q0[k]), b1 = hn::Set(d, q0[qs + k]),
                     b2 = hn::Set(d, q0[2 * qs + k]), b3 = hn::Set(d, q0[3 * qs + k]);
          a00 = hn::MulAdd(b0, k0, a00), a01 = hn::MulAdd(b0, k1, a01);
          a02 = hn::MulAdd(b0, k2, a02), a03 = hn::MulAdd(b0, k3, a03);
          a10 = hn::MulAdd(b1, k0, a10), a11 = hn::MulAdd(b1, k1, a11);
          a12 = hn::MulAdd(b1, k2, a12), a13 = hn::MulAdd(b1, k3, a13);
          a20 = hn::MulAdd(b2, k0, a20), a21 = hn::MulAdd(b2, k1, a21);
          a22 = hn::MulAdd(b2, k2, a22), a23 = hn::MulAdd(b2, k3, a23);
          a30 = hn::MulAdd(b3, k0, a30), a31 = hn::MulAdd(b3, k1, a31);
          a32 = hn::MulAdd(b3, k2, a32), a33 = hn::MulAdd(b3, k3, a33);
        }
        hn::StoreU(a00, d, s0), hn::StoreU(a01, d, s0 + n), hn::StoreU(a02, d, s0 + 2 * n);
        hn::StoreU(a03, d, s0 + 3 * n);
        hn::StoreU(a10, d, s0 + ss), hn::StoreU(a11, d, s0 + ss + n);
        hn::StoreU(a12, d, s0 + ss + 2 * n), hn::StoreU(a13, d, s0 + ss + 3 * n);
        hn::StoreU(a20, d, s0 + 2 * ss), hn::StoreU(a21, d, s0 + 2 * ss + n);
        hn::StoreU(a22, d, s0 + 2 * ss + 2 * n), hn::StoreU(a23, d, s0 + 2 * ss + 3 * n);
        hn::StoreU(a30, d, s0 + 3 * ss), hn::StoreU(a31, d, s0 + 3 * ss + n);
        hn::StoreU(a32, d, s0 + 3 * ss + 2 * n), hn::StoreU(a33, d, s0 + 3 * ss + 3 * n);
      } else {
        for (int64_t k = 0; k < dim; ++k) {
          const float* kr = kt + k * kTileK + c0;
          const auto k0 = hn::Load(d, kr), k1 = hn::Load(d, kr + n);
          const auto b0 = hn::Set(d, q0[k]), b1 = hn::Set(d, q0[qs + k]),
                     b2 = hn::Set(d, q0[2 * qs + k]), b3 = hn::Set(d, q0[3 * qs + k]);
          a00 = hn::MulAdd(b0, k0, a00), a01 = hn::MulAdd(b0, k1, a01);
          a10 = hn::MulAdd(b1, k0, a10), a11 = hn::MulAdd(b1, k1, a11);
          a20 = hn::MulAdd(b2, k0, a20), a21 = hn::MulAdd(b2, k1, a21);
          a30 = hn::MulAdd(b3, k0, a30), a31 = hn::MulAdd(b3, k1, a31);
        }
        hn::StoreU(a00, d, s0), hn::StoreU(a01, d, s0 + n);
        hn::StoreU(a10, d, s0 + ss), hn::StoreU(a11, d, s0 + ss + n);
        hn::StoreU(a20, d, s0 + 2 * ss), hn::StoreU(a21, d, s0 + 2 * ss + n);
        hn::StoreU(a30, d, s0 + 3 * ss), hn::StoreU(a31, d, s0 + 3 * ss + n);
      }
    }
  }
}

// O[r][:] += sum_{c < nk} P[r][c] * V[c][:] for r < rows_pad (multiple of 4); columns
// [0, dpad) with dpad a multiple of lanes; V rows vstride floats apart with at least dpad
// readable. P rows are ps floats apart (default kTileK), O rows os floats apart (0: dpad).
HWY_INLINE void AccumulateTile(const float* HWY_RESTRICT pm, int64_t nk, const float* v,
                               int64_t vstride, int64_t dpad, int64_t rows_pad,
                               float* HWY_RESTRICT o, int64_t ps = kTileK, int64_t os = 0) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  const int64_t dv = HWY_MAX_BYTES >= 64 ? 4 : 2;
  if (os == 0) os = dpad;
  int64_t r = 0;
  if constexpr (kSixRows) {
    // 6 rows x 2 vectors (see ScoresTile); dpad is a multiple of 2 vectors here or the rest of
    // the row goes to the blocks of 4 below.
    if (dpad % (2 * n) == 0) {
      for (const int64_t end = rows_pad / 12 * 12; r < end; r += 6) {
        const float* p0 = pm + r * ps;
        float* o0 = o + r * os;
        for (int64_t x0 = 0; x0 < dpad; x0 += 2 * n) {
          hn::Vec<DF> a[6][2];
          HWY_UNROLL(6)
          for (int64_t i = 0; i < 6; ++i) {
            a[i][0] = hn::LoadU(d, o0 + i * os + x0);
            a[i][1] = hn::LoadU(d, o0 + i * os + x0 + n);
          }
          for (int64_t c = 0; c < nk; ++c) {
            const float* vr = v + c * vstride + x0;
            const auto v0 = hn::LoadU(d, vr), v1 = hn::LoadU(d, vr + n);
            HWY_UNROLL(6)
            for (int64_t i = 0; i < 6; ++i) {
              const auto b = hn::Set(d, p0[i * ps + c]);
              a[i][0] = hn::MulAdd(b, v0, a[i][0]);
              a[i][1] = hn::MulAdd(b, v1, a[i][1]);
            }
          }
          HWY_UNROLL(6)
          for (int64_t i = 0; i < 6; ++i) {
            hn::StoreU(a[i][0], d, o0 + i * os + x0);
            hn::StoreU(a[i][1], d, o0 + i * os + x0 + n);
          }
        }
      }
    }
  }
  for (; r < rows_pad; r += 4) {
    const float* p0 = pm + r * ps;
    float* o0 = o + r * os;
    for (int64_t x0 = 0; x0 < dpad; x0 += dv * n) {
      const int64_t nv = std::min<int64_t>(dv, (dpad - x0) / n);
      if (nv == 4) {
        auto a00 = hn::LoadU(d, o0 + x0), a01 = hn::LoadU(d, o0 + x0 + n),
             a02 = hn::LoadU(d, o0 + x0 + 2 * n), a03 = hn::LoadU(d, o0 + x0 + 3 * n);
        auto a10 = hn::LoadU(d, o0 + os + x0), a11 = hn::LoadU(d, o0 + os + x0 + n),
             a12 = hn::LoadU(d, o0 + os + x0 + 2 * n), a13 = hn::LoadU(d, o0 + os + x0 + 3 * n);
        auto a20 = hn::LoadU(d, o0 + 2 * os + x0), a21 = hn::LoadU(d, o0 + 2 * os + x0 + n),
             a22 = hn::LoadU(d, o0 + 2 * os + x0 + 2 * n),
             a23 = hn::LoadU(d, o0 + 2 * os + x0 + 3 * n);
        auto a30 = hn::LoadU(d, o0 + 3 * os + x0), a31 = hn::LoadU(d, o0 + 3 * os + x0 + n),
             a32 = hn::LoadU(d, o0 + 3 * os + x0 + 2 * n),
             a33 = hn::LoadU(d, o0 + 3 * os + x0 + 3 * n);
        for (int64_t c = 0; c < nk; ++c) {
          const float* vr = v + c * vstride + x0;
          const auto v0 = hn::LoadU(d, vr), v1 = hn::LoadU(d, vr + n),
                     v2 = hn::LoadU(d, vr + 2 * n), v3 = hn::LoadU(d, vr + 3 * n);
          const auto b0 = hn::Set(d, p0[c]), b1 = hn::Set(d, p0[ps + c]),
                     b2 = hn::Set(d, p0[2 * ps + c]), b3 = hn::Set(d, p0[3 * ps + c]);
          a00 = hn::MulAdd(b0, v0, a00), a01 = hn::MulAdd(b0, v1, a01);
          a02 = hn::MulAdd(b0, v2, a02), a03 = hn::MulAdd(b0, v3, a03);
          a10 = hn::MulAdd(b1, v0, a10), a11 = hn::MulAdd(b1, v1, a11);
          a12 = hn::MulAdd(b1, v2, a12), a13 = hn::MulAdd(b1, v3, a13);
          a20 = hn::MulAdd(b2, v0, a20), a21 = hn::MulAdd(b2, v1, a21);
          a22 = hn::MulAdd(b2, v2, a22), a23 = hn::MulAdd(b2, v3, a23);
          a30 = hn::MulAdd(b3, v0, a30), a31 = hn::MulAdd(b3, v1, a31);
          a32 = hn::MulAdd(b3, v2, a32), a33 = hn::MulAdd(b3, v3, a33);
        }
        hn::StoreU(a00, d, o0 + x0), hn::StoreU(a01, d, o0 + x0 + n);
        hn::StoreU(a02, d, o0 + x0 + 2 * n), hn::StoreU(a03, d, o0 + x0 + 3 * n);
        hn::StoreU(a10, d, o0 + os + x0), hn::StoreU(a11, d, o0 + os + x0 + n);
        hn::StoreU(a12, d, o0 + os + x0 + 2 * n), hn::StoreU(a13, d, o0 + os + x0 + 3 * n);
        hn::StoreU(a20, d, o0 + 2 * os + x0), hn::StoreU(a21, d, o0 + 2 * os + x0 + n);
        hn::StoreU(a22, d, o0 + 2 * os + x0 + 2 * n);
        hn::StoreU(a23, d, o0 + 2 * os + x0 + 3 * n);
        hn::StoreU(a30, d, o0 + 3 * os + x0), hn::StoreU(a31, d, o0 + 3 * os + x0 + n);
        hn::StoreU(a32, d, o0 + 3 * os + x0 + 2 * n);
        hn::StoreU(a33, d, o0 + 3 * os + x0 + 3 * n);
      } else if (nv == 2) {
        // Two vectors x 4 rows: 8 independent accumulators (AVX2: 16 registers), enough to keep
        // both FMA pipes busy; each element is the same chain of fused multiply-adds in key
        // order as one vector at a time.
        auto a00 = hn::LoadU(d, o0 + x0), a01 = hn::LoadU(d, o0 + x0 + n);
        auto a10 = hn::LoadU(d, o0 + os + x0), a11 = hn::LoadU(d, o0 + os + x0 + n);
        auto a20 = hn::LoadU(d, o0 + 2 * os + x0), a21 = hn::LoadU(d, o0 + 2 * os + x0 + n);
        auto a30 = hn::LoadU(d, o0 + 3 * os + x0), a31 = hn::LoadU(d, o0 + 3 * os + x0 + n);
        for (int64_t c = 0; c < nk; ++c) {
          const float* vr = v + c * vstride + x0;
          const auto v0 = hn::LoadU(d, vr), v1 = hn::LoadU(d, vr + n);
          const auto b0 = hn::Set(d, p0[c]), b1 = hn::Set(d, p0[ps + c]),
                     b2 = hn::Set(d, p0[2 * ps + c]), b3 = hn::Set(d, p0[3 * ps + c]);
          a00 = hn::MulAdd(b0, v0, a00), a01 = hn::MulAdd(b0, v1, a01);
          a10 = hn::MulAdd(b1, v0, a10), a11 = hn::MulAdd(b1, v1, a11);
          a20 = hn::MulAdd(b2, v0, a20), a21 = hn::MulAdd(b2, v1, a21);
          a30 = hn::MulAdd(b3, v0, a30), a31 = hn::MulAdd(b3, v1, a31);
        }
        hn::StoreU(a00, d, o0 + x0), hn::StoreU(a01, d, o0 + x0 + n);
        hn::StoreU(a10, d, o0 + os + x0), hn::StoreU(a11, d, o0 + os + x0 + n);
        hn::StoreU(a20, d, o0 + 2 * os + x0), hn::StoreU(a21, d, o0 + 2 * os + x0 + n);
        hn::StoreU(a30, d, o0 + 3 * os + x0), hn::StoreU(a31, d, o0 + 3 * os + x0 + n);
      } else {
        for (int64_t xv = 0; xv < nv; ++xv) {
          const int64_t x = x0 + xv * n;
          auto a0 = hn::LoadU(d, o0 + x), a1 = hn::LoadU(d, o0 + os + x),
               a2 = hn::LoadU(d, o0 + 2 * os + x), a3 = hn::LoadU(d, o0 + 3 * os + x);
          for (int64_t c = 0; c < nk; ++c) {
            const auto vv = hn::LoadU(d, v + c * vstride + x);
            a0 = hn::MulAdd(hn::Set(d, p0[c]), vv, a0);
            a1 = hn::MulAdd(hn::Set(d, p0[ps + c]), vv, a1);
            a2 = hn::MulAdd(hn::Set(d, p0[2 * ps + c]), vv, a2);
            a3 = hn::MulAdd(hn::Set(d, p0[3 * ps + c]), vv, a3);
          }
          hn::StoreU(a0, d, o0 + x), hn::StoreU(a1, d, o0 + os + x);
          hn::StoreU(a2, d, o0 + 2 * os + x), hn::StoreU(a3, d, o0 + 3 * os + x);
        }
      }
    }
  }
}

// Dot product of two float rows of length dim (for per-query / per-key projections).
HWY_INLINE float Dot(const float* a, const float* b, int64_t dim) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  auto acc = hn::Zero(d);
  int64_t k = 0;
  for (; k + n <= dim; k += n) acc = hn::MulAdd(hn::LoadU(d, a + k), hn::LoadU(d, b + k), acc);
  float s = hn::GetLane(hn::SumOfLanes(d, acc));
  for (; k < dim; ++k) s += a[k] * b[k];
  return s;
}
}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#endif  // POSENC_KERNELS_ATTENTION_INL_H_
