// tests/test_cli.cc - the `posenc` command-line tool, run as a subprocess.
//
// Inputs are written with posenc::write_npy / write_safetensors, outputs read back with
// posenc::read_npy and compared with the library's own results computed here: the CLI is a thin
// layer, so the float32 paths must agree exactly. Error cases check the contract of docs/cli.md:
// exit status 2, exactly one stderr line "posenc <command>: error: <message>" naming the problem,
// and no output file left behind (an existing one left untouched).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "posenc/posenc.h"

namespace fs = std::filesystem;

namespace posenc {
namespace {

using cli_test::count;
using cli_test::quote;
using cli_test::random_floats;
using cli_test::read_text;
using cli_test::RunResult;

class CliTest : public cli_test::CliFixture {
 protected:
  std::string write_params(const std::string& name,
                           const std::map<std::string, Tensor>& tensors) const {
    SafetensorsFile f;
    f.tensors = tensors;
    const std::string p = path(name);
    write_safetensors(p, f);
    return p;
  }

  // Runs a command expected to fail with a usage/input error: status 2, one stderr line
  // "posenc <command>: error: ..." containing `needle`, and no output file afterwards.
  void expect_error(const std::string& command, const std::string& args,
                    const std::string& needle) const {
    const std::string out = path("error_out.npy");
    fs::remove(out);
    const RunResult r = run(command + " " + args + " --out " + quote(out));
    expect_error_result(r, command, needle);
    EXPECT_FALSE(fs::exists(out)) << "output left behind by posenc " << command << " " << args;
    // An existing output is left untouched.
    {
      std::ofstream f(out, std::ios::binary);
      f << "precious";
    }
    const RunResult r2 = run(command + " " + args + " --out " + quote(out));
    EXPECT_EQ(r2.status, 2);
    EXPECT_EQ(read_text(out), "precious") << "existing output modified on error";
    fs::remove(out);
    // No temporary files left in the output folder either.
    for (const auto& e : fs::directory_iterator(dir_)) {
      const std::string n = e.path().filename().string();
      EXPECT_EQ(n.find("error_out.npy"), std::string::npos) << "leftover " << n;
    }
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

// ---------------------------------------------------------------------------------------------
// Help, version, dispatch.

TEST_F(CliTest, HelpExitsZeroForEveryCommand) {
  for (const char* cmd : {"", "sinusoidal", "rope", "alibi-slopes", "t5-buckets", "attention",
                          "check", "demo", "learned", "deberta-buckets", "version", "rope-freqs",
                          "rope-precision", "describe", "inspect"}) {
    const RunResult r = run(std::string(cmd) + " --help");
    EXPECT_EQ(r.status, 0) << cmd << ": " << r.err;
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << cmd;
    EXPECT_EQ(r.err, "") << cmd;
  }
  const RunResult r = run("attention -h");
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.out.find("--scheme"), std::string::npos);
}

// The attention commands read the scheme registry: every scheme, parameter and settings flag of
// the registry is in their help, and an unknown scheme is refused naming the known ones.
TEST_F(CliTest, AttentionFlagsFollowTheSchemeRegistry) {
  for (const char* cmd : {"attention", "attention-grad"}) {
    const RunResult r = run(std::string(cmd) + " --help");
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find(scheme_names_text()), std::string::npos) << r.out;
    for (const SchemeInfo& s : attention_schemes()) {
      for (const SchemeParamInfo& p : s.params) {
        EXPECT_NE(r.out.find(p.name + " " + p.layout), std::string::npos) << cmd << " " << p.name;
      }
      for (const SchemeSettingInfo& t : s.settings) {
        if (!t.flag.empty()) {
          EXPECT_NE(r.out.find(t.flag), std::string::npos) << cmd << " " << t.flag;
        }
      }
    }
  }
  const RunResult bad = run("attention --q q.npy --k k.npy --v v.npy --out o.npy --scheme nope");
  EXPECT_EQ(bad.status, 2);
  EXPECT_NE(bad.err.find("nope"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("deberta"), std::string::npos) << bad.err;
}

TEST_F(CliTest, Version) {
  RunResult r = run("version");
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r.out, std::string("posenc ") + POSENC_VERSION_STRING + "\n");
  r = run("--version");
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.out.find(POSENC_VERSION_STRING), std::string::npos);
}

TEST_F(CliTest, NoOrUnknownCommand) {
  RunResult r = run("");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1);
  EXPECT_EQ(r.err.rfind("posenc: error: ", 0), 0u) << r.err;
  r = run("frobnicate");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1);
  EXPECT_NE(r.err.find("frobnicate"), std::string::npos) << r.err;
}

// ---------------------------------------------------------------------------------------------
// sinusoidal

TEST_F(CliTest, SinusoidalDefault) {
  const Tensor t = run_ok("sinusoidal --length 50 --dim 16", path("pe.npy"));
  SinusoidalConfig cfg;
  cfg.dim = 16;
  expect_tensor_eq(t, {50, 16}, sinusoidal_table(cfg, 50));
}

TEST_F(CliTest, SinusoidalVariants) {
  SinusoidalConfig cfg;
  cfg.dim = 12;
  cfg.base = 500.0;
  cfg.layout = SinLayout::kConcat;
  cfg.denominator = SinDenominator::kHalfMinusOne;
  cfg.origin = 2;
  Tensor t = run_ok(
      "sinusoidal --length 9 --dim 12 --base 500 --layout concat --denominator half-minus-one "
      "--origin 2",
      path("pe.npy"));
  expect_tensor_eq(t, {9, 12}, sinusoidal_table(cfg, 9));

  SinusoidalConfig odd;
  odd.dim = 7;
  odd.odd_dim = SinOddDim::kZeroPad;
  t = run_ok("sinusoidal --length 5 --dim 7 --odd-dim zero-pad", path("odd.npy"));
  expect_tensor_eq(t, {5, 7}, sinusoidal_table(odd, 5));

  // Explicit positions.
  const std::vector<int64_t> ids = {0, 3, 1000000, 7};
  const std::string p = write_i64("ids.npy", {4}, ids);
  t = run_ok("sinusoidal --dim 8 --positions " + quote(p), path("pos.npy"));
  SinusoidalConfig c8;
  c8.dim = 8;
  std::vector<float> want(4 * 8);
  sinusoidal_encode(c8, ids, View<float, 2>::contiguous(want.data(), {4, 8}));
  expect_tensor_eq(t, {4, 8}, want);
}

TEST_F(CliTest, SinusoidalErrors) {
  expect_error("sinusoidal", "--length 4 --dim 5", "dim");
  expect_error("sinusoidal", "--length 4 --dim 0", "dim");
  expect_error("sinusoidal", "--length -1 --dim 8", "length");
  expect_error("sinusoidal", "--length 4 --dim 8 --layout foo", "layout");
  expect_error("sinusoidal", "--length 4 --dim 8 --base 1", "base");
  expect_error("sinusoidal", "--length 4 --dim 8 --bogus", "--bogus");
  expect_error("sinusoidal", "--length abc --dim 8", "length");
  expect_error("sinusoidal", "--dim 8", "length");
  // Missing --out.
  const RunResult r = run("sinusoidal --length 4 --dim 8");
  expect_error_result(r, "sinusoidal", "--out");
}

TEST_F(CliTest, UnwritableOutputIsAnError) {
  const RunResult r = run("sinusoidal --length 4 --dim 8 --out " + quote(path("no/such/dir.npy")));
  expect_error_result(r, "sinusoidal", "no/such/dir.npy");
}

// ---------------------------------------------------------------------------------------------
// rope

class CliRopeTest : public CliTest {
 protected:
  static constexpr int64_t kB = 2, kL = 5, kH = 3, kD = 8;
  std::vector<int64_t> shape() const { return {kB, kL, kH, kD}; }

  std::vector<float> expected(const RopeConfig& cfg, const std::vector<float>& x,
                              const Positions& pos, Direction dir = Direction::kForward) const {
    std::vector<float> y(x.size());
    const RopeFrequencies f = rope_frequencies(cfg, pos.max_position(kB, kL) + 1);
    apply_rope(f, cfg.style, View<const float, 4>::contiguous(x.data(), {kB, kL, kH, kD}),
               View<float, 4>::contiguous(y.data(), {kB, kL, kH, kD}), &pos, dir);
    return y;
  }
  RopeConfig config() const {
    RopeConfig cfg;
    cfg.head_dim = kD;
    return cfg;
  }
};

TEST_F(CliRopeTest, DefaultOffsetAndPositions) {
  const std::vector<float> x = random_floats(count(shape()), 1);
  const std::string in = write_f32("x.npy", shape(), x);

  Tensor t = run_ok("rope --in " + quote(in), path("y0.npy"));
  expect_tensor_eq(t, shape(), expected(config(), x, Positions::offset(0)));

  t = run_ok("rope --in " + quote(in) + " --offset 1000", path("y1.npy"));
  expect_tensor_eq(t, shape(), expected(config(), x, Positions::offset(1000)));

  const std::vector<int64_t> shared = {4, 9, 0, 131072, 1 << 20};
  const std::string ps = write_i64("ps.npy", {kL}, shared);
  t = run_ok("rope --in " + quote(in) + " --positions " + quote(ps), path("y2.npy"));
  expect_tensor_eq(t, shape(), expected(config(), x, Positions::shared(shared)));

  const std::vector<int64_t> rows = {0, 0, 1, 2, 3, 5, 6, 7, 8, 9};  // left padding, packed
  const std::string pr = write_i64("pr.npy", {kB, kL}, rows);
  t = run_ok("rope --in " + quote(in) + " --positions " + quote(pr), path("y3.npy"));
  expect_tensor_eq(t, shape(), expected(config(), x, Positions::per_row(rows, kB, kL)));
}

TEST_F(CliRopeTest, StyleRotaryDimBaseInverse) {
  const std::vector<float> x = random_floats(count(shape()), 2);
  const std::string in = write_f32("x.npy", shape(), x);
  RopeConfig cfg = config();
  cfg.style = RopeStyle::kInterleaved;
  cfg.rotary_dim = 4;
  cfg.base = 500000.0;
  Tensor t = run_ok(
      "rope --in " + quote(in) + " --style interleaved --rotary-dim 4 --base 500000 --offset 3",
      path("y.npy"));
  expect_tensor_eq(t, shape(), expected(cfg, x, Positions::offset(3)));

  t = run_ok("rope --in " + quote(in) + " --inverse --offset 3", path("yi.npy"));
  expect_tensor_eq(t, shape(), expected(config(), x, Positions::offset(3), Direction::kInverse));
}

TEST_F(CliRopeTest, AcceptsFloat64Input) {
  const std::vector<float> x = random_floats(count(shape()), 3);
  std::vector<double> x64(x.begin(), x.end());
  const std::string in = path("x64.npy");
  write_npy(in, Tensor::from_f64(shape(), x64));
  const Tensor t = run_ok("rope --in " + quote(in) + " --offset 2", path("y.npy"));
  expect_tensor_eq(t, shape(), expected(config(), x, Positions::offset(2)));
}

TEST_F(CliRopeTest, Errors) {
  const std::vector<float> x = random_floats(count(shape()), 4);
  const std::string in = write_f32("x.npy", shape(), x);
  const std::string ps = write_i64("ps.npy", {kL}, {0, 1, 2, 3, 4});
  expect_error("rope", "--in " + quote(in) + " --offset 2 --positions " + quote(ps), "--offset");
  expect_error("rope", "--in " + quote(in) + " --rotary-dim 3", "rotary");
  expect_error("rope", "--in " + quote(in) + " --rotary-dim 10", "rotary");
  expect_error("rope", "--in " + quote(in) + " --style sideways", "style");
  expect_error("rope", "--in " + quote(in) + " --offset -5", "");
  // Positions of the wrong length / rank / dtype.
  const std::string bad_len = write_i64("bad_len.npy", {kL + 1}, {0, 1, 2, 3, 4, 5});
  expect_error("rope", "--in " + quote(in) + " --positions " + quote(bad_len), "bad_len.npy");
  const std::string bad_f = write_f32("bad_f.npy", {kL}, {0, 1, 2, 3, 4});
  expect_error("rope", "--in " + quote(in) + " --positions " + quote(bad_f), "bad_f.npy");
  const std::string neg = write_i64("neg.npy", {kL}, {0, 1, -2, 3, 4});
  expect_error("rope", "--in " + quote(in) + " --positions " + quote(neg), "");
  // Wrong rank.
  const std::string r3 = write_f32("r3.npy", {kL, kH, kD}, random_floats(kL * kH * kD, 5));
  expect_error("rope", "--in " + quote(r3), "r3.npy");
  // Integer input.
  const std::string ints = write_i64("ints.npy", {1, 1, 1, 2}, {1, 2});
  expect_error("rope", "--in " + quote(ints), "ints.npy");
  // Non-finite input names the file.
  std::vector<float> nan_x = x;
  nan_x[17] = std::nanf("");
  const std::string nan_in = write_f32("nan.npy", shape(), nan_x);
  expect_error("rope", "--in " + quote(nan_in), "nan.npy");
  std::vector<float> inf_x = x;
  inf_x[3] = INFINITY;
  const std::string inf_in = write_f32("inf.npy", shape(), inf_x);
  expect_error("rope", "--in " + quote(inf_in), "inf.npy");
  // Missing and malformed files.
  expect_error("rope", "--in " + quote(path("missing.npy")), "missing.npy");
  {
    std::ofstream f(path("garbage.npy"), std::ios::binary);
    f << "this is not a numpy file \x01\x02\x03";
  }
  expect_error("rope", "--in " + quote(path("garbage.npy")), "garbage.npy");
  {
    // A valid header with truncated data.
    std::vector<unsigned char> bytes = encode_npy(Tensor::from_f32(shape(), x));
    bytes.resize(bytes.size() - 7);
    std::ofstream f(path("short.npy"), std::ios::binary);
    f.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  }
  expect_error("rope", "--in " + quote(path("short.npy")), "short.npy");
  // Missing --in.
  expect_error("rope", "", "--in");
}

// ---------------------------------------------------------------------------------------------
// alibi-slopes, t5-buckets, deberta-buckets

TEST_F(CliTest, AlibiSlopes) {
  for (int64_t heads : {1, 8, 12, 16, 40}) {
    const Tensor t = run_ok("alibi-slopes --heads " + std::to_string(heads),
                            path("s" + std::to_string(heads) + ".npy"));
    const std::vector<double> s = alibi_slopes(AlibiConfig{heads, 8.0});
    std::vector<float> want;
    for (double m : s) want.push_back(static_cast<float>(m));
    expect_tensor_eq(t, {heads}, want);
  }
  const Tensor t = run_ok("alibi-slopes --heads 6 --max-bias 16", path("mb.npy"));
  std::vector<float> want;
  for (double m : alibi_slopes(AlibiConfig{6, 16.0})) want.push_back(static_cast<float>(m));
  expect_tensor_eq(t, {6}, want);

  const Tensor t64 = run_ok("alibi-slopes --heads 12 --out-dtype float64", path("s64.npy"));
  ASSERT_EQ(t64.dtype, DType::kF64);
  EXPECT_EQ(t64.to_f64(), alibi_slopes(AlibiConfig{12, 8.0}));

  expect_error("alibi-slopes", "--heads 0", "heads");
  expect_error("alibi-slopes", "--heads -3", "heads");
  expect_error("alibi-slopes", "--heads 8 --max-bias 0", "bias");
  expect_error("alibi-slopes", "", "--heads");
}

TEST_F(CliTest, T5BucketsCausalVsBidirectional) {
  T5BucketConfig cfg;
  const Tensor bi = run_ok("t5-buckets --query-length 20 --key-length 300", path("bi.npy"));
  ASSERT_EQ(bi.dtype, DType::kI64);
  ASSERT_EQ(bi.shape, (std::vector<int64_t>{20, 300}));
  EXPECT_EQ(bi.to_i64(), t5_bucket_map(cfg, 20, 300));

  cfg.bidirectional = false;
  const Tensor ca = run_ok("t5-buckets --query-length 20 --key-length 300 --causal", path("c.npy"));
  EXPECT_EQ(ca.to_i64(), t5_bucket_map(cfg, 20, 300));
  EXPECT_NE(ca.to_i64(), bi.to_i64());

  T5BucketConfig small{16, 40, true};
  const Tensor s =
      run_ok("t5-buckets --query-length 9 --key-length 70 --num-buckets 16 --max-distance 40",
             path("s.npy"));
  EXPECT_EQ(s.to_i64(), t5_bucket_map(small, 9, 70));

  // Explicit positions.
  const std::string pq = write_i64("pq.npy", {3}, {100, 5, 0});
  const std::string pk = write_i64("pk.npy", {4}, {0, 50, 99, 400});
  const Tensor p = run_ok("t5-buckets --query-length 3 --key-length 4 --positions-q " + quote(pq) +
                              " --positions-k " + quote(pk),
                          path("p.npy"));
  const Positions ppq = Positions::shared({100, 5, 0}), ppk = Positions::shared({0, 50, 99, 400});
  EXPECT_EQ(p.to_i64(), t5_bucket_map(T5BucketConfig{}, 3, 4, &ppq, &ppk));

  expect_error("t5-buckets", "--query-length 4 --key-length 4 --num-buckets 1", "num_buckets");
  expect_error("t5-buckets", "--query-length -1 --key-length 4", "query-length");
  expect_error("t5-buckets", "--key-length 4", "--query-length");
}

TEST_F(CliTest, DebertaBuckets) {
  for (const auto& [args, buckets] : std::vector<std::pair<std::string, DebertaBuckets>>{
           {"", DebertaBuckets{}},
           {"--position-buckets 8 --max-relative-positions 64", DebertaBuckets{64, 8}},
           {"--max-relative-positions 3", DebertaBuckets{3, 0}}}) {
    const Tensor t =
        run_ok("deberta-buckets --query-length 7 --key-length 40 " + args, path("d.npy"));
    ASSERT_EQ(t.dtype, DType::kI64);
    ASSERT_EQ(t.shape, (std::vector<int64_t>{7, 40}));
    std::vector<int64_t> want;
    for (int64_t i = 0; i < 7; ++i) {
      for (int64_t j = 0; j < 40; ++j) want.push_back(deberta_c2p_index(33 + i, j, buckets));
    }
    EXPECT_EQ(t.to_i64(), want) << args;
  }
  expect_error("deberta-buckets", "--query-length 4 --key-length 4 --max-relative-positions 0",
               "max_relative_positions");
}

// ---------------------------------------------------------------------------------------------
// learned

TEST_F(CliTest, Learned) {
  const int64_t P = 16, B = 2, L = 5, D = 6;
  const std::vector<float> w = random_floats(P * D, 10);
  const std::vector<float> x = random_floats(B * L * D, 11);
  const std::string tn = write_f32("w.npy", {P, D}, w);
  const std::string ts =
      write_params("w.safetensors", {{"wpe.weight", Tensor::from_f32({P, D}, w)}});
  const std::string xn = write_f32("x.npy", {B, L, D}, x);
  auto want = [&](const Positions& pos) {
    std::vector<float> y = x;
    add_learned(View<const float, 2>::contiguous(w.data(), {P, D}),
                View<float, 3>::contiguous(y.data(), {B, L, D}), &pos);
    return y;
  };
  Tensor t = run_ok("learned --table " + quote(tn) + " --in " + quote(xn), path("y0.npy"));
  expect_tensor_eq(t, {B, L, D}, want(Positions::offset(0)));
  t = run_ok(
      "learned --table " + quote(ts) + " --name wpe.weight --in " + quote(xn) + " --offset 11",
      path("y1.npy"));
  expect_tensor_eq(t, {B, L, D}, want(Positions::offset(11)));
  const std::vector<int64_t> ids = {15, 0, 3, 3, 1, 2, 2, 2, 9, 8};
  const std::string pr = write_i64("pr.npy", {B, L}, ids);
  t = run_ok("learned --table " + quote(ts) + " --in " + quote(xn) + " --positions " + quote(pr),
             path("y2.npy"));
  expect_tensor_eq(t, {B, L, D}, want(Positions::per_row(ids, B, L)));

  // A learned table cannot extrapolate.
  expect_error("learned", "--table " + quote(tn) + " --in " + quote(xn) + " --offset 12", "");
  expect_error("learned", "--table " + quote(ts) + " --name nope --in " + quote(xn), "nope");
  const std::string bad = write_f32("bad.npy", {P, D + 1}, random_floats(P * (D + 1), 12));
  expect_error("learned", "--table " + quote(bad) + " --in " + quote(xn), "");
}

// ---------------------------------------------------------------------------------------------
// attention

class CliAttentionTest : public CliTest {
 protected:
  static constexpr int64_t kB = 2, kLq = 5, kLk = 7, kHq = 4, kHkv = 2, kD = 8;

  void SetUp() override {
    CliTest::SetUp();
    q_ = random_floats(kB * kLq * kHq * kD, 21);
    k_ = random_floats(kB * kLk * kHkv * kD, 22);
    v_ = random_floats(kB * kLk * kHkv * kD, 23);
    qp_ = write_f32("q.npy", {kB, kLq, kHq, kD}, q_);
    kp_ = write_f32("k.npy", {kB, kLk, kHkv, kD}, k_);
    vp_ = write_f32("v.npy", {kB, kLk, kHkv, kD}, v_);
  }

  std::string qkv() const {
    return "--q " + quote(qp_) + " --k " + quote(kp_) + " --v " + quote(vp_);
  }

  std::vector<float> expected(const PositionScheme& scheme, const AttentionOptions& opt = {},
                              const Positions* pq = nullptr, const Positions* pk = nullptr) const {
    std::vector<float> out(q_.size());
    attention(View<const float, 4>::contiguous(q_.data(), {kB, kLq, kHq, kD}),
              View<const float, 4>::contiguous(k_.data(), {kB, kLk, kHkv, kD}),
              View<const float, 4>::contiguous(v_.data(), {kB, kLk, kHkv, kD}), scheme, opt,
              View<float, 4>::contiguous(out.data(), {kB, kLq, kHq, kD}), pq, pk);
    return out;
  }

  void check(const std::string& args, const PositionScheme& scheme,
             const AttentionOptions& opt = {}, const Positions* pq = nullptr,
             const Positions* pk = nullptr) {
    SCOPED_TRACE(args);
    const Tensor t = run_ok("attention " + qkv() + " " + args, path("o.npy"));
    expect_tensor_eq(t, {kB, kLq, kHq, kD}, expected(scheme, opt, pq, pk));
  }

  std::vector<float> q_, k_, v_;
  std::string qp_, kp_, vp_;
};

TEST_F(CliAttentionTest, NoneAndOptions) {
  check("--scheme none", NoPositions{});
  AttentionOptions opt;
  opt.causal = true;
  opt.scale = 0.5;
  check("--scheme none --causal --scale 0.5", NoPositions{}, opt);
  AttentionOptions win;
  win.window = 2;
  win.causal = true;
  check("--scheme none --causal --window 2 --threads 1", NoPositions{}, win);
}

TEST_F(CliAttentionTest, Rope) {
  RopeConfig cfg;
  cfg.head_dim = kD;
  check("--scheme rope", Rope{rope_frequencies(cfg), RopeStyle::kHalf});
  cfg.rotary_dim = 4;
  cfg.base = 1e6;
  AttentionOptions opt;
  opt.causal = true;
  check("--scheme rope --rotary-dim 4 --base 1e6 --style interleaved --causal",
        Rope{rope_frequencies(cfg), RopeStyle::kInterleaved}, opt);
}

TEST_F(CliAttentionTest, RopeWithPositions) {
  RopeConfig cfg;
  cfg.head_dim = kD;
  const std::vector<int64_t> kpos = {0, 1, 2, 10, 11, 12, 13};
  const std::vector<int64_t> qrows = {13, 14, 15, 16, 17, 100, 101, 102, 103, 104};
  const std::string pk = write_i64("pk.npy", {kLk}, kpos);
  const std::string pq = write_i64("pq.npy", {kB, kLq}, qrows);
  const Positions ppk = Positions::shared(kpos), ppq = Positions::per_row(qrows, kB, kLq);
  check("--scheme rope --positions-q " + quote(pq) + " --positions-k " + quote(pk),
        Rope{rope_frequencies(cfg, 105), RopeStyle::kHalf}, {}, &ppq, &ppk);
}

TEST_F(CliAttentionTest, Alibi) {
  check("--scheme alibi", Alibi{});
  AttentionOptions opt;
  opt.causal = true;
  check("--scheme alibi --causal --max-bias 4", Alibi{{}, 4.0}, opt);
  const std::vector<float> slopes = {0.5f, 0.25f, 0.125f, 0.0625f};
  const std::string p =
      write_params("alibi.safetensors", {{"slopes", Tensor::from_f32({kHq}, slopes)}});
  check("--scheme alibi --params " + quote(p), Alibi{{0.5, 0.25, 0.125, 0.0625}, 8.0});
}

TEST_F(CliAttentionTest, T5) {
  const int64_t nb = 16;
  const std::vector<float> table = random_floats(nb * kHq, 30);
  const std::string p = write_params(
      "t5.safetensors", {{"relative_attention_bias", Tensor::from_f32({nb, kHq}, table)}});
  const auto view = View<const float, 2>::contiguous(table.data(), {nb, kHq});
  AttentionOptions opt;
  opt.scale = 1.0;
  check("--scheme t5 --scale 1 --params " + quote(p), T5Bias{view, 128, std::nullopt}, opt);
  opt.causal = true;
  check("--scheme t5 --scale 1 --causal --num-buckets 16 --max-distance 20 --params " + quote(p),
        T5Bias{view, 20, std::nullopt}, opt);
  // A float64 table is converted to float32.
  std::vector<double> t64(table.begin(), table.end());
  const std::string p64 = write_params(
      "t5_64.safetensors", {{"relative_attention_bias", Tensor::from_f64({nb, kHq}, t64)}});
  check("--scheme t5 --params " + quote(p64), T5Bias{view, 128, std::nullopt});
}

TEST_F(CliAttentionTest, Shaw) {
  const int64_t K = 3, rows = 2 * K + 1;
  const std::vector<float> rk = random_floats(rows * kD, 40), rv = random_floats(rows * kD, 41);
  const std::vector<float> rkh = random_floats(rows * kHq * kD, 42);
  const auto vk = View<const float, 2>::contiguous(rk.data(), {rows, kD});
  const auto vv = View<const float, 2>::contiguous(rv.data(), {rows, kD});
  const std::string shared = write_params(
      "shaw.safetensors",
      {{"rel_k", Tensor::from_f32({rows, kD}, rk)}, {"rel_v", Tensor::from_f32({rows, kD}, rv)}});
  check("--scheme shaw --params " + quote(shared), Shaw{shaw_table(vk), shaw_table(vv)});
  const std::string konly =
      write_params("shaw_k.safetensors", {{"rel_k", Tensor::from_f32({rows, kD}, rk)}});
  AttentionOptions opt;
  opt.causal = true;
  check("--scheme shaw --causal --params " + quote(konly), Shaw{shaw_table(vk), {}}, opt);
  const std::string per_head =
      write_params("shaw_h.safetensors", {{"rel_k", Tensor::from_f32({rows, kHq, kD}, rkh)},
                                          {"rel_v", Tensor::from_f32({rows, kD}, rv)}});
  // A per-head rel_k with a shared rel_v: the CLI broadcasts the shared table over the heads.
  View<const float, 3> rv_b = shaw_table(vv);
  rv_b.shape[1] = kHq;
  check("--scheme shaw --params " + quote(per_head),
        Shaw{View<const float, 3>::contiguous(rkh.data(), {rows, kHq, kD}), rv_b});
  const std::string both =
      write_params("shaw_hh.safetensors", {{"rel_k", Tensor::from_f32({rows, kHq, kD}, rkh)},
                                           {"rel_v", Tensor::from_f32({rows, kHq, kD}, rkh)}});
  check("--scheme shaw --params " + quote(both),
        Shaw{View<const float, 3>::contiguous(rkh.data(), {rows, kHq, kD}),
             View<const float, 3>::contiguous(rkh.data(), {rows, kHq, kD})});
}

TEST_F(CliAttentionTest, TransformerXL) {
  const int64_t dm = 10;
  const std::vector<float> u = random_floats(kHq * kD, 50), v = random_floats(kHq * kD, 51);
  const std::vector<float> r = random_floats(kHq * kD * dm, 52);
  const std::string p =
      write_params("xl.safetensors", {{"r_w_bias", Tensor::from_f32({kHq, kD}, u)},
                                      {"r_r_bias", Tensor::from_f32({kHq, kD}, v)},
                                      {"r_net", Tensor::from_f32({kHq * kD, dm}, r)}});
  const TransformerXL xl{View<const float, 2>::contiguous(u.data(), {kHq, kD}),
                         View<const float, 2>::contiguous(v.data(), {kHq, kD}),
                         View<const float, 2>::contiguous(r.data(), {kHq * kD, dm}), 1e4};
  check("--scheme xl --params " + quote(p), xl);
  AttentionOptions opt;
  opt.causal = true;
  TransformerXL xl2 = xl;
  xl2.base = 100.0;
  check("--scheme xl --causal --base 100 --params " + quote(p), xl2, opt);
}

TEST_F(CliAttentionTest, DeBERTa) {
  for (const auto& [args, buckets] : std::vector<std::pair<std::string, DebertaBuckets>>{
           {"--max-relative-positions 4", DebertaBuckets{4, 0}},
           {"--position-buckets 4 --max-relative-positions 16", DebertaBuckets{16, 4}},
           {"--max-relative-positions 6 --deberta-p2c paper --deberta-float64-log",
            DebertaBuckets{6, 0, true, DebertaP2c::kPaper}}}) {
    const int64_t rows = 2 * buckets.span();
    const std::vector<float> pk = random_floats(rows * kHq * kD, 60);
    const std::vector<float> pq = random_floats(rows * kHq * kD, 61);
    const std::string p =
        write_params("deb.safetensors", {{"pos_key", Tensor::from_f32({rows, kHq, kD}, pk)},
                                         {"pos_query", Tensor::from_f32({rows, kHq, kD}, pq)}});
    check("--scheme deberta " + args + " --params " + quote(p),
          DeBERTa{View<const float, 3>::contiguous(pk.data(), {rows, kHq, kD}),
                  View<const float, 3>::contiguous(pq.data(), {rows, kHq, kD}), buckets});
  }
}

TEST_F(CliAttentionTest, ReferenceMatchesFloatPath) {
  const Tensor f = run_ok("attention " + qkv() + " --scheme alibi --causal", path("f.npy"));
  const Tensor r =
      run_ok("attention " + qkv() + " --scheme alibi --causal --reference", path("r.npy"));
  const Tensor r64 =
      run_ok("attention " + qkv() + " --scheme alibi --causal --reference --out-dtype float64",
             path("r64.npy"));
  ASSERT_EQ(r.dtype, DType::kF32);
  ASSERT_EQ(r64.dtype, DType::kF64);
  ASSERT_EQ(r64.shape, (std::vector<int64_t>{kB, kLq, kHq, kD}));
  const std::vector<float> fv = f.to_f32(), rv = r.to_f32();
  const std::vector<double> rv64 = r64.to_f64();
  for (std::size_t i = 0; i < fv.size(); ++i) {
    EXPECT_NEAR(fv[i], rv64[i], 1e-5);
    EXPECT_EQ(rv[i], static_cast<float>(rv64[i]));
  }
}

TEST_F(CliAttentionTest, SettingFlagsAreCheckedByTheirDeclaredTypeAndRange) {
  // Every flag of the registry's settings, from its declaration alone: a value of the wrong
  // kind or outside its range or choices, and a flag of another scheme, exit 2 naming the flag.
  int checked = 0;
  for (const SchemeSettingUse& use : scheme_settings()) {
    const SchemeSettingInfo& info = use.setting;
    if (info.flag.empty()) continue;
    const std::string scheme = use.schemes.front();
    std::vector<std::string> bad;
    if (info.type == SettingType::kInt) {
      bad = {"2.5", "x", ""};
      if (info.min) bad.push_back(std::to_string(static_cast<int64_t>(*info.min) - 1));
      if (info.max) bad.push_back(std::to_string(static_cast<int64_t>(*info.max) + 1));
    } else if (info.type == SettingType::kFloat) {
      bad = {"x", "nan", "inf", ""};
      if (info.min) bad.push_back(info.min_exclusive ? "0" : "-1e300");
    } else if (info.type == SettingType::kChoice) {
      bad = {"nope", ""};
    }
    for (const std::string& v : bad) {
      expect_error("attention", qkv() + " --scheme " + scheme + " " + info.flag + " " + quote(v),
                   info.flag);
      ++checked;
    }
    // A scheme the setting does not apply to.
    for (const SchemeInfo& other : attention_schemes()) {
      if (std::find(use.schemes.begin(), use.schemes.end(), other.name) != use.schemes.end() ||
          !other.params.empty()) {
        continue;
      }
      const std::string value =
          info.type == SettingType::kBool
              ? ""
              : " " + (info.type == SettingType::kChoice ? info.choices.front() : std::string("1"));
      expect_error("attention", qkv() + " --scheme " + other.name + " " + info.flag + value,
                   info.flag + " does not apply to --scheme " + other.name);
      ++checked;
      break;
    }
  }
  EXPECT_GE(checked, 30);
}

TEST_F(CliAttentionTest, Errors) {
  // kv heads must divide q heads.
  const std::string k3 = write_f32("k3.npy", {kB, kLk, 3, kD}, random_floats(kB * kLk * 3 * kD, 1));
  const std::string v3 = write_f32("v3.npy", {kB, kLk, 3, kD}, random_floats(kB * kLk * 3 * kD, 2));
  expect_error("attention",
               "--q " + quote(qp_) + " --k " + quote(k3) + " --v " + quote(v3) + " --scheme none",
               "heads");
  // Wrong rank.
  const std::string q3 = write_f32("q3.npy", {kLq, kHq, kD}, random_floats(kLq * kHq * kD, 3));
  expect_error("attention",
               "--q " + quote(q3) + " --k " + quote(kp_) + " --v " + quote(vp_) + " --scheme none",
               "q3.npy");
  // Unknown scheme.
  expect_error("attention", qkv() + " --scheme sinusoidal", "scheme");
  // Missing --params and missing tensors.
  expect_error("attention", qkv() + " --scheme t5", "relative_attention_bias");
  const std::string empty =
      write_params("other.safetensors", {{"unrelated", Tensor::from_f32({2}, {1.0f, 2.0f})}});
  expect_error("attention", qkv() + " --scheme t5 --params " + quote(empty),
               "relative_attention_bias");
  expect_error("attention", qkv() + " --scheme shaw --params " + quote(empty), "rel_k");
  expect_error("attention", qkv() + " --scheme xl --params " + quote(empty), "r_w_bias");
  expect_error("attention", qkv() + " --scheme deberta --params " + quote(empty), "pos_key");
  // T5 --num-buckets must match the table.
  const std::string t5 = write_params(
      "t5.safetensors",
      {{"relative_attention_bias", Tensor::from_f32({8, kHq}, random_floats(8 * kHq, 4))}});
  expect_error("attention", qkv() + " --scheme t5 --num-buckets 32 --params " + quote(t5),
               "num-buckets");
  // T5 table for the wrong number of heads.
  const std::string t5h = write_params(
      "t5h.safetensors",
      {{"relative_attention_bias", Tensor::from_f32({8, 3}, random_floats(8 * 3, 5))}});
  expect_error("attention", qkv() + " --scheme t5 --params " + quote(t5h), "");
  // DeBERTa table rows must be 2K.
  const std::string deb = write_params(
      "deb.safetensors",
      {{"pos_key", Tensor::from_f32({10, kHq, kD}, random_floats(10 * kHq * kD, 6))},
       {"pos_query", Tensor::from_f32({10, kHq, kD}, random_floats(10 * kHq * kD, 7))}});
  expect_error("attention", qkv() + " --scheme deberta --params " + quote(deb), "pos_key");
  // Non-finite inputs name the file.
  std::vector<float> bad = k_;
  bad[5] = std::nanf("");
  const std::string kn = write_f32("k_nan.npy", {kB, kLk, kHkv, kD}, bad);
  expect_error("attention",
               "--q " + quote(qp_) + " --k " + quote(kn) + " --v " + quote(vp_) + " --scheme none",
               "k_nan.npy");
  // Malformed npy.
  {
    std::ofstream f(path("garbage.npy"), std::ios::binary);
    f << "\x93NUMPY garbage";
  }
  expect_error("attention",
               "--q " + quote(path("garbage.npy")) + " --k " + quote(kp_) + " --v " + quote(vp_) +
                   " --scheme none",
               "garbage.npy");
  // Malformed safetensors.
  {
    std::ofstream f(path("garbage.safetensors"), std::ios::binary);
    f << "\xff\xff\xff\xff\xff\xff\xff\x7f{}";
  }
  expect_error("attention", qkv() + " --scheme t5 --params " + quote(path("garbage.safetensors")),
               "garbage.safetensors");
  // Fully masked rows are an error unless allowed.
  const std::string pq = write_i64("pq.npy", {kLq}, {0, 1, 2, 3, 4});
  const std::string pk = write_i64("pk.npy", {kLk}, {3, 4, 5, 6, 7, 8, 9});
  expect_error(
      "attention",
      qkv() + " --scheme none --causal --positions-q " + quote(pq) + " --positions-k " + quote(pk),
      "");
  const Tensor t = run_ok("attention " + qkv() + " --scheme none --causal --allow-fully-masked " +
                              "--positions-q " + quote(pq) + " --positions-k " + quote(pk),
                          path("masked.npy"));
  EXPECT_EQ(t.to_f32()[0], 0.0f);
  // --out-dtype float64 needs --reference; bad option values.
  expect_error("attention", qkv() + " --scheme none --out-dtype float64", "reference");
  expect_error("attention", qkv() + " --scheme none --window 0", "window");
  expect_error("attention", qkv() + " --scheme rope --rotary-dim 5", "rotary");
  expect_error("attention", qkv() + " --scheme none --scale nope", "scale");
  expect_error("attention", qkv(), "--scheme");
}

// ---------------------------------------------------------------------------------------------
// check, demo

TEST_F(CliTest, CheckTable) {
  const RunResult r = run("check");
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  for (const char* col : {"property", "scheme", "measured", "expected", "result"}) {
    EXPECT_NE(r.out.find(col), std::string::npos) << col;
  }
  const std::vector<CheckResult> results = run_checks();
  for (const CheckResult& c : results) {
    EXPECT_NE(r.out.find(c.property), std::string::npos) << c.property;
  }
  EXPECT_NE(r.out.find("PASS"), std::string::npos);
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos);
}

TEST_F(CliTest, CheckJson) {
  const RunResult r = run("check --json --seed 7");
  EXPECT_EQ(r.status, 0) << r.err;
  CheckOptions opt;
  opt.seed = 7;
  const std::vector<CheckResult> results = run_checks(opt);
  std::istringstream is(r.out);
  std::string line;
  std::size_t n = 0;
  while (std::getline(is, line)) {
    ASSERT_LT(n, results.size());
    EXPECT_EQ(line.front(), '{');
    EXPECT_EQ(line.back(), '}');
    EXPECT_NE(line.find("\"pass\": true"), std::string::npos) << line;
    EXPECT_NE(line.find("\"scheme\": \"" + results[n].scheme + "\""), std::string::npos) << line;
    ++n;
  }
  EXPECT_EQ(n, results.size());
  const RunResult bad = run("check --seed -x");
  expect_error_result(bad, "check", "seed");
}

TEST_F(CliTest, Demo) {
  // The text demo (`posenc demo` itself draws figures: tests/test_plot.cc).
  const RunResult r = run("demo --text");
  EXPECT_EQ(r.status, 0) << r.err;
  for (const char* s : {"PASS", "Sinusoidal", "ALiBi", "T5", "RoPE", "0.00390625"}) {
    EXPECT_NE(r.out.find(s), std::string::npos) << s;
  }
}

}  // namespace
}  // namespace posenc
