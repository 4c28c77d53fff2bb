// cli/cmd_plot.cc - `posenc plot KIND ... --out FILE.png|FILE.svg`: the figures of plot/plots.h.
//
// One CLI11 subcommand per kind (each with its own --help). The output format comes from the
// extension, checked before anything is computed; the figure is rendered in memory and written
// atomically, so a bad option or input leaves no file.
#include <CLI/CLI.hpp>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common.h"
#include "figure.h"
#include "plots.h"
#include "posenc/config.h"
#include "posenc/schemes.h"

namespace posenc::cli {

namespace {

struct Output {
  std::string out;
  double width = 800;
  double height = 0;
  double scale = 1;
};

void add_output_options(CLI::App* app, Output& o) {
  app->add_option("--out", o.out, "Output file: .png or .svg")->required();
  app->add_option("--width", o.width, "Figure width in px")->capture_default_str();
  app->add_option("--height", o.height, "Figure height in px (default: from the content)");
  app->add_option("--scale", o.scale, "PNG pixels per px (2 for high-DPI screens)")
      ->capture_default_str();
}

std::string file_name(const std::string& path) {
  return std::filesystem::path(path).filename().string();
}

// A kind's arguments: its options and how to build its figure once parsed.
struct Kind {
  CLI::App* app = nullptr;
  Output output;
  std::function<plot::Figure()> build;
};

// --- heatmap ----------------------------------------------------------------------------------
struct HeatmapArgs {
  std::string preset, layout = "interleaved", table, colormap;
  int64_t length = 64, dim = 128;
  double base = 1e4;
};

plot::Figure build_heatmap(const CLI::App& app, const HeatmapArgs& a, const Output& out) {
  plot::HeatmapOptions o;
  if (!a.preset.empty()) {
    if (!a.table.empty()) throw UsageError("--preset conflicts with --table");
    o = plot::heatmap_preset(a.preset);
  }
  if (app.count("--length") > 0 || a.preset.empty()) o.length = a.length;
  if (app.count("--dim") > 0 || a.preset.empty()) o.dim = a.dim;
  o.base = a.base;
  o.layout = parse_sin_layout(a.layout, "--layout");
  if (!a.colormap.empty()) {
    o.colormap = a.colormap == "diverging" ? plot::Colormap::kDiverging : plot::Colormap::kViridis;
  }
  o.width = out.width;
  o.height = out.height;
  FloatArray table;
  if (!a.table.empty()) {
    for (const char* f : {"--dim", "--base", "--layout"}) {
      if (app.count(f) > 0) throw UsageError(std::string(f) + " conflicts with --table");
    }
    table = read_float_npy(a.table, 2, "[max_positions, dim]", true);
    o.table = table.view<2>();
    o.table_name = file_name(a.table);
    if (app.count("--length") == 0) o.length = 0;
  }
  return plot::heatmap_figure(o);
}

// --- clock ------------------------------------------------------------------------------------
struct ClockArgs {
  plot::ClockOptions o;
  std::string layout = "interleaved";
  std::vector<double> embedding;
  bool no_embedding = false;
};

// --- similarity / bias: scheme parameters and --config -----------------------------------------
struct SchemeArgs {
  std::string scheme = "all", config;
  int64_t heads = 8, num_buckets = 32, max_distance = 128, shaw_k = 0;
  int64_t position_buckets = -1, max_relative_positions = -1;
};

void add_scheme_options(CLI::App* app, SchemeArgs& a, const std::vector<std::string>& schemes,
                        int64_t shaw_default) {
  a.shaw_k = shaw_default;
  std::string names = "all";
  for (const auto& s : schemes) names += ", " + s;
  app->add_option("--scheme", a.scheme, "Which panels: " + names)
      ->check(CLI::IsMember([&] {
        std::vector<std::string> v = {"all"};
        v.insert(v.end(), schemes.begin(), schemes.end());
        return v;
      }()))
      ->capture_default_str();
  app->add_option("--config", a.config,
                  "A model's config.json: plot its scheme with its parameters");
  app->add_option("--heads", a.heads, "ALiBi heads")->capture_default_str();
  app->add_option("--num-buckets", a.num_buckets, "T5 num_buckets")->capture_default_str();
  app->add_option("--max-distance", a.max_distance, "T5 max_distance")->capture_default_str();
  app->add_option("--shaw-k", a.shaw_k, "Shaw max_relative_position K")->capture_default_str();
  app->add_option("--position-buckets", a.position_buckets, "DeBERTa position_buckets (0: none)");
  app->add_option("--max-relative-positions", a.max_relative_positions,
                  "DeBERTa max_relative_positions");
}

const std::vector<std::string> kSchemeFlags = {"--heads", "--num-buckets", "--max-distance",
                                               "--position-buckets", "--max-relative-positions"};

std::optional<ModelConfig> read_config(const CLI::App& app, const SchemeArgs& a,
                                       std::vector<std::string> extra_flags) {
  if (a.config.empty()) return std::nullopt;
  extra_flags.insert(extra_flags.end(), kSchemeFlags.begin(), kSchemeFlags.end());
  reject_with_config(app, extra_flags);
  return read_model_config(a.config);
}

void apply_scheme_args(const SchemeArgs& a, T5BucketConfig& t5, DebertaBuckets& deberta) {
  t5.num_buckets = a.num_buckets;
  t5.max_distance = a.max_distance;
  if (a.position_buckets >= 0) deberta.position_buckets = a.position_buckets;
  if (a.max_relative_positions >= 0) deberta.max_relative_positions = a.max_relative_positions;
}

struct SimilarityArgs {
  SchemeArgs s;
  int64_t max_offset = 64, dim = 64;
  double base = 1e4;
  uint64_t seed = 7;
};

struct BiasArgs {
  SchemeArgs s;
  int64_t length = 32;
  bool causal = false;
};

struct RopeRotationArgs {
  plot::RopeRotationOptions o;
  std::string config;
};

// Registers a kind's subcommand with the output options and returns it (its args and build()
// are the caller's).
using AddKind = std::function<std::shared_ptr<Kind>(const std::string&, const std::string&)>;

// `posenc plot heatmap`.
void add_heatmap_kind(const AddKind& add_kind) {
  auto k = add_kind("heatmap",
                    "Sinusoidal (or learned) table as a heat map: positions x dimensions, with a "
                    "colour bar");
  auto a = std::make_shared<HeatmapArgs>();
  k->app->add_option("--preset", a->preset, "small (16 x 32) or paper (128 x 512)")
      ->check(CLI::IsMember({"small", "paper"}));
  k->app->add_option("--length", a->length, "Positions (rows)")->capture_default_str();
  k->app->add_option("--dim", a->dim, "Model dimension d (columns)")->capture_default_str();
  k->app->add_option("--base", a->base, "Sinusoid base")->capture_default_str();
  k->app->add_option("--layout", a->layout, "interleaved (paper) or concat")
      ->check(CLI::IsMember({"interleaved", "concat"}))
      ->capture_default_str();
  k->app->add_option("--table", a->table,
                     "A learned table [max_positions, dim] (.npy) instead of the sinusoids");
  k->app
      ->add_option("--colormap", a->colormap,
                   "viridis or diverging (default: viridis; diverging for --table)")
      ->check(CLI::IsMember({"viridis", "diverging"}));
  CLI::App* sub = k->app;
  Kind* kp = k.get();
  k->build = [sub, a, kp] { return build_heatmap(*sub, *a, kp->output); };
}

// `posenc plot clock`.
void add_clock_kind(const AddKind& add_kind) {
  auto k = add_kind("clock",
                    "Each sin/cos pair of PE(p) as a clock hand on the unit circle, one clock "
                    "per position, and the embedding + PE circle");
  auto a = std::make_shared<ClockArgs>();
  k->app->add_option("--dim", a->o.dim, "Model dimension d (d/2 hands)")->capture_default_str();
  k->app->add_option("--base", a->o.base, "Sinusoid base")->capture_default_str();
  k->app->add_option("--layout", a->layout, "interleaved or concat")
      ->check(CLI::IsMember({"interleaved", "concat"}))
      ->capture_default_str();
  k->app->add_option("--positions", a->o.positions, "Positions, comma separated (at most 16)")
      ->delimiter(',')
      ->capture_default_str();
  k->app
      ->add_option("--embedding", a->embedding,
                   "First two dims of the word embedding, X,Y (default 1.6,1.1)")
      ->delimiter(',')
      ->expected(2);
  k->app
      ->add_option("--circle-positions", a->o.circle_positions,
                   "Positions drawn around the embedding")
      ->capture_default_str();
  k->app->add_flag("--no-embedding", a->no_embedding, "Leave out the embedding panel");
  k->app->add_option("--columns", a->o.columns, "Clocks per row")->capture_default_str();
  Kind* kp = k.get();
  k->build = [a, kp] {
    plot::ClockOptions o = a->o;
    o.layout = parse_sin_layout(a->layout, "--layout");
    if (a->embedding.size() == 2) {
      o.embedding_x = a->embedding[0];
      o.embedding_y = a->embedding[1];
    }
    o.embedding_panel = !a->no_embedding;
    o.width = kp->output.width;
    o.height = kp->output.height;
    return plot::clock_figure(o);
  };
}

// `posenc plot similarity`.
void add_similarity_kind(const AddKind& add_kind) {
  auto k = add_kind("similarity",
                    "Scores against the offset k: PE(p).PE(p+k), <rope(q,m), rope(k,m+k)>, "
                    "ALiBi, T5, Shaw and DeBERTa terms");
  auto a = std::make_shared<SimilarityArgs>();
  add_scheme_options(k->app, a->s, {"sinusoidal", "rope", "alibi", "t5", "shaw", "deberta"}, 8);
  k->app->add_option("--max-offset", a->max_offset, "Offsets k in [-K, K]")->capture_default_str();
  k->app->add_option("--dim", a->dim, "Sinusoidal d and RoPE head_dim")->capture_default_str();
  k->app->add_option("--base", a->base, "Sinusoid and RoPE base")->capture_default_str();
  k->app->add_option("--seed", a->seed, "Seed of the random q, k and tables")
      ->capture_default_str();
  CLI::App* sub = k->app;
  Kind* kp = k.get();
  k->build = [sub, a, kp] {
    plot::SimilarityOptions o;
    o.scheme = a->s.scheme;
    o.max_offset = a->max_offset;
    o.dim = a->dim;
    o.base = a->base;
    o.heads = a->s.heads;
    o.shaw_k = a->s.shaw_k;
    o.seed = a->seed;
    apply_scheme_args(a->s, o.t5, o.deberta);
    o.model = read_config(*sub, a->s, {"--dim", "--base"});
    o.model_name = file_name(a->s.config);
    o.width = kp->output.width;
    o.height = kp->output.height;
    return plot::similarity_figure(o);
  };
}

// `posenc plot rope-rotation`.
void add_rope_rotation_kind(const AddKind& add_kind) {
  auto k = add_kind("rope-rotation",
                    "A unit vector in one RoPE pair rotated through positions, for several "
                    "frequencies");
  auto a = std::make_shared<RopeRotationArgs>();
  k->app->add_option("--head-dim", a->o.head_dim, "head_dim")->capture_default_str();
  k->app->add_option("--base", a->o.base, "RoPE base theta")->capture_default_str();
  k->app->add_option("--positions", a->o.positions, "Positions 0 .. N-1")->capture_default_str();
  k->app
      ->add_option("--pairs", a->o.pairs,
                   "Rotation pairs, comma separated (default 0, R/16, R/8, R/4)")
      ->delimiter(',');
  k->app->add_option("--config", a->config, "A RoPE model's config.json (its frequencies)");
  CLI::App* sub = k->app;
  Kind* kp = k.get();
  k->build = [sub, a, kp] {
    plot::RopeRotationOptions o = a->o;
    if (!a->config.empty()) {
      reject_with_config(*sub, {"--head-dim", "--base"});
      o.model = read_rope_model_config(a->config);
      o.model_name = file_name(a->config);
    }
    o.width = kp->output.width;
    o.height = kp->output.height;
    return plot::rope_rotation_figure(o);
  };
}

// `posenc plot bias`.
void add_bias_kind(const AddKind& add_kind) {
  auto k = add_kind("bias",
                    "The [Lq, Lk] bias or index map: ALiBi per head, T5 buckets, Shaw and "
                    "DeBERTa clipping");
  auto a = std::make_shared<BiasArgs>();
  std::vector<std::string> bias_schemes;  // the registry's schemes with a bias or index map
  for (const SchemeInfo& s : attention_schemes()) {
    if (s.bias_map) bias_schemes.push_back(s.name);
  }
  add_scheme_options(k->app, a->s, bias_schemes, 4);
  k->app->add_option("--length", a->length, "Queries = keys = L")->capture_default_str();
  k->app->add_flag("--causal", a->causal, "Mask keys after the query (T5: causal buckets)");
  CLI::App* sub = k->app;
  Kind* kp = k.get();
  k->build = [sub, a, kp] {
    plot::BiasOptions o;
    o.scheme = a->s.scheme;
    o.length = a->length;
    o.causal = a->causal;
    o.heads = a->s.heads;
    o.shaw_k = a->s.shaw_k;
    apply_scheme_args(a->s, o.t5, o.deberta);
    o.model = read_config(*sub, a->s, {});
    o.model_name = file_name(a->s.config);
    o.width = kp->output.width;
    o.height = kp->output.height;
    return plot::bias_figure(o);
  };
}

// `posenc plot attention`.
void add_attention_kind(const AddKind& add_kind) {
  auto k = add_kind("attention",
                    "Attention weights for the same q and k under each scheme, side by side");
  auto a = std::make_shared<plot::AttentionPlotOptions>();
  k->app->add_option("--length", a->length, "Tokens L")->capture_default_str();
  k->app->add_option("--head-dim", a->head_dim, "head_dim (>= L; default max(32, L))");
  k->app->add_flag("--causal", a->causal, "Causal mask");
  k->app
      ->add_option("--content", a->content, "constant (q = k, the same for every token) or random")
      ->check(CLI::IsMember({"constant", "random"}))
      ->capture_default_str();
  k->app->add_option("--base", a->base, "Sinusoid and RoPE base")->capture_default_str();
  k->app->add_option("--seed", a->seed, "Seed of the content and tables")->capture_default_str();
  Kind* kp = k.get();
  k->build = [a, kp] {
    plot::AttentionPlotOptions o = *a;
    o.width = kp->output.width;
    o.height = kp->output.height;
    return plot::attention_figure(o);
  };
}

// `posenc plot extrapolation`.
void add_extrapolation_kind(const AddKind& add_kind) {
  auto k = add_kind("extrapolation",
                    "Beyond the training length: ALiBi decay, T5 saturation, sinusoid and RoPE "
                    "scores, Shaw clipping, learned refusal");
  auto a = std::make_shared<plot::ExtrapolationOptions>();
  k->app->add_option("--train-length", a->train_length, "Training length (learned table rows)")
      ->capture_default_str();
  k->app->add_option("--max-length", a->max_length, "Largest distance shown")
      ->capture_default_str();
  k->app->add_option("--dim", a->dim, "Sinusoidal d and RoPE head_dim")->capture_default_str();
  k->app->add_option("--base", a->base, "Sinusoid and RoPE base")->capture_default_str();
  k->app->add_option("--heads", a->heads, "ALiBi heads")->capture_default_str();
  k->app->add_option("--num-buckets", a->t5.num_buckets, "T5 num_buckets")->capture_default_str();
  k->app->add_option("--max-distance", a->t5.max_distance, "T5 max_distance")
      ->capture_default_str();
  k->app->add_option("--shaw-k", a->shaw_k, "Shaw K")->capture_default_str();
  k->app
      ->add_option("--rope-scaling", a->rope_scaling,
                   "Linear RoPE scaling factor shown beside the unscaled one (1: none)")
      ->capture_default_str();
  Kind* kp = k.get();
  k->build = [a, kp] {
    plot::ExtrapolationOptions o = *a;
    o.width = kp->output.width;
    o.height = kp->output.height;
    return plot::extrapolation_figure(o);
  };
}

}  // namespace

Command add_plot_command(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand(
      "plot",
      "Draw a figure of the encodings (PNG or SVG by the extension of --out). Kinds: heatmap, "
      "clock, similarity, rope-rotation, bias, attention, extrapolation; `posenc plot KIND "
      "--help` for each");
  // No require_subcommand: an unknown kind lands in remaining() and gets a message naming the
  // kinds (CLI11 would only say that a subcommand is required).
  app->allow_extras();
  auto kinds = std::make_shared<std::vector<std::shared_ptr<Kind>>>();
  const AddKind add_kind = [&](const std::string& name, const std::string& help) {
    auto k = std::make_shared<Kind>();
    k->app = app->add_subcommand(name, help);
    add_output_options(k->app, k->output);
    kinds->push_back(k);
    return k;
  };

  add_heatmap_kind(add_kind);
  add_clock_kind(add_kind);
  add_similarity_kind(add_kind);
  add_rope_rotation_kind(add_kind);
  add_bias_kind(add_kind);
  add_attention_kind(add_kind);
  add_extrapolation_kind(add_kind);

  return {
      app, [kinds, app] {
        for (const auto& k : *kinds) {
          if (!k->app->parsed()) continue;
          const std::vector<std::string> extra = app->remaining(true);
          if (!extra.empty()) {
            std::string list;
            for (const auto& e : extra) list += (list.empty() ? "" : " ") + e;
            throw UsageError(k->app->get_name() + ": unexpected arguments: " + list);
          }
          const plot::Format format = plot::format_from_path(k->output.out);
          const plot::Figure fig = k->build();
          const std::vector<unsigned char> bytes = plot::render(fig, format, k->output.scale);
          write_file_atomic(k->output.out, bytes.data(), bytes.size());
          return 0;
        }
        std::string kinds_list;
        for (const auto& n : plot::plot_kinds()) {
          kinds_list += (kinds_list.empty() ? "" : ", ") + n;
        }
        const std::vector<std::string> rest = app->remaining();
        if (!rest.empty() && !rest.front().empty() && rest.front()[0] != '-') {
          throw UsageError("unknown plot kind '" + rest.front() + "' (kinds: " + kinds_list + ")");
        }
        throw UsageError("no plot kind given (kinds: " + kinds_list + ")");
      }};
}

}  // namespace posenc::cli
