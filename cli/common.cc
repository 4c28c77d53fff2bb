// cli/common.cc - shared helpers of the posenc command-line tool.
#include "common.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iomanip>
#include <limits>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>
#include <system_error>
#include <utility>

#include "posenc/half.h"
#include "posenc/version.h"

namespace posenc::cli {

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (d) s += ", ";
    s += std::to_string(shape[d]);
  }
  return s + "]";
}

namespace {

// Multi-index of flat element `flat` in a C-order tensor of `shape`, as "[i, j, ...]".
std::string index_string(std::size_t flat, const std::vector<int64_t>& shape) {
  std::vector<int64_t> idx(shape.size(), 0);
  auto rest = static_cast<int64_t>(flat);
  for (std::size_t d = shape.size(); d-- > 0;) {
    const int64_t n = std::max<int64_t>(shape[d], 1);
    idx[d] = rest % n;
    rest /= n;
  }
  return shape_string(idx);
}

template <class T>
void check_finite_impl(const std::vector<T>& values, const std::vector<int64_t>& shape,
                       const std::string& what) {
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      throw ValueError(what + ": non-finite value (" +
                       format_number(static_cast<double>(values[i])) + ") at index " +
                       index_string(i, shape) + "; inputs must be finite");
    }
  }
}

bool is_float(DType t) {
  return t == DType::kF16 || t == DType::kBF16 || t == DType::kF32 || t == DType::kF64;
}

}  // namespace

void require_rank(const Tensor& t, std::size_t rank, const std::string& layout,
                  const std::string& what) {
  if (t.shape.size() != rank) {
    throw ShapeError(what + ": expected rank " + std::to_string(rank) + " " + layout + ", got " +
                     std::to_string(t.shape.size()) + "-d tensor " + shape_string(t.shape));
  }
}

void require_rank(const NpyView& t, std::size_t rank, const std::string& layout,
                  const std::string& what) {
  if (t.shape.size() != rank) {
    throw ShapeError(what + ": expected rank " + std::to_string(rank) + " " + layout + ", got " +
                     std::to_string(t.shape.size()) + "-d tensor " + shape_string(t.shape));
  }
}

FloatArray to_float_array(const Tensor& t, const std::string& what, bool require_finite) {
  if (!is_float(t.dtype)) {
    throw IoError(what + ": expected a float tensor (float16, bfloat16, float32 or float64), got " +
                  dtype_name(t.dtype));
  }
  FloatArray a;
  a.shape = t.shape;
  if (require_finite && t.dtype == DType::kF64) {
    // Check before narrowing so the message shows the value that was in the file.
    check_finite(t.to_f64(what), t.shape, what);
  }
  a.data = t.to_f32(what);
  if (require_finite) check_finite(a.data, a.shape, what);
  return a;
}

FloatArray read_float_npy(const std::string& path, std::size_t rank, const std::string& layout,
                          bool require_finite) {
  const Tensor t = read_npy(path);
  require_rank(t, rank, layout, path);
  return to_float_array(t, path, require_finite);
}

FloatArray FloatInput::copy() const {
  FloatArray a;
  a.shape = shape;
  a.data.assign(ptr_, ptr_ + size_);
  return a;
}

FloatInput FloatInput::owning(FloatArray a) {
  FloatInput in;
  in.shape = std::move(a.shape);
  in.owned_ = std::move(a.data);
  in.size_ = in.owned_.size();
  if (in.size_ > 0) in.ptr_ = in.owned_.data();
  return in;
}

FloatInput to_float_input(NpyView v, const std::string& what, bool require_finite) {
  FloatInput in;
  in.shape = v.shape;
  if (const float* p = v.as<float>()) {
    in.size_ = static_cast<std::size_t>(v.numel());
    if (in.size_ > 0) in.ptr_ = p;
    if (require_finite) {
      for (std::size_t i = 0; i < in.size_; ++i) {
        if (!std::isfinite(p[i])) {
          throw ValueError(what + ": non-finite value (" + format_number(p[i]) + ") at index " +
                           index_string(i, in.shape) + "; inputs must be finite");
        }
      }
    }
    in.file_ = std::move(v.file);
    return in;
  }
  if (!is_float(v.dtype)) {
    throw IoError(what + ": expected a float tensor (float16, bfloat16, float32 or float64), got " +
                  dtype_name(v.dtype));
  }
  if (require_finite && v.dtype == DType::kF64) check_finite(v.to_f64(what), v.shape, what);
  in.owned_ = v.to_f32(what);
  if (require_finite) check_finite(in.owned_, in.shape, what);
  in.size_ = in.owned_.size();
  if (in.size_ > 0) in.ptr_ = in.owned_.data();
  return in;
}

FloatInput map_float_npy(const std::string& path, std::size_t rank, const std::string& layout,
                         bool require_finite) {
  NpyView v = map_npy(path);
  require_rank(v, rank, layout, path);
  return to_float_input(std::move(v), path, require_finite);
}

void check_finite(const std::vector<float>& values, const std::vector<int64_t>& shape,
                  const std::string& what) {
  check_finite_impl(values, shape, what);
}

void check_finite(const std::vector<double>& values, const std::vector<int64_t>& shape,
                  const std::string& what) {
  check_finite_impl(values, shape, what);
}

Positions read_positions(const std::string& path, int64_t batch, int64_t seq) {
  const NpyView t = map_npy(path);
  if (t.dtype != DType::kI64 && t.dtype != DType::kI32) {
    throw IoError(path + ": position ids must be int64 (or int32), got " + dtype_name(t.dtype));
  }
  std::vector<int64_t> ids = t.to_i64(path);
  Positions p;
  if (t.shape.size() == 1) {
    if (t.shape[0] != seq) {
      throw ShapeError(path + ": positions " + shape_string(t.shape) + " do not match seq " +
                       std::to_string(seq) + " (expected [" + std::to_string(seq) + "] or [" +
                       std::to_string(batch) + ", " + std::to_string(seq) + "])");
    }
    p = Positions::shared(std::move(ids));
  } else if (t.shape.size() == 2) {
    if (t.shape[1] != seq || (t.shape[0] != batch && t.shape[0] != 1)) {
      throw ShapeError(path + ": positions " + shape_string(t.shape) +
                       " do not match [batch, seq] = [" + std::to_string(batch) + ", " +
                       std::to_string(seq) + "]");
    }
    p = t.shape[0] == batch ? Positions::per_row(std::move(ids), batch, seq)
                            : Positions::shared(std::move(ids));
  } else {
    throw ShapeError(path + ": positions must be [seq] or [batch, seq], got " +
                     shape_string(t.shape));
  }
  p.validate(batch, seq, path);
  return p;
}

Positions positions_from_flags(const std::optional<int64_t>& offset, const std::string& path,
                               int64_t batch, int64_t seq) {
  if (offset && !path.empty()) throw UsageError("--offset and --positions are mutually exclusive");
  if (!path.empty()) return read_positions(path, batch, seq);
  Positions p = Positions::offset(offset.value_or(0));
  p.validate(batch, seq, "--offset");
  return p;
}

const Tensor* find_tensor(const SafetensorsFile& file, const std::string& name) {
  auto it = file.tensors.find(name);
  return it == file.tensors.end() ? nullptr : &it->second;
}

const Tensor& require_tensor(const SafetensorsFile& file, const std::string& name,
                             const std::string& path, const std::string& needed_by) {
  if (const Tensor* t = find_tensor(file, name)) return *t;
  std::string have;
  for (const auto& [key, value] : file.tensors) {
    have += (have.empty() ? "" : ", ") + key;
  }
  throw UsageError(path + ": missing tensor '" + name + "' (needed by " + needed_by +
                   "); the file has: " + (have.empty() ? "no tensors" : have));
}

namespace {

// Writes `values` as a .npy of `shape` straight from the vector (no staging copy).
template <class T>
void write_values(const std::string& path, DType dtype, const std::vector<int64_t>& shape,
                  const std::vector<T>& values) {
  int64_t n = 1;
  for (const int64_t d : shape) {
    const std::optional<int64_t> m = d >= 0 ? checked_mul(n, d) : std::nullopt;
    if (!m) throw ShapeError(path + ": bad output shape " + shape_string(shape));
    n = *m;
  }
  if (static_cast<uint64_t>(n) != values.size()) {
    throw ShapeError(path + ": " + std::to_string(values.size()) + " values do not match shape " +
                     shape_string(shape));
  }
  write_npy(path, dtype, shape, values.data());
}

}  // namespace

void write_f32(const std::string& path, std::vector<int64_t> shape,
               const std::vector<float>& values) {
  write_values(path, DType::kF32, shape, values);
}

bool is_safetensors_path(const std::string& path) {
  const std::string ext = ".safetensors";
  return path.size() >= ext.size() && path.compare(path.size() - ext.size(), ext.size(), ext) == 0;
}

NpyView map_tensor_input(const std::string& path, const std::string& name) {
  if (!is_safetensors_path(path)) return map_npy(path);
  SafetensorsFile f = read_safetensors(path);
  if (f.tensors.empty()) throw IoError(path + ": the .safetensors file holds no tensor");
  auto it = f.tensors.size() == 1 ? f.tensors.begin() : f.tensors.find(name);
  if (it == f.tensors.end()) {
    std::string names;
    for (const auto& [n, t] : f.tensors) names += (names.empty() ? "'" : ", '") + n + "'";
    throw IoError(path + ": " + std::to_string(f.tensors.size()) + " tensors (" + names +
                  ") and none named '" + name + "'; give a file with one tensor or one named '" +
                  name + "'");
  }
  return view_of(std::move(it->second));
}

DType output_dtype(const std::string& out_dtype, DType input, const std::string& out_path) {
  DType t = DType::kF32;
  if (out_dtype.empty()) {
    if (input == DType::kF16 || input == DType::kBF16) t = input;
  } else if (out_dtype == "float16") {
    t = DType::kF16;
  } else if (out_dtype == "bfloat16") {
    t = DType::kBF16;
  } else if (out_dtype == "float64") {
    t = DType::kF64;
  } else if (out_dtype != "float32") {
    throw UsageError("--out-dtype must be float32, float16, bfloat16 or float64 (got '" +
                     out_dtype + "')");
  }
  if (t == DType::kBF16 && !is_safetensors_path(out_path)) {
    throw UsageError("--out " + out_path + ": a bfloat16 output needs a .safetensors file (NumPy " +
                     "has no bfloat16); name it *.safetensors or pass --out-dtype float32 or " +
                     "float16");
  }
  return t;
}

namespace {

template <class T>
void write_output_impl(const std::string& path, DType dtype, const std::vector<int64_t>& shape,
                       const std::vector<T>& values) {
  std::vector<unsigned char> bytes(values.size() * static_cast<std::size_t>(dtype_size(dtype)));
  for (std::size_t i = 0; i < values.size(); ++i) {
    const auto x = values[i];
    switch (dtype) {
      case DType::kF32: {
        const float f = static_cast<float>(x);
        std::memcpy(bytes.data() + 4 * i, &f, 4);
        break;
      }
      case DType::kF64: {
        const double d = static_cast<double>(x);
        std::memcpy(bytes.data() + 8 * i, &d, 8);
        break;
      }
      case DType::kF16: {
        const uint16_t b = f16_from_float(static_cast<float>(x)).bits;
        std::memcpy(bytes.data() + 2 * i, &b, 2);
        break;
      }
      case DType::kBF16: {
        const uint16_t b = bf16_from_float(static_cast<float>(x)).bits;
        std::memcpy(bytes.data() + 2 * i, &b, 2);
        break;
      }
      default:
        throw IoError(path + ": cannot write " + dtype_name(dtype) + " output");
    }
  }
  if (is_safetensors_path(path)) {
    write_safetensors(path, {{"out", TensorRef{dtype, shape, bytes.data()}}});
  } else {
    write_npy(path, dtype, shape, bytes.data());
  }
}

}  // namespace

void write_output(const std::string& path, DType dtype, const std::vector<int64_t>& shape,
                  const std::vector<float>& values) {
  write_output_impl(path, dtype, shape, values);
}

void write_output(const std::string& path, DType dtype, const std::vector<int64_t>& shape,
                  const std::vector<double>& values) {
  write_output_impl(path, dtype, shape, values);
}

void write_f64(const std::string& path, std::vector<int64_t> shape,
               const std::vector<double>& values) {
  write_values(path, DType::kF64, shape, values);
}

void write_i64(const std::string& path, std::vector<int64_t> shape,
               const std::vector<int64_t>& values) {
  write_values(path, DType::kI64, shape, values);
}

ModelConfig read_rope_model_config(const std::string& path) {
  ModelConfig cfg = read_model_config(path);
  if (cfg.scheme != ModelScheme::kRope) {
    throw UsageError(path + ": model_type '" + cfg.model_type + "' uses " +
                     model_scheme_name(cfg.scheme) + " positions, not RoPE");
  }
  return cfg;
}

void reject_with_config(const CLI::App& app, const std::vector<std::string>& flags) {
  for (const std::string& f : flags) {
    const CLI::Option* opt = app.get_option_no_throw(f);
    if (opt && opt->count() > 0) throw UsageError(f + " conflicts with --config");
  }
}

std::vector<double> read_inv_freq(const std::string& path, int64_t rotary_dim,
                                  const std::string& origin, int64_t head_dim) {
  const Tensor t = read_npy(path);
  if (t.dtype != DType::kF64 && t.dtype != DType::kF32) {
    throw IoError(path + ": inverse frequencies must be float64 or float32, got " +
                  dtype_name(t.dtype));
  }
  require_rank(t, 1, "[rotary_dim / 2]", path);
  std::vector<double> inv = t.to_f64(path);
  if (inv.empty()) throw ShapeError(path + ": inverse frequencies are empty");
  check_finite(inv, t.shape, path);
  const auto r = 2 * static_cast<int64_t>(inv.size());
  if (rotary_dim > 0 && r != rotary_dim) {
    throw ShapeError(path + ": " + std::to_string(inv.size()) +
                     " inverse frequencies give rotary_dim " + std::to_string(r) + ", but " +
                     origin + " gives rotary_dim " + std::to_string(rotary_dim) + " (expected " +
                     std::to_string(rotary_dim / 2) + " entries)");
  }
  if (head_dim > 0 && r > head_dim) {
    throw ShapeError(path + ": " + std::to_string(inv.size()) +
                     " inverse frequencies give rotary_dim " + std::to_string(r) +
                     ", more than head_dim " + std::to_string(head_dim));
  }
  return inv;
}

std::string full_precision(double v) {
  if (!std::isfinite(v)) return "null";
  // The shortest text that reads back to the same double (0.1, not 0.10000000000000001).
  char buf[40];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  if (ec == std::errc()) return std::string(buf, end);
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

void require_at_least(const std::string& flag, int64_t value, int64_t min) {
  if (value < min) {
    throw UsageError(flag + " must be >= " + std::to_string(min) + " (got " +
                     std::to_string(value) + ")");
  }
}

namespace {

constexpr int64_t kPow48 = int64_t{1} << 48;
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

// The ranges. Sizes that multiply into a buffer are also checked against the allocation limit
// (posenc/size.h) when the buffer is made; these bounds keep each factor meaningful on its own.
const std::vector<IntRange> kRanges = {
    // Threads: libgomp keeps per-thread start data on the caller's stack.
    {"*", "--threads", 0, kMaxThreads},
    // Positions and lengths: posenc positions lie in [0, 2^48].
    {"*", "--length", 0, kPow48},
    {"*", "--query-length", 0, kPow48},
    {"*", "--key-length", 0, kPow48},
    {"*", "--offset", 0, kPow48},
    {"*", "--origin", 0, kPow48},
    {"*", "--seq-len", 0, kPow48},
    {"*", "--window", 1, kPow48},
    // Widths.
    {"*", "--dim", 1, int64_t{1} << 32},
    {"*", "--head-dim", 1, int64_t{1} << 32},
    {"*", "--rotary-dim", 0, int64_t{1} << 32},
    {"*", "--heads", 1, int64_t{1} << 32},
    // Scheme settings.
    {"*", "--num-buckets", 1, kPow48},
    {"*", "--max-distance", 1, kPow48},
    {"*", "--position-buckets", 0, kPow48},
    {"*", "--max-relative-positions", 0, kPow48},  // 0: the library says why it must be >= 1
    // Seeds: any unsigned 64-bit value (INT64_MAX here stands for 2^64 - 1).
    {"*", "--seed", 0, kInt64Max},
    // rope-precision: exponents e of the positions 2^e.
    {"rope-precision", "--positions", 0, 52},
    {"rope-precision", "--head-dim", 2, int64_t{1} << 24},
    // Figures: every quantity is drawn, so a few thousand is already more than a page shows.
    {"plot *", "--length", 1, 1024},
    {"plot *", "--dim", 1, 4096},
    {"plot heatmap", "--length", 0, 4096},  // 0: every row of --table
    {"plot *", "--head-dim", 1, 4096},
    {"plot *", "--heads", 1, 256},
    {"plot *", "--max-offset", 1, 65536},
    {"plot rope-rotation", "--positions", 1, 65536},
    {"plot clock", "--positions", 0, kPow48},
    {"plot *", "--pairs", 1, 4096},
    {"plot *", "--columns", 1, 64},
    {"plot *", "--train-length", 1, 65536},
    {"plot *", "--max-length", 1, 1 << 20},
    {"plot *", "--shaw-k", 0, 65536},
    {"plot *", "--num-buckets", 1, 65536},
    {"plot *", "--max-distance", 1, 1 << 20},
    {"plot *", "--position-buckets", -1, 65536},
    {"plot *", "--max-relative-positions", -1, 1 << 20},
    {"plot *", "--circle-positions", 0, 65536},
};

bool command_matches(const std::string& pattern, const std::string& command) {
  if (pattern == "*") return true;
  if (pattern.size() >= 2 && pattern.compare(pattern.size() - 2, 2, " *") == 0) {
    return command.rfind(pattern.substr(0, pattern.size() - 1), 0) == 0;
  }
  return pattern == command;
}

// Strict decimal parsing of `s` into [lo, hi]; for unsigned options hi = INT64_MAX stands for
// 2^64 - 1. Rewrites `s` canonically.
std::string range_text(const IntRange& r, bool is_unsigned) {
  return "[" + std::to_string(r.lo) + ", " +
         (is_unsigned && r.hi == kInt64Max ? std::string("18446744073709551615")
                                           : std::to_string(r.hi)) +
         "]";
}

std::string check_integer(std::string& s, const IntRange& r, bool is_unsigned) {
  const std::string range = range_text(r, is_unsigned);
  const char* b = s.data();
  const char* e = s.data() + s.size();
  if (b != e && *b == '+') ++b;
  const bool negative = b != e && *b == '-';
  const char* digits = negative ? b + 1 : b;
  bool all_digits = digits != e;
  for (const char* p = digits; p != e; ++p) all_digits = all_digits && *p >= '0' && *p <= '9';
  if (!all_digits) return "expected a decimal integer in " + range + " (got '" + s + "')";
  if (is_unsigned) {
    uint64_t v = 0;
    const auto [p, ec] = std::from_chars(digits, e, v);
    const uint64_t hi =
        r.hi == kInt64Max ? std::numeric_limits<uint64_t>::max() : static_cast<uint64_t>(r.hi);
    if (negative || ec != std::errc() || p != e || v > hi ||
        v < static_cast<uint64_t>(std::max<int64_t>(r.lo, 0))) {
      return s + " is outside " + range;
    }
    s = std::to_string(v);
    return "";
  }
  int64_t v = 0;
  const auto [p, ec] = std::from_chars(b, e, v);
  if (ec != std::errc() || p != e || v < r.lo || v > r.hi) return s + " is outside " + range;
  s = std::to_string(v);  // canonical: CLI11 would read a leading 0 as octal
  return "";
}

void harden(CLI::App& app, const std::string& command) {
  for (CLI::Option* opt : app.get_options()) {
    const std::string type = opt->get_type_name();
    const bool is_int = type == "INT" || type.rfind("INT:", 0) == 0;
    const bool is_uint = type == "UINT" || type.rfind("UINT:", 0) == 0;
    if ((!is_int && !is_uint) || opt->get_lnames().empty()) continue;
    const IntRange r = integer_option_range(command, "--" + opt->get_lnames().front());
    opt->transform(
        CLI::Validator([r, is_uint](std::string& s) { return check_integer(s, r, is_uint); },
                       range_text(r, is_uint)));
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    harden(*sub, command.empty() ? sub->get_name() : command + " " + sub->get_name());
  }
}

}  // namespace

const std::vector<IntRange>& integer_option_ranges() { return kRanges; }

IntRange integer_option_range(const std::string& command, const std::string& flag) {
  // The most specific entry wins: exact command, then "plot *", then "*".
  const IntRange* best = nullptr;
  int best_rank = -1;
  for (const IntRange& r : kRanges) {
    if (flag != r.flag || !command_matches(r.command, command)) continue;
    const std::string c = r.command;
    const int rank = c == "*" ? 0 : c.back() == '*' ? 1 : 2;
    if (rank > best_rank) {
      best = &r;
      best_rank = rank;
    }
  }
  return best != nullptr ? *best : kDefaultIntRange;
}

void harden_integer_options(CLI::App& app) { harden(app, ""); }

std::vector<Command> add_all_commands(CLI::App& app) {
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("posenc ") + POSENC_VERSION_STRING);
  std::vector<Command> commands = {
      add_sinusoidal_command(app),
      add_rope_command(app),
      add_rope_freqs_command(app),
      add_rope_precision_command(app),
      add_alibi_slopes_command(app),
      add_t5_buckets_command(app),
      add_deberta_buckets_command(app),
      add_learned_command(app),
      add_attention_command(app),
      add_attention_grad_command(app),
      add_check_command(app),
      add_bench_command(app),
      add_describe_command(app),
      add_inspect_command(app),
      add_demo_command(app),
      add_plot_command(app),
      add_version_command(app),
  };
  harden_integer_options(app);
  return commands;
}

void check_out_early(const CLI::App& app) {
  if (app.get_name() == "demo") return;
  const CLI::Option* out = app.get_option_no_throw("--out");
  if (out != nullptr && out->count() > 0) check_output_path(out->as<std::string>());
  for (const CLI::App* sub : app.get_subcommands()) check_out_early(*sub);
}

std::string one_line(std::string s) {
  for (char& c : s) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

std::string format_number(double v, int digits) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::ostringstream os;
  os << std::setprecision(digits) << v;
  return os.str();
}

std::string expected_text(const CheckResult& r) {
  if (r.expect.empty()) return "<= " + format_number(r.threshold, 6);
  std::string e = r.expect;
  const std::string word = "threshold";
  if (auto pos = e.find(word); pos != std::string::npos) {
    e.replace(pos, word.size(), format_number(r.threshold, 6));
  }
  return e;
}

void print_check_table(std::ostream& os, const std::vector<CheckResult>& results) {
  const std::array<std::string, 5> header = {"property", "scheme", "measured", "expected",
                                             "result"};
  std::vector<std::array<std::string, 5>> rows;
  rows.reserve(results.size());
  for (const CheckResult& r : results) {
    rows.push_back({r.property, r.scheme, format_number(r.measured, 6), expected_text(r),
                    r.pass ? "PASS" : "FAIL"});
  }
  std::array<std::size_t, 5> width{};
  for (std::size_t c = 0; c < 5; ++c) width[c] = header[c].size();
  for (const auto& row : rows) {
    for (std::size_t c = 0; c < 5; ++c) width[c] = std::max(width[c], row[c].size());
  }
  auto print_row = [&](const std::array<std::string, 5>& row) {
    for (std::size_t c = 0; c < 5; ++c) {
      os << row[c];
      if (c + 1 < 5) os << std::string(width[c] - row[c].size() + 2, ' ');
    }
    os << '\n';
  };
  print_row(header);
  std::array<std::string, 5> rule;
  for (std::size_t c = 0; c < 5; ++c) rule[c] = std::string(width[c], '-');
  print_row(rule);
  std::size_t failed = 0;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    print_row(rows[i]);
    if (!results[i].pass) ++failed;
  }
  os << results.size() << " checks, " << (results.size() - failed) << " passed, " << failed
     << " failed\n";
}

namespace {
// The length of the UTF-8 sequence at s[i] (1 to 4), or 0 when the bytes there are not a
// well-formed sequence (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF).
std::size_t utf8_sequence(const std::string& s, std::size_t i) {
  const auto at = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned c = at(i);
  if (c < 0x80) return 1;
  std::size_t n = 0;
  unsigned lo = 0x80, hi = 0xbf;  // the allowed range of the second byte
  if (c >= 0xc2 && c <= 0xdf) {
    n = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    n = 3;
    if (c == 0xe0) lo = 0xa0;
    if (c == 0xed) hi = 0x9f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4;
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  if (at(i + 1) < lo || at(i + 1) > hi) return 0;
  for (std::size_t k = 2; k < n; ++k) {
    if (at(i + k) < 0x80 || at(i + k) > 0xbf) return 0;
  }
  return n;
}
}  // namespace

bool is_valid_utf8(const std::string& s) {
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_sequence(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string hex_bytes(const std::string& s) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  out.reserve(2 * s.size());
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

std::string json_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size() + 2);
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const std::size_t n = utf8_sequence(s, i);
    if (n == 0) {  // not UTF-8: the byte becomes U+FFFD (its value is in the _hex field)
      out += "\\ufffd";
      ++i;
      continue;
    }
    if (n > 1) {
      out.append(s, i, n);
      i += n;
      continue;
    }
    ++i;
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out;
}

std::string json_dump(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void set_json_path(nlohmann::json& j, const std::string& key, const std::string& path) {
  j[key] = path;
  if (!is_valid_utf8(path)) j[key + "_hex"] = hex_bytes(path);
}

namespace {
// Shortest representation that reads back to the same double.
std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";  // JSON has no NaN/Inf
  char buf[32];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return ec == std::errc() ? std::string(buf, end) : format_number(v, 17);
}
}  // namespace

void print_check_json(std::ostream& os, const std::vector<CheckResult>& results) {
  for (const CheckResult& r : results) {
    os << "{\"property\": \"" << json_escape(r.property) << "\", \"scheme\": \""
       << json_escape(r.scheme) << "\", \"measured\": " << json_number(r.measured)
       << ", \"threshold\": " << json_number(r.threshold) << ", \"expected\": \""
       << json_escape(expected_text(r)) << "\", \"result\": \"" << (r.pass ? "PASS" : "FAIL")
       << "\", \"pass\": " << (r.pass ? "true" : "false") << "}\n";
  }
}

}  // namespace posenc::cli
