// tests/test_cli_hostile.cc - the hostile-input contract of the posenc CLI (docs/reliability.md):
// whatever the input, a failing command prints one line on stderr naming the problem, exits with
// status 2 and leaves no file behind. One test per reproducer of issue 13, plus the guarantees
// around them (strict integers, the allocation limit, the thread bound, atomic outputs).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "posenc/io.h"

namespace posenc::cli_test {
namespace {

class Hostile : public CliFixture {
 protected:
  // Names in the scratch folder, hidden ones included (temporaries start with '.').
  std::set<std::string> listing() const {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) names.insert(e.path().filename().string());
    names.erase("stdout.txt");
    names.erase("stderr.txt");
    return names;
  }

  // Runs `prefix posenc args` through /bin/sh in the scratch folder (prefix: environment
  // assignments or a `ulimit` for the child alone).
  RunResult sh(const std::string& prefix, const std::string& args) const {
    const std::string out = path("stdout.txt"), err = path("stderr.txt");
    const std::string cmd = "cd " + quote(dir_.string()) + " && " + prefix + " " +
                            quote(POSENC_CLI_PATH) + " " + args + " > " + quote(out) + " 2> " +
                            quote(err);
    const std::string wrapped = "sh -c " + quote(cmd);
    const int raw = std::system(wrapped.c_str());
    RunResult r;
    r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
    r.out = read_text(out);
    r.err = read_text(err);
    return r;
  }

  // The contract: status 2, exactly one stderr line "posenc ...: error: ..." containing every
  // needle, and the folder as it was before.
  void expect_refused(const std::string& args, const std::vector<std::string>& needles,
                      const std::string& prefix = "") {
    const std::set<std::string> before = listing();
    const RunResult r = sh(prefix, args);
    EXPECT_EQ(r.status, 2) << "posenc " << args << "\nstderr: " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(r.err.rfind("posenc", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(": error: "), std::string::npos) << r.err;
    for (const std::string& n : needles) {
      EXPECT_NE(r.err.find(n), std::string::npos) << "missing '" << n << "' in: " << r.err;
    }
    EXPECT_EQ(listing(), before) << "posenc " << args << " left files behind";
  }

  // q, k, v [1, 4, 2, 8] float32 in the scratch folder.
  void write_qkv() const {
    const std::vector<int64_t> s = {1, 4, 2, 8};
    write_f32("q.npy", s, random_floats(count(s), 1));
    write_f32("k.npy", s, random_floats(count(s), 2));
    write_f32("v.npy", s, random_floats(count(s), 3));
  }
};

// --- sizes ---------------------------------------------------------------------------------------

TEST_F(Hostile, SizeProductOverflowIsRefusedNotCrashed) {
  expect_refused("sinusoidal --length 1099511627776 --dim 16777216 --out pe.npy",
                 {"--length (1099511627776)", "--dim (16777216)", "overflows"});
  expect_refused("deberta-buckets --query-length 4294967296 --key-length 4294967296 --out m.npy",
                 {"--query-length (4294967296)", "--key-length (4294967296)", "overflows"});
  expect_refused("t5-buckets --query-length 4294967296 --key-length 4294967296 --out m.npy",
                 {"--query-length", "overflows"});
}

TEST_F(Hostile, AllocationsBeyondTheLimitNameTheSize) {
  expect_refused("sinusoidal --length 1000000000000 --dim 4096 --out pe.npy",
                 {"--length (1000000000000) x --dim (4096) x 4 bytes = 16384000000000000 bytes",
                  "more than the limit"});
  expect_refused("deberta-buckets --query-length 1000000 --key-length 1000000 --out m.npy",
                 {"8000000000000 bytes", "more than the limit"});
  // An explicit limit, with a suffix.
  expect_refused("sinusoidal --length 1024 --dim 64 --out pe.npy",
                 {"262144 bytes", "limit of 1 KiB", "POSENC_MAX_BYTES"}, "POSENC_MAX_BYTES=1K");
  expect_refused("sinusoidal --length 4 --dim 4 --out pe.npy", {"POSENC_MAX_BYTES", "'lots'"},
                 "POSENC_MAX_BYTES=lots");
  EXPECT_EQ(sh("POSENC_MAX_BYTES=1M", "sinusoidal --length 1024 --dim 64 --out pe.npy").status, 0);
}

// Kernel switches from the environment are validated on every processor.
TEST_F(Hostile, BadKernelSwitchesAreRefused) {
  write_qkv();
  const std::string att = "attention --q q.npy --k k.npy --v v.npy --scheme none --out o.npy";
  expect_refused(att, {"POSENC_BF16_DOT", "'2'", "auto, 0 or 1"}, "POSENC_BF16_DOT=2");
  expect_refused(att, {"POSENC_SIMD_TARGET", "'AVX9'"}, "POSENC_SIMD_TARGET=AVX9");
  for (const char* ok : {"POSENC_BF16_DOT=0", "POSENC_BF16_DOT=1", "POSENC_BF16_DOT=auto"}) {
    EXPECT_EQ(sh(ok, att).status, 0) << ok;
  }
}

TEST_F(Hostile, HugeDimensionsAreOutOfRange) {
  expect_refused("sinusoidal --length 1 --dim 4611686018427387904 --out pe.npy",
                 {"--dim", "4611686018427387904", "outside"});
  expect_refused("rope-freqs --head-dim 1000000000000 --out f.npy", {"--head-dim", "outside"});
  expect_refused("rope-precision --head-dim 1099511627776", {"--head-dim", "outside"});
  for (const char* kind :
       {"heatmap --dim", "similarity --dim", "extrapolation --dim", "clock --dim",
        "rope-rotation --head-dim", "attention --head-dim", "bias --length", "heatmap --length"}) {
    expect_refused(std::string("plot ") + kind + " 281474976710656 --out p.png",
                   {"281474976710656", "outside"});
  }
}

// --- integers ------------------------------------------------------------------------------------

TEST_F(Hostile, IntegersAreParsedStrictly) {
  expect_refused("check --seed 18446744073709551616", {"--seed", "18446744073709551616"});
  expect_refused("check --seed -1", {"--seed", "outside"});
  expect_refused("sinusoidal --length 0x10 --dim 4 --out pe.npy", {"--length", "decimal"});
  expect_refused("sinusoidal --length 1e3 --dim 4 --out pe.npy", {"--length", "decimal"});
  expect_refused("sinusoidal --length 9223372036854775808 --dim 4 --out pe.npy", {"--length"});
  // A leading zero is decimal (CLI11 alone reads "010" as octal 8).
  const Tensor t = run_ok("sinusoidal --length 010 --dim 4", path("pe.npy"));
  EXPECT_EQ(t.shape, (std::vector<int64_t>{10, 4}));
}

TEST_F(Hostile, DebertaSpansAreBounded) {
  expect_refused(
      "deberta-buckets --query-length 4 --key-length 4 --max-relative-positions "
      "9223372036854775807 --out m.npy",
      {"--max-relative-positions", "outside"});
  expect_refused(
      "deberta-buckets --query-length 4 --key-length 4 --position-buckets 4611686018427387904 "
      "--out m.npy",
      {"--position-buckets", "outside"});
  expect_refused("plot bias --max-relative-positions 9223372036854775807 --out b.png",
                 {"--max-relative-positions"});
  write_qkv();
  expect_refused(
      "attention --q q.npy --k k.npy --v v.npy --scheme deberta --max-relative-positions "
      "4611686018427387904 --out o.npy",
      {"--max-relative-positions", "outside"});
  // At the largest span the map is computed, not wrapped to negative rows.
  const Tensor m = run_ok(
      "deberta-buckets --query-length 2 --key-length 2 --max-relative-positions 281474976710656",
      path("m.npy"));
  for (const int64_t v : m.to_i64()) EXPECT_GE(v, 0);
}

// --- threads -------------------------------------------------------------------------------------

TEST_F(Hostile, ThreadCountsAreBounded) {
  write_qkv();
  expect_refused(
      "attention --q q.npy --k k.npy --v v.npy --scheme none --threads 100000 --out o.npy",
      {"--threads", "100000", "[0, 1024]"});
  expect_refused("bench --threads 100000 --quick", {"--threads", "[0, 1024]"});
  // OMP_NUM_THREADS beyond the bound is clamped, not obeyed into a stack overflow.
  const RunResult r = sh("OMP_NUM_THREADS=100000",
                         "attention --q q.npy --k k.npy --v v.npy --scheme none --out o.npy");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(fs::exists(path("o.npy")));
}

// --- input files ---------------------------------------------------------------------------------

TEST_F(Hostile, NonRegularInputsAreRefusedByName) {
  expect_refused("inspect /dev/zero", {"/dev/zero", "character device"});
  expect_refused("rope --in /dev/zero --out y.npy", {"/dev/zero", "character device"});
  write_qkv();
  expect_refused(
      "attention --q q.npy --k k.npy --v v.npy --scheme t5 --params /dev/zero --out o.npy",
      {"/dev/zero", "character device"});
  expect_refused("describe /dev/zero", {"/dev/zero", "character device"});
  expect_refused("inspect .", {"directory"});
  // A FIFO without a writer: refused at once, not read forever (the timeout is a backstop).
  ASSERT_EQ(::mkfifo(path("fifo.npy").c_str(), 0600), 0);
  expect_refused("inspect fifo.npy", {"fifo.npy", "FIFO"}, "timeout 20");
  expect_refused("rope --in fifo.npy --out y.npy", {"FIFO"}, "timeout 20");
}

TEST_F(Hostile, LargeInputsAreCheckedAgainstTheLimit) {
  // A valid header for 2^24 float32 (64 MiB) over a sparse file: mapping costs nothing, the
  // copy `inspect` makes is refused under a 1 MiB limit before it is attempted.
  const std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (16777216,), }";
  std::string prelude = "\x93NUMPY";
  prelude += '\x01';  // version 1.0
  prelude += '\0';
  const std::size_t len = 128 - 10;
  prelude += static_cast<char>(len & 0xff);
  prelude += static_cast<char>(len >> 8);
  std::string h = header + std::string(len - header.size() - 1, ' ') + "\n";
  {
    std::ofstream f(path("big.npy"), std::ios::binary);
    f << prelude << h;
  }
  fs::resize_file(path("big.npy"), 128 + (std::uintmax_t{1} << 26));
  expect_refused("inspect big.npy", {"big.npy", "67108864 bytes", "POSENC_MAX_BYTES"},
                 "POSENC_MAX_BYTES=1M");
  // Trailing bytes beyond the declared data: refused, not read.
  fs::resize_file(path("big.npy"), 128 + (std::uintmax_t{1} << 26) + 1);
  expect_refused("inspect big.npy", {"trailing data"});
}

TEST_F(Hostile, ConfigNumbersOutOfDoubleRangeAreErrors) {
  std::ofstream(path("tiny.json")) << "6e406";
  expect_refused("describe tiny.json", {"tiny.json", "invalid JSON", "6e406"});
  std::ofstream(path("theta.json"))
      << R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, )"
      << R"("rope_theta": 1e400})";
  expect_refused("describe theta.json", {"theta.json", "invalid JSON"});
}

TEST_F(Hostile, DuplicateSafetensorsNamesAreErrors) {
  const std::string header = R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, )"
                             R"("a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})";
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  file += header + std::string(8, '\0');
  std::ofstream(path("dup.safetensors"), std::ios::binary) << file;
  expect_refused("inspect dup.safetensors", {"duplicate tensor name 'a'"});
}

// --- outputs -------------------------------------------------------------------------------------

TEST_F(Hostile, FileSizeLimitFailsTheWriteCleanly) {
  // ulimit -f counts 512-byte blocks: 4 blocks is far below the 256 KB table.
  expect_refused("sinusoidal --length 1000 --dim 64 --out pe.npy", {"pe.npy", "file-size limit"},
                 "ulimit -f 4;");
}

TEST_F(Hostile, OutputsNeverReplaceNonRegularFiles) {
  ASSERT_EQ(::mkfifo(path("fifo.npy").c_str(), 0600), 0);
  expect_refused("sinusoidal --length 2 --dim 4 --out fifo.npy", {"fifo.npy", "FIFO"});
  EXPECT_TRUE(fs::is_fifo(path("fifo.npy")));
  fs::create_symlink("elsewhere.npy", path("link.npy"));
  expect_refused("sinusoidal --length 2 --dim 4 --out link.npy", {"link.npy", "symbolic link"});
  EXPECT_TRUE(fs::is_symlink(path("link.npy")));
  EXPECT_FALSE(fs::exists(path("elsewhere.npy")));
  expect_refused("sinusoidal --length 2 --dim 4 --out /dev/null", {"character device"});
}

TEST_F(Hostile, LongOutputNamesGetShortTemporaryNames) {
  const std::string name = std::string(250, 'n') + ".npy";  // 254 bytes: at NAME_MAX
  const Tensor t = run_ok("sinusoidal --length 2 --dim 4", path(name));
  EXPECT_EQ(t.shape, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(listing(), (std::set<std::string>{name}));
}

TEST_F(Hostile, FailedDemoLeavesNothing) {
  // The first figure (heatmap-small, ~23 KB) fits 100 blocks (50 KiB), the second (~170 KB) does
  // not: the demo fails half way, after writing a file. The message names the final path.
  expect_refused("demo --skip-checks --out d", {"d/heatmap-paper.png", "file-size limit"},
                 "ulimit -f 100;");
  EXPECT_FALSE(fs::exists(path("d")));
  // Into an existing folder: its other files stay, nothing of the demo is added.
  fs::create_directories(path("e"));
  std::ofstream(path("e/keep.txt")) << "mine";
  expect_refused("demo --skip-checks --out e", {"file-size limit"}, "ulimit -f 100;");
  std::set<std::string> in_e;
  for (const auto& f : fs::directory_iterator(path("e"))) in_e.insert(f.path().filename());
  EXPECT_EQ(in_e, (std::set<std::string>{"keep.txt"}));
}

// --- messages ------------------------------------------------------------------------------------

TEST_F(Hostile, RopeInputWithZeroHeadDimSaysSo) {
  write_f32("x.npy", {1, 2, 1, 0}, {});
  expect_refused("rope --in x.npy --out y.npy", {"x.npy: head_dim (the last dimension)"});
  const RunResult r = run("rope --in " + path("x.npy") + " --out " + path("y.npy"));
  EXPECT_EQ(r.err.find("--head-dim"), std::string::npos) << r.err;
}

TEST_F(Hostile, EmptyTensorsAreNotReportedMissing) {
  write_qkv();
  SafetensorsFile f;
  f.tensors["pos_key"] = Tensor::from_f32({0, 2, 8}, {});
  f.tensors["pos_query"] = Tensor::from_f32({0, 2, 8}, {});
  write_safetensors(path("deberta.safetensors"), f);
  // The float32 path, and the float64 one, which reads the same tensors in float64.
  for (const std::string extra : {"", " --reference"}) {
    expect_refused(
        "attention --q q.npy --k k.npy --v v.npy --scheme deberta --params deberta.safetensors "
        "--max-relative-positions 4 --out o.npy" +
            extra,
        {"pos_key", "0 rows"});
    const RunResult r =
        run("attention --q " + path("q.npy") + " --k " + path("k.npy") + " --v " + path("v.npy") +
            " --scheme deberta --params " + path("deberta.safetensors") +
            " --max-relative-positions 4 --out " + path("o.npy") + extra);
    EXPECT_EQ(r.err.find("missing"), std::string::npos) << r.err;
  }
}

}  // namespace
}  // namespace posenc::cli_test
