// cli/cmd_inspect.cc - `posenc inspect FILE`: validate a .safetensors or .npy file and list its
// tensors (name, dtype, shape, bytes) and metadata; --json for one JSON object, --stats for
// min / max / mean / non-finite counts of float tensors.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common.h"
#include "posenc/io.h"

namespace posenc::cli {

namespace {

struct InspectArgs {
  std::string file;
  bool json = false;
  bool stats = false;
};

// NumPy's spelling, or bfloat16's name where NumPy has none.
const char* npy_dtype(DType t) {
  const char* d = dtype_npy_descr(t);
  return d != nullptr ? d : "bfloat16";
}

// By content (the NumPy magic), else by a .npy suffix (so a broken .npy gets the npy reader's
// message).
bool is_npy(const std::string& path) {
  const std::string suffix = ".npy";
  if (path.size() >= suffix.size() &&
      path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0) {
    return true;
  }
  // Mapped, not opened as a stream: a FIFO or device is refused here, before any read blocks.
  const std::shared_ptr<const MappedFile> f = MappedFile::map(path);
  return f->size() >= 6 && std::memcmp(f->data(), "\x93NUMPY", 6) == 0;
}

struct Stats {
  double min = 0, max = 0, mean = 0;
  int64_t non_finite = 0;
  bool any = false;  // at least one finite value
};

Stats tensor_stats(const Tensor& t, const std::string& what) {
  std::vector<double> v;
  if (t.dtype == DType::kI32 || t.dtype == DType::kI64) {
    for (int64_t x : t.to_i64(what)) v.push_back(static_cast<double>(x));
  } else {
    v = t.to_f64(what);
  }
  Stats s;
  s.min = std::numeric_limits<double>::infinity();
  s.max = -s.min;
  double sum = 0;
  int64_t n = 0;
  for (double x : v) {
    if (!std::isfinite(x)) {
      ++s.non_finite;
      continue;
    }
    s.min = std::min(s.min, x);
    s.max = std::max(s.max, x);
    sum += x;
    ++n;
  }
  s.any = n > 0;
  s.mean = n > 0 ? sum / static_cast<double>(n) : 0.0;
  return s;
}

struct Row {
  std::string name;
  const Tensor* tensor;
};

void print_table(const std::vector<Row>& rows, bool stats, const std::string& what) {
  std::vector<std::string> header = {"name", "dtype", "shape", "bytes"};
  if (stats) header.insert(header.end(), {"min", "max", "mean", "non_finite"});
  std::vector<std::vector<std::string>> cells;
  for (const Row& r : rows) {
    const Tensor& t = *r.tensor;
    std::vector<std::string> c = {
        r.name, std::string(dtype_name(t.dtype)) + " (" + dtype_safetensors_name(t.dtype) + ")",
        t.shape_str(), std::to_string(t.bytes.size())};
    if (stats) {
      const Stats s = tensor_stats(t, what + ": " + r.name);
      c.push_back(s.any ? format_number(s.min) : "-");
      c.push_back(s.any ? format_number(s.max) : "-");
      c.push_back(s.any ? format_number(s.mean) : "-");
      c.push_back(std::to_string(s.non_finite));
    }
    cells.push_back(std::move(c));
  }
  std::vector<std::size_t> width(header.size());
  for (std::size_t i = 0; i < header.size(); ++i) width[i] = header[i].size();
  for (const auto& c : cells) {
    for (std::size_t i = 0; i < c.size(); ++i) width[i] = std::max(width[i], c[i].size());
  }
  auto print_row = [&](const std::vector<std::string>& c) {
    std::string line;
    for (std::size_t i = 0; i < c.size(); ++i) {
      line += c[i];
      if (i + 1 < c.size()) line += std::string(width[i] - c[i].size() + 2, ' ');
    }
    std::cout << line << '\n';
  };
  print_row(header);
  std::vector<std::string> rule(header.size());
  for (std::size_t i = 0; i < header.size(); ++i) rule[i] = std::string(width[i], '-');
  print_row(rule);
  for (const auto& c : cells) print_row(c);
}

nlohmann::json tensor_json(const std::string& name, const Tensor& t, bool stats,
                           const std::string& what) {
  nlohmann::json j = {{"name", name},
                      {"dtype", dtype_name(t.dtype)},
                      {"safetensors_dtype", dtype_safetensors_name(t.dtype)},
                      {"shape", t.shape},
                      {"bytes", t.bytes.size()}};
  if (stats) {
    const Stats s = tensor_stats(t, what);
    j["min"] = s.any ? nlohmann::json(s.min) : nullptr;
    j["max"] = s.any ? nlohmann::json(s.max) : nullptr;
    j["mean"] = s.any ? nlohmann::json(s.mean) : nullptr;
    j["non_finite"] = s.non_finite;
  }
  return j;
}

int inspect_npy(const InspectArgs& a) {
  const Tensor t = read_npy(a.file);
  if (a.json) {
    nlohmann::json j = tensor_json("", t, a.stats, a.file);
    j.erase("name");
    j.erase("safetensors_dtype");
    j["format"] = "npy";
    j["descr"] = npy_dtype(t.dtype);
    set_json_path(j, "file", a.file);
    std::cout << json_dump(j) << std::endl;
    return 0;
  }
  std::cout << a.file << ": npy\n"
            << "dtype: " << dtype_name(t.dtype) << " (" << npy_dtype(t.dtype) << ")\n"
            << "shape: " << t.shape_str() << "\n"
            << "elements: " << t.numel() << "\n"
            << "bytes: " << t.bytes.size() << "\n";
  if (a.stats) {
    const Stats s = tensor_stats(t, a.file);
    if (s.any) {
      std::cout << "min: " << format_number(s.min) << "\nmax: " << format_number(s.max)
                << "\nmean: " << format_number(s.mean) << "\n";
    }
    std::cout << "non_finite: " << s.non_finite << "\n";
  }
  std::cout << std::flush;
  return 0;
}

int inspect_safetensors(const InspectArgs& a) {
  const SafetensorsFile f = read_safetensors(a.file);
  std::size_t total = 0;
  std::vector<Row> rows;
  for (const auto& [name, t] : f.tensors) {
    total += t.bytes.size();
    rows.push_back({name, &t});
  }
  if (a.json) {
    nlohmann::json tensors = nlohmann::json::array();
    for (const Row& r : rows) {
      tensors.push_back(tensor_json(r.name, *r.tensor, a.stats, a.file + ": " + r.name));
    }
    nlohmann::json meta = nlohmann::json::object();
    for (const auto& [k, v] : f.metadata) meta[k] = v;
    nlohmann::json j = {
        {"format", "safetensors"}, {"tensors", tensors}, {"metadata", meta}, {"data_bytes", total}};
    set_json_path(j, "file", a.file);
    std::cout << json_dump(j) << std::endl;
    return 0;
  }
  std::cout << a.file << ": safetensors, " << rows.size()
            << (rows.size() == 1 ? " tensor, " : " tensors, ") << total
            << " bytes of tensor data\n";
  print_table(rows, a.stats, a.file);
  if (f.metadata.empty()) {
    std::cout << "metadata: (none)\n";
  } else {
    std::cout << "metadata:\n";
    for (const auto& [k, v] : f.metadata) std::cout << "  " << k << ": " << one_line(v) << "\n";
  }
  std::cout << std::flush;
  return 0;
}

}  // namespace

Command add_inspect_command(CLI::App& parent) {
  auto a = std::make_shared<InspectArgs>();
  CLI::App* app = parent.add_subcommand(
      "inspect",
      "Validate a .safetensors (or .npy) file and list its tensors (name, dtype, shape, bytes) "
      "and metadata");
  app->add_option("file", a->file, ".safetensors or .npy file (told apart by content)")->required();
  app->add_flag("--json", a->json, "One JSON object instead of text");
  app->add_flag("--stats", a->stats, "Also min, max, mean and non-finite count of each tensor");
  return {app, [a] { return is_npy(a->file) ? inspect_npy(*a) : inspect_safetensors(*a); }};
}

}  // namespace posenc::cli
