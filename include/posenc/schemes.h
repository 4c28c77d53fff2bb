// posenc/schemes.h - the registry of attention schemes: one table of every scheme's name,
// parameter tensors (names, layouts, head axis, whether required and learned), settings (Python
// keyword, CLI flag, type, range, default, help, where the value is stored) and documentation
// page, read by the command-line tool, the Python bindings and torch ops, `posenc check`, the
// figures and the benchmarks instead of lists of their own.
//
//   for (const SchemeInfo& s : attention_schemes()) std::cout << s.name << ": " << s.title;
//   const SchemeInfo& t5 = scheme_info("t5");   // ValueError naming the known schemes
//
// The order is PositionScheme's alternative order (posenc/attention.h): none, rope, alibi, t5,
// shaw, xl, deberta. Adding a scheme: docs/architecture.md, "How to add a scheme".
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace posenc {

struct SchemeSettings;  // posenc/scheme.h

// A parameter tensor the scheme reads (`--params` file, Python `params=`, `AttentionTables`).
struct SchemeParamInfo {
  std::string name;    // e.g. "relative_attention_bias"
  std::string layout;  // e.g. "[num_buckets, heads]"
  bool required = true;
  bool learned = true;  // trained with the model: attention_grad returns "d" + name
  std::string help;
  // The axis of the layout that is the heads ([num_buckets, heads]: 1; -1: shared by the heads):
  // what splits the table when heads are split across processes.
  int head_axis = -1;
};

// The kind of value a setting takes: the CLI flag's and the Python keyword's type.
//   kFloat, kInt: a number in [min, max] (min_exclusive: > min); kBool: True / False, a CLI flag
//   without a value; kChoice: one of `choices`; kRopeFrequencies: a posenc.RopeFrequencies
//   (Python only); kRopeScaling: a Hugging Face rope_scaling dict (Python only).
enum class SettingType { kFloat, kInt, kBool, kChoice, kRopeFrequencies, kRopeScaling };

// A checked value of a float, int, bool or choice setting.
using SettingValue = std::variant<double, int64_t, bool, std::string>;

// A setting of the scheme: its Python keyword, CLI flag, type, range, default and doc line, and
// where it goes in SchemeSettings. Every front end reads these: the CLI's flags, the Python
// keywords and their checks, posenc.schemes(), the torch ops' arguments.
struct SchemeSettingInfo {
  std::string keyword;  // e.g. "max_distance"
  std::string flag;     // e.g. "--max-distance"; empty: not a flag of `posenc attention`
  SettingType type = SettingType::kFloat;
  std::optional<double> min, max;  // kFloat, kInt: the range (inclusive unless min_exclusive)
  bool min_exclusive = false;
  std::vector<std::string> choices;  // kChoice
  std::string default_value;         // in words: "10000", "head_dim", "not causal"
  std::string help;                  // without the scheme's name, default or range
  // A model config fixes it: giving it beside one is a conflict.
  bool model_sets = false;
  // Stores a checked value (kFloat, kInt, kBool, kChoice) in SchemeSettings; nullptr: the front
  // ends read it themselves (seq_len, a dimension of the call) or convert it (the object types).
  void (*store)(SchemeSettings&, const SettingValue&) = nullptr;
};

struct SchemeInfo {
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

// Every attention scheme, in PositionScheme order (attention_schemes()[s.index()] describes s).
const std::vector<SchemeInfo>& attention_schemes();

// The scheme called `name`; ValueError naming the known ones otherwise.
const SchemeInfo& scheme_info(const std::string& name);
// The scheme of PositionScheme's alternative `index`.
const SchemeInfo& scheme_info(std::size_t index);

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

// The setting `keyword` of scheme `scheme`; nullptr when the scheme has none of that name.
const SchemeSettingInfo* scheme_setting(const std::string& scheme, const std::string& keyword);

// "float", "int", "bool", "choice", "rope_frequencies", "rope_scaling".
const char* setting_type_name(SettingType t);

// The setting's range and choices in words: "> 0", "in [1, 2^48]", "half or interleaved".
std::string setting_range_text(const SchemeSettingInfo& s);

// `value` checked against the setting's type, range and choices (ValueError naming `name`, e.g.
// "max_distance" or "--max-distance", and what is allowed); ints are refused for kFloat never
// (widened), kInt takes no double.
SettingValue check_setting(const SchemeSettingInfo& s, SettingValue value, const std::string& name);

// A CLI flag's text parsed by the setting's type (a whole int, a finite number, a choice) and
// checked (ValueError naming `name`).
SettingValue parse_setting(const SchemeSettingInfo& s, const std::string& text,
                           const std::string& name);

// check_setting, then the value stored in `settings` (s.store; ValueError when it has none).
void set_scheme_setting(SchemeSettings& settings, const SchemeSettingInfo& s, SettingValue value,
                        const std::string& name);

}  // namespace posenc
