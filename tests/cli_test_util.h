// tests/cli_test_util.h - running the posenc binary from tests: a fixture with a fresh scratch
// folder per test, the command runner (stdout and stderr captured) and .npy writers.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "posenc/io.h"

#ifndef POSENC_CLI_PATH
#error "POSENC_CLI_PATH must name the posenc binary"
#endif

namespace posenc::cli_test {

namespace fs = std::filesystem;

struct RunResult {
  int status = -1;
  std::string out;
  std::string err;
};

inline std::string read_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// Single-quotes `s` for /bin/sh.
inline std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') {
      q += "'\\''";
    } else {
      q += c;
    }
  }
  return q + "'";
}

// A scratch folder per test under $POSENC_TEST_TMP (or the system temp folder).
class CliFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* env = std::getenv("POSENC_TEST_TMP");
    const fs::path base = env && *env ? fs::path(env) : fs::temp_directory_path() / "posenc_cli";
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = base / (std::string(info->test_suite_name()) + "." + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // Runs `posenc <args>` with stdout and stderr captured to files.
  RunResult run(const std::string& args) const {
    const std::string out = path("stdout.txt"), err = path("stderr.txt");
    const std::string cmd =
        quote(POSENC_CLI_PATH) + " " + args + " > " + quote(out) + " 2> " + quote(err);
    const int raw = std::system(cmd.c_str());
    RunResult r;
    r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
    r.out = read_text(out);
    r.err = read_text(err);
    return r;
  }

  // Runs a command expected to succeed (writing `out`, empty stderr) and returns the tensor.
  Tensor run_ok(const std::string& args, const std::string& out,
                RunResult* result = nullptr) const {
    const RunResult r = run(args + " --out " + quote(out));
    EXPECT_EQ(r.status, 0) << "posenc " << args << "\nstderr: " << r.err;
    EXPECT_EQ(r.err, "");
    if (result) *result = r;
    if (r.status != 0) return {};
    return read_npy(out);
  }

  std::string write_f32(const std::string& name, const std::vector<int64_t>& shape,
                        const std::vector<float>& v) const {
    const std::string p = path(name);
    write_npy(p, Tensor::from_f32(shape, v));
    return p;
  }
  std::string write_i64(const std::string& name, const std::vector<int64_t>& shape,
                        const std::vector<int64_t>& v) const {
    const std::string p = path(name);
    write_npy(p, Tensor::from_i64(shape, v));
    return p;
  }

  fs::path dir_;
};

// n uniform floats in [lo, hi) from a seeded generator (test inputs).
inline std::vector<float> random_floats(std::size_t n, uint32_t seed, float lo = -1.0f,
                                        float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Number of elements of a shape.
inline std::size_t count(const std::vector<int64_t>& shape) {
  std::size_t n = 1;
  for (int64_t s : shape) n *= static_cast<std::size_t>(s);
  return n;
}

}  // namespace posenc::cli_test
