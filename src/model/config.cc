// src/model/config.cc - Hugging Face style config.json -> ModelConfig (docs/model-configs.md).
//
// Strict reading: every key that decides the positional encoding is type-checked, range-checked
// and cross-checked against its aliases (rope_theta / rotary_emb_base, type / rope_type,
// rope_scaling / rope_parameters, partial_rotary_factor / rotary_pct / rotary_dim, ...). Any
// problem is an IoError "<source>: <key> ...". Keys that do not concern positions are ignored.
// The families' defaults: defaults.cc; RoPE and its scaling: rope_scaling.cc; the per-family
// readers: families.cc; what they share: reader.h.
#include "posenc/config.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "model/reader.h"
#include "posenc/io.h"

namespace posenc {

using model::Family;
using model::json;
using model::Node;
using model::Reader;
using model::Scope;
using model::show;

// ---------------------------------------------------------------------------------------------
// Public API.

int64_t ModelConfig::effective_context() const {
  if (scheme != ModelScheme::kRope || rope.scaling.type == RopeScalingType::kDefault) {
    return max_position_embeddings;
  }
  // original x factor; configs such as Llama 3.1 (8192 x 8 < 131072) or Phi-3 (no factor) state a
  // larger max_position_embeddings, which then wins.
  const RopeScaling& s = rope.scaling;
  const int64_t lo = s.original_max_position_embeddings > 0 ? s.original_max_position_embeddings
                                                            : max_position_embeddings;
  const double scaled = static_cast<double>(lo) * s.factor;
  const int64_t e = scaled >= 9.0e18 ? std::numeric_limits<int64_t>::max()
                                     : static_cast<int64_t>(std::llround(scaled));
  return std::max(e, max_position_embeddings);
}

ModelConfig parse_model_config(const std::string& json_text, const std::string& what) {
  const Reader r(what);
  json top;
  try {
    top = json::parse(json_text);
  } catch (const json::parse_error& e) {
    // "[json.exception.parse_error.101] parse error at line 1, column 5: ..." -> one line
    // without the exception id.
    std::string msg = e.what();
    if (const auto p = msg.find("] "); msg.rfind("[json.exception", 0) == 0 && p != msg.npos) {
      msg = msg.substr(p + 2);
    }
    for (char& c : msg) {
      if (static_cast<unsigned char>(c) < 0x20) c = ' ';
    }
    r.fail("invalid JSON (byte " + std::to_string(e.byte) + "): " + msg);
  } catch (const json::exception& e) {
    // A number beyond double's range ("1e400"): out_of_range.406.
    const std::string msg = e.what();
    const auto p = msg.find("] ");
    r.fail("invalid JSON: " + (p == msg.npos ? msg : msg.substr(p + 2)));
  }
  if (!top.is_object()) r.fail("the top level must be a JSON object (got " + show(top) + ")");
  const Node root{&top, ""};
  const auto mt = root.get("model_type");
  if (!mt) r.fail("missing required key 'model_type'");
  ModelConfig cfg;
  cfg.model_type = r.string(*mt);
  // The text model's type under a multimodal wrapper names the same family.
  if (cfg.model_type == "llama4" || cfg.model_type == "gemma3" || cfg.model_type == "gemma4") {
    if (const auto tc = root.get("text_config")) {
      if (const auto tt = Node{&r.object(*tc), "text_config"}.get("model_type")) {
        const std::string inner = r.string(*tt);
        if (inner != cfg.model_type + "_text") {
          r.fail(tt->name + " '" + inner + "' does not belong to model_type '" + cfg.model_type +
                 "' (expected '" + cfg.model_type + "_text')");
        }
      }
    }
  }
  const model::TypeDefaults* entry = model::find_type_defaults(cfg.model_type);
  if (entry == nullptr) {
    r.fail("model_type '" + cfg.model_type +
           "' is not supported (supported: " + model::supported_families() + ")");
  }
  switch (entry->family) {
    case Family::kRopeHalf:
    case Family::kRopeInterleaved:
    case Family::kRopeVl:
    case Family::kDeepseek:
    case Family::kLlama4:
    case Family::kGptOss:
    case Family::kGemma3:
    case Family::kGemma4:
      model::read_rope_family(r, top, *entry, cfg.model_type, cfg);
      break;
    case Family::kFalcon: {
      const auto alibi = root.get("alibi");
      if (alibi && r.boolean(*alibi)) {
        model::read_alibi_family(r, top, *entry, cfg);
        // The kv heads do not change ALiBi; record them as HF computes them.
        model::read_falcon_kv_heads(r, Scope{{root}}, cfg);
      } else {
        model::read_rope_family(r, top, *entry, cfg.model_type, cfg);
      }
      break;
    }
    case Family::kBloom:
    case Family::kMpt:
      model::read_alibi_family(r, top, *entry, cfg);
      break;
    case Family::kT5:
      model::read_t5(r, top, *entry, cfg);
      break;
    case Family::kDeberta:
    case Family::kDebertaV2:
      model::read_deberta(r, top, *entry, cfg);
      break;
    case Family::kGpt2:
    case Family::kBert:
      model::read_learned(r, top, *entry, cfg);
      break;
  }
  cfg.json = json_text;
  cfg.source = what;
  return cfg;
}

ModelConfig read_model_config(const std::string& path) {
  const std::vector<unsigned char> bytes = read_file(path, std::size_t{64} << 20);
  return parse_model_config(std::string(bytes.begin(), bytes.end()), path);
}

RopeFrequencies model_rope_frequencies(const ModelConfig& cfg, int64_t seq_len, RopeAngles angles) {
  if (cfg.scheme != ModelScheme::kRope) {
    throw ValueError("model_rope_frequencies: model_type '" + cfg.model_type +
                     "' does not use RoPE");
  }
  return rope_frequencies(cfg.rope, seq_len, angles);
}

namespace model {

std::string fmt(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.10g", v);
  return buf;
}

std::string fmt(int64_t v) { return std::to_string(v); }

}  // namespace model

}  // namespace posenc
