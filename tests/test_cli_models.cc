// tests/test_cli_models.cc - the model-config commands and flags of the `posenc` CLI, run as a
// subprocess: rope --config / --seq-len / --angles / --inv-freq / M-RoPE positions, rope-freqs,
// describe, inspect, attention --config and rope-precision.
//
// As in test_cli.cc, outputs are compared with the library's own results computed here (exact
// equality: the CLI is a thin layer), and error cases check docs/cli.md: exit status 2, one stderr
// line "posenc <command>: error: ...", no output file left behind.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "posenc/posenc.h"

#ifndef POSENC_TEST_CONFIGS_DIR
#error "POSENC_TEST_CONFIGS_DIR must name tests/configs"
#endif

namespace fs = std::filesystem;

namespace posenc {
namespace {

using cli_test::quote;
using cli_test::read_text;
using cli_test::RunResult;

std::string config(const std::string& name) {
  return quote(std::string(POSENC_TEST_CONFIGS_DIR) + "/" + name);
}

ModelConfig load(const std::string& name) {
  return read_model_config(std::string(POSENC_TEST_CONFIGS_DIR) + "/" + name);
}

std::vector<float> random_floats(std::size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

std::size_t count(const std::vector<int64_t>& shape) {
  std::size_t n = 1;
  for (int64_t s : shape) n *= static_cast<std::size_t>(s);
  return n;
}

std::array<int64_t, 4> dims4(const std::vector<int64_t>& s) { return {s[0], s[1], s[2], s[3]}; }

// The library's RoPE of x (float32 path).
std::vector<float> lib_rope(const RopeFrequencies& f, RopeStyle style, const std::vector<float>& x,
                            const std::vector<int64_t>& shape, const Positions& pos,
                            Direction dir = Direction::kForward) {
  std::vector<float> y(x.size());
  apply_rope(f, style, View<const float, 4>::contiguous(x.data(), dims4(shape)),
             View<float, 4>::contiguous(y.data(), dims4(shape)), &pos, dir);
  return y;
}

std::vector<float> lib_mrope(const RopeFrequencies& f, RopeStyle style, const MRope& m,
                             const std::vector<float>& x, const std::vector<int64_t>& shape,
                             const std::array<Positions, 3>& pos) {
  std::vector<float> y(x.size());
  apply_mrope(f, style, m, View<const float, 4>::contiguous(x.data(), dims4(shape)),
              View<float, 4>::contiguous(y.data(), dims4(shape)), pos);
  return y;
}

void expect_tensor_eq(const Tensor& t, const std::vector<int64_t>& shape,
                      const std::vector<float>& want) {
  ASSERT_EQ(t.dtype, DType::kF32);
  ASSERT_EQ(t.shape, shape);
  const std::vector<float> got = t.to_f32();
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], want[i]) << "element " << i;
  }
}

class CliModelsTest : public cli_test::CliFixture {
 protected:
  // Status 2, one stderr line "posenc <command>: error: ..." containing `needle`, no output.
  void expect_error(const std::string& command, const std::string& args,
                    const std::string& needle) const {
    const std::string out = path("error_out.npy");
    fs::remove(out);
    const RunResult r = run(command + " " + args + " --out " + quote(out));
    expect_error_result(r, command, needle);
    EXPECT_EQ(r.out, "") << "stdout on error";
    EXPECT_FALSE(fs::exists(out)) << "output left behind by posenc " << command << " " << args;
  }

  static void expect_error_result(const RunResult& r, const std::string& command,
                                  const std::string& needle) {
    EXPECT_EQ(r.status, 2) << "stderr: " << r.err;
    ASSERT_FALSE(r.err.empty());
    EXPECT_EQ(r.err.back(), '\n');
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "stderr: " << r.err;
    const std::string prefix = "posenc " + command + ": error: ";
    EXPECT_EQ(r.err.rfind(prefix, 0), 0u) << "stderr: " << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos)
        << "stderr does not name '" << needle << "': " << r.err;
  }
};

TEST_F(CliModelsTest, HelpForNewCommands) {
  for (const char* cmd : {"rope-freqs", "describe", "inspect", "rope-precision", "rope"}) {
    const RunResult r = run(std::string(cmd) + " --help");
    EXPECT_EQ(r.status, 0) << cmd << ": " << r.err;
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << cmd;
  }
  EXPECT_NE(run("rope --help").out.find("--config"), std::string::npos);
  EXPECT_NE(run("rope --help").out.find("--inv-freq"), std::string::npos);
  EXPECT_NE(run("rope-freqs --help").out.find("--seq-len"), std::string::npos);
  EXPECT_NE(run("attention --help").out.find("--config"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// rope --config

TEST_F(CliModelsTest, RopeConfigLlama31EqualsLibrary) {
  const ModelConfig cfg = load("llama-3.1-8b.json");
  const std::vector<int64_t> shape = {2, 5, 3, 128};
  const std::vector<float> x = random_floats(count(shape), 1);
  const std::string in = write_f32("x.npy", shape, x);

  // Offset: L = K + seq.
  Tensor t = run_ok(
      "rope --config " + config("llama-3.1-8b.json") + " --in " + quote(in) + " --offset 1000",
      path("y0.npy"));
  expect_tensor_eq(t, shape,
                   lib_rope(model_rope_frequencies(cfg, 1005), RopeStyle::kHalf, x, shape,
                            Positions::offset(1000)));

  // Per-row positions; inverse.
  const std::vector<int64_t> rows = {0, 1, 2, 3, 4, 100000, 100001, 100002, 100003, 130000};
  const std::string pr = write_i64("pr.npy", {2, 5}, rows);
  const Positions pos = Positions::per_row(rows, 2, 5);
  t = run_ok("rope --config " + config("llama-3.1-8b.json") + " --in " + quote(in) +
                 " --positions " + quote(pr) + " --inverse",
             path("y1.npy"));
  expect_tensor_eq(t, shape,
                   lib_rope(model_rope_frequencies(cfg, 130001), RopeStyle::kHalf, x, shape, pos,
                            Direction::kInverse));

  // Interleaved style and a partial rotary dim from the config (GPT-J: 64 of 256).
  const ModelConfig gptj = load("gpt-j-6b.json");
  ASSERT_EQ(gptj.rope.style, RopeStyle::kInterleaved);
  const std::vector<int64_t> gshape = {1, 4, 2, gptj.head_dim};
  const std::vector<float> gx = random_floats(count(gshape), 2);
  const std::string gin = write_f32("gx.npy", gshape, gx);
  t = run_ok("rope --config " + config("gpt-j-6b.json") + " --in " + quote(gin) + " --offset 7",
             path("y2.npy"));
  expect_tensor_eq(t, gshape,
                   lib_rope(model_rope_frequencies(gptj, 11), RopeStyle::kInterleaved, gx, gshape,
                            Positions::offset(7)));
}

TEST_F(CliModelsTest, RopeConfigDynamicSeqLen) {
  const ModelConfig cfg = load("llama-2-7b-dynamic-2x.json");
  ASSERT_EQ(cfg.rope.scaling.type, RopeScalingType::kDynamic);
  const std::vector<int64_t> shape = {1, 4, 2, 128};
  const std::vector<float> x = random_floats(count(shape), 3);
  const std::string in = write_f32("x.npy", shape, x);
  const std::string base = "rope --config " + config("llama-2-7b-dynamic-2x.json") + " --in " +
                           quote(in) + " --offset 10";

  const Tensor short_t = run_ok(base, path("short.npy"));
  const std::vector<float> short_want =
      lib_rope(model_rope_frequencies(cfg, 14), RopeStyle::kHalf, x, shape, Positions::offset(10));
  expect_tensor_eq(short_t, shape, short_want);

  const Tensor long_t = run_ok(base + " --seq-len 10000", path("long.npy"));
  const std::vector<float> long_want = lib_rope(model_rope_frequencies(cfg, 10000),
                                                RopeStyle::kHalf, x, shape, Positions::offset(10));
  expect_tensor_eq(long_t, shape, long_want);
  EXPECT_NE(short_want, long_want) << "--seq-len must change a dynamic NTK config";

  // Default L past the original length: scaled.
  const Tensor far = run_ok("rope --config " + config("llama-2-7b-dynamic-2x.json") + " --in " +
                                quote(in) + " --offset 8000",
                            path("far.npy"));
  expect_tensor_eq(far, shape,
                   lib_rope(model_rope_frequencies(cfg, 8004), RopeStyle::kHalf, x, shape,
                            Positions::offset(8000)));
}

TEST_F(CliModelsTest, RopeConfigLongRopeSwitchesPastOriginal) {
  const ModelConfig cfg = load("phi-3-mini-128k-like.json");
  ASSERT_EQ(cfg.rope.scaling.type, RopeScalingType::kLongRope);
  const int64_t lo = cfg.rope.scaling.original_max_position_embeddings;
  const std::vector<int64_t> shape = {1, 3, 2, cfg.head_dim};
  const std::vector<float> x = random_floats(count(shape), 4);
  const std::string in = write_f32("x.npy", shape, x);
  const std::string base =
      "rope --config " + config("phi-3-mini-128k-like.json") + " --in " + quote(in);

  const RopeFrequencies f_short = model_rope_frequencies(cfg, lo);
  const RopeFrequencies f_long = model_rope_frequencies(cfg, lo + 1);
  EXPECT_NE(f_short.inv_freq, f_long.inv_freq);
  EXPECT_GT(f_short.attention_factor, 1.0);

  // L = offset + 3: at Lo short factors, one past it long factors.
  Tensor t = run_ok(base + " --offset " + std::to_string(lo - 3), path("at.npy"));
  const std::vector<float> at =
      lib_rope(f_short, RopeStyle::kHalf, x, shape, Positions::offset(lo - 3));
  expect_tensor_eq(t, shape, at);
  t = run_ok(base + " --offset " + std::to_string(lo - 2), path("past.npy"));
  expect_tensor_eq(t, shape,
                   lib_rope(f_long, RopeStyle::kHalf, x, shape, Positions::offset(lo - 2)));

  // --seq-len alone switches at the same position.
  t = run_ok(base + " --offset 5 --seq-len " + std::to_string(lo + 1), path("sl.npy"));
  const std::vector<float> sl = lib_rope(f_long, RopeStyle::kHalf, x, shape, Positions::offset(5));
  expect_tensor_eq(t, shape, sl);
  EXPECT_NE(sl, lib_rope(f_short, RopeStyle::kHalf, x, shape, Positions::offset(5)));

  // The attention factor scales the rotated dims: |y| = af |x| per token and head.
  const std::vector<float> y = t.to_f32();
  for (int64_t row = 0; row < 6; ++row) {
    double nx = 0, ny = 0;
    for (int64_t d = 0; d < cfg.head_dim; ++d) {
      nx += double(x[row * cfg.head_dim + d]) * x[row * cfg.head_dim + d];
      ny += double(y[row * cfg.head_dim + d]) * y[row * cfg.head_dim + d];
    }
    EXPECT_NEAR(std::sqrt(ny / nx), f_long.attention_factor, 1e-5);
  }
}

TEST_F(CliModelsTest, AnglesFloat32) {
  const int64_t p = int64_t{1} << 20;
  const std::vector<int64_t> shape = {1, 4, 2, 128};
  const std::vector<float> x = random_floats(count(shape), 5);
  const std::string in = write_f32("x.npy", shape, x);
  RopeConfig rc;
  rc.head_dim = 128;
  rc.base = 5e5;
  const std::string args = "rope --in " + quote(in) + " --base 5e5 --offset " + std::to_string(p);
  const Tensor acc = run_ok(args + " --angles accurate", path("acc.npy"));
  const Tensor f32 = run_ok(args + " --angles float32", path("f32.npy"));
  const std::vector<float> want_acc =
      lib_rope(rope_frequencies(rc, p + 4), RopeStyle::kHalf, x, shape, Positions::offset(p));
  const std::vector<float> want_f32 = lib_rope(rope_frequencies(rc, p + 4, RopeAngles::kFloat32),
                                               RopeStyle::kHalf, x, shape, Positions::offset(p));
  expect_tensor_eq(acc, shape, want_acc);
  expect_tensor_eq(f32, shape, want_f32);
  double diff = 0;
  for (std::size_t i = 0; i < want_acc.size(); ++i) {
    diff = std::max(diff, double(std::abs(want_acc[i] - want_f32[i])));
  }
  EXPECT_GT(diff, 1e-3) << "float32 angles must differ at 2^20";

  // With a config.
  const ModelConfig cfg = load("llama-3.1-8b.json");
  const Tensor c = run_ok("rope --config " + config("llama-3.1-8b.json") + " --in " + quote(in) +
                              " --angles float32 --offset " + std::to_string(p),
                          path("cfg.npy"));
  expect_tensor_eq(c, shape,
                   lib_rope(model_rope_frequencies(cfg, p + 4, RopeAngles::kFloat32),
                            RopeStyle::kHalf, x, shape, Positions::offset(p)));
  expect_error("rope", "--in " + quote(in) + " --angles double", "angles");
}

TEST_F(CliModelsTest, InvFreqRoundTrip) {
  const std::vector<int64_t> shape = {1, 4, 2, 96};
  const std::vector<float> x = random_floats(count(shape), 6);
  const std::string in = write_f32("x.npy", shape, x);
  const ModelConfig cfg = load("phi-3-mini-128k-like.json");
  const std::string phi = config("phi-3-mini-128k-like.json");

  for (const char* angles : {"accurate", "float32"}) {
    SCOPED_TRACE(angles);
    const std::string a = std::string(" --angles ") + angles;
    const std::string f = path(std::string("f_") + angles + ".npy");
    RunResult r;
    run_ok("rope-freqs --config " + phi + " --seq-len 9000" + a, f, &r);
    const std::string rope = "rope --config " + phi + " --in " + quote(in) + " --offset 8996" + a;
    const Tensor direct = run_ok(rope, path("direct.npy"));
    const Tensor injected = run_ok(rope + " --inv-freq " + quote(f), path("inj.npy"));
    expect_tensor_eq(injected, shape, direct.to_f32());
    // Without --config: attention factor 1, so the result differs by af exactly in spirit;
    // compare with the library.
    RopeFrequencies fr;
    fr.inv_freq = read_npy(f).to_f64();
    fr.angles = std::string(angles) == "float32" ? RopeAngles::kFloat32 : RopeAngles::kAccurate;
    const Tensor plain = run_ok(
        "rope --in " + quote(in) + " --offset 8996 --inv-freq " + quote(f) + a, path("plain.npy"));
    expect_tensor_eq(plain, shape,
                     lib_rope(fr, RopeStyle::kHalf, x, shape, Positions::offset(8996)));
  }

  // A float32 table works too; a short table (R < D) leaves the tail dims alone.
  const std::vector<float> inv32 = {1.0f, 0.5f, 0.25f, 0.125f};
  const std::string f32 = write_f32("inv32.npy", {4}, inv32);
  RopeFrequencies fr;
  fr.inv_freq = {1.0, 0.5, 0.25, 0.125};
  const Tensor t = run_ok(
      "rope --in " + quote(in) + " --offset 3 --inv-freq " + quote(f32) + " --style interleaved",
      path("short.npy"));
  expect_tensor_eq(t, shape, lib_rope(fr, RopeStyle::kInterleaved, x, shape, Positions::offset(3)));

  // Length mismatches.
  expect_error("rope", "--in " + quote(in) + " --inv-freq " + quote(f32) + " --rotary-dim 16",
               "inv32.npy");
  expect_error("rope", "--config " + phi + " --in " + quote(in) + " --inv-freq " + quote(f32),
               "rotary_dim");
  const std::string big = write_f32("big.npy", {64}, std::vector<float>(64, 0.5f));
  expect_error("rope", "--in " + quote(in) + " --inv-freq " + quote(big), "head_dim");
  const std::string ints = write_i64("ints.npy", {4}, {1, 2, 3, 4});
  expect_error("rope", "--in " + quote(in) + " --inv-freq " + quote(ints), "ints.npy");
  expect_error("rope", "--in " + quote(in) + " --inv-freq " + quote(f32) + " --base 100", "--base");
  (void)cfg;
}

TEST_F(CliModelsTest, MRopePositions) {
  const ModelConfig cfg = load("qwen2-vl-7b.json");
  ASSERT_TRUE(cfg.mrope.has_value());
  const int64_t B = 2, L = 5;
  const std::vector<int64_t> shape = {B, L, 2, cfg.head_dim};
  const std::vector<float> x = random_floats(count(shape), 7);
  const std::string in = write_f32("x.npy", shape, x);
  const std::string qwen = config("qwen2-vl-7b.json");

  // [3, seq]: t, h, w differ (an image patch grid after text).
  const std::vector<int64_t> t_ids = {0, 1, 2, 2, 2}, h_ids = {0, 1, 2, 2, 3},
                             w_ids = {0, 1, 2, 3, 2};
  std::vector<int64_t> thw = t_ids;
  thw.insert(thw.end(), h_ids.begin(), h_ids.end());
  thw.insert(thw.end(), w_ids.begin(), w_ids.end());
  const std::string p3 = write_i64("p3.npy", {3, L}, thw);
  Tensor t = run_ok("rope --config " + qwen + " --in " + quote(in) + " --positions " + quote(p3),
                    path("y3.npy"));
  const std::array<Positions, 3> pos = {Positions::shared(t_ids), Positions::shared(h_ids),
                                        Positions::shared(w_ids)};
  const std::vector<float> want =
      lib_mrope(model_rope_frequencies(cfg, 4), cfg.rope.style, *cfg.mrope, x, shape, pos);
  expect_tensor_eq(t, shape, want);
  EXPECT_NE(want, lib_rope(model_rope_frequencies(cfg, 4), cfg.rope.style, x, shape,
                           Positions::shared(t_ids)));

  // [3, batch, seq].
  std::vector<int64_t> per_row;
  for (int c = 0; c < 3; ++c) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < L; ++i) per_row.push_back(10 * b + i + (c == 0 ? 0 : c * i));
    }
  }
  const std::string p3b = write_i64("p3b.npy", {3, B, L}, per_row);
  std::array<Positions, 3> rows;
  int64_t max_pos = 0;
  for (int c = 0; c < 3; ++c) {
    std::vector<int64_t> part(per_row.begin() + c * B * L, per_row.begin() + (c + 1) * B * L);
    max_pos = std::max(max_pos, *std::max_element(part.begin(), part.end()));
    rows[c] = Positions::per_row(part, B, L);
  }
  t = run_ok("rope --config " + qwen + " --in " + quote(in) + " --positions " + quote(p3b),
             path("y3b.npy"));
  expect_tensor_eq(t, shape,
                   lib_mrope(model_rope_frequencies(cfg, max_pos + 1), cfg.rope.style, *cfg.mrope,
                             x, shape, rows));

  // Text tokens: offset or 1-component positions, t = h = w (= plain RoPE).
  t = run_ok("rope --config " + qwen + " --in " + quote(in) + " --offset 20", path("yt.npy"));
  const Positions off = Positions::offset(20);
  const std::vector<float> text = lib_mrope(model_rope_frequencies(cfg, 25), cfg.rope.style,
                                            *cfg.mrope, x, shape, {off, off, off});
  expect_tensor_eq(t, shape, text);
  expect_tensor_eq(t, shape,
                   lib_rope(model_rope_frequencies(cfg, 25), cfg.rope.style, x, shape, off));
  const std::string p1 = write_i64("p1.npy", {L}, {20, 21, 22, 23, 24});
  t = run_ok("rope --config " + qwen + " --in " + quote(in) + " --positions " + quote(p1),
             path("y1.npy"));
  expect_tensor_eq(t, shape, text);

  // Bad 3-component files; 3-component positions without an M-RoPE config.
  const std::string bad = write_i64("bad.npy", {3, B + 1, L}, std::vector<int64_t>(3 * 3 * L, 0));
  expect_error("rope", "--config " + qwen + " --in " + quote(in) + " --positions " + quote(bad),
               "bad.npy");
  expect_error("rope",
               "--config " + config("llama-3.1-8b.json") + " --in " + quote(in) + " --positions " +
                   quote(p3b),
               "M-RoPE");
}

// ---------------------------------------------------------------------------------------------
// rope-freqs

TEST_F(CliModelsTest, RopeFreqsJsonAndTable) {
  struct Case {
    const char* file;
    int64_t seq_len;
    RopeAngles angles;
  };
  for (const Case& c : {Case{"llama-3.1-8b.json", 0, RopeAngles::kAccurate},
                        Case{"gpt-j-6b.json", 0, RopeAngles::kAccurate},
                        Case{"phi-3-mini-128k-like.json", 0, RopeAngles::kAccurate},
                        Case{"phi-3-mini-128k-like.json", 100000, RopeAngles::kAccurate},
                        Case{"llama-2-7b-dynamic-2x.json", 10000, RopeAngles::kFloat32},
                        Case{"qwen2-vl-7b.json", 0, RopeAngles::kAccurate}}) {
    SCOPED_TRACE(std::string(c.file) + " L=" + std::to_string(c.seq_len));
    const ModelConfig cfg = load(c.file);
    const RopeFrequencies want = model_rope_frequencies(cfg, c.seq_len, c.angles);
    std::string args = "rope-freqs --config " + config(c.file);
    if (c.seq_len) args += " --seq-len " + std::to_string(c.seq_len);
    if (c.angles == RopeAngles::kFloat32) args += " --angles float32";
    RunResult r;
    const Tensor t = run_ok(args, path("f.npy"), &r);
    ASSERT_EQ(t.dtype, DType::kF64);
    ASSERT_EQ(t.shape, std::vector<int64_t>{static_cast<int64_t>(want.inv_freq.size())});
    EXPECT_EQ(t.to_f64(), want.inv_freq);

    ASSERT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j.at("rotary_dim").get<int64_t>(), want.rotary_dim());
    EXPECT_EQ(j.at("attention_factor").get<double>(), want.attention_factor);
    EXPECT_EQ(j.at("style").get<std::string>(), style_name(cfg.rope.style));
    // Exactly the contract's three keys, in order; --details adds the rest.
    EXPECT_EQ(j.size(), 3u) << r.out;
    EXPECT_EQ(r.out.rfind("{\"rotary_dim\": ", 0), 0u) << r.out;
    EXPECT_LT(r.out.find("\"attention_factor\""), r.out.find("\"style\""));
    RunResult rd;
    run_ok(args + " --details", path("f2.npy"), &rd);
    const nlohmann::json jd = nlohmann::json::parse(rd.out);
    EXPECT_EQ(jd.at("scaling").get<std::string>(), scaling_name(cfg.rope.scaling.type));
    EXPECT_EQ(jd.at("rotary_dim"), j.at("rotary_dim"));
  }
  // Without --config: --head-dim and the rope flags.
  RopeConfig rc;
  rc.head_dim = 64;
  rc.rotary_dim = 32;
  rc.base = 1e6;
  RunResult r;
  const Tensor t = run_ok("rope-freqs --head-dim 64 --rotary-dim 32 --base 1e6 --style interleaved",
                          path("g.npy"), &r);
  EXPECT_EQ(t.to_f64(), rope_frequencies(rc).inv_freq);
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("style"), "interleaved");
  EXPECT_EQ(j.at("rotary_dim"), 32);
  EXPECT_EQ(j.at("attention_factor"), 1.0);

  expect_error("rope-freqs", "--config " + config("bloom-560m.json"), "bloom");
  expect_error("rope-freqs", "--config " + config("llama-3.1-8b.json") + " --style interleaved",
               "--style conflicts with --config");
  expect_error("rope-freqs", "--config " + config("llama-3.1-8b.json") + " --seq-len -1",
               "seq-len");
  expect_error("rope-freqs", "", "--config");
  expect_error("rope-freqs", "--config " + quote(path("missing.json")), "missing.json");
}

// ---------------------------------------------------------------------------------------------
// describe

TEST_F(CliModelsTest, Describe) {
  struct Case {
    const char* file;
    std::vector<std::string> needles;
  };
  for (const Case& c : {Case{"llama-3.1-8b.json", {"scheme: rope", "500000", "llama3", "128"}},
                        Case{"bloom-560m.json", {"scheme: alibi", "16"}},
                        Case{"t5-base.json", {"scheme: t5", "32", "128"}},
                        Case{"deberta-v3-base.json", {"scheme: deberta", "256"}},
                        Case{"qwen2-vl-7b.json", {"mrope", "16, 24, 24"}},
                        Case{"phi-3-mini-128k-like.json", {"longrope", "4096"}}}) {
    SCOPED_TRACE(c.file);
    const RunResult r = run(std::string("describe ") + config(c.file));
    EXPECT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(r.out, describe(load(c.file)));
    for (const std::string& n : c.needles) {
      EXPECT_NE(r.out.find(n), std::string::npos) << n << " in\n" << r.out;
    }
    const RunResult js = run(std::string("describe --json ") + config(c.file));
    EXPECT_EQ(js.status, 0) << js.err;
    const nlohmann::json j = nlohmann::json::parse(js.out);
    EXPECT_EQ(j.at("model_type"), load(c.file).model_type);
    EXPECT_EQ(j.at("head_dim"), load(c.file).head_dim);
  }
  const nlohmann::json j =
      nlohmann::json::parse(run("describe --json " + config("llama-3.1-8b.json")).out);
  EXPECT_EQ(j.at("rope").at("base"), 500000.0);
  EXPECT_EQ(j.at("rope").at("scaling").at("type"), "llama3");

  expect_error_result(run("describe " + quote(path("missing.json"))), "describe", "missing.json");
  {
    std::ofstream f(path("bad.json"));
    f << "{\"model_type\": \"llama\",";
  }
  expect_error_result(run("describe " + quote(path("bad.json"))), "describe", "bad.json");
  expect_error_result(run("describe"), "describe", "config");
}

// ---------------------------------------------------------------------------------------------
// inspect

TEST_F(CliModelsTest, InspectSafetensorsAndNpy) {
  SafetensorsFile f;
  f.tensors["relative_attention_bias"] = Tensor::from_f32({32, 12}, random_floats(32 * 12, 8));
  f.tensors["slopes"] = Tensor::from_f64({16}, std::vector<double>(16, 0.5));
  f.tensors["ids"] = Tensor::from_i64({2, 3}, {1, 2, 3, 4, 5, 6});
  f.metadata["format"] = "pt";
  f.metadata["note"] = "written by test_cli_models";
  const std::string st = path("p.safetensors");
  write_safetensors(st, f);

  RunResult r = run("inspect " + quote(st));
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");
  for (const char* s : {"relative_attention_bias", "[32, 12]", "1536", "float32", "slopes", "[16]",
                        "float64", "128", "ids", "int64", "[2, 3]", "48", "format", "pt",
                        "written by test_cli_models", "3 tensors"}) {
    EXPECT_NE(r.out.find(s), std::string::npos) << s << " in\n" << r.out;
  }
  r = run("inspect --json " + quote(st));
  EXPECT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j.at("tensors").size(), 3u);
  EXPECT_EQ(j.at("metadata").at("format"), "pt");
  bool found = false;
  for (const auto& t : j.at("tensors")) {
    if (t.at("name") == "relative_attention_bias") {
      found = true;
      EXPECT_EQ(t.at("shape"), nlohmann::json({32, 12}));
      EXPECT_EQ(t.at("dtype"), "float32");
      EXPECT_EQ(t.at("bytes"), 32 * 12 * 4);
    }
  }
  EXPECT_TRUE(found);
  r = run("inspect --stats " + quote(st));
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("non_finite"), std::string::npos);

  // .npy
  const std::string npy = write_f32("x.npy", {2, 3, 4}, random_floats(24, 9));
  r = run("inspect " + quote(npy));
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("float32"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[2, 3, 4]"), std::string::npos) << r.out;

  // Truncated and garbage files: exit 2, one line, naming the file.
  std::vector<unsigned char> bytes = encode_safetensors(f);
  bytes.resize(bytes.size() - 5);
  {
    std::ofstream o(path("short.safetensors"), std::ios::binary);
    o.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  }
  r = run("inspect " + quote(path("short.safetensors")));
  expect_error_result(r, "inspect", "short.safetensors");
  EXPECT_EQ(r.out, "");
  {
    std::ofstream o(path("junk.safetensors"), std::ios::binary);
    o << "not a safetensors file at all";
  }
  expect_error_result(run("inspect " + quote(path("junk.safetensors"))), "inspect",
                      "junk.safetensors");
  std::vector<unsigned char> nb = encode_npy(Tensor::from_f32({2, 3}, random_floats(6, 10)));
  nb.resize(nb.size() - 3);
  {
    std::ofstream o(path("short.npy"), std::ios::binary);
    o.write(reinterpret_cast<const char*>(nb.data()), static_cast<std::streamsize>(nb.size()));
  }
  expect_error_result(run("inspect " + quote(path("short.npy"))), "inspect", "short.npy");
  expect_error_result(run("inspect " + quote(path("none.safetensors"))), "inspect",
                      "none.safetensors");
}

// A file name is any byte string; JSON text is UTF-8. inspect --json stays valid JSON (strictly
// parsed here), the bad bytes as U+FFFD and the exact name in file_hex.
TEST_F(CliModelsTest, InspectJsonNameNotUtf8) {
  const std::vector<int64_t> shape = {4};
  const std::string good = write_f32("plain.npy", shape, random_floats(4, 3));
  for (const std::string& name :
       {std::string("w\xffx.npy"), std::string("\xc3(\xa9\xed\xa0\x80.npy"),
        std::string("tail\xe2\x82.npy")}) {
    const std::string bad = path(name);
    fs::copy_file(good, bad, fs::copy_options::overwrite_existing);
    const RunResult r = run("inspect --json " + quote(bad));
    ASSERT_EQ(r.status, 0) << r.err;
    nlohmann::json j;
    ASSERT_NO_THROW(j = nlohmann::json::parse(r.out)) << r.out;
    EXPECT_EQ(j.at("file_hex").get<std::string>().size(), 2 * bad.size());
    std::string back;
    const std::string hex = j.at("file_hex").get<std::string>();
    for (std::size_t i = 0; i + 1 < hex.size(); i += 2) {
      back += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
    }
    EXPECT_EQ(back, bad);
    const std::string shown = j.at("file").get<std::string>();
    EXPECT_NE(shown.find("\xef\xbf\xbd"), std::string::npos) << shown;  // U+FFFD
    EXPECT_EQ(j.at("shape"), nlohmann::json({4}));
    // A valid name has no file_hex; the text output still names the file.
    const RunResult t = run("inspect " + quote(bad));
    EXPECT_EQ(t.status, 0) << t.err;
  }
  // A valid UTF-8 name (not ASCII) is echoed as is.
  const std::string ok = path("caf\xc3\xa9.npy");
  fs::copy_file(good, ok, fs::copy_options::overwrite_existing);
  const RunResult r = run("inspect --json " + quote(ok));
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("file"), ok);
  EXPECT_FALSE(j.contains("file_hex"));
  // A .safetensors file under such a name too.
  SafetensorsFile f;
  f.tensors["x"] = Tensor::from_f32({2}, {1.0f, 2.0f});
  const std::string st = path("t\x80.safetensors");
  write_safetensors(st, f);
  const RunResult rs = run("inspect --json " + quote(st));
  ASSERT_EQ(rs.status, 0) << rs.err;
  const nlohmann::json js = nlohmann::json::parse(rs.out);
  EXPECT_EQ(js.at("tensors").at(0).at("name"), "x");
  EXPECT_TRUE(js.contains("file_hex"));
}

// ---------------------------------------------------------------------------------------------
// attention --config

class CliAttentionConfigTest : public CliModelsTest {
 protected:
  // Writes q [1, Lq, Hq, D], k and v [1, Lk, Hkv, D]; returns the --q/--k/--v flags.
  std::string make_qkv(int64_t lq, int64_t lk, int64_t hq, int64_t hkv, int64_t d) {
    qs_ = {1, lq, hq, d};
    ks_ = {1, lk, hkv, d};
    q_ = random_floats(count(qs_), 21);
    k_ = random_floats(count(ks_), 22);
    v_ = random_floats(count(ks_), 23);
    return "--q " + quote(write_f32("q.npy", qs_, q_)) + " --k " +
           quote(write_f32("k.npy", ks_, k_)) + " --v " + quote(write_f32("v.npy", ks_, v_));
  }

  std::vector<float> expected(const PositionScheme& scheme, const AttentionOptions& opt = {}) {
    std::vector<float> out(q_.size());
    attention(View<const float, 4>::contiguous(q_.data(), dims4(qs_)),
              View<const float, 4>::contiguous(k_.data(), dims4(ks_)),
              View<const float, 4>::contiguous(v_.data(), dims4(ks_)), scheme, opt,
              View<float, 4>::contiguous(out.data(), dims4(qs_)));
    return out;
  }

  std::vector<int64_t> qs_, ks_;
  std::vector<float> q_, k_, v_;
};

TEST_F(CliAttentionConfigTest, RopeConfig) {
  const ModelConfig cfg = load("llama-3.1-8b.json");
  const std::string qkv = make_qkv(3, 4, cfg.heads_q, cfg.heads_kv, cfg.head_dim);
  Tensor t = run_ok("attention " + qkv + " --config " + config("llama-3.1-8b.json") + " --causal",
                    path("o.npy"));
  AttentionOptions opt;
  opt.causal = true;
  expect_tensor_eq(t, qs_, expected(Rope{model_rope_frequencies(cfg, 4), RopeStyle::kHalf}, opt));
  // An agreeing --scheme is fine.
  t = run_ok("attention " + qkv + " --scheme rope --config " + config("llama-3.1-8b.json"),
             path("o2.npy"));
  expect_tensor_eq(t, qs_, expected(Rope{model_rope_frequencies(cfg, 4), RopeStyle::kHalf}));
  // --angles and --seq-len (dynamic NTK depends on it).
  const ModelConfig dyn = load("llama-2-7b-dynamic-2x.json");
  const std::string qkv2 = make_qkv(3, 4, dyn.heads_q, dyn.heads_kv, dyn.head_dim);
  t = run_ok("attention " + qkv2 + " --config " + config("llama-2-7b-dynamic-2x.json") +
                 " --seq-len 10000 --angles float32",
             path("o3.npy"));
  expect_tensor_eq(
      t, qs_,
      expected(Rope{model_rope_frequencies(dyn, 10000, RopeAngles::kFloat32), RopeStyle::kHalf}));
}

TEST_F(CliAttentionConfigTest, MRopeConfigUsesTextPositions) {
  const ModelConfig cfg = load("qwen2-vl-7b.json");
  const std::string qkv = make_qkv(2, 3, cfg.heads_q, cfg.heads_kv, cfg.head_dim);
  const Tensor t =
      run_ok("attention " + qkv + " --config " + config("qwen2-vl-7b.json"), path("o.npy"));
  expect_tensor_eq(t, qs_, expected(Rope{model_rope_frequencies(cfg, 3), cfg.rope.style}));
}

TEST_F(CliAttentionConfigTest, AlibiConfig) {
  const ModelConfig cfg = load("bloom-560m.json");
  ASSERT_EQ(cfg.alibi.heads, 16);
  const std::string qkv = make_qkv(4, 4, 16, 16, cfg.head_dim);
  const Tensor t = run_ok(
      "attention " + qkv + " --config " + config("bloom-560m.json") + " --causal", path("o.npy"));
  AttentionOptions opt;
  opt.causal = true;
  expect_tensor_eq(t, qs_, expected(Alibi{alibi_slopes(cfg.alibi), 8.0}, opt));
  // Wrong number of heads.
  const std::string bad = make_qkv(4, 4, 8, 8, cfg.head_dim);
  expect_error("attention", bad + " --config " + config("bloom-560m.json"), "heads");
}

TEST_F(CliAttentionConfigTest, T5Config) {
  const ModelConfig cfg = load("t5-base.json");
  const std::string qkv = make_qkv(5, 6, cfg.heads_q, cfg.heads_kv, cfg.head_dim);
  const std::vector<float> table = random_floats(cfg.t5.num_buckets * cfg.heads_q, 30);
  SafetensorsFile f;
  f.tensors["relative_attention_bias"] = Tensor::from_f32({cfg.t5.num_buckets, cfg.heads_q}, table);
  const std::string p = path("t5.safetensors");
  write_safetensors(p, f);
  const auto view =
      View<const float, 2>::contiguous(table.data(), {cfg.t5.num_buckets, cfg.heads_q});

  // Default scale 1 for T5.
  Tensor t =
      run_ok("attention " + qkv + " --config " + config("t5-base.json") + " --params " + quote(p),
             path("o.npy"));
  AttentionOptions opt;
  opt.scale = 1.0;
  expect_tensor_eq(t, qs_, expected(T5Bias{view, cfg.t5.max_distance, std::nullopt}, opt));
  // --scale still wins; causal decoder bucketing.
  t = run_ok("attention " + qkv + " --config " + config("t5-base.json") + " --params " + quote(p) +
                 " --scale 0.25 --causal",
             path("o2.npy"));
  opt.scale = 0.25;
  opt.causal = true;
  expect_tensor_eq(t, qs_, expected(T5Bias{view, cfg.t5.max_distance, std::nullopt}, opt));

  // A table with the wrong number of buckets; --num-buckets / --max-distance conflict.
  SafetensorsFile g;
  g.tensors["relative_attention_bias"] =
      Tensor::from_f32({16, cfg.heads_q}, random_floats(16 * 12, 1));
  write_safetensors(path("t5_16.safetensors"), g);
  expect_error(
      "attention",
      qkv + " --config " + config("t5-base.json") + " --params " + quote(path("t5_16.safetensors")),
      "buckets");
  expect_error(
      "attention",
      qkv + " --config " + config("t5-base.json") + " --params " + quote(p) + " --max-distance 64",
      "--max-distance conflicts with --config");
  expect_error("attention", qkv + " --config " + config("t5-base.json"), "--params");
}

TEST_F(CliAttentionConfigTest, DebertaConfig) {
  const ModelConfig cfg = load("deberta-v3-base.json");
  const int64_t k2 = 2 * cfg.deberta.span();
  const std::string qkv = make_qkv(3, 3, cfg.heads_q, cfg.heads_kv, cfg.head_dim);
  const std::vector<float> pk = random_floats(k2 * cfg.heads_q * cfg.head_dim, 31);
  const std::vector<float> pq = random_floats(k2 * cfg.heads_q * cfg.head_dim, 32);
  SafetensorsFile f;
  f.tensors["pos_key"] = Tensor::from_f32({k2, cfg.heads_q, cfg.head_dim}, pk);
  f.tensors["pos_query"] = Tensor::from_f32({k2, cfg.heads_q, cfg.head_dim}, pq);
  const std::string p = path("deberta.safetensors");
  write_safetensors(p, f);
  const Tensor t = run_ok(
      "attention " + qkv + " --config " + config("deberta-v3-base.json") + " --params " + quote(p),
      path("o.npy"));
  DeBERTa d;
  d.pos_key = View<const float, 3>::contiguous(pk.data(), {k2, cfg.heads_q, cfg.head_dim});
  d.pos_query = View<const float, 3>::contiguous(pq.data(), {k2, cfg.heads_q, cfg.head_dim});
  d.buckets = cfg.deberta;
  expect_tensor_eq(t, qs_, expected(d));
}

TEST_F(CliAttentionConfigTest, Conflicts) {
  const ModelConfig cfg = load("llama-3.1-8b.json");
  const std::string llama = config("llama-3.1-8b.json");
  const std::string qkv = make_qkv(2, 2, cfg.heads_q, cfg.heads_kv, cfg.head_dim);
  expect_error("attention", qkv + " --config " + llama + " --scheme alibi", "--scheme alibi");
  expect_error("attention", qkv + " --config " + llama + " --base 1e4", "--base conflicts");
  expect_error("attention", qkv + " --config " + llama + " --style interleaved", "--style");
  expect_error("attention", qkv + " --config " + config("gpt2.json"), "gpt2");
  const std::string small = make_qkv(2, 2, cfg.heads_q, cfg.heads_kv, 64);
  expect_error("attention", small + " --config " + llama, "head_dim");
  const std::string heads = make_qkv(2, 2, cfg.heads_q, cfg.heads_q, cfg.head_dim);
  expect_error("attention", heads + " --config " + llama, "heads_kv");
}

// ---------------------------------------------------------------------------------------------
// rope conflicts

TEST_F(CliModelsTest, RopeConfigConflicts) {
  const std::vector<int64_t> shape = {1, 2, 1, 128};
  const std::string in = write_f32("x.npy", shape, random_floats(count(shape), 11));
  const std::string llama = config("llama-3.1-8b.json");
  expect_error("rope", "--config " + llama + " --in " + quote(in) + " --base 1e4",
               "--base conflicts with --config");
  expect_error("rope", "--config " + llama + " --in " + quote(in) + " --rotary-dim 64",
               "--rotary-dim conflicts with --config");
  expect_error("rope", "--config " + llama + " --in " + quote(in) + " --style half",
               "--style conflicts with --config");
  expect_error("rope", "--config " + config("bloom-560m.json") + " --in " + quote(in), "bloom");
  expect_error("rope", "--config " + config("t5-base.json") + " --in " + quote(in), "'t5'");
  const std::string in64 = write_f32("x64.npy", {1, 2, 1, 64}, random_floats(128, 12));
  expect_error("rope", "--config " + llama + " --in " + quote(in64), "head_dim");
  expect_error("rope", "--config " + llama + " --in " + quote(in) + " --seq-len -2", "seq-len");
  expect_error("rope", "--config " + quote(path("nope.json")) + " --in " + quote(in), "nope.json");
}

// ---------------------------------------------------------------------------------------------
// rope-precision

TEST_F(CliModelsTest, RopePrecision) {
  const std::vector<RopePrecisionRow> lib = rope_precision({int64_t{1} << 20});
  ASSERT_EQ(lib.size(), 1u);
  EXPECT_LT(lib[0].accurate_error, 1e-6);
  EXPECT_GT(lib[0].float32_error, 1e-3);
  EXPECT_GT(lib[0].float32_angle_error, 1e-3);
  EXPECT_LT(lib[0].float32_angle_error, 0.1);

  RunResult r = run("rope-precision");
  EXPECT_EQ(r.status, 0) << r.err;
  for (const char* col :
       {"position", "accurate_max_err", "float32_max_err", "float32_angle_err_rad"}) {
    EXPECT_NE(r.out.find(col), std::string::npos) << col;
  }
  std::istringstream is(r.out);
  std::string line;
  bool found = false;
  while (std::getline(is, line)) {
    if (line.rfind("1048576 ", 0) != 0) continue;
    found = true;
    std::istringstream ls(line);
    std::string pos;
    double acc = 0, f32 = 0, ang = 0;
    ls >> pos >> acc >> f32 >> ang;
    EXPECT_LT(acc, 1e-6) << line;
    EXPECT_GT(f32, 1e-3) << line;
    EXPECT_GT(ang, 1e-3) << line;
  }
  EXPECT_TRUE(found) << r.out;

  r = run("rope-precision --positions 16,20 --json");
  EXPECT_EQ(r.status, 0) << r.err;
  std::istringstream js(r.out);
  std::vector<nlohmann::json> rows;
  while (std::getline(js, line)) rows.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[1].at("position"), 1048576);
  EXPECT_EQ(rows[1].at("accurate_max_err").get<double>(), lib[0].accurate_error);
  EXPECT_EQ(rows[1].at("float32_max_err").get<double>(), lib[0].float32_error);
  EXPECT_EQ(rows[1].at("float32_angle_err_rad").get<double>(), lib[0].float32_angle_error);

  expect_error_result(run("rope-precision --positions 70"), "rope-precision", "70");
  expect_error_result(run("rope-precision --head-dim 7"), "rope-precision", "--head-dim");
}

// ---------------------------------------------------------------------------------------------
// Per-layer models (issue 12 item 3) and the DeBERTa p2c default (item 2).

TEST_F(CliModelsTest, RopeFreqsLayer) {
  const ModelConfig g = load("gemma-3-4b-it.json");
  // Gemma 3's local and global layers differ: --layer is required, and picks the layer's RoPE.
  expect_error("rope-freqs", "--config " + config("gemma-3-4b-it.json"), "--layer");
  for (const int64_t layer : {int64_t{0}, int64_t{5}}) {
    const Tensor t = run_ok(
        "rope-freqs --config " + config("gemma-3-4b-it.json") + " --layer " + std::to_string(layer),
        path("f" + std::to_string(layer) + ".npy"));
    const RopeFrequencies want = layer_rope_frequencies(g, layer);
    ASSERT_EQ(t.to_f64("f"), want.inv_freq) << layer;
  }
  expect_error("rope-freqs", "--config " + config("gemma-3-4b-it.json") + " --layer 34",
               "out of range");
  // Llama 4: the RoPE layers agree, so no --layer is needed; a NoPE layer has no frequencies.
  const RunResult r = run("rope-freqs --config " + config("llama-4-scout-17b-16e-instruct.json") +
                          " --details --layer 0 --out " + quote(path("l4.npy")));
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("\"layer\": 0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"style\": \"interleaved\""), std::string::npos) << r.out;
  (void)run_ok("rope-freqs --config " + config("llama-4-scout-17b-16e-instruct.json"),
               path("l4b.npy"));
  expect_error("rope-freqs", "--head-dim 64 --layer 1", "--layer needs --config");
}

// Llama 4's NoPE layers: rope-freqs --layer N on every layer exits 0; a NoPE layer says so
// ("nope": true, rotary_dim 0, its temperature tuning) and writes an empty table; a RoPE layer's
// line keeps exactly the three keys. `rope` on a NoPE layer has nothing to rotate with: an error.
TEST_F(CliModelsTest, RopeFreqsNopeLayers) {
  const std::string cfg = config("llama-4-scout-17b-16e-instruct.json");
  const ModelConfig m = load("llama-4-scout-17b-16e-instruct.json");
  ASSERT_EQ(m.layers.size(), 48u);
  int nope_layers = 0;
  for (const ModelLayer& l : m.layers) {
    const std::string out = path("layer" + std::to_string(l.index) + ".npy");
    const RunResult r = run("rope-freqs --config " + cfg + " --layer " + std::to_string(l.index) +
                            " --out " + quote(out));
    ASSERT_EQ(r.status, 0) << l.index << ": " << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    const Tensor t = read_npy(out);
    if (!l.rope) {
      ++nope_layers;
      EXPECT_EQ(j.at("nope"), true) << r.out;
      EXPECT_EQ(j.at("rotary_dim"), 0) << r.out;
      EXPECT_EQ(j.at("attention_factor"), 1) << r.out;
      EXPECT_EQ(j.at("style"), "interleaved") << r.out;
      ASSERT_TRUE(l.temperature.has_value());
      EXPECT_EQ(j.at("temperature").at("floor_scale").get<double>(), l.temperature->floor_scale);
      EXPECT_EQ(j.at("temperature").at("attn_scale").get<double>(), l.temperature->attn_scale);
      EXPECT_EQ(t.shape, std::vector<int64_t>({0}));
    } else {
      EXPECT_EQ(j.size(), 3u) << r.out;
      EXPECT_FALSE(j.contains("nope")) << r.out;
      EXPECT_EQ(j.at("rotary_dim"), 128) << r.out;
      EXPECT_EQ(t.to_f64("t"), layer_rope_frequencies(m, l.index).inv_freq);
    }
  }
  EXPECT_EQ(nope_layers, 12);
  // --details on a NoPE layer: no scaling or base, the layer named.
  const RunResult d =
      run("rope-freqs --config " + cfg + " --layer 7 --details --out " + quote(path("d.npy")));
  ASSERT_EQ(d.status, 0) << d.err;
  const nlohmann::json jd = nlohmann::json::parse(d.out);
  EXPECT_EQ(jd.at("nope"), true);
  EXPECT_EQ(jd.at("layer"), 7);
  EXPECT_TRUE(jd.at("scaling").is_null());
  EXPECT_EQ(jd.at("model_type"), "llama4");
  // Out of range stays an error; rope on a NoPE layer too.
  expect_error("rope-freqs", "--config " + cfg + " --layer 48", "out of range");
  const std::string x = write_f32("xn.npy", {1, 2, 1, 128}, random_floats(256, 4));
  expect_error("rope", "--config " + cfg + " --layer 3 --in " + quote(x), "NoPE");
  // describe --json marks the same layers.
  const RunResult dj = run("describe --json " + cfg);
  ASSERT_EQ(dj.status, 0) << dj.err;
  const nlohmann::json layers = nlohmann::json::parse(dj.out).at("layers");
  for (const ModelLayer& l : m.layers) {
    EXPECT_EQ(layers.at(l.index).at("nope"), !l.rope) << l.index;
  }
}

TEST_F(CliModelsTest, RopeDeepseekLayout) {
  const ModelConfig c = load("deepseek-v3.json");
  for (const int64_t d : {int64_t{192}, int64_t{64}}) {
    const std::vector<int64_t> shape = {1, 4, 2, d};
    const std::vector<float> x = random_floats(count(shape), 9);
    const std::string in = write_f32("x" + std::to_string(d) + ".npy", shape, x);
    const Tensor t = run_ok(
        "rope --config " + config("deepseek-v3.json") + " --in " + quote(in) + " --offset 4000",
        path("y" + std::to_string(d) + ".npy"));
    std::vector<float> want(x.size());
    const Positions pos = Positions::offset(4000);
    apply_model_rope(c, model_rope_frequencies(c, 4004),
                     View<const float, 4>::contiguous(x.data(), dims4(shape)),
                     View<float, 4>::contiguous(want.data(), dims4(shape)), &pos);
    expect_tensor_eq(t, shape, want);
  }
  const std::string bad = write_f32("bad.npy", {1, 2, 1, 96}, random_floats(192, 3));
  expect_error("rope", "--config " + config("deepseek-v3.json") + " --in " + quote(bad),
               "head_dim 96");
}

TEST_F(CliModelsTest, DescribeLayersAndDefaults) {
  RunResult r = run("describe " + config("gemma-3-4b-it.json"));
  ASSERT_EQ(r.status, 0) << r.err;
  for (const char* s :
       {"pattern AAAAAB", "sliding_attention, window 1024, rope theta 10000",
        "full_attention, rope theta 1000000 linear: factor 8", "defaults: (Gemma3TextConfig"}) {
    EXPECT_NE(r.out.find(s), std::string::npos) << s << " in:\n" << r.out;
  }
  r = run("describe --json " + config("gpt-oss-20b.json"));
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["layers"].size(), 24u);
  EXPECT_TRUE(j["layers_differ"].get<bool>());
  EXPECT_EQ(j["layers"][0]["attention"], "sliding_attention");
  EXPECT_EQ(j["layers"][0]["sliding_window"], 128);
  EXPECT_TRUE(j["layers"][1]["attention_sinks"].get<bool>());
  EXPECT_TRUE(j["layers"][1]["sliding_window"].is_null());
  r = run("describe --json " + config("gemma-3-4b-it.json"));
  const nlohmann::json g = nlohmann::json::parse(r.out);
  EXPECT_EQ(g["defaults"]["head_dim"], "256");
  EXPECT_EQ(g["default_source"], "Gemma3TextConfig");
  r = run("describe --json " + config("deepseek-v3.json"));
  const nlohmann::json d = nlohmann::json::parse(r.out);
  EXPECT_EQ(d["rope"]["offset"], 128);
  EXPECT_TRUE(d["rope"]["deinterleave"].get<bool>());
  EXPECT_EQ(d["v_head_dim"], 128);
}

TEST_F(CliModelsTest, DebertaP2cDefaultIsTheCheckpoints) {
  // Default p2c = clamp(rho + K): the same map as c2p; --p2c paper gives clamp(-rho + K).
  const Tensor c2p = run_ok(
      "deberta-buckets --query-length 5 --key-length 7 "
      "--max-relative-positions 4 --index c2p",
      path("c2p.npy"));
  const Tensor p2c = run_ok(
      "deberta-buckets --query-length 5 --key-length 7 "
      "--max-relative-positions 4 --index p2c",
      path("p2c.npy"));
  EXPECT_EQ(p2c.to_i64("p2c"), c2p.to_i64("c2p"));
  const Tensor paper = run_ok(
      "deberta-buckets --query-length 5 --key-length 7 "
      "--max-relative-positions 4 --index p2c --p2c paper",
      path("paper.npy"));
  const std::vector<int64_t> pv = paper.to_i64("paper"), cv = c2p.to_i64("c2p");
  // Unclamped (|rho| < K = 4): rho + K and -rho + K add up to 2K.
  for (std::size_t i = 0; i < pv.size(); ++i) {
    if (cv[i] > 0 && cv[i] < 7) {
      EXPECT_EQ(pv[i] + cv[i], 8) << i;
    }
  }
  EXPECT_NE(pv, cv);
  // (query 4 at position 6, key 0): rho = 6 -> c2p clamps to 7, paper p2c to 0.
  EXPECT_EQ(cv[4 * 7 + 0], 7);
  EXPECT_EQ(pv[4 * 7 + 0], 0);
  expect_error("deberta-buckets", "--query-length 2 --key-length 2 --p2c spec", "spec");
}
// DeepSeek's multi-head latent attention: q, k [.., 192] = [nope 128 | rope 64], v [.., 128].
// Expected by hand: the model's RoPE (apply_model_rope, its own output layout) on q and k, then
// causal softmax attention in double with the model's scale; dv = P^T dout.
TEST_F(CliModelsTest, AttentionDeepseekLatentHeads) {
  for (const char* name : {"deepseek-v2-lite.json", "deepseek-v3.json"}) {
    SCOPED_TRACE(name);
    const ModelConfig c = load(name);
    const int64_t L = 6, H = c.heads_q, D = c.head_dim, Dv = c.v_head_dim;
    ASSERT_EQ(c.heads_kv, H);
    ASSERT_EQ(D, 192);
    ASSERT_EQ(Dv, 128);
    const std::vector<int64_t> qs = {1, L, H, D}, vs = {1, L, H, Dv};
    const std::vector<float> q = random_floats(count(qs), 21), k = random_floats(count(qs), 22),
                             v = random_floats(count(vs), 23), dout = random_floats(count(vs), 24);
    const std::string args =
        "--q " + quote(write_f32("q.npy", qs, q)) + " --k " + quote(write_f32("k.npy", qs, k)) +
        " --v " + quote(write_f32("v.npy", vs, v)) + " --config " + config(name) + " --causal";
    std::vector<float> qr(q.size()), kr(k.size());
    const RopeFrequencies f = model_rope_frequencies(c, L);
    apply_model_rope(c, f, View<const float, 4>::contiguous(q.data(), dims4(qs)),
                     View<float, 4>::contiguous(qr.data(), dims4(qs)));
    apply_model_rope(c, f, View<const float, 4>::contiguous(k.data(), dims4(qs)),
                     View<float, 4>::contiguous(kr.data(), dims4(qs)));
    const double scale = c.layers[0].softmax_scale;
    EXPECT_GT(scale, 1.0 / std::sqrt(192.0));  // YaRN's mscale_all_dim raises it
    std::vector<double> want(count(vs), 0.0), dv(count(vs), 0.0);
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < L; ++i) {
        std::vector<double> p(static_cast<std::size_t>(i + 1));
        double m = -1e300, z = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double s = 0;
          for (int64_t x = 0; x < D; ++x) {
            s += double(qr[static_cast<std::size_t>((i * H + h) * D + x)]) *
                 double(kr[static_cast<std::size_t>((j * H + h) * D + x)]);
          }
          p[static_cast<std::size_t>(j)] = s * scale;
          m = std::max(m, s * scale);
        }
        for (double& e : p) z += (e = std::exp(e - m));
        for (int64_t j = 0; j <= i; ++j) {
          const double w = p[static_cast<std::size_t>(j)] / z;
          for (int64_t x = 0; x < Dv; ++x) {
            const auto o = static_cast<std::size_t>((i * H + h) * Dv + x);
            const auto vj = static_cast<std::size_t>((j * H + h) * Dv + x);
            want[o] += w * v[vj];
            dv[vj] += w * dout[o];
          }
        }
      }
    }
    for (const char* extra : {"", " --reference"}) {
      const Tensor t = run_ok("attention " + args + extra, path("o.npy"));
      ASSERT_EQ(t.shape, vs);
      const std::vector<double> got = t.to_f64();
      for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 2e-5) << i;
    }
    const std::string dpath = write_f32("dout.npy", vs, dout);
    std::map<std::string, SafetensorsFile> grads;
    for (const char* extra : {"", " --reference"}) {
      const std::string out = path(std::string("g") + extra + ".safetensors");
      const RunResult r = run("attention-grad " + args + " --dout " + quote(dpath) + extra +
                              " --out " + quote(out));
      ASSERT_EQ(r.status, 0) << r.err;
      grads[extra] = read_safetensors(out);
      const Tensor& g = grads[extra].tensors.at("dv");
      ASSERT_EQ(g.shape, vs);
      const std::vector<double> got = g.to_f64();
      for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], dv[i], 2e-5) << i;
    }
    for (const char* t : {"dq", "dk"}) {
      const std::vector<double> a = grads[""].tensors.at(t).to_f64(),
                                b = grads[" --reference"].tensors.at(t).to_f64();
      ASSERT_EQ(grads[""].tensors.at(t).shape, qs);
      for (std::size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-5) << t << " " << i;
    }
    // Heads of another width, and v wider than q and k, are refused.
    const std::string bad =
        write_f32("bad.npy", {1, L, H, 96}, random_floats(size_t(L * H * 96), 5));
    expect_error("attention",
                 "--q " + quote(bad) + " --k " + quote(bad) + " --v " + quote(bad) + " --config " +
                     config(name),
                 "head_dim 96 does not match");
    expect_error("attention",
                 "--q " + quote(path("v.npy")) + " --k " + quote(path("v.npy")) + " --v " +
                     quote(path("q.npy")) + " --config " + config(name),
                 "exceeds the head_dim");
    const RunResult r = run("attention-grad " + args + " --dout " + quote(path("q.npy")) +
                            " --out " + quote(path("x.safetensors")));
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(
        r.err.find("must have the shape of the output [1, 6, " + std::to_string(H) + ", 128]"),
        std::string::npos)
        << r.err;
  }
}

// Half precision on the command line: float16 .npy and bfloat16 .safetensors in, the input's type
// out by default (rounded once from the float32 result: the library's half entry points bit for
// bit), --out-dtype, and the errors.
template <class H>
Tensor half_tensor(DType dtype, const std::vector<int64_t>& shape, const std::vector<H>& v) {
  Tensor t;
  t.dtype = dtype;
  t.shape = shape;
  t.bytes.resize(v.size() * 2);
  std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
  return t;
}

template <class H>
std::vector<uint16_t> bits_of(const std::vector<H>& v) {
  std::vector<uint16_t> b(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) b[i] = v[i].bits;
  return b;
}

std::vector<uint16_t> bits_of(const Tensor& t) {
  std::vector<uint16_t> b(t.bytes.size() / 2);
  std::memcpy(b.data(), t.bytes.data(), t.bytes.size());
  return b;
}

TEST_F(CliModelsTest, HalfPrecisionInputsAndOutputs) {
  const std::vector<int64_t> shape = {1, 7, 2, 8};
  const auto d4 = dims4(shape);
  const std::vector<float> xf = random_floats(count(shape), 31);
  std::vector<f16> xh(xf.size());
  std::vector<bf16> xb(xf.size());
  for (std::size_t i = 0; i < xf.size(); ++i) {
    xh[i] = f16_from_float(xf[i]);
    xb[i] = bf16_from_float(xf[i]);
  }
  const std::string h_npy = path("xh.npy"), b_st = path("xb.safetensors");
  write_npy(h_npy, half_tensor(DType::kF16, shape, xh));
  SafetensorsFile sf;
  sf.tensors["x"] = half_tensor(DType::kBF16, shape, xb);
  write_safetensors(b_st, sf);
  const RopeFrequencies f = rope_frequencies({.head_dim = 8});
  const Positions pos = Positions::offset(100);

  // rope: float16 in -> float16 out; bfloat16 in -> bfloat16 out ("out" in a .safetensors).
  Tensor t = run_ok("rope --in " + quote(h_npy) + " --offset 100", path("yh.npy"));
  std::vector<f16> yh(xh.size());
  apply_rope(f, RopeStyle::kHalf, View<const f16, 4>::contiguous(xh.data(), d4),
             View<f16, 4>::contiguous(yh.data(), d4), &pos);
  ASSERT_EQ(t.dtype, DType::kF16);
  EXPECT_EQ(bits_of(t), bits_of(yh));
  RunResult r =
      run("rope --in " + quote(b_st) + " --offset 100 --out " + quote(path("yb.safetensors")));
  ASSERT_EQ(r.status, 0) << r.err;
  const SafetensorsFile yb_file = read_safetensors(path("yb.safetensors"));
  ASSERT_EQ(yb_file.tensors.count("out"), 1u);
  std::vector<bf16> yb(xb.size());
  apply_rope(f, RopeStyle::kHalf, View<const bf16, 4>::contiguous(xb.data(), d4),
             View<bf16, 4>::contiguous(yb.data(), d4), &pos);
  EXPECT_EQ(yb_file.tensors.at("out").dtype, DType::kBF16);
  EXPECT_EQ(bits_of(yb_file.tensors.at("out")), bits_of(yb));
  // --out-dtype float32: the float32 rotation of the widened values.
  t = run_ok("rope --in " + quote(h_npy) + " --offset 100 --out-dtype float32", path("y32.npy"));
  std::vector<float> xw(xh.size()), y32(xh.size());
  for (std::size_t i = 0; i < xh.size(); ++i) xw[i] = to_float(xh[i]);
  apply_rope(f, RopeStyle::kHalf, View<const float, 4>::contiguous(xw.data(), d4),
             View<float, 4>::contiguous(y32.data(), d4), &pos);
  expect_tensor_eq(t, shape, y32);

  // attention: all bfloat16 -> bfloat16; float32 q with a float16 KV cache -> float32.
  r = run("attention --q " + quote(b_st) + " --k " + quote(b_st) + " --v " + quote(b_st) +
          " --scheme alibi --causal --out " + quote(path("ob.safetensors")));
  ASSERT_EQ(r.status, 0) << r.err;
  std::vector<bf16> ob(xb.size());
  const auto bv = View<const bf16, 4>::contiguous(xb.data(), d4);
  attention(bv, bv, bv, Alibi{}, {.causal = true}, View<bf16, 4>::contiguous(ob.data(), d4));
  EXPECT_EQ(bits_of(read_safetensors(path("ob.safetensors")).tensors.at("out")), bits_of(ob));
  const std::string q32 = write_f32("q32.npy", shape, xf);
  t = run_ok("attention --q " + quote(q32) + " --k " + quote(h_npy) + " --v " + quote(h_npy) +
                 " --scheme rope --causal",
             path("om.npy"));
  std::vector<float> om(xf.size());
  const auto hv = View<const f16, 4>::contiguous(xh.data(), d4);
  attention(View<const float, 4>::contiguous(xf.data(), d4), hv, hv, Rope{f, RopeStyle::kHalf},
            {.causal = true}, View<float, 4>::contiguous(om.data(), d4));
  expect_tensor_eq(t, shape, om);
  // attention-grad: half inputs, bfloat16 gradients on request.
  r = run("attention-grad --q " + quote(h_npy) + " --k " + quote(h_npy) + " --v " + quote(h_npy) +
          " --dout " + quote(h_npy) + " --scheme none --causal --out-dtype bfloat16 --out " +
          quote(path("g.safetensors")));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(read_safetensors(path("g.safetensors")).tensors.at("dq").dtype, DType::kBF16);

  // Errors: bfloat16 into a .npy, an ambiguous .safetensors input.
  expect_error("rope", "--in " + quote(b_st), "a bfloat16 output needs a .safetensors file");
  SafetensorsFile two;
  two.tensors["a"] = half_tensor(DType::kBF16, shape, xb);
  two.tensors["b"] = half_tensor(DType::kBF16, shape, xb);
  write_safetensors(path("two.safetensors"), two);
  expect_error("attention",
               "--q " + quote(path("two.safetensors")) + " --k " + quote(b_st) + " --v " +
                   quote(b_st) + " --scheme none",
               "2 tensors ('a', 'b') and none named 'q'");
}

}  // namespace
}  // namespace posenc
