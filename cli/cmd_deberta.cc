// cli/cmd_deberta.cc - `posenc deberta-buckets`: DeBERTa relative index maps (docs/deberta.md).
#include <CLI/CLI.hpp>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "posenc/deberta.h"

namespace posenc::cli {

namespace {

struct DebertaArgs {
  int64_t query_length = 0;
  int64_t key_length = 0;
  int64_t position_buckets = 0;
  int64_t max_relative_positions = 512;
  bool float64_log = false;
  std::string index = "c2p";
  std::string p2c = "model";
  std::string out;
};

int run_deberta(const DebertaArgs& a) {
  require_at_least("--query-length", a.query_length, 0);
  require_at_least("--key-length", a.key_length, 0);
  DebertaBuckets cfg;
  cfg.max_relative_positions = a.max_relative_positions;
  cfg.position_buckets = a.position_buckets;
  cfg.float64_log = a.float64_log;
  cfg.p2c = parse_deberta_p2c(a.p2c, "--p2c");
  validate(cfg);
  // Default positions: key j at j, query i at Lk - Lq + i.
  if (a.query_length > a.key_length) {
    throw UsageError("default positions need --query-length <= --key-length (got " +
                     std::to_string(a.query_length) + " > " + std::to_string(a.key_length) + ")");
  }
  const Positions pq = Positions::offset(a.key_length - a.query_length);
  const Positions pk = Positions::offset(0);
  pq.validate(1, a.query_length, "query positions (key_length - query_length + i)");
  std::vector<int64_t> map(static_cast<std::size_t>(
      checked_elements("the int64 map [Lq, Lk]",
                       {{"--query-length", a.query_length}, {"--key-length", a.key_length}}, 8)));
  const bool c2p = a.index == "c2p";
  for (int64_t i = 0; i < a.query_length; ++i) {
    for (int64_t j = 0; j < a.key_length; ++j) {
      const int64_t q = pq.at(0, i), k = pk.at(0, j);
      map[static_cast<std::size_t>(i * a.key_length + j)] =
          c2p ? deberta_c2p_index(q, k, cfg) : deberta_p2c_index(q, k, cfg);
    }
  }
  write_i64(a.out, {a.query_length, a.key_length}, map);
  return 0;
}

}  // namespace

Command add_deberta_buckets_command(CLI::App& parent) {
  auto a = std::make_shared<DebertaArgs>();
  CLI::App* app = parent.add_subcommand(
      "deberta-buckets",
      "Write the DeBERTa relative index map [query_length, key_length] (int64) to a .npy file");
  app->add_option("--query-length", a->query_length, "Lq")->required();
  app->add_option("--key-length", a->key_length, "Lk")->required();
  app->add_option("--position-buckets", a->position_buckets,
                  "position_buckets (0 = no log bucketing)")
      ->capture_default_str();
  app->add_option("--max-relative-positions", a->max_relative_positions, "max_relative_positions")
      ->capture_default_str();
  app->add_flag("--float64-log", a->float64_log,
                "Evaluate the log bucketing in float64 (the authors' code) instead of float32");
  app->add_option("--index", a->index, "c2p (rows of pos_key) or p2c (rows of pos_query)")
      ->check(CLI::IsMember({"c2p", "p2c"}))
      ->capture_default_str();
  app->add_option(
         "--p2c", a->p2c,
         "p2c index form: model (clamp(rho + K), what trained checkpoints compute; default) or "
         "paper (clamp(-rho + K), the paper's delta(j, i))")
      ->check(CLI::IsMember({"model", "paper"}))
      ->capture_default_str();
  app->add_option("--out", a->out, "Output .npy, int64 [Lq, Lk]")->required();
  return {app, [a] { return run_deberta(*a); }};
}

}  // namespace posenc::cli
