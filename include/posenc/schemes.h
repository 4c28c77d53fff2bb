// posenc/schemes.h - the registry of attention schemes: one table of every scheme's name,
// parameter tensors (names, layouts, whether required), settings (Python keyword, CLI flag, help)
// and documentation page, read by the command-line tool, the Python bindings, `posenc check`, the
// figures and the benchmarks instead of lists of their own.
//
//   for (const SchemeInfo& s : attention_schemes()) std::cout << s.name << ": " << s.title;
//   const SchemeInfo& t5 = scheme_info("t5");   // ValueError naming the known schemes
//
// The order is PositionScheme's alternative order (posenc/attention.h): none, rope, alibi, t5,
// shaw, xl, deberta. Adding a scheme: docs/architecture.md, "How to add a scheme".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace posenc {

// PositionScheme's alternatives, by index.
enum class SchemeKind { kNone = 0, kRope, kAlibi, kT5, kShaw, kXl, kDeberta };

// A parameter tensor the scheme reads (`--params` file, Python `params=`, `AttentionTables`).
struct SchemeParamInfo {
  std::string name;    // e.g. "relative_attention_bias"
  std::string layout;  // e.g. "[num_buckets, heads]"
  bool required = true;
  bool learned = true;  // trained with the model: attention_grad returns "d" + name
  std::string help;
};

// A setting of the scheme: the Python keyword (SchemeSettings' field) and the CLI flag.
struct SchemeSettingInfo {
  std::string keyword;  // e.g. "max_distance"
  std::string flag;     // e.g. "--max-distance"; empty: not a flag of `posenc attention`
  std::string help;     // without the scheme's name
};

struct SchemeInfo {
  SchemeKind kind = SchemeKind::kNone;
  std::string name;     // "t5": what --scheme, scheme= and messages say
  std::string title;    // "T5 relative bias"
  std::string summary;  // one line: what the scheme adds to attention
  std::string models;   // model families that use it
  std::string doc;      // its documentation page, e.g. "docs/t5.md"
  std::vector<SchemeParamInfo> params;
  std::vector<SchemeSettingInfo> settings;
  // A term added to the scores that depends on the query-key offset only (posenc check measures
  // that the scores are offset-only); RoPE's rotation is checked by its own rules.
  bool relative = false;
  bool bias_map = false;  // an additive [Lq, Lk] bias or bucket map that figures can draw
};

// Every attention scheme, in PositionScheme order.
const std::vector<SchemeInfo>& attention_schemes();

// The scheme called `name`; ValueError naming the known ones otherwise.
const SchemeInfo& scheme_info(const std::string& name);
const SchemeInfo& scheme_info(SchemeKind kind);

// {"none", "rope", ...} in registry order.
std::vector<std::string> scheme_names();
// The names for messages and help: "none, rope, alibi, t5, shaw, xl or deberta".
std::string scheme_names_text();

// Parameters every scheme accepts besides its own: attention sinks [heads_q] (optional).
const std::vector<SchemeParamInfo>& common_scheme_params();

// The settings of every scheme, each with the names of the schemes it applies to (a setting
// such as `base` serves rope and xl): for front ends that reject a setting of another scheme.
struct SchemeSettingUse {
  SchemeSettingInfo setting;
  std::vector<std::string> schemes;
};
std::vector<SchemeSettingUse> scheme_settings();

}  // namespace posenc
