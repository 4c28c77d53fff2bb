// tests/test_cli_grad.cc - `posenc attention-grad`, run as a subprocess.
//
// Inputs are written with posenc::write_npy / write_safetensors, the gradients read back with
// posenc::read_safetensors and compared with the library's own results on the same inputs:
// posenc::attention (with lse) + posenc::attention_backward for the float32 path, and
// ref::attention + ref::attention_backward under --reference. The CLI is a thin layer and both
// paths are deterministic for any thread count, so they must agree exactly. Error cases check
// the contract of every command: exit status 2, one stderr line "posenc attention-grad: error:
// <message>" naming the problem, and no output file left behind (an existing one untouched).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
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

template <std::size_t R>
std::array<int64_t, R> dims(const std::vector<int64_t>& shape) {
  std::array<int64_t, R> a{};
  std::copy(shape.begin(), shape.end(), a.begin());
  return a;
}

// A learned parameter whose gradient d<name> is expected: the shape of the library's gradient
// view (the scheme's view of the table) and the shape written (the tensor's in --params).
struct Param {
  std::string name;
  std::vector<int64_t> grad_shape;
  std::vector<int64_t> file_shape;
};

Param same(const std::string& name, std::vector<int64_t> shape) { return {name, shape, shape}; }

// Expected tensors by name: shape and values.
template <class T>
using Expected = std::map<std::string, std::pair<std::vector<int64_t>, std::vector<T>>>;

template <class T>
void set_grad(AttentionGradsOf<T>& g, const Param& p, std::vector<T>& buf) {
  const auto& s = p.grad_shape;
  if (p.name == "relative_attention_bias") {
    g.drelative_attention_bias = View<T, 2>::contiguous(buf.data(), dims<2>(s));
  } else if (p.name == "slopes") {
    g.dslopes = View<T, 1>::contiguous(buf.data(), dims<1>(s));
  } else if (p.name == "rel_k") {
    g.drel_k = View<T, 3>::contiguous(buf.data(), dims<3>(s));
  } else if (p.name == "rel_v") {
    g.drel_v = View<T, 3>::contiguous(buf.data(), dims<3>(s));
  } else if (p.name == "r_w_bias") {
    g.dr_w_bias = View<T, 2>::contiguous(buf.data(), dims<2>(s));
  } else if (p.name == "r_r_bias") {
    g.dr_r_bias = View<T, 2>::contiguous(buf.data(), dims<2>(s));
  } else if (p.name == "r_net") {
    g.dr_net = View<T, 2>::contiguous(buf.data(), dims<2>(s));
  } else if (p.name == "pos_key") {
    g.dpos_key = View<T, 3>::contiguous(buf.data(), dims<3>(s));
  } else if (p.name == "pos_query") {
    g.dpos_query = View<T, 3>::contiguous(buf.data(), dims<3>(s));
  } else {
    ADD_FAILURE() << "unknown parameter " << p.name;
  }
}

// The gradient of a shared [2K+1, D] Shaw table broadcast over H heads: the sum over the heads.
template <class T>
std::vector<T> sum_heads(const std::vector<T>& g, const std::vector<int64_t>& grad_shape) {
  const auto rows = static_cast<std::size_t>(grad_shape[0]);
  const auto heads = static_cast<std::size_t>(grad_shape[1]);
  const auto dim = static_cast<std::size_t>(grad_shape[2]);
  std::vector<T> out(rows * dim);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < dim; ++c) {
      double s = 0;
      for (std::size_t h = 0; h < heads; ++h)
        s += static_cast<double>(g[(r * heads + h) * dim + c]);
      out[r * dim + c] = static_cast<T>(s);
    }
  return out;
}

class CliGradTest : public cli_test::CliFixture {
 protected:
  void SetUp() override {
    CliFixture::SetUp();
    make_inputs(2, 5, 7, 4, 2, 8, 100);
  }

  // q [b, lq, hq, d], k and v [b, lk, hkv, d], dout like q: random, written to .npy files.
  void make_inputs(int64_t b, int64_t lq, int64_t lk, int64_t hq, int64_t hkv, int64_t d,
                   uint32_t seed) {
    q_shape_ = {b, lq, hq, d};
    kv_shape_ = {b, lk, hkv, d};
    q_ = random_floats(count(q_shape_), seed);
    k_ = random_floats(count(kv_shape_), seed + 1);
    v_ = random_floats(count(kv_shape_), seed + 2);
    dout_ = random_floats(count(q_shape_), seed + 3);
    qp_ = write_f32("q.npy", q_shape_, q_);
    kp_ = write_f32("k.npy", kv_shape_, k_);
    vp_ = write_f32("v.npy", kv_shape_, v_);
    dp_ = write_f32("do.npy", q_shape_, dout_);
  }

  int64_t heads_q() const { return q_shape_[2]; }
  int64_t head_dim() const { return q_shape_[3]; }

  std::string inputs() const {
    return "--q " + quote(qp_) + " --k " + quote(kp_) + " --v " + quote(vp_) + " --dout " +
           quote(dp_);
  }

  std::string write_params(const std::string& name,
                           const std::map<std::string, Tensor>& tensors) const {
    SafetensorsFile f;
    f.tensors = tensors;
    const std::string p = path(name);
    write_safetensors(p, f);
    return p;
  }

  // Runs `posenc attention-grad <inputs> <args> --out <out>`, expected to succeed.
  SafetensorsFile run_grad(const std::string& args, const std::string& out_name = "g.safetensors") {
    const std::string out = path(out_name);
    const RunResult r = run("attention-grad " + inputs() + " " + args + " --out " + quote(out));
    EXPECT_EQ(r.status, 0) << "posenc attention-grad " << args << "\nstderr: " << r.err;
    EXPECT_EQ(r.err, "");
    EXPECT_EQ(r.out, "");
    if (r.status != 0) return {};
    return read_safetensors(out);
  }

  // The library's gradients on the same inputs (T = float: posenc::attention +
  // attention_backward; T = double: the ref:: oracle), named as the CLI names them.
  template <class T>
  Expected<T> library(const PositionScheme& scheme, const AttentionOptions& opt,
                      const std::vector<Param>& params, bool with_lse = false,
                      const Positions* pq = nullptr, const Positions* pk = nullptr) const {
    const std::vector<T> q(q_.begin(), q_.end()), k(k_.begin(), k_.end()), v(v_.begin(), v_.end()),
        dout(dout_.begin(), dout_.end());
    const auto qd = dims<4>(q_shape_), kd = dims<4>(kv_shape_);
    const std::vector<int64_t> lse_shape = {q_shape_[0], q_shape_[2], q_shape_[1]};
    const auto qv = View<const T, 4>::contiguous(q.data(), qd);
    const auto kv = View<const T, 4>::contiguous(k.data(), kd);
    const auto vv = View<const T, 4>::contiguous(v.data(), kd);
    const auto dov = View<const T, 4>::contiguous(dout.data(), qd);
    std::vector<T> out(q.size()), lse(count(lse_shape));
    const auto out_v = View<T, 4>::contiguous(out.data(), qd);
    const auto lse_v = View<T, 3>::contiguous(lse.data(), dims<3>(lse_shape));
    if constexpr (std::is_same_v<T, double>) {
      ref::attention(qv, kv, vv, scheme, opt, out_v, lse_v, pq, pk);
    } else {
      attention(qv, kv, vv, scheme, opt, out_v, lse_v, pq, pk);
    }
    std::vector<T> dq(q.size()), dk(k.size()), dv(v.size());
    AttentionGradsOf<T> g;
    g.dq = View<T, 4>::contiguous(dq.data(), qd);
    g.dk = View<T, 4>::contiguous(dk.data(), kd);
    g.dv = View<T, 4>::contiguous(dv.data(), kd);
    std::vector<std::vector<T>> dp(params.size());
    for (std::size_t i = 0; i < params.size(); ++i) {
      dp[i].resize(count(params[i].grad_shape));
      set_grad(g, params[i], dp[i]);
    }
    if constexpr (std::is_same_v<T, double>) {
      ref::attention_backward(qv, kv, vv, out_v, lse_v, dov, scheme, opt, g, pq, pk);
    } else {
      attention_backward(qv, kv, vv, out_v, lse_v, dov, scheme, opt, g, pq, pk);
    }
    Expected<T> e;
    e["dq"] = {q_shape_, dq};
    e["dk"] = {kv_shape_, dk};
    e["dv"] = {kv_shape_, dv};
    for (std::size_t i = 0; i < params.size(); ++i) {
      const Param& p = params[i];
      e["d" + p.name] = {p.file_shape, count(p.file_shape) == dp[i].size()
                                           ? dp[i]
                                           : sum_heads(dp[i], p.grad_shape)};
    }
    if (with_lse) e["lse"] = {lse_shape, lse};
    return e;
  }

  // `f` holds exactly the tensors of `want`, of `dtype`, with equal shapes and values.
  template <class T>
  static void expect_equal(const SafetensorsFile& f, const Expected<T>& want, DType dtype) {
    std::set<std::string> got_names, want_names;
    for (const auto& [name, t] : f.tensors) got_names.insert(name);
    for (const auto& [name, t] : want) want_names.insert(name);
    EXPECT_EQ(got_names, want_names);
    for (const auto& [name, sv] : want) {
      SCOPED_TRACE(name);
      const auto it = f.tensors.find(name);
      ASSERT_NE(it, f.tensors.end());
      const Tensor& t = it->second;
      ASSERT_EQ(t.dtype, dtype);
      ASSERT_EQ(t.shape, sv.first);
      if (dtype == DType::kF64) {
        const std::vector<double> got = t.to_f64();
        ASSERT_EQ(got.size(), sv.second.size());
        for (std::size_t i = 0; i < got.size(); ++i) {
          ASSERT_EQ(got[i], static_cast<double>(sv.second[i])) << "element " << i;
        }
      } else {
        const std::vector<float> got = t.to_f32();
        ASSERT_EQ(got.size(), sv.second.size());
        for (std::size_t i = 0; i < got.size(); ++i) {
          ASSERT_EQ(got[i], static_cast<float>(sv.second[i])) << "element " << i;
        }
      }
    }
  }

  // The float32 path and the --reference path of `args` against the library.
  void check(const std::string& args, const PositionScheme& scheme,
             const AttentionOptions& opt = {}, const std::vector<Param>& params = {},
             const Positions* pq = nullptr, const Positions* pk = nullptr) {
    SCOPED_TRACE(args);
    const SafetensorsFile f = run_grad(args);
    expect_equal(f, library<float>(scheme, opt, params, false, pq, pk), DType::kF32);
    auto meta = f.metadata.find("scheme");
    ASSERT_NE(meta, f.metadata.end());
    EXPECT_EQ(meta->second, scheme_name(scheme));
    const SafetensorsFile r = run_grad(args + " --reference", "r.safetensors");
    expect_equal(r, library<double>(scheme, opt, params, false, pq, pk), DType::kF64);
  }

  // Runs a command expected to fail with a usage/input error: status 2, one stderr line
  // "posenc attention-grad: error: ..." containing `needle`, and no output file afterwards.
  void expect_error(const std::string& args, const std::string& needle) const {
    SCOPED_TRACE(args);
    const std::string out = path("error_out.safetensors");
    fs::remove(out);
    const RunResult r = run("attention-grad " + args + " --out " + quote(out));
    EXPECT_EQ(r.status, 2) << "stderr: " << r.err;
    ASSERT_FALSE(r.err.empty());
    EXPECT_EQ(r.err.back(), '\n');
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "stderr: " << r.err;
    EXPECT_EQ(r.err.rfind("posenc attention-grad: error: ", 0), 0u) << "stderr: " << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos)
        << "stderr does not name '" << needle << "': " << r.err;
    EXPECT_EQ(r.out, "");
    EXPECT_FALSE(fs::exists(out)) << "output left behind";
    // An existing output is left untouched.
    {
      std::ofstream f(out, std::ios::binary);
      f << "precious";
    }
    const RunResult r2 = run("attention-grad " + args + " --out " + quote(out));
    EXPECT_EQ(r2.status, 2);
    EXPECT_EQ(read_text(out), "precious") << "existing output modified on error";
    fs::remove(out);
    // No temporary files left in the output folder either.
    for (const auto& e : fs::directory_iterator(dir_)) {
      const std::string n = e.path().filename().string();
      EXPECT_EQ(n.find("error_out"), std::string::npos) << "leftover " << n;
    }
  }

  std::vector<int64_t> q_shape_, kv_shape_;
  std::vector<float> q_, k_, v_, dout_;
  std::string qp_, kp_, vp_, dp_;
};

// ---------------------------------------------------------------------------------------------
// Every scheme, float32 and --reference, against the library.

TEST_F(CliGradTest, Help) {
  RunResult r = run("attention-grad --help");
  EXPECT_EQ(r.status, 0) << r.err;
  for (const char* flag : {"--dout", "--lse", "--scheme", "--params", "--reference", "--threads",
                           "--positions-q", "--config", "--out-dtype"}) {
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag;
  }
  r = run("--help");
  EXPECT_NE(r.out.find("attention-grad"), std::string::npos);
}

TEST_F(CliGradTest, None) {
  check("--scheme none", NoPositions{});
  AttentionOptions opt;
  opt.causal = true;
  opt.scale = 0.5;
  check("--scheme none --causal --scale 0.5", NoPositions{}, opt);
  AttentionOptions win;
  win.causal = true;
  win.window = 3;
  check("--scheme none --causal --window 3", NoPositions{}, win);
}

TEST_F(CliGradTest, Rope) {
  RopeConfig cfg;
  cfg.head_dim = head_dim();
  check("--scheme rope", Rope{rope_frequencies(cfg), RopeStyle::kHalf});
  cfg.rotary_dim = 4;
  cfg.base = 5e5;
  AttentionOptions opt;
  opt.causal = true;
  check("--scheme rope --rotary-dim 4 --base 5e5 --style interleaved --causal",
        Rope{rope_frequencies(cfg), RopeStyle::kInterleaved}, opt);
}

TEST_F(CliGradTest, AlibiComputedSlopes) {
  // Slopes computed from --max-bias are not a given parameter: no dslopes.
  check("--scheme alibi", Alibi{});
  AttentionOptions opt;
  opt.causal = true;
  check("--scheme alibi --causal --max-bias 4", Alibi{{}, 4.0}, opt);
}

TEST_F(CliGradTest, AlibiGivenSlopes) {
  const std::vector<float> slopes = {0.5f, 0.25f, 0.125f, 0.0625f};
  const std::string p =
      write_params("alibi.safetensors", {{"slopes", Tensor::from_f32({heads_q()}, slopes)}});
  const std::vector<Param> params = {same("slopes", {heads_q()})};
  check("--scheme alibi --params " + quote(p), Alibi{{0.5, 0.25, 0.125, 0.0625}, 8.0}, {}, params);
  AttentionOptions opt;
  opt.causal = true;
  check("--scheme alibi --causal --params " + quote(p), Alibi{{0.5, 0.25, 0.125, 0.0625}, 8.0}, opt,
        params);
}

TEST_F(CliGradTest, T5) {
  const int64_t nb = 16;
  const std::vector<float> table = random_floats(nb * heads_q(), 30);
  const std::string p = write_params(
      "t5.safetensors", {{"relative_attention_bias", Tensor::from_f32({nb, heads_q()}, table)}});
  const auto view = View<const float, 2>::contiguous(table.data(), {nb, heads_q()});
  const std::vector<Param> params = {same("relative_attention_bias", {nb, heads_q()})};
  AttentionOptions opt;
  opt.scale = 1.0;
  check("--scheme t5 --scale 1 --params " + quote(p), T5Bias{view, 128, std::nullopt}, opt, params);
  opt.causal = true;
  check("--scheme t5 --scale 1 --causal --max-distance 20 --params " + quote(p),
        T5Bias{view, 20, std::nullopt}, opt, params);
}

TEST_F(CliGradTest, Shaw) {
  const int64_t K = 3, rows = 2 * K + 1, H = heads_q(), D = head_dim();
  const std::vector<float> rk = random_floats(rows * D, 40), rv = random_floats(rows * D, 41);
  const std::vector<float> rkh = random_floats(rows * H * D, 42);
  const std::vector<float> rvh = random_floats(rows * H * D, 43);
  const auto vk = View<const float, 2>::contiguous(rk.data(), {rows, D});
  const auto vv = View<const float, 2>::contiguous(rv.data(), {rows, D});
  const auto vkh = View<const float, 3>::contiguous(rkh.data(), {rows, H, D});
  const auto vvh = View<const float, 3>::contiguous(rvh.data(), {rows, H, D});
  {
    // Shared tables [2K+1, D]: gradients of that shape.
    const std::string p = write_params(
        "shaw.safetensors",
        {{"rel_k", Tensor::from_f32({rows, D}, rk)}, {"rel_v", Tensor::from_f32({rows, D}, rv)}});
    check("--scheme shaw --params " + quote(p), Shaw{shaw_table(vk), shaw_table(vv)}, {},
          {{"rel_k", {rows, 1, D}, {rows, D}}, {"rel_v", {rows, 1, D}, {rows, D}}});
  }
  {
    // rel_k only: no drel_v.
    const std::string p =
        write_params("shaw_k.safetensors", {{"rel_k", Tensor::from_f32({rows, D}, rk)}});
    AttentionOptions opt;
    opt.causal = true;
    check("--scheme shaw --causal --params " + quote(p), Shaw{shaw_table(vk), {}}, opt,
          {{"rel_k", {rows, 1, D}, {rows, D}}});
  }
  {
    // Per-head tables [2K+1, H, D].
    const std::string p =
        write_params("shaw_hh.safetensors", {{"rel_k", Tensor::from_f32({rows, H, D}, rkh)},
                                             {"rel_v", Tensor::from_f32({rows, H, D}, rvh)}});
    check("--scheme shaw --params " + quote(p), Shaw{vkh, vvh}, {},
          {same("rel_k", {rows, H, D}), same("rel_v", {rows, H, D})});
  }
  {
    // A shared rel_k with a per-head rel_v: the CLI broadcasts rel_k over the heads, and its
    // gradient is the sum of the per-head gradients, written as [2K+1, D].
    const std::string p =
        write_params("shaw_kh.safetensors", {{"rel_k", Tensor::from_f32({rows, D}, rk)},
                                             {"rel_v", Tensor::from_f32({rows, H, D}, rvh)}});
    View<const float, 3> rk_b = shaw_table(vk);
    rk_b.shape[1] = H;
    check("--scheme shaw --params " + quote(p), Shaw{rk_b, vvh}, {},
          {{"rel_k", {rows, H, D}, {rows, D}}, same("rel_v", {rows, H, D})});
    // The summed gradient is the derivative with respect to the shared table: central
    // differences of loss = sum(dout * out) through the float64 oracle.
    const SafetensorsFile r = run_grad("--scheme shaw --reference --params " + quote(p), "fd.st");
    ASSERT_TRUE(r.tensors.count("drel_k"));
    const std::vector<double> drel_k = r.tensors.at("drel_k").to_f64();
    const std::vector<double> q(q_.begin(), q_.end()), k(k_.begin(), k_.end()),
        v(v_.begin(), v_.end());
    auto loss = [&](const std::vector<float>& table) {
      View<const float, 3> t =
          shaw_table(View<const float, 2>::contiguous(table.data(), {rows, D}));
      t.shape[1] = H;
      std::vector<double> out(q.size());
      ref::attention(View<const double, 4>::contiguous(q.data(), dims<4>(q_shape_)),
                     View<const double, 4>::contiguous(k.data(), dims<4>(kv_shape_)),
                     View<const double, 4>::contiguous(v.data(), dims<4>(kv_shape_)), Shaw{t, vvh},
                     {}, View<double, 4>::contiguous(out.data(), dims<4>(q_shape_)));
      double l = 0;
      for (std::size_t i = 0; i < out.size(); ++i) l += static_cast<double>(dout_[i]) * out[i];
      return l;
    };
    for (const std::size_t e : {std::size_t{0}, std::size_t{3 * 8 + 5}, std::size_t{6 * 8 + 7}}) {
      std::vector<float> plus = rk, minus = rk;
      plus[e] += 1e-2f;
      minus[e] -= 1e-2f;
      const double h = static_cast<double>(plus[e]) - static_cast<double>(minus[e]);
      EXPECT_NEAR((loss(plus) - loss(minus)) / h, drel_k[e], 1e-4) << "rel_k element " << e;
    }
  }
}

TEST_F(CliGradTest, TransformerXL) {
  const int64_t dm = 10, H = heads_q(), D = head_dim();
  const std::vector<float> u = random_floats(H * D, 50), v = random_floats(H * D, 51);
  const std::vector<float> r = random_floats(H * D * dm, 52);
  const std::string p =
      write_params("xl.safetensors", {{"r_w_bias", Tensor::from_f32({H, D}, u)},
                                      {"r_r_bias", Tensor::from_f32({H, D}, v)},
                                      {"r_net", Tensor::from_f32({H * D, dm}, r)}});
  const TransformerXL xl{View<const float, 2>::contiguous(u.data(), {H, D}),
                         View<const float, 2>::contiguous(v.data(), {H, D}),
                         View<const float, 2>::contiguous(r.data(), {H * D, dm}), 1e4};
  const std::vector<Param> params = {same("r_w_bias", {H, D}), same("r_r_bias", {H, D}),
                                     same("r_net", {H * D, dm})};
  check("--scheme xl --params " + quote(p), xl, {}, params);
  AttentionOptions opt;
  opt.causal = true;
  TransformerXL xl2 = xl;
  xl2.base = 100.0;
  check("--scheme xl --causal --base 100 --params " + quote(p), xl2, opt, params);
}

TEST_F(CliGradTest, DeBERTa) {
  const int64_t H = heads_q(), D = head_dim();
  for (const auto& [args, buckets] : std::vector<std::pair<std::string, DebertaBuckets>>{
           {"--max-relative-positions 4", DebertaBuckets{4, 0}},
           {"--position-buckets 4 --max-relative-positions 16 --deberta-p2c model",
            DebertaBuckets{16, 4, false, DebertaP2c::kModel}}}) {
    const int64_t rows = 2 * buckets.span();
    const std::vector<float> pk = random_floats(rows * H * D, 60);
    const std::vector<float> pq = random_floats(rows * H * D, 61);
    const std::string p =
        write_params("deb.safetensors", {{"pos_key", Tensor::from_f32({rows, H, D}, pk)},
                                         {"pos_query", Tensor::from_f32({rows, H, D}, pq)}});
    check("--scheme deberta " + args + " --params " + quote(p),
          DeBERTa{View<const float, 3>::contiguous(pk.data(), {rows, H, D}),
                  View<const float, 3>::contiguous(pq.data(), {rows, H, D}), buckets},
          {}, {same("pos_key", {rows, H, D}), same("pos_query", {rows, H, D})});
  }
}

// ---------------------------------------------------------------------------------------------
// Outputs and options.

TEST_F(CliGradTest, ReferenceDtypes) {
  // --reference writes float64 (the oracle at the files' precision); --out-dtype float32 rounds.
  const SafetensorsFile r = run_grad("--scheme alibi --causal --reference --lse");
  expect_equal(r, library<double>(Alibi{}, {.causal = true}, {}, true), DType::kF64);
  const SafetensorsFile r32 =
      run_grad("--scheme alibi --causal --reference --lse --out-dtype float32", "r32.safetensors");
  expect_equal(r32, library<double>(Alibi{}, {.causal = true}, {}, true), DType::kF32);
  const SafetensorsFile r64 =
      run_grad("--scheme alibi --causal --reference --lse --out-dtype float64", "r64.safetensors");
  expect_equal(r64, library<double>(Alibi{}, {.causal = true}, {}, true), DType::kF64);
  // The float32 path is close to the oracle.
  const SafetensorsFile f = run_grad("--scheme alibi --causal", "f.safetensors");
  for (const char* name : {"dq", "dk", "dv"}) {
    const std::vector<float> fv = f.tensors.at(name).to_f32();
    const std::vector<double> rv = r.tensors.at(name).to_f64();
    ASSERT_EQ(fv.size(), rv.size());
    for (std::size_t i = 0; i < fv.size(); ++i) EXPECT_NEAR(fv[i], rv[i], 1e-5) << name << i;
  }
}

TEST_F(CliGradTest, ReferenceKeepsFloat64Inputs) {
  // A float64 q file: the float32 path rounds it, the oracle uses it as it is.
  std::vector<double> q64(q_.size());
  // Perturbed below half a float32 ulp (|q| > 0.25: ulp >= 3e-8), so float32 rounds back to q_.
  for (std::size_t i = 0; i < q64.size(); ++i) {
    q64[i] = q_[i];
    if (std::abs(q_[i]) > 0.25f) q64[i] += 1e-9 * static_cast<double>(1 + i % 7);
  }
  write_npy(qp_, Tensor::from_f64(q_shape_, q64));
  const SafetensorsFile r = run_grad("--scheme none --reference");
  const SafetensorsFile f = run_grad("--scheme none", "f.safetensors");
  // The float32 path sees q rounded to float32, i.e. q_ again.
  expect_equal(f, library<float>(NoPositions{}, {}, {}), DType::kF32);
  const std::vector<double> dk = r.tensors.at("dk").to_f64();
  const Expected<double> want = library<double>(NoPositions{}, {}, {});
  double diff = 0;
  for (std::size_t i = 0; i < dk.size(); ++i) {
    diff = std::max(diff, std::abs(dk[i] - want.at("dk").second[i]));
  }
  EXPECT_GT(diff, 0.0) << "--reference must read float64 inputs at their precision";
  EXPECT_LT(diff, 1e-6);
}

TEST_F(CliGradTest, Lse) {
  const SafetensorsFile f = run_grad("--scheme rope --causal --lse");
  ASSERT_TRUE(f.tensors.count("lse"));
  EXPECT_EQ(f.tensors.at("lse").shape,
            (std::vector<int64_t>{q_shape_[0], q_shape_[2], q_shape_[1]}));
  RopeConfig cfg;
  cfg.head_dim = head_dim();
  const Rope rope{rope_frequencies(cfg), RopeStyle::kHalf};
  expect_equal(f, library<float>(rope, {.causal = true}, {}, true), DType::kF32);
  const SafetensorsFile r = run_grad("--scheme rope --causal --lse --reference", "r.safetensors");
  expect_equal(r, library<double>(rope, {.causal = true}, {}, true), DType::kF64);
  // Without --lse there is none.
  const SafetensorsFile n = run_grad("--scheme rope --causal", "n.safetensors");
  EXPECT_FALSE(n.tensors.count("lse"));
}

TEST_F(CliGradTest, FullyMaskedRows) {
  // Keys at 10..16; query 0 of batch row 0 at position 3, before every key (causal): no visible
  // key. Its lse is -inf and it contributes nothing.
  const std::vector<int64_t> kpos = {10, 11, 12, 13, 14, 15, 16};
  const std::vector<int64_t> qrows = {3, 13, 14, 15, 16, 12, 13, 14, 15, 16};
  const std::string pq = write_i64("pq.npy", {2, 5}, qrows);
  const std::string pk = write_i64("pk.npy", {7}, kpos);
  const Positions ppq = Positions::per_row(qrows, 2, 5), ppk = Positions::shared(kpos);
  const std::string pos = " --positions-q " + quote(pq) + " --positions-k " + quote(pk);
  const std::string args = "--scheme none --causal --allow-fully-masked --lse" + pos;
  AttentionOptions opt;
  opt.causal = true;
  opt.allow_fully_masked = true;
  const SafetensorsFile f = run_grad(args);
  expect_equal(f, library<float>(NoPositions{}, opt, {}, true, &ppq, &ppk), DType::kF32);
  const std::vector<float> lse = f.tensors.at("lse").to_f32();
  EXPECT_EQ(lse[0], -std::numeric_limits<float>::infinity());  // [b 0, h 0, i 0]
  const std::vector<float> dq = f.tensors.at("dq").to_f32();
  for (int64_t c = 0; c < head_dim(); ++c) EXPECT_EQ(dq[static_cast<std::size_t>(c)], 0.0f);
  const SafetensorsFile r = run_grad(args + " --reference", "r.safetensors");
  expect_equal(r, library<double>(NoPositions{}, opt, {}, true, &ppq, &ppk), DType::kF64);
  // Without --allow-fully-masked: an error.
  expect_error(inputs() + " --scheme none --causal" + pos, "no key");
}

TEST_F(CliGradTest, ThreadsBitIdentical) {
  const int64_t nb = 8;
  const std::vector<float> table = random_floats(nb * 6, 31);
  make_inputs(2, 33, 41, 6, 3, 16, 200);
  const std::string p = write_params(
      "t5.safetensors", {{"relative_attention_bias", Tensor::from_f32({nb, 6}, table)}});
  const T5Bias t5{View<const float, 2>::contiguous(table.data(), {nb, 6}), 128, std::nullopt};
  const Expected<float> want =
      library<float>(t5, {.causal = true}, {same("relative_attention_bias", {nb, 6})}, true);
  std::string first;
  for (int threads : {1, 2, 3, 0}) {
    SCOPED_TRACE(threads);
    const std::string name = "t" + std::to_string(threads) + ".safetensors";
    const SafetensorsFile f = run_grad(
        "--scheme t5 --causal --lse --params " + quote(p) + " --threads " + std::to_string(threads),
        name);
    expect_equal(f, want, DType::kF32);
    const std::string bytes = read_text(path(name));
    if (first.empty()) first = bytes;
    EXPECT_EQ(bytes, first) << "output differs with --threads " << threads;
  }
}

TEST_F(CliGradTest, GqaAndMqa) {
  for (int64_t hkv : {1, 2, 4}) {
    SCOPED_TRACE(hkv);
    make_inputs(1, 6, 9, 4, hkv, 8, 300 + static_cast<uint32_t>(hkv));
    const SafetensorsFile f = run_grad("--scheme alibi --causal");
    ASSERT_TRUE(f.tensors.count("dk"));
    EXPECT_EQ(f.tensors.at("dk").shape, (std::vector<int64_t>{1, 9, hkv, 8}));
    EXPECT_EQ(f.tensors.at("dv").shape, (std::vector<int64_t>{1, 9, hkv, 8}));
    EXPECT_EQ(f.tensors.at("dq").shape, (std::vector<int64_t>{1, 6, 4, 8}));
    expect_equal(f, library<float>(Alibi{}, {.causal = true}, {}), DType::kF32);
    const SafetensorsFile r = run_grad("--scheme alibi --causal --reference", "r.safetensors");
    expect_equal(r, library<double>(Alibi{}, {.causal = true}, {}), DType::kF64);
  }
}

TEST_F(CliGradTest, Causal) {
  // Lq < Lk: the queries are the last Lq tokens (KV-cache convention); and Lq == Lk.
  AttentionOptions opt;
  opt.causal = true;
  check("--scheme none --causal", NoPositions{}, opt);
  make_inputs(2, 7, 7, 2, 2, 4, 400);
  check("--scheme none --causal", NoPositions{}, opt);
  // Causal and bidirectional differ.
  const SafetensorsFile c = run_grad("--scheme none --causal", "c.safetensors");
  const SafetensorsFile b = run_grad("--scheme none", "b.safetensors");
  EXPECT_NE(c.tensors.at("dk").to_f32(), b.tensors.at("dk").to_f32());
}

TEST_F(CliGradTest, ExplicitPositions) {
  RopeConfig cfg;
  cfg.head_dim = head_dim();
  const std::vector<int64_t> kpos = {0, 1, 2, 10, 11, 12, 13};
  const std::vector<int64_t> qrows = {13, 14, 15, 16, 17, 100, 101, 102, 103, 104};
  const std::string pk = write_i64("pk.npy", {7}, kpos);
  const std::string pq = write_i64("pq.npy", {2, 5}, qrows);
  const Positions ppk = Positions::shared(kpos), ppq = Positions::per_row(qrows, 2, 5);
  const std::string pos = " --positions-q " + quote(pq) + " --positions-k " + quote(pk);
  check("--scheme rope" + pos, Rope{rope_frequencies(cfg, 105), RopeStyle::kHalf}, {}, {}, &ppq,
        &ppk);
  AttentionOptions opt;
  opt.causal = true;
  check("--scheme alibi --causal" + pos, Alibi{}, opt, {}, &ppq, &ppk);
  // T5 at explicit positions, with its table gradient.
  const std::vector<float> table = random_floats(8 * heads_q(), 32);
  const std::string p = write_params(
      "t5.safetensors", {{"relative_attention_bias", Tensor::from_f32({8, heads_q()}, table)}});
  check("--scheme t5 --causal --params " + quote(p) + pos,
        T5Bias{View<const float, 2>::contiguous(table.data(), {8, heads_q()}), 128, std::nullopt},
        opt, {same("relative_attention_bias", {8, heads_q()})}, &ppq, &ppk);
}

TEST_F(CliGradTest, ModelConfig) {
  // --config works as for `posenc attention`: T5-base gives the bucketing and scale 1.
  const std::string config =
      (fs::path(__FILE__).parent_path() / "configs" / "t5-base.json").string();
  const ModelConfig m = read_model_config(config);
  make_inputs(1, 4, 6, 12, 12, 64, 500);
  const int64_t nb = m.t5.num_buckets;
  const std::vector<float> table = random_floats(nb * 12, 33);
  const std::string p = write_params(
      "t5.safetensors", {{"relative_attention_bias", Tensor::from_f32({nb, 12}, table)}});
  AttentionOptions opt;
  opt.scale = 1.0;
  check("--config " + quote(config) + " --params " + quote(p),
        T5Bias{View<const float, 2>::contiguous(table.data(), {nb, 12}), m.t5.max_distance,
               std::nullopt},
        opt, {same("relative_attention_bias", {nb, 12})});
}

// ---------------------------------------------------------------------------------------------
// Errors: status 2, one stderr line, no output.

TEST_F(CliGradTest, MissingDout) {
  expect_error("--q " + quote(qp_) + " --k " + quote(kp_) + " --v " + quote(vp_) + " --scheme none",
               "--dout");
}

TEST_F(CliGradTest, DoutShape) {
  const std::string qkv = "--q " + quote(qp_) + " --k " + quote(kp_) + " --v " + quote(vp_);
  // dout with k's shape instead of q's.
  expect_error(qkv + " --dout " + quote(kp_) + " --scheme none", "must have the shape of q");
  const std::string d5 = write_f32("d5.npy", {2, 5, 4, 7}, random_floats(2 * 5 * 4 * 7, 3));
  expect_error(qkv + " --dout " + quote(d5) + " --scheme none", "d5.npy");
  const std::string d3 = write_f32("d3.npy", {2, 5, 32}, random_floats(2 * 5 * 32, 4));
  expect_error(qkv + " --dout " + quote(d3) + " --scheme none", "expected rank 4");
  std::vector<float> bad = dout_;
  bad[3] = std::numeric_limits<float>::quiet_NaN();
  const std::string dn = write_f32("dn.npy", q_shape_, bad);
  expect_error(qkv + " --dout " + quote(dn) + " --scheme none", "non-finite");
}

TEST_F(CliGradTest, MalformedNpy) {
  const std::string junk = path("junk.npy");
  {
    std::ofstream f(junk, std::ios::binary);
    f << "\x93NUMPY garbage";
  }
  expect_error("--q " + quote(junk) + " --k " + quote(kp_) + " --v " + quote(vp_) + " --dout " +
                   quote(dp_) + " --scheme none",
               "junk.npy");
  expect_error("--q " + quote(qp_) + " --k " + quote(kp_) + " --v " + quote(vp_) + " --dout " +
                   quote(junk) + " --scheme none",
               "junk.npy");
  expect_error("--q " + quote(qp_) + " --k " + quote(kp_) + " --v " + quote(vp_) + " --dout " +
                   quote(path("absent.npy")) + " --scheme none",
               "absent.npy");
}

TEST_F(CliGradTest, UnknownScheme) {
  expect_error(inputs() + " --scheme sinusoidal", "--scheme");
  expect_error(inputs(), "--scheme is required");
}

TEST_F(CliGradTest, ParamsMissingTensor) {
  const std::string other =
      write_params("other.safetensors", {{"unrelated", Tensor::from_f32({2}, {1.0f, 2.0f})}});
  expect_error(inputs() + " --scheme t5 --params " + quote(other), "relative_attention_bias");
  expect_error(inputs() + " --scheme t5", "--params");
  expect_error(inputs() + " --scheme shaw --params " + quote(other), "rel_k");
  const int64_t H = heads_q(), D = head_dim();
  const std::string xl = write_params(
      "xl.safetensors", {{"r_w_bias", Tensor::from_f32({H, D}, random_floats(H * D, 1))},
                         {"r_r_bias", Tensor::from_f32({H, D}, random_floats(H * D, 2))}});
  expect_error(inputs() + " --scheme xl --params " + quote(xl), "r_net");
  const std::string deb = write_params(
      "deb.safetensors", {{"pos_key", Tensor::from_f32({8, H, D}, random_floats(8 * H * D, 3))}});
  expect_error(inputs() + " --scheme deberta --max-relative-positions 4 --params " + quote(deb),
               "pos_query");
  // ALiBi slopes of the wrong length.
  const std::string slopes =
      write_params("slopes.safetensors", {{"slopes", Tensor::from_f32({3}, {0.5f, 0.25f, 0.1f})}});
  expect_error(inputs() + " --scheme alibi --params " + quote(slopes), "slopes");
}

TEST_F(CliGradTest, OtherUsageErrors) {
  expect_error(inputs() + " --scheme none --out-dtype float64", "--reference");
  expect_error(inputs() + " --scheme none --threads -1", "--threads");
  expect_error(inputs() + " --scheme none --bogus", "--bogus");
  // Missing --out.
  const RunResult r = run("attention-grad " + inputs() + " --scheme none");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find("--out"), std::string::npos) << r.err;
}

// ---------------------------------------------------------------------------------------------
// The safetensors writer the command relies on: float32 and float64 tensors round-trip, the
// write is atomic.

TEST_F(CliGradTest, SafetensorsWriterRoundTrip) {
  SafetensorsFile f;
  f.metadata["scheme"] = "t5";
  f.tensors["a"] = Tensor::from_f32({2, 3}, {1, 2, 3, 4, 5, 6});
  f.tensors["b"] = Tensor::from_f64({3}, {0.1, -0.0, std::numeric_limits<double>::infinity()});
  const std::string p = path("w.safetensors");
  write_safetensors(p, f);
  const SafetensorsFile g = read_safetensors(p);
  EXPECT_EQ(g.metadata, f.metadata);
  ASSERT_EQ(g.tensors.size(), 2u);
  EXPECT_EQ(g.tensors.at("a").dtype, DType::kF32);
  EXPECT_EQ(g.tensors.at("a").bytes, f.tensors.at("a").bytes);
  EXPECT_EQ(g.tensors.at("b").dtype, DType::kF64);
  EXPECT_EQ(g.tensors.at("b").bytes, f.tensors.at("b").bytes);
  // A failing write (bytes that do not match the shape) leaves the old file.
  SafetensorsFile bad;
  bad.tensors["x"] = Tensor::from_f32({2}, {1, 2});
  bad.tensors["x"].shape = {3};
  EXPECT_THROW(write_safetensors(p, bad), IoError);
  EXPECT_EQ(read_safetensors(p).tensors.size(), 2u);
}

}  // namespace
}  // namespace posenc
