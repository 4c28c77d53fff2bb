// cli/attention_common.cc - the flags, inputs and scheme building that `posenc attention` and
// `posenc attention-grad` share (see attention_common.h).
#include "attention_common.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace posenc::cli {

namespace {

class SchemeBuilder {
 public:
  SchemeBuilder(const AttentionArgs& a, SchemeHolder& h) : a_(a), h_(h) {}

  void load_params(bool required) {
    if (a_.params.empty()) {
      if (required) {
        throw UsageError("--scheme " + a_.scheme + " needs --params P.safetensors with " +
                         needed_tensors());
      }
      return;
    }
    h_.file = read_safetensors(a_.params);
  }

  // A parameter tensor as float32, checked for rank (one of `ranks`) and finiteness.
  const FloatArray* get(const std::string& name, std::vector<std::size_t> ranks,
                        const std::string& layout, bool required) {
    const Tensor* t = find_tensor(h_.file, name);
    if (!t) {
      if (!required) return nullptr;
      if (a_.params.empty()) {
        throw UsageError("--scheme " + a_.scheme + " needs --params with tensor '" + name + "'");
      }
      t = &require_tensor(h_.file, name, a_.params, "--scheme " + a_.scheme);
    }
    const std::string what = a_.params + ": " + name;
    if (std::find(ranks.begin(), ranks.end(), t->shape.size()) == ranks.end()) {
      require_rank(*t, ranks.front(), layout, what);
    }
    h_.arrays.push_back(to_float_array(*t, what, true));
    return &h_.arrays.back();
  }

  std::string needed_tensors() const {
    if (a_.scheme == "t5") return "'relative_attention_bias' [num_buckets, heads]";
    if (a_.scheme == "shaw") return "'rel_k' (and optionally 'rel_v') [2K+1, head_dim]";
    if (a_.scheme == "xl") return "'r_w_bias', 'r_r_bias' [heads, head_dim], 'r_net'";
    if (a_.scheme == "deberta") return "'pos_key', 'pos_query' [2K, heads, head_dim]";
    return "its parameter tensors";
  }

 private:
  const AttentionArgs& a_;
  SchemeHolder& h_;
};

View<const float, 3> shaw_view(const FloatArray* t) {
  if (!t) return {};
  return t->shape.size() == 2 ? shaw_table(t->view<2>()) : t->view<3>();
}

// `model`: the --config file (nullptr without one); its settings replace the scheme flags.
void build_scheme(const AttentionArgs& a, const ModelConfig* model, int64_t head_dim,
                  int64_t seq_len, SchemeHolder& h) {
  SchemeBuilder b(a, h);
  const std::string& s = a.scheme;
  const RopeAngles angles = parse_rope_angles(a.angles);
  if (s == "none") {
    h.scheme = NoPositions{};
  } else if (s == "rope" && model) {
    // M-RoPE configs: text positions (t = h = w) make M-RoPE plain RoPE with these frequencies.
    h.scheme = Rope{model_rope_frequencies(*model, seq_len, angles), model->rope.style};
  } else if (s == "rope") {
    RopeConfig cfg;
    cfg.head_dim = head_dim;
    cfg.rotary_dim = a.rotary_dim;
    cfg.base = a.base;
    cfg.style = parse_rope_style(a.style);
    validate(cfg);
    h.scheme = Rope{rope_frequencies(cfg, seq_len, angles), cfg.style};
  } else if (s == "alibi") {
    b.load_params(false);
    Alibi alibi;
    alibi.max_bias = a.max_bias;
    if (model) {
      if (find_tensor(h.file, "slopes")) {
        throw UsageError(a.params +
                         ": tensor 'slopes' conflicts with --config (the config's "
                         "slopes are used)");
      }
      alibi.slopes = alibi_slopes(model->alibi);
    } else if (b.get("slopes", {1}, "[heads]", false)) {
      // Slopes are double in the API: keep a float64 file's precision.
      const std::string what = a.params + ": slopes";
      alibi.slopes = find_tensor(h.file, "slopes")->to_f64(what);
    }
    h.scheme = std::move(alibi);
  } else if (s == "t5") {
    b.load_params(true);
    const FloatArray* table = b.get("relative_attention_bias", {2}, "[num_buckets, heads]", true);
    if (model && model->t5.num_buckets != table->shape[0]) {
      throw ShapeError(a.params + ": relative_attention_bias has " +
                       std::to_string(table->shape[0]) + " buckets, but " + a.config +
                       " says relative_attention_num_buckets " +
                       std::to_string(model->t5.num_buckets));
    }
    if (a.num_buckets && *a.num_buckets != table->shape[0]) {
      throw UsageError("--num-buckets " + std::to_string(*a.num_buckets) + " does not match " +
                       a.params + ": relative_attention_bias with " +
                       std::to_string(table->shape[0]) + " buckets");
    }
    h.scheme = T5Bias{table->view<2>(), a.max_distance, std::nullopt};
  } else if (s == "shaw") {
    b.load_params(true);
    const FloatArray* rk =
        b.get("rel_k", {2, 3}, "[2K+1, head_dim] or [2K+1, heads, head_dim]", true);
    const FloatArray* rv =
        b.get("rel_v", {2, 3}, "[2K+1, head_dim] or [2K+1, heads, head_dim]", false);
    Shaw shaw{shaw_view(rk), shaw_view(rv)};
    // One shared table with one per-head table: broadcast the shared one over the heads
    // (stride 0), as the library wants both with the same number of table heads.
    if (rv && shaw.rel_k.shape[1] != shaw.rel_v.shape[1]) {
      View<const float, 3>& shared = shaw.rel_k.shape[1] == 1 ? shaw.rel_k : shaw.rel_v;
      const int64_t heads = std::max(shaw.rel_k.shape[1], shaw.rel_v.shape[1]);
      if (shared.shape[1] == 1) {
        shared.shape[1] = heads;
        shared.stride[1] = 0;
      }
    }
    h.scheme = shaw;
  } else if (s == "xl") {
    b.load_params(true);
    const FloatArray* u = b.get("r_w_bias", {2}, "[heads, head_dim]", true);
    const FloatArray* v = b.get("r_r_bias", {2}, "[heads, head_dim]", true);
    const FloatArray* r = b.get("r_net", {2}, "[heads * head_dim, d_model]", true);
    h.scheme = TransformerXL{u->view<2>(), v->view<2>(), r->view<2>(), a.base};
  } else if (s == "deberta") {
    DebertaBuckets buckets;
    buckets.max_relative_positions = a.max_relative_positions;
    buckets.position_buckets = a.position_buckets;
    buckets.float64_log = a.deberta_float64_log;
    buckets.p2c = a.deberta_p2c == "model" ? DebertaP2c::kModel : DebertaP2c::kSpec;
    validate(buckets);
    b.load_params(true);
    const FloatArray* pk = b.get("pos_key", {3}, "[2K, heads, head_dim]", true);
    const FloatArray* pq = b.get("pos_query", {3}, "[2K, heads, head_dim]", true);
    const int64_t k = buckets.span();
    const std::string origin =
        model
            ? a.config + ": " +
                  (buckets.position_buckets > 0 ? "position_buckets " : "max_relative_positions ") +
                  std::to_string(k)
        : buckets.position_buckets > 0 ? "--position-buckets " + std::to_string(k)
                                       : "--max-relative-positions " + std::to_string(k);
    for (const auto& [name, t] : {std::pair{"pos_key", pk}, std::pair{"pos_query", pq}}) {
      if (t->shape[0] != 2 * k) {
        throw ShapeError(a.params + ": " + name + " has " + std::to_string(t->shape[0]) +
                         " rows, expected 2K = " + std::to_string(2 * k) + " (K = " + origin + ")");
      }
    }
    h.scheme = DeBERTa{pk->view<3>(), pq->view<3>(), buckets};
  } else {
    throw UsageError("unknown --scheme '" + s + "' (none, rope, alibi, t5, shaw, xl, deberta)");
  }
}

// Shapes the CLI can name by file before the library sees them.
void check_shapes(const AttentionArgs& a, const std::vector<int64_t>& q,
                  const std::vector<int64_t>& k, const std::vector<int64_t>& v) {
  auto str = [](const std::vector<int64_t>& s) {
    std::string r = "[";
    for (std::size_t d = 0; d < s.size(); ++d) r += (d ? ", " : "") + std::to_string(s[d]);
    return r + "]";
  };
  if (k != v) {
    throw ShapeError(a.v + ": v " + str(v) + " must have the shape of k " + str(k) + " (" + a.k +
                     ")");
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

// The scheme a model config implies, as --scheme spells it (learned absolute positions are not an
// attention scheme).
std::string config_scheme(const ModelConfig& m, const std::string& path) {
  if (m.scheme != ModelScheme::kLearned) return model_scheme_name(m.scheme);
  throw UsageError(path + ": model_type '" + m.model_type +
                   "' uses learned absolute positions, which are added to the input, not applied "
                   "in attention (see `posenc learned`)");
}

// Q and K dims against the config's heads and head_dim.
void check_config_dims(const AttentionArgs& a, const ModelConfig& m, const std::vector<int64_t>& q,
                       const std::vector<int64_t>& k) {
  const std::string who = a.config + " (model_type '" + m.model_type + "')";
  if (m.head_dim > 0 && q[3] != m.head_dim) {
    throw ShapeError(a.q + ": head_dim " + std::to_string(q[3]) + " does not match " + who +
                     ": head_dim " + std::to_string(m.head_dim));
  }
  if (m.heads_q > 0 && q[2] != m.heads_q) {
    throw ShapeError(a.q + ": heads_q " + std::to_string(q[2]) + " does not match " + who + ": " +
                     std::to_string(m.heads_q) + " attention heads");
  }
  if (m.heads_kv > 0 && k[2] != m.heads_kv) {
    throw ShapeError(a.k + ": heads_kv " + std::to_string(k[2]) + " does not match " + who + ": " +
                     std::to_string(m.heads_kv) + " key/value heads");
  }
  if (m.scheme == ModelScheme::kAlibi && q[2] != m.alibi.heads) {
    throw ShapeError(a.q + ": heads_q " + std::to_string(q[2]) + " does not match " + who + ": " +
                     std::to_string(m.alibi.heads) + " ALiBi heads");
  }
}

}  // namespace

void read_attention_inputs(const CLI::App& app, const AttentionArgs& args, AttentionInputs& in) {
  // With --config the scheme and its settings come from the model; flags it replaces conflict.
  in.args = args;
  AttentionArgs& a = in.args;
  std::optional<ModelConfig>& model = in.model;
  if (!a.config.empty()) {
    reject_with_config(app, {"--base", "--rotary-dim", "--style", "--max-bias", "--num-buckets",
                             "--max-distance", "--position-buckets", "--max-relative-positions"});
    model = read_model_config(a.config);
    const std::string s = config_scheme(*model, a.config);
    if (!a.scheme.empty() && a.scheme != s) {
      throw UsageError("--scheme " + a.scheme + " conflicts with --config " + a.config +
                       " (model_type '" + model->model_type + "' uses " + s + ")");
    }
    a.scheme = s;
    if (s == "t5") {
      a.num_buckets = model->t5.num_buckets;
      a.max_distance = model->t5.max_distance;
      if (!a.scale) a.scale = 1.0;  // T5 does not scale its scores
    } else if (s == "deberta") {
      a.position_buckets = model->deberta.position_buckets;
      a.max_relative_positions = model->deberta.max_relative_positions;
      const auto& types = model->pos_att_type;
      const bool c2p = std::find(types.begin(), types.end(), "c2p") != types.end();
      const bool p2c = std::find(types.begin(), types.end(), "p2c") != types.end();
      if (!c2p || !p2c) {
        std::string t;
        for (const auto& x : types) t += (t.empty() ? "" : "|") + x;
        throw UsageError(a.config + ": pos_att_type '" + t +
                         "' lacks c2p or p2c; posenc's DeBERTa scheme computes both");
      }
    }
  } else if (a.scheme.empty()) {
    throw UsageError("--scheme is required (or --config config.json)");
  }
  if (a.out_dtype == "float64" && !a.reference) {
    throw UsageError("--out-dtype float64 needs --reference (the float32 path computes float32)");
  }
  if (a.threads < 0)
    throw UsageError("--threads must be >= 0 (got " + std::to_string(a.threads) + ")");
  const char* layout_q = "[batch, seq_q, heads_q, head_dim]";
  const char* layout_kv = "[batch, seq_k, heads_kv, head_dim]";
  in.q_file = read_npy(a.q);
  require_rank(in.q_file, 4, layout_q, a.q);
  in.k_file = read_npy(a.k);
  require_rank(in.k_file, 4, layout_kv, a.k);
  in.v_file = read_npy(a.v);
  require_rank(in.v_file, 4, layout_kv, a.v);
  in.q = to_float_array(in.q_file, a.q, true);
  in.k = to_float_array(in.k_file, a.k, true);
  in.v = to_float_array(in.v_file, a.v, true);
  const FloatArray& q = in.q;
  const FloatArray& k = in.k;
  const FloatArray& v = in.v;
  check_shapes(a, q.shape, k.shape, v.shape);
  if (model) check_config_dims(a, *model, q.shape, k.shape);
  const int64_t batch = q.shape[0], seq_q = q.shape[1], seq_k = k.shape[1];

  std::optional<Positions>& pos_q = in.pos_q;
  std::optional<Positions>& pos_k = in.pos_k;
  if (!a.positions_q.empty()) pos_q = read_positions(a.positions_q, batch, seq_q);
  if (!a.positions_k.empty()) pos_k = read_positions(a.positions_k, batch, seq_k);
  // Sequence length for length-dependent RoPE frequencies: the largest position + 1.
  const int64_t max_q = pos_q ? pos_q->max_position(batch, seq_q) : seq_k - 1;
  const int64_t max_k = pos_k ? pos_k->max_position(batch, seq_k) : seq_k - 1;
  const int64_t seq_len = a.seq_len.value_or(std::max<int64_t>({max_q, max_k, 0}) + 1);
  require_at_least("--seq-len", seq_len, 0);

  build_scheme(a, model ? &*model : nullptr, q.shape[3], seq_len, in.holder);

  AttentionOptions& opt = in.options;
  opt.causal = a.causal;
  opt.scale = a.scale;
  opt.window = a.window;
  opt.allow_fully_masked = a.allow_fully_masked;
  opt.num_threads = a.threads;
}

void add_attention_flags(CLI::App* app, AttentionArgs& a, const AttentionFlagHelp& help) {
  app->add_option("--q", a.q, "Queries .npy [batch, seq_q, heads_q, head_dim]")->required();
  app->add_option("--k", a.k, "Keys .npy [batch, seq_k, heads_kv, head_dim]")->required();
  app->add_option("--v", a.v, "Values .npy [batch, seq_k, heads_kv, head_dim]")->required();
  app->add_option("--out", a.out, help.out)->required();
  app->add_option("--scheme", a.scheme,
                  "none, rope, alibi, t5, shaw, xl or deberta (required unless --config)")
      ->check(CLI::IsMember({"none", "rope", "alibi", "t5", "shaw", "xl", "deberta"}));
  app->add_option("--config", a.config,
                  "Model config.json: scheme and its settings from the model (rope: theta, "
                  "rotary dim, style, scaling at seq_len = max position + 1; alibi: slopes; t5: "
                  "num_buckets, max_distance, default --scale 1; deberta: position_buckets, "
                  "max_relative_positions); q/k heads and head_dim must match it");
  app->add_flag("--causal", a.causal, "Key j visible iff pos_k(j) <= pos_q(i)");
  app->add_option("--scale", a.scale, "Score scale (default 1/sqrt(D); DeBERTa 1/sqrt(3D))");
  app->add_option("--params", a.params,
                  "Parameters .safetensors: t5 relative_attention_bias [NB, H]; alibi slopes [H] "
                  "(optional); shaw rel_k, rel_v [2K+1, D] or [2K+1, H, D]; xl r_w_bias, "
                  "r_r_bias [H, D], r_net [H*D, Dm]; deberta pos_key, pos_query [2K, H, D]");
  app->add_option("--base", a.base, "rope: theta; xl: sinusoid base")->capture_default_str();
  app->add_option("--rotary-dim", a.rotary_dim, "rope: rotary dim R (default head_dim)");
  app->add_option("--style", a.style, "rope: half or interleaved")
      ->check(CLI::IsMember({"half", "interleaved"}))
      ->capture_default_str();
  app->add_option("--angles", a.angles, "rope: accurate or float32 angles (SPEC section 10)")
      ->check(CLI::IsMember({"accurate", "float32"}))
      ->capture_default_str();
  app->add_option("--seq-len", a.seq_len,
                  "rope: sequence length for length-dependent scaling (default: max position + "
                  "1)");
  app->add_option("--max-bias", a.max_bias, "alibi: maximum bias B when slopes are computed")
      ->capture_default_str();
  app->add_option("--num-buckets", a.num_buckets,
                  "t5: number of buckets (must equal the table's rows; default: the table's)");
  app->add_option("--max-distance", a.max_distance, "t5: max distance")->capture_default_str();
  app->add_option("--position-buckets", a.position_buckets,
                  "deberta: position_buckets (0 = no log bucketing)")
      ->capture_default_str();
  app->add_option("--max-relative-positions", a.max_relative_positions,
                  "deberta: max_relative_positions")
      ->capture_default_str();
  app->add_option("--deberta-p2c", a.deberta_p2c,
                  "deberta: p2c index: spec (SPEC §8 and the paper, clamp(-rho + K)) or model "
                  "(what trained checkpoints compute, clamp(rho + K)); paper = spec")
      ->check(CLI::IsMember({"spec", "paper", "model"}))
      ->capture_default_str();
  app->add_flag("--deberta-float64-log", a.deberta_float64_log,
                "deberta: log bucketing in float64 (the authors' code) instead of float32 (HF)");
  app->add_option("--positions-q", a.positions_q,
                  "int64 query positions [Lq] or [B, Lq] (.npy); default Lk - Lq + i");
  app->add_option("--positions-k", a.positions_k,
                  "int64 key positions [Lk] or [B, Lk] (.npy); default j");
  app->add_option("--window", a.window, "Sliding window w >= 1: key visible iff |rel| < w");
  app->add_flag("--allow-fully-masked", a.allow_fully_masked,
                "A query row with no visible key outputs 0 instead of an error");
  app->add_flag("--reference", a.reference, help.reference);
  CLI::Option* out_dtype = app->add_option("--out-dtype", a.out_dtype, help.out_dtype)
                               ->check(CLI::IsMember({"float32", "float64"}));
  if (!a.out_dtype.empty()) out_dtype->capture_default_str();
  app->add_option("--threads", a.threads, "Worker threads (0 = all available)")
      ->capture_default_str();
}

}  // namespace posenc::cli
