// tests/test_rope_models.cc - RoPE as real model families use it: float32-angle compatibility
// mode vs accurate angles at long positions, re-rotation of cached keys, M-RoPE.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <complex>
#include <numbers>
#include <random>

#include "posenc/posenc.h"

namespace {

using namespace posenc;

std::vector<float> randn_f(std::mt19937_64& rng, int64_t n) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = nd(rng);
  return v;
}

// Max |float32 path - float64 reference| over x [1, L, H, D] at the given positions.
double rope_error(const RopeFrequencies& freqs, RopeStyle style, const std::vector<float>& x,
                  std::array<int64_t, 4> shape, const Positions& pos) {
  std::vector<float> y(x.size());
  apply_rope(freqs, style, View<const float, 4>::contiguous(x.data(), shape),
             View<float, 4>::contiguous(y.data(), shape), &pos);
  RopeFrequencies exact = freqs;
  exact.angles = RopeAngles::kAccurate;
  std::vector<double> xd(x.begin(), x.end()), yd(x.size());
  ref::apply_rope(exact, style, View<const double, 4>::contiguous(xd.data(), shape),
                  View<double, 4>::contiguous(yd.data(), shape), &pos);
  double e = 0;
  for (std::size_t i = 0; i < y.size(); ++i) e = std::max(e, std::abs(y[i] - yd[i]));
  return e;
}

// docs/precision.md: accurate angles stay at float32 rounding at 2^16, 2^20, 2^24; the frameworks'
// float32 recipe shows the error that grows with the position.
TEST(RopePrecision, AccurateVsFloat32AnglesAtLongPositions) {
  std::mt19937_64 rng(7);
  const int64_t l = 16, h = 2, d = 128;
  const auto x = randn_f(rng, l * h * d);
  const RopeConfig cfg{.head_dim = d, .base = 5e5};
  for (int64_t p0 : {int64_t{1} << 16, int64_t{1} << 20, int64_t{1} << 24}) {
    SCOPED_TRACE("position " + std::to_string(p0));
    const auto pos = Positions::offset(p0);
    // Unit-normal inputs: |y| < ~5, so float32 rounding of the output is <= ~5e-7.
    const double acc = rope_error(rope_frequencies(cfg), RopeStyle::kHalf, x, {1, l, h, d}, pos);
    // The float32 mode uses float32 inverse frequencies; its reference uses the same ones so the
    // measured error is the angle's, not the frequency table's.
    auto f32 = rope_frequencies(cfg, 0, RopeAngles::kFloat32);
    const double fe = rope_error(f32, RopeStyle::kHalf, x, {1, l, h, d}, pos);
    EXPECT_LE(acc, 1e-6);
    // float32(p) * inv_freq rounds to ~p * 2^-24 rad: 4e-3 at 2^16, growing with p.
    EXPECT_GE(fe, 1e-4 * static_cast<double>(p0 >> 16));
    RecordProperty("accurate_error_" + std::to_string(p0), std::to_string(acc));
    RecordProperty("float32_error_" + std::to_string(p0), std::to_string(fe));
  }
}

TEST(RopePrecision, Float32ModeRoundsTheFrequencyTable) {
  const auto f = rope_frequencies({.head_dim = 64, .base = 1e4}, 0, RopeAngles::kFloat32);
  EXPECT_EQ(f.angles, RopeAngles::kFloat32);
  for (std::size_t i = 0; i < f.inv_freq.size(); ++i) {
    EXPECT_EQ(f.inv_freq[i], static_cast<double>(static_cast<float>(f.inv_freq[i])));
    EXPECT_NEAR(f.inv_freq[i], std::pow(1e4, -2.0 * static_cast<double>(i) / 64.0),
                1e-6 * f.inv_freq[i]);
  }
}

// Keys written with one set of frequencies and moved to another by rerotate_rope equal keys
// rotated with the new set directly, to float32 rounding.
void expect_rerotation_exact(const RopeFrequencies& from, const RopeFrequencies& to,
                             RopeStyle style, int64_t p0) {
  std::mt19937_64 rng(11);
  const int64_t l = 9, h = 3, d = 64;
  const std::array<int64_t, 4> shape{1, l, h, d};
  const auto k = randn_f(rng, l * h * d);
  const auto pos = Positions::offset(p0);
  std::vector<float> cached(k.size()), direct(k.size());
  apply_rope(from, style, View<const float, 4>::contiguous(k.data(), shape),
             View<float, 4>::contiguous(cached.data(), shape), &pos);
  apply_rope(to, style, View<const float, 4>::contiguous(k.data(), shape),
             View<float, 4>::contiguous(direct.data(), shape), &pos);
  rerotate_rope(from, to, style, View<float, 4>::contiguous(cached.data(), shape), &pos);
  double e = 0, moved = 0;
  for (std::size_t i = 0; i < k.size(); ++i) {
    e = std::max(e, static_cast<double>(std::abs(cached[i] - direct[i])));
  }
  apply_rope(from, style, View<const float, 4>::contiguous(k.data(), shape),
             View<float, 4>::contiguous(cached.data(), shape), &pos);
  for (std::size_t i = 0; i < k.size(); ++i) {
    moved = std::max(moved, static_cast<double>(std::abs(cached[i] - direct[i])));
  }
  // Two float32 roundings of values below ~6 in magnitude.
  EXPECT_LE(e, 2e-6) << "re-rotated keys differ from directly rotated ones";
  EXPECT_GT(moved, 1e-3) << "the two frequency sets should give different keys";
}

TEST(RopeRerotation, DynamicNtkGrowth) {
  RopeConfig cfg{.head_dim = 64, .base = 1e4};
  cfg.scaling = {
      .type = RopeScalingType::kDynamic, .factor = 2.0, .original_max_position_embeddings = 4096};
  const auto before = rope_frequencies(cfg, 4096);  // unchanged at Lo
  const auto after = rope_frequencies(cfg, 20000);  // theta grown
  EXPECT_NE(before.inv_freq[5], after.inv_freq[5]);
  expect_rerotation_exact(before, after, RopeStyle::kHalf, 4000);
  expect_rerotation_exact(before, after, RopeStyle::kInterleaved, int64_t{1} << 20);
}

TEST(RopeRerotation, LongRopeCrossingTheOriginalLength) {
  RopeConfig cfg{.head_dim = 64, .base = 1e4};
  cfg.scaling.type = RopeScalingType::kLongRope;
  cfg.scaling.original_max_position_embeddings = 4096;
  cfg.scaling.max_position_embeddings = 131072;
  for (int i = 0; i < 32; ++i) {
    cfg.scaling.short_factor.push_back(1.0 + 0.01 * i);
    cfg.scaling.long_factor.push_back(1.0 + 0.5 * i);
  }
  const auto short_f = rope_frequencies(cfg, 4096);
  const auto long_f = rope_frequencies(cfg, 4097);
  EXPECT_NE(short_f.inv_freq[3], long_f.inv_freq[3]);
  expect_rerotation_exact(short_f, long_f, RopeStyle::kHalf, 0);
  expect_rerotation_exact(short_f, long_f, RopeStyle::kHalf, 100000);
  // Attention factor changes are carried too (from af 1 to af 1.2).
  RopeFrequencies scaled = long_f;
  scaled.attention_factor = 1.2;
  expect_rerotation_exact(short_f, scaled, RopeStyle::kHalf, 4000);
}

TEST(RopeRerotation, Validation) {
  std::vector<float> k(8, 1.0f);
  const auto a = rope_frequencies({.head_dim = 8}), b = rope_frequencies({.head_dim = 4});
  EXPECT_THROW(
      rerotate_rope(a, b, RopeStyle::kHalf, View<float, 4>::contiguous(k.data(), {1, 1, 1, 8})),
      ShapeError);
  const auto f32 = rope_frequencies({.head_dim = 8}, 0, RopeAngles::kFloat32);
  EXPECT_THROW(
      rerotate_rope(a, f32, RopeStyle::kHalf, View<float, 4>::contiguous(k.data(), {1, 1, 1, 8})),
      ValueError);
}

// Published LongRoPE settings of a Phi-3 128k model (tests/configs/phi-3-vision-128k.json):
// short factors up to 4096 tokens, long factors beyond, attention factor sqrt(1 + ln 32 / ln 4096).
TEST(RopeModels, Phi3LongRopeFromAPublishedConfig) {
  const auto cfg =
      read_model_config(std::string(POSENC_TEST_CONFIGS_DIR) + "/phi-3-vision-128k.json");
  ASSERT_EQ(cfg.rope.scaling.type, RopeScalingType::kLongRope);
  ASSERT_EQ(cfg.rope.scaling.short_factor.size(), 48u);
  const auto at_lo = model_rope_frequencies(cfg, 4096), past_lo = model_rope_frequencies(cfg, 4097);
  const double af = std::sqrt(1.0 + std::log(32.0) / std::log(4096.0));
  EXPECT_NEAR(at_lo.attention_factor, af, 1e-15);
  EXPECT_NEAR(past_lo.attention_factor, af, 1e-15);
  for (int i : {0, 10, 47}) {
    const double base = std::pow(1e4, 2.0 * i / 96.0);
    EXPECT_DOUBLE_EQ(at_lo.inv_freq[i], 1.0 / (cfg.rope.scaling.short_factor[i] * base)) << i;
    EXPECT_DOUBLE_EQ(past_lo.inv_freq[i], 1.0 / (cfg.rope.scaling.long_factor[i] * base)) << i;
  }
  EXPECT_DOUBLE_EQ(cfg.rope.scaling.long_factor[47], 64.81001281738281);
}

// YaRN with low == high after rounding and clamping (docs/rope.md: "hi += 0.001 if equal"): with
// Lo = 6, corr(32) < 0 and corr(1) = -0.32 both clamp to 0, so pair 0 keeps inv_freq and every
// other pair is interpolated (inv / f).
TEST(RopeModels, YarnLowEqualsHigh) {
  RopeConfig cfg{.head_dim = 128, .base = 1e4};
  cfg.scaling = {
      .type = RopeScalingType::kYarn, .factor = 4.0, .original_max_position_embeddings = 6};
  const auto f = rope_frequencies(cfg);
  const auto plain = rope_frequencies({.head_dim = 128, .base = 1e4});
  EXPECT_DOUBLE_EQ(f.inv_freq[0], plain.inv_freq[0]);
  for (std::size_t i = 1; i < 64; ++i)
    EXPECT_DOUBLE_EQ(f.inv_freq[i], plain.inv_freq[i] / 4.0) << i;
}

// Llama 4 uses rope_type llama3 with low_freq_factor == high_freq_factor: no blend band, every
// wavelength is either interpolated (longer than Lo / low) or kept.
TEST(RopeModels, Llama3WithEqualFactors) {
  RopeConfig cfg{.head_dim = 128, .base = 5e5};
  cfg.scaling = {.type = RopeScalingType::kLlama3,
                 .factor = 16.0,
                 .original_max_position_embeddings = 8192,
                 .low_freq_factor = 1.0,
                 .high_freq_factor = 1.0};
  const auto f = rope_frequencies(cfg);
  const auto plain = rope_frequencies({.head_dim = 128, .base = 5e5});
  for (std::size_t i = 0; i < 64; ++i) {
    const double wl = 2.0 * std::numbers::pi / plain.inv_freq[i];
    EXPECT_DOUBLE_EQ(f.inv_freq[i], wl > 8192.0 ? plain.inv_freq[i] / 16.0 : plain.inv_freq[i])
        << i;
  }
}

// ---- M-RoPE ------------------------------------------------------------------------------------

TEST(MRope, ComponentsSectioned) {
  const MRope m{.sections = {16, 24, 24}};
  EXPECT_EQ(mrope_component(m, 0), 0);
  EXPECT_EQ(mrope_component(m, 15), 0);
  EXPECT_EQ(mrope_component(m, 16), 1);
  EXPECT_EQ(mrope_component(m, 39), 1);
  EXPECT_EQ(mrope_component(m, 40), 2);
  EXPECT_EQ(mrope_component(m, 63), 2);
}

TEST(MRope, ComponentsInterleaved) {
  const MRope m{.sections = {24, 20, 20}, .layout = MRopeLayout::kInterleaved};
  // h at 1, 4, ..., 58 (< 60); w at 2, 5, ..., 59 (< 60); t elsewhere, including 60..63.
  int counts[3] = {0, 0, 0};
  for (int64_t i = 0; i < 64; ++i) {
    const int c = mrope_component(m, i);
    ++counts[c];
    if (i >= 60) {
      EXPECT_EQ(c, 0) << i;
    } else {
      EXPECT_EQ(c, static_cast<int>(i % 3)) << i;
    }
  }
  EXPECT_EQ(counts[0], 24);
  EXPECT_EQ(counts[1], 20);
  EXPECT_EQ(counts[2], 20);
}

// With t = h = w, M-RoPE is plain RoPE; with distinct components each pair follows its own.
TEST(MRope, MatchesPlainRopeAndAnIndependentFormula) {
  std::mt19937_64 rng(5);
  const int64_t b = 2, l = 5, h = 2, d = 128;
  const std::array<int64_t, 4> shape{b, l, h, d};
  const auto x = randn_f(rng, b * l * h * d);
  const auto freqs = rope_frequencies({.head_dim = d, .base = 1e6});
  for (MRopeLayout layout : {MRopeLayout::kSectioned, MRopeLayout::kInterleaved}) {
    const MRope m{.sections = layout == MRopeLayout::kSectioned
                                  ? std::array<int64_t, 3>{16, 24, 24}
                                  : std::array<int64_t, 3>{24, 20, 20},
                  .layout = layout};
    const auto same = Positions::offset(3);
    std::vector<float> y1(x.size()), y2(x.size());
    apply_mrope(freqs, RopeStyle::kHalf, m, View<const float, 4>::contiguous(x.data(), shape),
                View<float, 4>::contiguous(y1.data(), shape), {same, same, same});
    apply_rope(freqs, RopeStyle::kHalf, View<const float, 4>::contiguous(x.data(), shape),
               View<float, 4>::contiguous(y2.data(), shape), &same);
    EXPECT_EQ(y1, y2);
    // Vision tokens: t, h, w differ per row.
    const auto t = Positions::per_row({0, 1, 1, 1, 1, 0, 1, 2, 3, 4}, b, l);
    const auto hh = Positions::per_row({0, 1, 1, 2, 2, 0, 1, 2, 3, 4}, b, l);
    const auto w = Positions::per_row({0, 1, 2, 1, 2, 7, 8, 9, 10, 11}, b, l);
    apply_mrope(freqs, RopeStyle::kHalf, m, View<const float, 4>::contiguous(x.data(), shape),
                View<float, 4>::contiguous(y1.data(), shape), {t, hh, w});
    const Positions* comps[3] = {&t, &hh, &w};
    double e = 0;
    for (int64_t bb = 0; bb < b; ++bb)
      for (int64_t i = 0; i < l; ++i)
        for (int64_t hd = 0; hd < h; ++hd)
          for (int64_t k = 0; k < d / 2; ++k) {
            const int64_t p = comps[mrope_component(m, k)]->at(bb, i);
            const std::size_t base = static_cast<std::size_t>(((bb * l + i) * h + hd) * d);
            const std::complex<double> z(x[base + k], x[base + k + d / 2]);
            const auto r = z * std::polar(1.0, static_cast<double>(p) * freqs.inv_freq[k]);
            e = std::max(
                {e, std::abs(r.real() - y1[base + k]), std::abs(r.imag() - y1[base + k + d / 2])});
          }
    EXPECT_LE(e, 1e-6);
  }
}

TEST(MRope, Validation) {
  std::vector<float> x(128, 1.0f), y(128);
  const auto p = Positions::offset(0);
  const auto freqs = rope_frequencies({.head_dim = 128});
  EXPECT_THROW(apply_mrope(freqs, RopeStyle::kHalf, MRope{.sections = {16, 24, 16}},
                           View<const float, 4>::contiguous(x.data(), {1, 1, 1, 128}),
                           View<float, 4>::contiguous(y.data(), {1, 1, 1, 128}), {p, p, p}),
               ValueError);
  const auto short_ids = Positions::shared({0, 1});
  EXPECT_THROW(apply_mrope(freqs, RopeStyle::kHalf, MRope{},
                           View<const float, 4>::contiguous(x.data(), {1, 1, 1, 128}),
                           View<float, 4>::contiguous(y.data(), {1, 1, 1, 128}), {p, short_ids, p}),
               ShapeError);
}

// ---------------------------------------------------------------------------------------------
// The float32 recipe (issue 12 item 4): rope_frequencies(..., kFloat32) follows the reference's
// float32 steps. The evaluations below are written independently from the spelled-out formulas
// of Hugging Face's rope init functions, one float32 operation per tensor operation.

float f32pow(float b, float e) { return std::pow(b, e); }
std::vector<float> f32_base(float theta, int r) {
  std::vector<float> v;
  for (int i = 0; i < r; i += 2) v.push_back(1.0f / f32pow(theta, static_cast<float>(i) / r));
  return v;
}

TEST(RopeFloat32Recipe, Llama3BlendStepByStep) {
  RopeConfig cfg{.head_dim = 128, .base = 5e5};
  cfg.scaling = {
      .type = RopeScalingType::kLlama3, .factor = 8, .original_max_position_embeddings = 8192};
  const RopeFrequencies f = rope_frequencies(cfg, 0, RopeAngles::kFloat32);
  const std::vector<float> inv = f32_base(5e5f, 128);
  int blended = 0;
  for (std::size_t i = 0; i < inv.size(); ++i) {
    // wavelen = 2 pi / inv is inv.reciprocal() * float(2 pi) in PyTorch.
    const float wl = (1.0f / inv[i]) * static_cast<float>(2 * std::numbers::pi);
    float want = wl > 8192.0f ? inv[i] / 8.0f : inv[i];
    if (!(wl < 2048.0f) && !(wl > 8192.0f)) {
      const float sm = ((1.0f / wl) * 8192.0f - 1.0f) / 3.0f;
      want = (1.0f - sm) * want / 8.0f + sm * want;
      ++blended;
    }
    EXPECT_EQ(static_cast<float>(f.inv_freq[i]), want) << i;
    // Double-valued storage holds exactly the float32 value.
    EXPECT_EQ(f.inv_freq[i], static_cast<double>(static_cast<float>(f.inv_freq[i])));
  }
  EXPECT_GT(blended, 0);
}

TEST(RopeFloat32Recipe, YarnRampStepByStep) {
  for (const bool truncate : {true, false}) {
    RopeConfig cfg{.head_dim = 64, .base = 150000};
    cfg.scaling = {.type = RopeScalingType::kYarn,
                   .factor = 32,
                   .original_max_position_embeddings = 4096,
                   .truncate = truncate};
    const RopeFrequencies f = rope_frequencies(cfg, 0, RopeAngles::kFloat32);
    // Correction range in double, as the reference computes it in Python.
    auto corr = [](double n) {
      return 64.0 * std::log(4096.0 / (n * 2 * std::numbers::pi)) / (2 * std::log(150000.0));
    };
    double lo = corr(32), hi = corr(1);
    if (truncate) lo = std::floor(lo), hi = std::ceil(hi);
    lo = std::max(lo, 0.0), hi = std::min(hi, 63.0);
    for (int i = 0; i < 32; ++i) {
      const float pos = f32pow(150000.0f, static_cast<float>(2 * i) / 64);
      const float ramp =
          std::clamp((static_cast<float>(i) - static_cast<float>(lo)) / static_cast<float>(hi - lo),
                     0.0f, 1.0f);
      const float ef = 1.0f - ramp;
      const float want = (1.0f / (32.0f * pos)) * (1.0f - ef) + (1.0f / pos) * ef;
      EXPECT_EQ(static_cast<float>(f.inv_freq[i]), want) << i << " truncate " << truncate;
    }
    // Accurate and float32 tables stay within a few float32 ulps of each other.
    const RopeFrequencies a = rope_frequencies(cfg, 0);
    for (int i = 0; i < 32; ++i) EXPECT_NEAR(f.inv_freq[i], a.inv_freq[i], 4e-7 * a.inv_freq[i]);
  }
}

TEST(RopeFloat32Recipe, LongRopeAndDynamicStepByStep) {
  RopeConfig lr{.head_dim = 16, .base = 1e4};
  lr.scaling = {.type = RopeScalingType::kLongRope,
                .original_max_position_embeddings = 4096,
                .max_position_embeddings = 131072,
                .short_factor = {1, 1.1, 1.3, 1.7, 2.3, 3.1, 4.9, 7.7},
                .long_factor = {1.01, 1.5, 2.5, 4.5, 8.5, 16.5, 32.5, 64.5}};
  for (const int64_t len : {int64_t{0}, int64_t{5000}}) {
    const RopeFrequencies f = rope_frequencies(lr, len, RopeAngles::kFloat32);
    const auto& ext = len > 4096 ? lr.scaling.long_factor : lr.scaling.short_factor;
    for (int i = 0; i < 8; ++i) {
      const float want =
          1.0f / (static_cast<float>(ext[i]) * f32pow(1e4f, static_cast<float>(2 * i) / 16));
      EXPECT_EQ(static_cast<float>(f.inv_freq[i]), want) << i;
    }
  }
  // Dynamic NTK: the grown base is a float32 value (the update passes seq_len as a tensor).
  RopeConfig dy{.head_dim = 128, .base = 1e4};
  dy.scaling = {
      .type = RopeScalingType::kDynamic, .factor = 2, .original_max_position_embeddings = 4096};
  const RopeFrequencies f = rope_frequencies(dy, 8195, RopeAngles::kFloat32);
  const float t = 2.0f * 8195.0f / 4096.0f - 1.0f;
  const float grown = 1e4f * static_cast<float>(std::pow(static_cast<double>(t), 128.0 / 126.0));
  const std::vector<float> want = f32_base(grown, 128);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(static_cast<float>(f.inv_freq[i]), want[i]) << i;
  // Below the original length: the unscaled table.
  const RopeFrequencies s = rope_frequencies(dy, 100, RopeAngles::kFloat32);
  const std::vector<float> base = f32_base(1e4f, 128);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(static_cast<float>(s.inv_freq[i]), base[i]) << i;
}

// Phi-3-vision's published LongRoPE lists, float32 recipe. Measured once against PyTorch 1.13
// (CPU) running Hugging Face's longrope init on this config: 47 of the 48 entries are
// bit-identical, the other differs by 1 ulp where PyTorch's vectorised pow differs from powf;
// the former posenc recipe (double math, one rounding) was off by up to 3 ulp on 37 entries.
TEST(RopeFloat32Recipe, Phi3VisionLongRopeStepByStep) {
  const ModelConfig c =
      read_model_config(std::string(POSENC_TEST_CONFIGS_DIR) + "/phi-3-vision-128k.json");
  const RopeFrequencies f = model_rope_frequencies(c, 0, RopeAngles::kFloat32);
  const RopeFrequencies a = model_rope_frequencies(c, 0);
  ASSERT_EQ(f.inv_freq.size(), 48u);
  for (std::size_t i = 0; i < 48; ++i) {
    const float want = 1.0f / (static_cast<float>(c.rope.scaling.short_factor[i]) *
                               f32pow(1e4f, static_cast<float>(2 * i) / 96.0f));
    EXPECT_EQ(static_cast<float>(f.inv_freq[i]), want) << i;
    EXPECT_NEAR(f.inv_freq[i], a.inv_freq[i], 5e-7 * a.inv_freq[i]) << i;
  }
}

// ---------------------------------------------------------------------------------------------
// DeepSeek's layout (issue 12 item 3): rotary part at the head's end, pairs de-interleaved.

TEST(ModelRope, DeepseekV3LayoutAndInverse) {
  const ModelConfig c =
      read_model_config(std::string(POSENC_TEST_CONFIGS_DIR) + "/deepseek-v3.json");
  const RopeFrequencies f = model_rope_frequencies(c, 4096);
  std::mt19937_64 rng(5);
  const std::array<int64_t, 4> shape = {1, 3, 2, 192};
  const std::vector<float> x = randn_f(rng, 1 * 3 * 2 * 192);
  std::vector<float> y(x.size()), back(x.size());
  const Positions pos = Positions::offset(1000);
  apply_model_rope(c, f, View<const float, 4>::contiguous(x.data(), shape),
                   View<float, 4>::contiguous(y.data(), shape), &pos);
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t h = 0; h < 2; ++h) {
      const float* xr = x.data() + (i * 2 + h) * 192;
      const float* yr = y.data() + (i * 2 + h) * 192;
      for (int c0 = 0; c0 < 128; ++c0) EXPECT_EQ(yr[c0], xr[c0]);  // the nope part
      for (int k = 0; k < 32; ++k) {
        // Pair (2k, 2k + 1) of the rope part rotates by inv_freq[k] into (k, k + 32).
        const double a = static_cast<double>(1000 + i) * f.inv_freq[k];
        const double x0 = xr[128 + 2 * k], x1 = xr[128 + 2 * k + 1];
        EXPECT_NEAR(yr[128 + k], x0 * std::cos(a) - x1 * std::sin(a), 1e-5);
        EXPECT_NEAR(yr[128 + 32 + k], x1 * std::cos(a) + x0 * std::sin(a), 1e-5);
      }
    }
  }
  apply_model_rope(c, f, View<const float, 4>::contiguous(y.data(), shape),
                   View<float, 4>::contiguous(back.data(), shape), &pos, Direction::kInverse);
  for (std::size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(back[i], x[i], 1e-5) << i;
  // The rotary part alone gives the same numbers as the tail of the full head.
  const std::array<int64_t, 4> rshape = {1, 3, 2, 64};
  std::vector<float> xr(1 * 3 * 2 * 64), yr(xr.size());
  for (int64_t t = 0; t < 6; ++t) {
    std::copy_n(x.data() + t * 192 + 128, 64, xr.data() + t * 64);
  }
  apply_model_rope(c, f, View<const float, 4>::contiguous(xr.data(), rshape),
                   View<float, 4>::contiguous(yr.data(), rshape), &pos);
  for (int64_t t = 0; t < 6; ++t) {
    for (int k = 0; k < 64; ++k) EXPECT_EQ(yr[t * 64 + k], y[t * 192 + 128 + k]);
  }
  // Any other head dim is a ShapeError.
  std::vector<float> bad(1 * 3 * 2 * 100);
  EXPECT_THROW(apply_model_rope(c, f, View<const float, 4>::contiguous(bad.data(), {1, 3, 2, 100}),
                                View<float, 4>::contiguous(bad.data(), {1, 3, 2, 100}), &pos),
               ShapeError);
}

}  // namespace
