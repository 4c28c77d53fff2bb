// .safetensors reader and writer (docs/cli.md, File conventions).
//
// Format (huggingface/safetensors): u64 little-endian header length N, N bytes of JSON
//   {"__metadata__": {"k": "v"}, "name": {"dtype": "F32", "shape": [2, 3],
//                                         "data_offsets": [begin, end]}, ...}
// then the data section; offsets are relative to its start.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "io/io_util.h"
#include "posenc/error.h"
#include "posenc/io.h"
#include "posenc/size.h"

namespace posenc {

namespace {

using nlohmann::json;

constexpr uint64_t kMaxHeader = uint64_t{100} << 20;  // 100 MiB, as in the reference reader
constexpr const char* kMetadataKey = "__metadata__";

std::optional<DType> dtype_from_name(const std::string& s) {
  if (s == "F16") return DType::kF16;
  if (s == "BF16") return DType::kBF16;
  if (s == "F32") return DType::kF32;
  if (s == "F64") return DType::kF64;
  if (s == "I32") return DType::kI32;
  if (s == "I64") return DType::kI64;
  return std::nullopt;
}

std::string quoted(const std::string& name) {
  std::string s(1, '\'');
  s += io_detail::printable(name);
  s += '\'';
  return s;
}

// A JSON value for messages, one line and bounded. Only scalars and flat arrays are printed:
// dumping is recursive, and a hostile header may nest a million levels deep.
std::string brief(const json& v) {
  bool flat = !v.is_object();
  if (v.is_array()) {
    for (const json& e : v) flat = flat && e.is_primitive();
  }
  if (!flat) return std::string("a JSON ") + v.type_name();
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 80) s = s.substr(0, 80) + "...";
  return io_detail::printable(s);
}

struct Range {
  uint64_t begin;
  uint64_t end;
  const std::string* name;
};

uint64_t load_u64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace

SafetensorsFile parse_safetensors(const unsigned char* data, std::size_t size,
                                  const std::string& what) {
  if (size < 8) {
    throw IoError(what + ": truncated: file has " + std::to_string(size) +
                  " bytes, a .safetensors file starts with an 8-byte header length");
  }
  const uint64_t n = load_u64(data);
  if (n > kMaxHeader) {
    throw IoError(what + ": header length " + std::to_string(n) + " exceeds the limit of " +
                  std::to_string(kMaxHeader) + " bytes (not a .safetensors file?)");
  }
  if (n > size - 8) {
    throw IoError(what + ": truncated: header length " + std::to_string(n) + " exceeds the " +
                  std::to_string(size - 8) + " bytes after the length field");
  }
  json header;
  // Keys seen in each open object: nlohmann keeps the last of duplicate keys silently, and a
  // repeated tensor name (or a repeated "dtype" inside one) must be an error.
  std::vector<std::vector<std::string>> open_objects;
  const json::parser_callback_t unique_keys = [&](int depth, json::parse_event_t event,
                                                  json& parsed) {
    if (event == json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      if (!open_objects.empty()) open_objects.pop_back();
    } else if (event == json::parse_event_t::key && !open_objects.empty()) {
      std::vector<std::string>& keys = open_objects.back();
      const std::string& key = parsed.get_ref<const std::string&>();
      if (std::find(keys.begin(), keys.end(), key) != keys.end()) {
        throw IoError(what + ": malformed header: duplicate " +
                      (depth == 1 ? "tensor name " : "key ") + quoted(key));
      }
      keys.push_back(key);
    }
    return true;
  };
  try {
    header = json::parse(data + 8, data + 8 + n, unique_keys);
  } catch (const json::exception& e) {
    throw IoError(what + ": malformed JSON header: " + io_detail::printable(e.what()));
  }
  if (!header.is_object()) {
    throw IoError(what + ": malformed header: expected a JSON object, got " +
                  std::string(header.type_name()));
  }

  const unsigned char* section = data + 8 + n;
  const uint64_t section_size = size - 8 - n;
  SafetensorsFile out;
  std::vector<Range> ranges;
  for (const auto& [name, info] : header.items()) {
    if (name == kMetadataKey) {
      if (!info.is_object()) {
        throw IoError(what + ": __metadata__ must be an object of strings, got " +
                      std::string(info.type_name()));
      }
      for (const auto& [key, value] : info.items()) {
        if (!value.is_string()) {
          throw IoError(what + ": __metadata__ " + quoted(key) + " must be a string, got " +
                        brief(value));
        }
        out.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string where = what + ": tensor " + quoted(name);
    if (!info.is_object()) {
      throw IoError(where + ": expected an object with dtype, shape and data_offsets, got " +
                    brief(info));
    }
    const auto dt = info.find("dtype");
    const auto sh = info.find("shape");
    const auto off = info.find("data_offsets");
    if (dt == info.end()) throw IoError(where + ": missing \"dtype\"");
    if (sh == info.end()) throw IoError(where + ": missing \"shape\"");
    if (off == info.end()) throw IoError(where + ": missing \"data_offsets\"");
    if (!dt->is_string()) throw IoError(where + ": dtype must be a string, got " + brief(*dt));
    const std::string dtype_str = dt->get<std::string>();
    const std::optional<DType> dtype = dtype_from_name(dtype_str);
    if (!dtype) {
      throw IoError(where + ": unsupported dtype " + quoted(dtype_str) +
                    " (supported: F16, BF16, F32, F64, I32, I64)");
    }
    if (!sh->is_array()) {
      throw IoError(where + ": shape must be an array of non-negative integers, got " + brief(*sh));
    }
    Tensor t;
    t.dtype = *dtype;
    for (const json& d : *sh) {
      if (!d.is_number_unsigned() ||
          d.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        throw IoError(where + ": shape must be an array of non-negative integers, got " +
                      brief(*sh));
      }
      t.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
    }
    int64_t numel = 0;
    int64_t nbytes = 0;
    if (!io_detail::checked_nbytes(t.shape, dtype_size(t.dtype), &numel, &nbytes)) {
      throw IoError(where + ": shape " + t.shape_str() + " of " + dtype_str +
                    " overflows the element count");
    }
    if (!off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned()) {
      throw IoError(where + ": data_offsets must be [begin, end] non-negative integers, got " +
                    brief(*off));
    }
    const uint64_t begin = (*off)[0].get<uint64_t>();
    const uint64_t end = (*off)[1].get<uint64_t>();
    const std::string offsets_str =
        "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "]";
    if (begin > end) throw IoError(where + ": " + offsets_str + " has begin > end");
    if (end > section_size) {
      throw IoError(where + ": " + offsets_str + " lie outside the data section of " +
                    std::to_string(section_size) + " bytes (truncated file?)");
    }
    if (end - begin != static_cast<uint64_t>(nbytes)) {
      throw IoError(where + ": " + offsets_str + " do not match dtype " + dtype_str + " x shape " +
                    t.shape_str() + " (" + std::to_string(nbytes) + " bytes)");
    }
    require_allocation(where + ": copying its data", nbytes);
    t.bytes.assign(section + begin, section + end);
    ranges.push_back({begin, end, &out.tensors.emplace(name, std::move(t)).first->first});
  }

  // The data section holds the tensors and at most kSafetensorsSlack other bytes, so a small
  // header cannot make posenc accept (and map) an arbitrarily large file.
  uint64_t used = 0;
  for (const Range& r : ranges) used += r.end - r.begin;
  if (section_size > used + kSafetensorsSlack) {
    throw IoError(what + ": the data section has " + std::to_string(section_size) +
                  " bytes, but the tensors declare only " + std::to_string(used) + " (more than " +
                  std::to_string(kSafetensorsSlack) + " bytes of slack)");
  }

  // No two tensors may share bytes. Empty tensors occupy nothing.
  std::erase_if(ranges, [](const Range& r) { return r.begin == r.end; });
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  for (std::size_t i = 1; i < ranges.size(); ++i) {
    const Range& a = ranges[i - 1];
    const Range& b = ranges[i];
    if (b.begin < a.end) {
      throw IoError(what + ": tensors " + quoted(*a.name) + " (data_offsets [" +
                    std::to_string(a.begin) + ", " + std::to_string(a.end) + "]) and " +
                    quoted(*b.name) + " (data_offsets [" + std::to_string(b.begin) + ", " +
                    std::to_string(b.end) + "]) overlap");
    }
  }
  return out;
}

SafetensorsFile read_safetensors(const std::string& path) {
  const std::shared_ptr<const MappedFile> file = MappedFile::map(path);
  return parse_safetensors(file->data(), file->size(), path);
}

namespace {

// One tensor of a file to write: its bytes live elsewhere.
struct Entry {
  const std::string* name;
  DType dtype;
  const std::vector<int64_t>* shape;
  const void* data;
  std::size_t size;  // bytes held at data
};

// The 8-byte length and the JSON header (padded with spaces so the data section starts 8-byte
// aligned) of a file holding `entries` in order.
std::string header_bytes(const std::vector<Entry>& entries,
                         const std::map<std::string, std::string>& metadata,
                         const std::string& what) {
  json header = json::object();
  if (!metadata.empty()) {
    json meta = json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header[kMetadataKey] = std::move(meta);
  }
  uint64_t offset = 0;
  for (const Entry& e : entries) {
    const std::string& name = *e.name;
    const std::string where = what + ": tensor " + quoted(name);
    if (name == kMetadataKey) throw IoError(where + ": the name is reserved for metadata");
    int64_t numel = 0;
    int64_t nbytes = 0;
    if (!io_detail::checked_nbytes(*e.shape, dtype_size(e.dtype), &numel, &nbytes)) {
      throw IoError(where + ": shape " + io_detail::dims_str(*e.shape) +
                    " has a negative or too large dimension");
    }
    if (static_cast<uint64_t>(nbytes) != e.size) {
      throw IoError(where + ": " + std::to_string(e.size) + " bytes do not match " +
                    dtype_safetensors_name(e.dtype) + " x shape " + io_detail::dims_str(*e.shape) +
                    " (" + std::to_string(nbytes) + " bytes)");
    }
    header[name] = {{"dtype", dtype_safetensors_name(e.dtype)},
                    {"shape", *e.shape},
                    {"data_offsets", {offset, offset + e.size}}};
    offset += e.size;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& ex) {
    // Names and metadata must be valid UTF-8.
    throw IoError(what + ": cannot encode the header: " + io_detail::printable(ex.what()));
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>(n >> (8 * i));
  return out + text;
}

std::vector<Entry> entries_of(const SafetensorsFile& f) {
  std::vector<Entry> out;
  for (const auto& [name, t] : f.tensors) {  // std::map: sorted by name
    out.push_back(Entry{&name, t.dtype, &t.shape, t.bytes.data(), t.bytes.size()});
  }
  return out;
}

std::vector<Entry> entries_of(const std::map<std::string, TensorRef>& tensors,
                              const std::string& what) {
  std::vector<Entry> out;
  for (const auto& [name, t] : tensors) {
    int64_t numel = 0;
    int64_t nbytes = 0;
    if (!io_detail::checked_nbytes(t.shape, dtype_size(t.dtype), &numel, &nbytes)) {
      throw IoError(what + ": tensor " + quoted(name) + ": shape " + io_detail::dims_str(t.shape) +
                    " has a negative or too large dimension");
    }
    if (nbytes > 0 && t.data == nullptr) {
      throw IoError(what + ": tensor " + quoted(name) + " has no data");
    }
    out.push_back(Entry{&name, t.dtype, &t.shape, t.data, static_cast<std::size_t>(nbytes)});
  }
  return out;
}

std::vector<unsigned char> encode(const SafetensorsFile& f, const std::string& what) {
  const std::vector<Entry> entries = entries_of(f);
  const std::string head = header_bytes(entries, f.metadata, what);
  std::size_t total = head.size();
  for (const Entry& e : entries) total += e.size;
  std::vector<unsigned char> out;
  out.reserve(total);
  out.insert(out.end(), head.begin(), head.end());
  for (const Entry& e : entries) {
    const auto* b = static_cast<const unsigned char*>(e.data);
    out.insert(out.end(), b, b + e.size);
  }
  return out;
}

void write_entries(const std::string& path, const std::vector<Entry>& entries,
                   const std::map<std::string, std::string>& metadata) {
  const std::string head = header_bytes(entries, metadata, path);
  std::vector<ByteSpan> parts;
  parts.push_back(ByteSpan{head.data(), head.size()});
  for (const Entry& e : entries) {
    if (e.size > 0) parts.push_back(ByteSpan{e.data, e.size});
  }
  write_file_atomic(path, parts);
}

}  // namespace

std::vector<unsigned char> encode_safetensors(const SafetensorsFile& f) {
  return encode(f, "encode_safetensors");
}

void write_safetensors(const std::string& path, const SafetensorsFile& f) {
  write_entries(path, entries_of(f), f.metadata);
}

void write_safetensors(const std::string& path, const std::map<std::string, TensorRef>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  write_entries(path, entries_of(tensors, path), metadata);
}

const char* dtype_safetensors_name(DType t) {
  switch (t) {
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kF32:
      return "F32";
    case DType::kF64:
      return "F64";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
  }
  return "?";
}

}  // namespace posenc
