// cli/cmd_rope.cc - `posenc rope`: rotate x [batch, seq, heads, head_dim] (docs/rope.md), and
// `posenc rope-freqs`: the inverse frequencies and attention factor a configuration uses.
//
// Frequencies come from flags (--base, --rotary-dim, --style) or from a model's config.json
// (--config: posenc::read_model_config + model_rope_frequencies, including rope scaling and
// M-RoPE), optionally replaced by an injected table (--inv-freq).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "posenc/config.h"
#include "posenc/rope.h"

namespace posenc::cli {

namespace {

// The flags that choose the frequencies (shared by rope and rope-freqs).
struct FreqFlags {
  std::string config;
  std::optional<double> base;
  std::optional<int64_t> rotary_dim;
  std::optional<std::string> style;
  std::optional<int64_t> seq_len;
  std::string angles = "accurate";
  std::string inv_freq;
  std::optional<int64_t> layer;
};

struct RopeSetup {
  RopeFrequencies freqs;
  RopeStyle style = RopeStyle::kHalf;
  double base = 1e4;
  RopeScalingType scaling = RopeScalingType::kDefault;
  std::optional<MRope> mrope;
  std::optional<ModelConfig> model;
  std::optional<int64_t> layer;
  bool nope = false;  // the layer applies no RoPE (Llama 4's NoPE layers): freqs empty
  std::optional<AttentionTemperature> temperature;  // the layer's attention-temperature tuning
};

void add_freq_flags(CLI::App* app, FreqFlags& f, bool with_inv_freq) {
  app->add_option("--config", f.config,
                  "Model config.json (HF style): head_dim, rotary dim, theta, style, rope "
                  "scaling, attention factor and M-RoPE from it; excludes --base, --rotary-dim, "
                  "--style");
  app->add_option("--base", f.base, "theta (rope_theta), default 10000");
  app->add_option("--rotary-dim", f.rotary_dim,
                  "Rotary dim R (even, <= head_dim); 0 or absent: R = head_dim");
  app->add_option("--style", f.style,
                  "half (GPT-NeoX, HF; default) or interleaved (GPT-J, RoFormer)")
      ->check(CLI::IsMember({"half", "interleaved"}));
  app->add_option("--angles", f.angles,
                  "accurate (p * inv_freq, cos and sin in double) or float32 (the frameworks' "
                  "float32 recipe; docs/precision.md)")
      ->check(CLI::IsMember({"accurate", "float32"}))
      ->capture_default_str();
  app->add_option("--layer", f.layer,
                  "With --config: the decoder layer (0-based) whose RoPE to use; required when the "
                  "model's layers use different RoPE settings (Gemma 3's local and global layers)");
  if (with_inv_freq) {
    app->add_option("--inv-freq", f.inv_freq,
                    "Inject inverse frequencies .npy (float64 or float32 [R/2]) instead of "
                    "computing them; keeps the config's attention factor (else 1) and --angles");
  }
}

// The --config file (nullopt without one), checked first: flags it replaces are conflicts, and
// it must describe a RoPE model.
std::optional<ModelConfig> read_config(const CLI::App& app, const FreqFlags& f) {
  if (f.config.empty()) return std::nullopt;
  reject_with_config(app, {"--base", "--rotary-dim", "--style", "--head-dim"});
  return read_rope_model_config(f.config);
}

// Resolves the frequencies for inputs with head dim `head_dim` (0: not known, rope-freqs without
// --head-dim) at sequence length `seq_len`.
// `model` is the --config file's contents (read_config). allow_nope: a --layer without RoPE gives
// a setup with nope set (rope-freqs reports it) instead of a usage error (rope has nothing to
// rotate with).
RopeSetup rope_setup(const FreqFlags& f, const std::optional<ModelConfig>& model, int64_t head_dim,
                     const std::string& head_dim_origin, int64_t seq_len, bool allow_nope = false) {
  require_at_least("--seq-len", seq_len, 0);
  const RopeAngles angles = parse_rope_angles(f.angles, "--angles");
  RopeSetup s;
  if (model) {
    s.model = model;
    const ModelConfig& m = *model;
    // DeepSeek's MLA heads: the full q / k head or its rotary part alone.
    const bool rotary_only = m.rope_offset > 0 && head_dim == m.rope.head_dim;
    if (head_dim > 0 && head_dim != m.head_dim && !rotary_only) {
      throw ShapeError(head_dim_origin + ": head_dim " + std::to_string(head_dim) +
                       " does not match " + f.config + ": head_dim " + std::to_string(m.head_dim) +
                       (m.rope_offset > 0
                            ? " (or its rotary part, " + std::to_string(m.rope.head_dim) + ")"
                            : std::string()) +
                       " (model_type '" + m.model_type + "')");
    }
    // The layer: --layer N, or any when every RoPE layer has the same settings.
    const RopeConfig* rc = &m.rope;
    if (f.layer) {
      const ModelLayer& l = model_layer(m, *f.layer);
      s.layer = f.layer;
      s.temperature = l.temperature;
      if (!l.rope && allow_nope) {
        s.nope = true;
        s.style = m.rope.style;
        s.freqs.angles = angles;
        return s;
      }
      if (!l.rope) {
        throw UsageError("--layer " + std::to_string(*f.layer) + ": layer " +
                         std::to_string(*f.layer) + " of " + f.config +
                         " uses no RoPE (a NoPE layer)");
      }
      rc = &l.rope_config;
    } else {
      const ModelLayer* first = nullptr;
      for (const ModelLayer& l : m.layers) {
        if (!l.rope) continue;
        if (first == nullptr) {
          first = &l;
        } else if (l.rope_config.base != first->rope_config.base ||
                   l.rope_config.scaling.type != first->rope_config.scaling.type ||
                   l.rope_config.scaling.factor != first->rope_config.scaling.factor) {
          throw UsageError(f.config + ": the layers of model_type '" + m.model_type +
                           "' use different RoPE settings (layer " + std::to_string(first->index) +
                           " and layer " + std::to_string(l.index) +
                           "); pass --layer N (see posenc describe)");
        }
      }
      if (first != nullptr) rc = &first->rope_config;
    }
    s.style = rc->style;
    s.base = rc->base;
    s.scaling = rc->scaling.type;
    s.mrope = m.mrope;
    s.freqs = rope_frequencies(*rc, seq_len, angles);
    if (!f.inv_freq.empty()) {
      s.freqs.inv_freq = read_inv_freq(f.inv_freq, s.freqs.rotary_dim(), f.config, m.head_dim);
    }
    return s;
  }
  if (f.style) s.style = parse_rope_style(*f.style, "--style");
  const int64_t rotary = f.rotary_dim.value_or(0);
  if (!f.inv_freq.empty()) {
    if (f.base) throw UsageError("--base conflicts with --inv-freq");
    const int64_t known = rotary > 0 ? rotary : (f.rotary_dim ? head_dim : 0);
    s.freqs.inv_freq = read_inv_freq(f.inv_freq, known, "--rotary-dim", head_dim);
    s.freqs.angles = angles;
    return s;
  }
  RopeConfig cfg;
  cfg.head_dim = head_dim > 0 ? head_dim : rotary;
  cfg.rotary_dim = rotary;
  cfg.base = f.base.value_or(1e4);
  cfg.style = s.style;
  if (cfg.head_dim <= 0) throw UsageError("--config or --head-dim is required");
  validate(cfg);
  s.base = cfg.base;
  s.freqs = rope_frequencies(cfg, seq_len, angles);
  return s;
}

// ---------------------------------------------------------------------------------------------
// rope

struct RopeArgs {
  std::string in;
  std::string out;
  FreqFlags freq;
  std::optional<int64_t> offset;
  std::string positions;
  bool inverse = false;
  std::string out_dtype;  // empty: x's half type, else float32
};

// Positions for an M-RoPE model: [3, seq] or [3, batch, seq] int64 are (t, h, w); anything else
// is a 1-component file (text tokens, t = h = w). Returns nullopt for the latter.
std::optional<std::array<Positions, 3>> read_mrope_positions(const std::string& path, int64_t batch,
                                                             int64_t seq) {
  const Tensor t = read_npy(path);
  const bool three = (t.shape.size() == 2 && t.shape[0] == 3 && t.shape[1] == seq) ||
                     (t.shape.size() == 3 && t.shape[0] == 3);
  if (!three) return std::nullopt;
  if (t.dtype != DType::kI64 && t.dtype != DType::kI32) {
    throw IoError(path + ": position ids must be int64 (or int32), got " + dtype_name(t.dtype));
  }
  if (t.shape.size() == 3 && (t.shape[2] != seq || (t.shape[1] != batch && t.shape[1] != 1))) {
    throw ShapeError(path + ": M-RoPE positions " + shape_string(t.shape) +
                     " do not match [3, batch, seq] = [3, " + std::to_string(batch) + ", " +
                     std::to_string(seq) + "]");
  }
  const std::vector<int64_t> ids = t.to_i64(path);
  const bool per_row = t.shape.size() == 3 && t.shape[1] == batch && batch > 1;
  const std::size_t n = ids.size() / 3;
  static const char* kNames[] = {"t", "h", "w"};
  std::array<Positions, 3> p;
  for (std::size_t c = 0; c < 3; ++c) {
    std::vector<int64_t> part(ids.begin() + static_cast<std::ptrdiff_t>(c * n),
                              ids.begin() + static_cast<std::ptrdiff_t>((c + 1) * n));
    p[c] = per_row ? Positions::per_row(std::move(part), batch, seq)
                   : Positions::shared(std::move(part));
    p[c].validate(batch, seq, path + " (" + kNames[c] + ")");
  }
  return p;
}

int run_rope(const CLI::App& app, const RopeArgs& a) {
  if (a.offset && !a.positions.empty()) {
    throw UsageError("--offset and --positions are mutually exclusive");
  }
  if (a.freq.layer && a.freq.config.empty()) throw UsageError("--layer needs --config");
  const std::optional<ModelConfig> model = read_config(app, a.freq);
  const NpyView xin = map_tensor_input(a.in, "x");
  require_rank(xin, 4, "[batch, seq, heads, head_dim]", a.in);
  // x's half type unless --out-dtype says otherwise (bfloat16 goes to .safetensors).
  const DType dtype = output_dtype(a.out_dtype, xin.dtype, a.out);
  FloatArray x = to_float_input(xin, a.in, true).copy();
  require_at_least(a.in + ": head_dim (the last dimension)", x.shape[3], 1);
  const int64_t batch = x.shape[0], seq = x.shape[1];
  const bool mrope_config = model && model->mrope;
  std::array<Positions, 3> thw;
  bool three = false;
  if (mrope_config && !a.positions.empty()) {
    if (auto p = read_mrope_positions(a.positions, batch, seq)) {
      thw = std::move(*p);
      three = true;
    }
  } else if (!a.positions.empty()) {
    const Tensor t = read_npy(a.positions);
    if (t.shape.size() == 3) {
      throw UsageError(a.positions + ": 3-component positions " + shape_string(t.shape) +
                       " need an M-RoPE model (--config with mrope_section)");
    }
  }
  if (!three) thw.fill(positions_from_flags(a.offset, a.positions, batch, seq));

  int64_t max_pos = 0;
  for (const Positions& p : thw) max_pos = std::max(max_pos, p.max_position(batch, seq));
  const int64_t seq_len = a.freq.seq_len.value_or(max_pos + 1);
  const RopeSetup s = rope_setup(a.freq, model, x.shape[3], a.in, seq_len);

  FloatArray y;
  y.shape = x.shape;
  y.data.resize(x.data.size());
  const Direction dir = a.inverse ? Direction::kInverse : Direction::kForward;
  if (s.mrope) {
    apply_mrope(s.freqs, s.style, *s.mrope, x.view<4>(), y.mutable_view<4>(), thw, dir);
  } else if (s.model) {
    // The model's own layout (DeepSeek: rotary part at the head's end, de-interleaved pairs).
    apply_model_rope(*s.model, s.freqs, x.view<4>(), y.mutable_view<4>(), &thw[0], dir);
  } else {
    apply_rope(s.freqs, s.style, x.view<4>(), y.mutable_view<4>(), &thw[0], dir);
  }
  write_output(a.out, dtype, y.shape, y.data);
  return 0;
}

// ---------------------------------------------------------------------------------------------
// rope-freqs

struct RopeFreqsArgs {
  FreqFlags freq;
  int64_t head_dim = 0;
  std::string out;
  bool details = false;
};

int run_rope_freqs(const CLI::App& app, const RopeFreqsArgs& a) {
  const int64_t seq_len = a.freq.seq_len.value_or(0);
  if (a.freq.layer && a.freq.config.empty()) throw UsageError("--layer needs --config");
  if (a.freq.config.empty() && a.head_dim == 0 && !a.freq.rotary_dim) {
    throw UsageError("--config (or --head-dim) is required");
  }
  if (a.freq.config.empty()) require_at_least("--head-dim", a.head_dim, 0);
  const std::optional<ModelConfig> model = read_config(app, a.freq);
  const RopeSetup s =
      rope_setup(a.freq, model, a.head_dim, "--head-dim", seq_len, /*allow_nope=*/true);
  // A NoPE layer writes an empty table (float64 [0]).
  write_f64(a.out, {static_cast<int64_t>(s.freqs.inv_freq.size())}, s.freqs.inv_freq);

  // Exactly the three keys rotary_dim, attention_factor, style for a RoPE layer; a NoPE layer
  // adds "nope": true and its attention-temperature tuning when it has one; --details appends
  // the rest.
  std::string line = "{\"rotary_dim\": " + std::to_string(s.freqs.rotary_dim()) +
                     ", \"attention_factor\": " + full_precision(s.freqs.attention_factor) +
                     ", \"style\": \"" + style_name(s.style) + "\"";
  if (s.nope) line += ", \"nope\": true";
  if (s.temperature) {
    line += ", \"temperature\": {\"floor_scale\": " + full_precision(s.temperature->floor_scale) +
            ", \"attn_scale\": " + full_precision(s.temperature->attn_scale) + "}";
  }
  if (!a.details) {
    std::cout << line << "}" << std::endl;
    return 0;
  }
  if (s.nope) {
    line += ", \"scaling\": null, \"base\": null";
  } else {
    line += ", \"scaling\": \"" + std::string(scaling_name(s.scaling)) +
            "\", \"base\": " + full_precision(s.base);
  }
  line += ", \"seq_len\": " + std::to_string(seq_len) + ", \"angles\": \"" + a.freq.angles + "\"";
  if (s.model) {
    line += ", \"model_type\": \"" + json_escape(s.model->model_type) +
            "\", \"head_dim\": " + std::to_string(s.model->head_dim);
  }
  if (s.layer) line += ", \"layer\": " + std::to_string(*s.layer);
  if (s.mrope) {
    line += std::string(", \"mrope\": \"") +
            (s.mrope->layout == MRopeLayout::kInterleaved ? "interleaved" : "sectioned") +
            "\", \"mrope_section\": [" + std::to_string(s.mrope->sections[0]) + ", " +
            std::to_string(s.mrope->sections[1]) + ", " + std::to_string(s.mrope->sections[2]) +
            "]";
  }
  std::cout << line << "}" << std::endl;
  return 0;
}

}  // namespace

Command add_rope_command(CLI::App& parent) {
  auto a = std::make_shared<RopeArgs>();
  CLI::App* app = parent.add_subcommand(
      "rope", "Apply rotary position embedding to x [batch, seq, heads, head_dim] (.npy)");
  app->footer(
      "With --config, x's head_dim must equal the config's. M-RoPE configs (qwen2_vl, ...) take "
      "3-component positions --positions P.npy int64 [3, seq] or [3, batch, seq] (t, h, w); "
      "1-component positions or --offset rotate text tokens (t = h = w); with an M-RoPE config a "
      "[3, seq] file is read as (t, h, w) even when batch is 3. --seq-len defaults to "
      "the largest position + 1 (dynamic NTK and LongRoPE depend on it).");
  app->add_option("--in", a->in,
                  "Input [batch, seq, heads, head_dim]: .npy (float16, float32 or float64) or "
                  ".safetensors (one tensor or one named 'x'; also bfloat16)")
      ->required();
  app->add_option("--out", a->out,
                  "Output, same shape: .npy, or .safetensors (one tensor 'out'; needed for "
                  "bfloat16)")
      ->required();
  app->add_option("--out-dtype", a->out_dtype,
                  "float32, float16 or bfloat16 (default: x's type when it is float16 / "
                  "bfloat16, else float32); rounded once from the float32 result")
      ->check(CLI::IsMember({"float32", "float16", "bfloat16"}));
  add_freq_flags(app, a->freq, true);
  app->add_option("--seq-len", a->freq.seq_len,
                  "Sequence length L for length-dependent scaling (default: max position + 1)");
  auto* offset = app->add_option("--offset", a->offset, "Token i at position K + i (default 0)");
  auto* positions = app->add_option(
      "--positions", a->positions,
      "int64 position ids [seq] or [batch, seq] (.npy); M-RoPE also [3, seq], [3, batch, seq]");
  offset->excludes(positions);
  app->add_flag("--inverse", a->inverse, "Rotate by -angle (the inverse / backward)");
  return {app, [a, app] { return run_rope(*app, *a); }};
}

Command add_rope_freqs_command(CLI::App& parent) {
  auto a = std::make_shared<RopeFreqsArgs>();
  CLI::App* app = parent.add_subcommand(
      "rope-freqs",
      "Write the RoPE inverse frequencies (float64 [R/2] .npy) of a config and print one JSON "
      "line {\"rotary_dim\", \"attention_factor\", \"style\", ...}");
  app->footer(
      "--seq-len L (default 0) is the sequence length (max position + 1) the frequencies are "
      "for: only dynamic NTK and LongRoPE depend on it; 0 means a short sequence (dynamic: the "
      "unscaled base; LongRoPE: short_factor). Without --config: --head-dim D, --rotary-dim, "
      "--base, --style as for `posenc rope`. With --layer N, a layer "
      "without RoPE (Llama 4's NoPE layers) exits 0 with \"nope\": true, \"rotary_dim\": 0, "
      "attention factor 1, an empty table, and its attention-temperature tuning as "
      "\"temperature\": {\"floor_scale\", \"attn_scale\"} when the layer has it.");
  add_freq_flags(app, a->freq, false);
  app->add_option("--seq-len", a->freq.seq_len,
                  "Sequence length L (default 0: the short / original regime)");
  app->add_option("--head-dim", a->head_dim, "Head dim D (without --config)");
  app->add_option("--out", a->out, "Output .npy, float64 [R/2]")->required();
  app->add_flag("--details", a->details,
                "Also print scaling, base, seq_len, angles, model_type, head_dim (and M-RoPE)");
  return {app, [a, app] { return run_rope_freqs(*app, *a); }};
}

}  // namespace posenc::cli
