// plot/plots.h - the figures of `posenc plot` and `posenc demo`, each built from the public API.
//
// Every number drawn comes from posenc: tables from sinusoidal_table / sinusoidal_encode, rotated
// pairs from apply_rope, slopes from alibi_slopes, buckets from t5_bucket / t5_bucket_map,
// indices from shaw_index / deberta_bucket / deberta_c2p_index, scores from
// ref::attention_scores, attention weights from ref::attention (the rows of the output for
// one-hot values), dot products from sinusoidal_dot. This file only arranges them.
//
// Each builder validates its options (ValueError naming the option, like the library) and
// returns a plot::Figure; save it with plot::save. Figures are about 800 px wide by default.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "figure.h"
#include "posenc/config.h"
#include "posenc/deberta.h"
#include "posenc/sinusoidal.h"
#include "posenc/t5.h"
#include "posenc/tensor.h"

namespace posenc::plot {

// The plot kinds, as `posenc plot KIND` spells them.
const std::vector<std::string>& plot_kinds();

// heatmap: a positional table, positions (rows, top to bottom) x dimensions (columns), with a
// colour bar. Sinusoidal by default; a learned table when `table` is set.
struct HeatmapOptions {
  int64_t length = 64;  // positions shown (sinusoidal), starting at 0
  int64_t dim = 128;
  double base = 1e4;
  SinLayout layout = SinLayout::kInterleaved;
  // A learned table [max_positions, dim] (rows shown: min(length, max_positions) unless
  // length == 0: all). Not owned; must outlive the call.
  std::optional<View<const float, 2>> table;
  std::string table_name = "learned table";  // e.g. the file name, for the title
  std::optional<Colormap> colormap;          // default: viridis (sinusoidal, as in the paper's
                                             // figures), diverging (learned tables)
  double width = 800, height = 0;            // 0: chosen from the table's shape
};
// "small": 16 positions x 32 dims (the pattern is visible cell by cell); "paper": 128 x 512
// (the original Transformer's width). ValueError for other names.
HeatmapOptions heatmap_preset(const std::string& name);
Figure heatmap_figure(const HeatmapOptions& o);

// clock: each sin/cos pair of PE(p) drawn as a clock hand from (0, 0) to the point
// (PE[sin], PE[cos]) on the unit circle: at p = 0 every hand points to 12 o'clock and hand i turns
// clockwise by w_i radians per position, slower toward the end of the vector. One clock per
// position, plus a panel with a word embedding e (its first two dims) and e + PE(p) for
// p = 0 .. circle_positions - 1: points on a unit circle around e.
struct ClockOptions {
  int64_t dim = 16;  // hands = dim / 2
  double base = 1e4;
  SinLayout layout = SinLayout::kInterleaved;
  std::vector<int64_t> positions = {0, 1, 2, 3, 5, 10, 50};
  double embedding_x = 1.6, embedding_y = 1.1;  // first two dims of the word embedding
  int64_t circle_positions = 12;
  bool embedding_panel = true;
  int columns = 4;
  double width = 800, height = 0;
};
Figure clock_figure(const ClockOptions& o);
// Hand geometry (what clock_figure draws): hand i of the clock of position p ends at
// hand_length(i, hands) * (PE[p, sin_i], PE[p, cos_i]) in the clock's data coordinates.
double clock_hand_length(int64_t pair, int64_t hands);
Color clock_hand_color(int64_t pair, int64_t hands);

// similarity: scores against the offset k between two positions, one panel per scheme:
//   sinusoidal  PE(p).PE(p+k) for several p (the curves coincide: it depends only on k);
//   rope        <rope(q, m), rope(k, m + k)> for random q, k and several m (coincide too), raw
//               dot products (scale 1);
//   alibi       the bias -m_h |k| of several heads;
//   t5          the bucket of k, bidirectional and causal (the bias is a learned table indexed
//               by it);
//   shaw        q . rel_k[clip(k)] for a random table: flat beyond +-K;
//   deberta     the relative position after DeBERTa-v2 log bucketing (flat beyond the span).
// scheme "all" (default) shows every panel. With `model` (a config.json) the panel of its scheme
// uses its parameters.
struct SimilarityOptions {
  std::string scheme = "all";
  int64_t max_offset = 64;  // k in [-max_offset, max_offset]
  int64_t dim = 64;         // sinusoidal d and RoPE head_dim
  double base = 1e4;
  int64_t heads = 8;  // ALiBi
  T5BucketConfig t5 = {};
  int64_t shaw_k = 8;  // Shaw's max_relative_position
  DebertaBuckets deberta = {.max_relative_positions = 64, .position_buckets = 16};
  std::optional<ModelConfig> model;
  std::string model_name;
  uint64_t seed = 7;
  double width = 800, height = 0;
};
Figure similarity_figure(const SimilarityOptions& o);

// rope-rotation: a unit vector in one rotation pair of RoPE rotated by apply_rope through
// positions 0 .. positions - 1, for several pairs (frequencies theta_i): the (x_i, x_{i+R/2})
// plane (half style) with points coloured by position.
struct RopeRotationOptions {
  int64_t head_dim = 64;
  double base = 1e4;
  int64_t positions = 24;
  std::vector<int64_t> pairs;  // default: 0, R/16, R/8, R/4 (clipped to R/2 - 1)
  std::optional<ModelConfig> model;
  std::string model_name;
  double width = 800, height = 0;
};
Figure rope_rotation_figure(const RopeRotationOptions& o);

// bias: the [Lq, Lk] map (query rows, key columns) of a scheme's relative term: ALiBi's bias for
// several heads, T5 buckets, Shaw's clipped index, DeBERTa's c2p index. causal: cells after the
// query are masked, and T5 uses causal buckets. scheme "all" shows one panel of each.
struct BiasOptions {
  std::string scheme = "all";  // all, alibi, t5, shaw, deberta
  int64_t length = 32;
  bool causal = false;
  int64_t heads = 8;  // ALiBi
  T5BucketConfig t5 = {};
  int64_t shaw_k = 4;
  DebertaBuckets deberta = {.max_relative_positions = 32, .position_buckets = 8};
  std::optional<ModelConfig> model;
  std::string model_name;
  double width = 800, height = 0;
};
Figure bias_figure(const BiasOptions& o);

// attention: attention weights [Lq, Lk] for the same queries and keys under each scheme side by
// side: none, sinusoidal (x + PE, then no positional term), RoPE, ALiBi (head 1 of 8), T5 (an
// illustrative table: bias -0.3 x bucket rank), Shaw, Transformer-XL, DeBERTa (random tables
// from `seed`). Weights come from ref::attention with one-hot values. content: "constant" (every
// token has the same q and k, so the pattern is the positional effect alone) or "random".
struct AttentionPlotOptions {
  int64_t length = 24;
  int64_t head_dim = 32;
  bool causal = false;
  std::string content = "constant";
  double base = 1e4;
  uint64_t seed = 11;
  double width = 800, height = 0;
};
Figure attention_figure(const AttentionPlotOptions& o);

// extrapolation: what each scheme does beyond the length it was trained for: ALiBi's bias keeps
// decaying linearly, T5's buckets saturate at max_distance, the sinusoidal dot product stays
// bounded, RoPE's score of q = k decays (and linear scaling stretches it), Shaw's index clips at
// K, a learned table refuses positions >= its size (add_learned throws). A dashed line marks the
// training length.
struct ExtrapolationOptions {
  int64_t train_length = 512;
  int64_t max_length = 2048;
  int64_t dim = 64;
  double base = 1e4;
  int64_t heads = 8;
  T5BucketConfig t5 = {.num_buckets = 32, .max_distance = 128, .bidirectional = false};
  int64_t shaw_k = 64;
  double rope_scaling = 4;  // linear scaling factor shown beside the unscaled RoPE
  double width = 800, height = 0;
};
Figure extrapolation_figure(const ExtrapolationOptions& o);

}  // namespace posenc::plot
