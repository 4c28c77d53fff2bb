// cli/common.h - shared helpers of the posenc command-line tool.
//
// The CLI is a thin layer: parse the command line, read tensors with posenc/io.h, call the public
// API, write the result with posenc::write_npy (atomic) once everything succeeded. Every usage or
// input error is a posenc::Error (UsageError for the ones the CLI finds itself); main() turns it
// into one stderr line and exit status 2.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "posenc/check.h"
#include "posenc/config.h"
#include "posenc/error.h"
#include "posenc/io.h"
#include "posenc/rope.h"
#include "posenc/size.h"
#include "posenc/tensor.h"

namespace CLI {
class App;
}  // namespace CLI

namespace posenc::cli {

// A usage error the CLI detects itself (exit status 2, like every posenc::Error).
class UsageError : public posenc::Error {
 public:
  using Error::Error;
};

// A registered subcommand: its CLI11 app and what runs it once parsing succeeded. `run` returns
// the exit status and throws on errors.
struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

// One registration function per subcommand (cli/cmd_<name>.cc).
Command add_sinusoidal_command(CLI::App& parent);
Command add_rope_command(CLI::App& parent);
Command add_alibi_slopes_command(CLI::App& parent);
Command add_t5_buckets_command(CLI::App& parent);
Command add_deberta_buckets_command(CLI::App& parent);
Command add_learned_command(CLI::App& parent);
Command add_attention_command(CLI::App& parent);
Command add_attention_grad_command(CLI::App& parent);
Command add_check_command(CLI::App& parent);
Command add_bench_command(CLI::App& parent);
Command add_demo_command(CLI::App& parent);
Command add_plot_command(CLI::App& parent);
Command add_version_command(CLI::App& parent);
Command add_rope_freqs_command(CLI::App& parent);
Command add_describe_command(CLI::App& parent);
Command add_inspect_command(CLI::App& parent);
Command add_rope_precision_command(CLI::App& parent);

// Every subcommand above registered on `app` (in the order `posenc --help` lists them), with
// --version, one required subcommand and harden_integer_options applied: the whole command line
// of `posenc` (cli/main.cc, fuzz/fuzz_cli.cc).
std::vector<Command> add_all_commands(CLI::App& app);

// A non-null address for the views of empty arrays: an empty tensor is present, not missing
// (the API reads a null data pointer as an absent table).
inline float* empty_float_data() {
  static float dummy = 0.0f;
  return &dummy;
}

// A dense float32 array in C order (what the CLI hands to the API).
struct FloatArray {
  std::vector<int64_t> shape;
  std::vector<float> data;

  // The elements; never null, so an empty array reads as present (see empty_float_data).
  const float* ptr() const { return data.empty() ? empty_float_data() : data.data(); }
  template <std::size_t R>
  View<const float, R> view() const {
    return View<const float, R>::contiguous(ptr(), dims<R>());
  }
  template <std::size_t R>
  View<float, R> mutable_view() {
    return View<float, R>::contiguous(data.empty() ? empty_float_data() : data.data(), dims<R>());
  }
  template <std::size_t R>
  std::array<int64_t, R> dims() const {
    std::array<int64_t, R> a{};
    for (std::size_t d = 0; d < R && d < shape.size(); ++d) a[d] = shape[d];
    return a;
  }
};

// Throws ShapeError unless `t` has rank `rank`; `layout` names the dimensions, e.g.
// "[batch, seq, heads, head_dim]", and `what` the file or tensor.
void require_rank(const Tensor& t, std::size_t rank, const std::string& layout,
                  const std::string& what);
void require_rank(const NpyView& t, std::size_t rank, const std::string& layout,
                  const std::string& what);

// Converts a tensor of any float dtype to float32 (IoError naming `what` on other dtypes). With
// `require_finite`, a NaN or infinity is a ValueError naming `what` and the element.
FloatArray to_float_array(const Tensor& t, const std::string& what, bool require_finite);

// Reads a .npy float tensor of the given rank as float32 (see to_float_array).
FloatArray read_float_npy(const std::string& path, std::size_t rank, const std::string& layout,
                          bool require_finite);

// A read-only float32 input: the mapped file's own bytes when it holds aligned little-endian
// float32 (zero copy), else a float32 copy converted from its dtype. Cheap to move; the views
// stay valid while the FloatInput lives.
class FloatInput {
 public:
  std::vector<int64_t> shape;

  const float* data() const { return ptr_; }
  std::size_t size() const { return size_; }
  bool mapped() const { return owned_.empty() && file_ != nullptr; }
  template <std::size_t R>
  std::array<int64_t, R> dims() const {
    std::array<int64_t, R> a{};
    for (std::size_t d = 0; d < R && d < shape.size(); ++d) a[d] = shape[d];
    return a;
  }
  template <std::size_t R>
  View<const float, R> view() const {
    std::array<int64_t, R> a{};
    for (std::size_t d = 0; d < R && d < shape.size(); ++d) a[d] = shape[d];
    return View<const float, R>::contiguous(ptr_, a);
  }
  // An owning copy, for APIs that take a FloatArray or modify their input.
  FloatArray copy() const;
  // Takes over an array already converted (e.g. a .safetensors tensor).
  static FloatInput owning(FloatArray a);

 private:
  friend FloatInput to_float_input(NpyView v, const std::string& what, bool require_finite);
  std::shared_ptr<const MappedFile> file_;
  std::vector<float> owned_;
  const float* ptr_ = empty_float_data();
  std::size_t size_ = 0;
};

// The float32 input of a mapped .npy (posenc::map_npy): `v`'s own bytes when they are aligned
// little-endian float32 (no copy; the FloatInput keeps the mapping alive), else a converted copy
// (see to_float_array; `what` names the file in messages).
FloatInput to_float_input(NpyView v, const std::string& what, bool require_finite);

// map_npy(path), require_rank, then to_float_input.
FloatInput map_float_npy(const std::string& path, std::size_t rank, const std::string& layout,
                         bool require_finite);

// Throws ValueError naming `what` unless every value is finite.
void check_finite(const std::vector<float>& values, const std::vector<int64_t>& shape,
                  const std::string& what);
void check_finite(const std::vector<double>& values, const std::vector<int64_t>& shape,
                  const std::string& what);

// Reads int64 (or int32) position ids from `path`: [seq] (Positions::shared) or [batch, seq]
// (Positions::per_row), checked against the tensor they place.
Positions read_positions(const std::string& path, int64_t batch, int64_t seq);

// Positions from --offset K / --positions P.npy (at most one given; none: offset 0).
Positions positions_from_flags(const std::optional<int64_t>& offset, const std::string& path,
                               int64_t batch, int64_t seq);

// The tensor `name` of a safetensors file, or UsageError naming it, the file and who needs it.
const Tensor& require_tensor(const SafetensorsFile& file, const std::string& name,
                             const std::string& path, const std::string& needed_by);
const Tensor* find_tensor(const SafetensorsFile& file, const std::string& name);

// Writers (atomic, through posenc::write_npy).
void write_f32(const std::string& path, std::vector<int64_t> shape,
               const std::vector<float>& values);
void write_f64(const std::string& path, std::vector<int64_t> shape,
               const std::vector<double>& values);
void write_i64(const std::string& path, std::vector<int64_t> shape,
               const std::vector<int64_t>& values);

// Half precision and .safetensors tensors on the command line (bf16 has no NumPy type).
bool is_safetensors_path(const std::string& path);  // ends in .safetensors
// A float tensor input: a .npy (mapped, no copy), or a .safetensors file holding one tensor, or
// several of which one is named `name` (the flag's name: "q", "k", "v", "x", "dout").
NpyView map_tensor_input(const std::string& path, const std::string& name);
// The output dtype: --out-dtype's ("float32", "float16", "bfloat16", "float64"), or when empty
// the input's half type (float16 / bfloat16), else float32. bfloat16 needs a .safetensors --out
// (UsageError before anything is computed).
DType output_dtype(const std::string& out_dtype, DType input, const std::string& out_path);
// Writes `values` rounded once to `dtype` (float32, float16, bfloat16, float64): a .safetensors
// --out holds one tensor named "out", anything else is a .npy (atomic).
void write_output(const std::string& path, DType dtype, const std::vector<int64_t>& shape,
                  const std::vector<float>& values);
void write_output(const std::string& path, DType dtype, const std::vector<int64_t>& shape,
                  const std::vector<double>& values);

// read_model_config(path), which must describe a RoPE model: otherwise a UsageError naming the
// model_type and its scheme.
ModelConfig read_rope_model_config(const std::string& path);

// Throws UsageError "<flag> conflicts with --config" for the first flag of `flags` that `app`
// saw on the command line (flags `app` does not define are skipped).
void reject_with_config(const CLI::App& app, const std::vector<std::string>& flags);

// Inverse frequencies from a .npy (float64 or float32 [R/2], finite): the --inv-freq flag.
// `rotary_dim` (0: unknown) must equal 2 x the length when given, and 2 x the length must not
// exceed `head_dim` (0: unknown); `origin` names where rotary_dim came from.
std::vector<double> read_inv_freq(const std::string& path, int64_t rotary_dim,
                                  const std::string& origin, int64_t head_dim);

// "[2, 3]".
std::string shape_string(const std::vector<int64_t>& shape);

// printf("%.17g"): every double reads back exactly (JSON output).
std::string full_precision(double v);

// Throws UsageError "<flag> must be >= <min> (got <value>)" when value < min.
void require_at_least(const std::string& flag, int64_t value, int64_t min);

// ---------------------------------------------------------------------------------------------
// Hostile input (docs/reliability.md).

// The documented range of an integer option: `flag` of `command` ("*": every command; "plot *":
// every plot kind) takes values in [lo, hi].
struct IntRange {
  const char* command;
  const char* flag;
  int64_t lo;
  int64_t hi;
};
// Every integer option's range (the table of docs/reliability.md); options not listed take
// kDefaultIntRange.
const std::vector<IntRange>& integer_option_ranges();
inline constexpr IntRange kDefaultIntRange = {"*", "*", 0, int64_t{1} << 48};
// The range of `flag` in `command` ("sinusoidal", "plot heatmap").
IntRange integer_option_range(const std::string& command, const std::string& flag);

// For every integer option of `app` and its subcommands: the value must be a plain decimal
// integer (CLI11 alone reads "010" as octal, wraps "-1" to 2^64 - 1 and clamps overflow) inside
// the option's documented range; anything else is a CLI11 ValidationError naming the flag.
void harden_integer_options(CLI::App& app);

// Refuses a bad output file before the command computes anything: the --out of `app` (or of its
// parsed subcommand) must be absent or a regular file (posenc::check_output_path). `posenc demo`,
// whose --out is a folder, is left to the command.
void check_out_early(const CLI::App& app);

// `s` with line breaks replaced by spaces (error messages are one line).
std::string one_line(std::string s);

// Formatting for text output: shortest round-trip-ish representation with `digits` significant
// digits, e.g. 0.00390625, 7.4852, 1e-07.
std::string format_number(double v, int digits = 6);

// The expected column: `expect` with the word "threshold" replaced by its value.
std::string expected_text(const CheckResult& r);
// The `posenc check` table (columns property, scheme, measured, expected, result).
void print_check_table(std::ostream& os, const std::vector<CheckResult>& results);
// One JSON object per line.
void print_check_json(std::ostream& os, const std::vector<CheckResult>& results);
// Text outputs that echo a path or a name (which on Linux is any byte string) stay valid JSON:
// json_escape writes the body of a JSON string literal, each byte that is not part of well-formed
// UTF-8 as U+FFFD; json_dump serializes the same way; set_json_path sets j[key] to the path and,
// when it is not valid UTF-8, j[key + "_hex"] to its bytes in lowercase hex (so the exact name
// can be recovered: bytes.fromhex in Python).
std::string json_escape(const std::string& s);
bool is_valid_utf8(const std::string& s);
std::string hex_bytes(const std::string& s);
std::string json_dump(const nlohmann::json& j);
void set_json_path(nlohmann::json& j, const std::string& key, const std::string& path);

}  // namespace posenc::cli
