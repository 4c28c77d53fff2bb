// cli/attention_common.cc - the flags and inputs that `posenc attention` and
// `posenc attention-grad` share; the scheme itself is built by posenc::build_scheme (see
// attention_common.h).
#include "attention_common.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "posenc/schemes.h"

namespace posenc::cli {

namespace {

// Shapes the CLI can name by file before the library sees them.
void check_shapes(const AttentionArgs& a, const std::vector<int64_t>& q,
                  const std::vector<int64_t>& k, const std::vector<int64_t>& v) {
  if (k[0] != v[0] || k[1] != v[1] || k[2] != v[2] || v[3] < 1) {
    throw ShapeError(a.v + ": v " + shape_string(v) + " must have the shape of k " +
                     shape_string(k) + " (" + a.k + ")" +
                     (v[3] != k[3] ? " (its head_dim may be smaller)" : ""));
  }
  if (v[3] > k[3]) {
    throw ShapeError(a.v + ": v head_dim (" + std::to_string(v[3]) + ") exceeds the head_dim of " +
                     "q and k (" + std::to_string(k[3]) + "); it may be equal or smaller");
  }
  if (k[0] != q[0]) {
    throw ShapeError(a.k + ": k batch (" + std::to_string(k[0]) + ") must equal q batch (" +
                     std::to_string(q[0]) + ")");
  }
  if (k[3] != q[3]) {
    throw ShapeError(a.k + ": k head_dim (" + std::to_string(k[3]) + ") must equal q head_dim (" +
                     std::to_string(q[3]) + ")");
  }
  if (k[2] < 1 || q[2] % k[2] != 0) {
    throw ShapeError(a.k + ": kv heads (" + std::to_string(k[2]) + ") must divide q heads (" +
                     std::to_string(q[2]) + ")");
  }
}

// The tensors `scheme` reads, from the registry: "'rel_k' [2K+1, head_dim] or ... (and
// optionally 'rel_v' ...)".
std::string needed_tensors(const std::string& scheme) {
  std::string required, optional;
  for (const SchemeParamInfo& p : scheme_info(scheme).params) {
    std::string& to = p.required ? required : optional;
    to += (to.empty() ? "" : ", ") + ("'" + p.name + "' " + p.layout);
  }
  if (required.empty()) return "its parameter tensors";
  return required + (optional.empty() ? "" : " (and optionally " + optional + ")");
}

// Reads the scheme's tensors from --params (float32, or float64 for the reference; finite, named
// by file and tensor in messages) into `h` and returns them by name. Other tensors of the file
// are ignored; a missing required one is a UsageError naming the file.
ParamMap load_params(const AttentionArgs& a, SchemeHolder& h) {
  const std::vector<std::string> required = scheme_required_params(a.scheme);
  ParamMap params;
  if (a.params.empty()) {
    if (!required.empty()) {
      throw UsageError("--scheme " + a.scheme + " needs --params P.safetensors with " +
                       needed_tensors(a.scheme));
    }
    return params;
  }
  h.file = read_safetensors(a.params);
  for (const std::string& name : scheme_param_names(a.scheme)) {
    const Tensor* t = find_tensor(h.file, name);
    if (!t) {
      if (std::find(required.begin(), required.end(), name) == required.end()) continue;
      t = &require_tensor(h.file, name, a.params, "--scheme " + a.scheme);
    }
    const std::string what = a.params + ": " + name;
    ParamTensor p;
    p.shape = t->shape;
    if (a.reference) {
      std::vector<double>& v = h.arrays64.emplace_back(t->to_f64(what));
      check_finite(v, t->shape, what);
      // Never null, so an empty tensor reads as present (its shape is then checked).
      static const double kEmpty = 0.0;
      p.f64 = v.empty() ? &kEmpty : v.data();
    } else {
      p.f32 = h.arrays.emplace_back(to_float_array(*t, what, true)).ptr();
    }
    params.emplace(name, std::move(p));
  }
  return params;
}

}  // namespace

namespace {
// cu_seqlens from an .npy: int32 or int64, one dimension.
std::vector<int64_t> read_offsets(const std::string& path, const char* flag) {
  const NpyView t = map_npy(path);
  if (t.dtype != DType::kI64 && t.dtype != DType::kI32) {
    throw IoError(path + ": " + flag + " must hold int32 or int64 offsets, got " +
                  dtype_name(t.dtype));
  }
  if (t.shape.size() != 1) {
    throw ShapeError(path + ": " + flag + " must be [num_seqs + 1], got " + shape_string(t.shape));
  }
  return t.to_i64(path);
}
}  // namespace

void read_attention_inputs(const CLI::App& app, const AttentionArgs& args, AttentionInputs& in) {
  // With --config the scheme and its settings come from the model; flags it replaces conflict.
  in.args = args;
  AttentionArgs& a = in.args;
  std::optional<ModelConfig>& model = in.model;
  if (!a.config.empty()) {
    model = read_model_config(a.config);
    const std::string s = model_attention_scheme(*model, a.config);
    if (!a.scheme.empty() && a.scheme != s) {
      throw UsageError("--scheme " + a.scheme + " conflicts with --config " + a.config +
                       " (model_type '" + model->model_type + "' uses " + s + ")");
    }
    a.scheme = s;
  } else if (a.scheme.empty()) {
    throw UsageError("--scheme is required (or --config config.json)");
  }
  // The settings given as flags, each checked by the registry's type and range: a flag of another
  // scheme, or one the model config fixes, is a usage error.
  SchemeSettings s;
  s.scheme = a.scheme;
  std::optional<int64_t> given_seq_len;
  for (const SchemeSettingUse& use : scheme_settings()) {
    const SchemeSettingInfo& info = use.setting;
    if (info.flag.empty()) continue;
    s.setting_names[info.keyword] = info.flag;
    if (app.count(info.flag) == 0) continue;
    const SchemeSettingInfo* own = scheme_setting(a.scheme, info.keyword);
    if (own == nullptr) {
      std::string schemes;
      for (const std::string& n : use.schemes) schemes += (schemes.empty() ? "" : ", ") + n;
      throw UsageError(info.flag + " does not apply to --scheme " + a.scheme + " (it is for " +
                       schemes + ")");
    }
    if (model && own->model_sets) throw UsageError(info.flag + " conflicts with --config");
    const std::string& text = a.settings.at(info.keyword);
    SettingValue value;
    try {
      value = parse_setting(*own, text, info.flag);
    } catch (const ValueError& e) {
      throw UsageError(e.what());
    }
    if (own->store == nullptr) {
      given_seq_len = std::get<int64_t>(value);  // seq_len: a dimension of the call
    } else {
      own->store(s, value);
    }
  }
  if (a.layer && !model) throw UsageError("--layer needs --config");
  if (model && !a.layer && model->layers_differ()) {
    throw UsageError(a.config + ": the layers of model_type '" + model->model_type +
                     "' differ in position handling (window, chunk, RoPE, sinks; see posenc "
                     "describe); pass --layer N");
  }
  if (a.chunk) require_at_least("--chunk", *a.chunk, 1);
  if (a.softcap && !(std::isfinite(*a.softcap) && *a.softcap > 0)) {
    throw UsageError("--softcap must be a finite number > 0 (got " + format_number(*a.softcap) +
                     ")");
  }
  if (a.out_dtype == "float64" && !a.reference) {
    throw UsageError("--out-dtype float64 needs --reference (the float32 path computes float32)");
  }
  if (a.threads < 0)
    throw UsageError("--threads must be >= 0 (got " + std::to_string(a.threads) + ")");
  const bool varlen = !a.cu_seqlens_q.empty() || !a.cu_seqlens_k.empty();
  if (varlen && (a.cu_seqlens_q.empty() || a.cu_seqlens_k.empty())) {
    throw UsageError(std::string(a.cu_seqlens_q.empty() ? "--cu-seqlens-q" : "--cu-seqlens-k") +
                     " is missing: packed sequences need --cu-seqlens-q and --cu-seqlens-k");
  }
  const char* layout_q =
      varlen ? "[total_q, heads_q, head_dim]" : "[batch, seq_q, heads_q, head_dim]";
  const char* layout_kv =
      varlen ? "[total_k, heads_kv, head_dim]" : "[batch, seq_k, heads_kv, head_dim]";
  const std::size_t rank = varlen ? 3 : 4;
  in.q_file = map_tensor_input(a.q, "q");
  require_rank(in.q_file, rank, layout_q, a.q);
  in.k_file = map_tensor_input(a.k, "k");
  require_rank(in.k_file, rank, layout_kv, a.k);
  in.v_file = map_tensor_input(a.v, "v");
  require_rank(in.v_file, rank, layout_kv, a.v);
  in.q = to_float_input(in.q_file, a.q, true);
  in.k = to_float_input(in.k_file, a.k, true);
  in.v = to_float_input(in.v_file, a.v, true);
  if (varlen) {
    for (FloatInput* x : {&in.q, &in.k, &in.v}) x->shape.insert(x->shape.begin(), 1);
  }
  const FloatInput& q = in.q;
  const FloatInput& k = in.k;
  const FloatInput& v = in.v;
  check_shapes(a, q.shape, k.shape, v.shape);
  in.v_dim = v.shape[3];
  const int64_t batch = q.shape[0], seq_q = q.shape[1], seq_k = k.shape[1];

  std::optional<Positions>& pos_q = in.pos_q;
  std::optional<Positions>& pos_k = in.pos_k;
  if (!a.positions_q.empty()) pos_q = read_positions(a.positions_q, batch, seq_q);
  if (!a.positions_k.empty()) pos_k = read_positions(a.positions_k, batch, seq_k);
  if (varlen) {
    in.packed = pack_sequences(read_offsets(a.cu_seqlens_q, "--cu-seqlens-q"),
                               read_offsets(a.cu_seqlens_k, "--cu-seqlens-k"), seq_q, seq_k,
                               pos_q ? &*pos_q : nullptr, pos_k ? &*pos_k : nullptr);
    pos_q = in.packed->query_positions;
    pos_k = in.packed->key_positions;
  }
  s.layer = a.layer;
  s.params_name = a.params.empty() ? "--params" : a.params;
  s.config_name = a.config;
  s.q_name = a.q;
  s.k_name = a.k;

  // Sequence length for length-dependent RoPE frequencies: the largest position + 1.
  const int64_t seq_len = given_seq_len.value_or(
      attention_seq_len(batch, seq_q, seq_k, pos_q ? &*pos_q : nullptr, pos_k ? &*pos_k : nullptr));

  ParamMap params = load_params(a, in.holder);
  in.holder.built =
      build_scheme(s, params, model ? &*model : nullptr,
                   SchemeDims{.heads_q = q.shape[2],
                              .heads_kv = k.shape[2],
                              .head_dim = q.shape[3],
                              .seq_len = seq_len},
                   a.reference ? SchemePrecision::kFloat64 : SchemePrecision::kFloat32);

  AttentionOptions& opt = in.options;
  opt.causal = a.causal;
  opt.scale = a.scale;
  opt.window = a.window;
  opt.chunk = a.chunk;
  opt.softcap = a.softcap;
  if (in.packed) opt = in.packed->options(opt);
  opt.allow_fully_masked = a.allow_fully_masked;
  opt.num_threads = a.threads;
  // T5 configs: scale 1 unless --scale; --layer: the layer's scale, window, chunk, sinks (from
  // --params) and the query temperature of Llama 4's NoPE layers, unless given.
  opt = in.holder.built.options(opt);
}

namespace {
// The --params help from the scheme registry: each scheme's tensors and layouts.
std::string params_help() {
  std::string h = "Parameters .safetensors:";
  auto tensors = [](const std::vector<SchemeParamInfo>& ps) {
    std::string t;
    for (const SchemeParamInfo& p : ps) {
      t += (t.empty() ? " " : ", ") + p.name + " " + p.layout + (p.required ? "" : " (optional)");
    }
    return t;
  };
  for (const SchemeInfo& s : attention_schemes()) {
    if (!s.params.empty()) h += " " + s.name + tensors(s.params) + ";";
  }
  return h + " any scheme:" + tensors(common_scheme_params()) +
         " (attention sinks; required by gpt_oss layers)";
}
}  // namespace

namespace {
// The schemes' settings as flags, from the registry: "rope: theta (rope_theta); default 10000;
// > 0. xl: sinusoid base; ...". A flag serving several schemes (--base) is registered once.
void add_setting_flags(CLI::App* app, AttentionArgs& a) {
  for (const SchemeSettingUse& use : scheme_settings()) {
    const SchemeSettingInfo& info = use.setting;
    if (info.flag.empty()) continue;
    std::string help;
    for (const std::string& name : use.schemes) {
      const SchemeSettingInfo& own = *scheme_setting(name, info.keyword);
      const std::string range = setting_range_text(own);
      help += (help.empty() ? "" : ". ") + name + ": " + own.help + " (default " +
              own.default_value + (range.empty() ? "" : "; " + range) + ")";
    }
    std::string& text = a.settings[info.keyword];
    if (info.type == SettingType::kBool) {
      app->add_flag_callback(
          info.flag, [&text] { text = "true"; }, help);
    } else {
      app->add_option(info.flag, text, help)
          ->type_name(info.type == SettingType::kInt     ? "INT"
                      : info.type == SettingType::kFloat ? "FLOAT"
                                                         : "TEXT");
    }
  }
}
}  // namespace

void add_attention_flags(CLI::App* app, AttentionArgs& a, const AttentionFlagHelp& help) {
  app->add_option("--q", a.q, "Queries .npy [batch, seq_q, heads_q, head_dim]")->required();
  app->add_option("--k", a.k, "Keys .npy [batch, seq_k, heads_kv, head_dim]")->required();
  app->add_option("--v", a.v, "Values .npy [batch, seq_k, heads_kv, head_dim]")->required();
  app->add_option("--out", a.out, help.out)->required();
  app->add_option("--scheme", a.scheme, scheme_names_text() + " (required unless --config)")
      ->check(CLI::IsMember(scheme_names()));
  app->add_option("--config", a.config,
                  "Model config.json: scheme and its settings from the model (rope: theta, "
                  "rotary dim, style, scaling at seq_len = max position + 1; alibi: slopes; t5: "
                  "num_buckets, max_distance, default --scale 1; deberta: position_buckets, "
                  "max_relative_positions); q/k heads and head_dim must match it");
  app->add_option("--layer", a.layer,
                  "With --config: the decoder layer (0-based) whose attention to use: its RoPE "
                  "(none on a NoPE layer, whose queries are scaled by the attention temperature), "
                  "sliding window, chunk, softmax scale and sinks (from --params). Required when "
                  "the model's layers differ (gemma2/3, gpt_oss, llama4)");
  app->add_flag("--causal", a.causal, "Key j visible iff pos_k(j) <= pos_q(i)");
  app->add_option("--scale", a.scale, "Score scale (default 1/sqrt(D); DeBERTa 1/sqrt(3D))");
  app->add_option("--params", a.params, params_help());
  add_setting_flags(app, a);
  app->add_option("--positions-q", a.positions_q,
                  "int64 query positions [Lq] or [B, Lq] (.npy); default Lk - Lq + i");
  app->add_option("--positions-k", a.positions_k,
                  "int64 key positions [Lk] or [B, Lk] (.npy); default j");
  app->add_option("--window", a.window, "Sliding window w >= 1: key visible iff |rel| < w");
  app->add_option("--chunk", a.chunk,
                  "Chunked local attention c >= 1 (Llama 4): key visible only within the query's "
                  "chunk, floor(pos_k / c) == floor(pos_q / c), on top of the other masks");
  app->add_option("--cu-seqlens-q", a.cu_seqlens_q,
                  "Packed sequences: int32/int64 .npy [num_seqs + 1] query offsets (0 first, the "
                  "total last); q, k, v are then [total, heads, head_dim] and out [total_q, "
                  "heads_q, head_dim]; positions restart in each sequence, no attention across");
  app->add_option("--cu-seqlens-k", a.cu_seqlens_k,
                  "Packed sequences: int32/int64 .npy [num_seqs + 1] key offsets");
  app->add_option("--softcap", a.softcap,
                  "Logit soft-capping C > 0 (Gemma 2): each score s (scale and positional bias "
                  "included) becomes C tanh(s / C) before the mask and softmax");
  app->add_flag("--allow-fully-masked", a.allow_fully_masked,
                "A query row with no visible key outputs 0 instead of an error");
  app->add_flag("--reference", a.reference, help.reference);
  CLI::Option* out_dtype =
      app->add_option("--out-dtype", a.out_dtype, help.out_dtype)
          ->check(CLI::IsMember({"float32", "float16", "bfloat16", "float64"}));
  if (!a.out_dtype.empty()) out_dtype->capture_default_str();
  app->add_option("--threads", a.threads, "Worker threads (0 = all available)")
      ->capture_default_str();
}

}  // namespace posenc::cli
