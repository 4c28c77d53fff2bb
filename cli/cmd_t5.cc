// cli/cmd_t5.cc - `posenc t5-buckets`: the T5 relative-position bucket map
// (docs/t5.md).
#include <CLI/CLI.hpp>
#include <memory>
#include <optional>
#include <string>

#include "common.h"
#include "posenc/t5.h"

namespace posenc::cli {

namespace {

struct T5Args {
  int64_t query_length = 0;
  int64_t key_length = 0;
  int64_t num_buckets = 32;
  int64_t max_distance = 128;
  bool causal = false;
  std::string positions_q;
  std::string positions_k;
  std::string out;
};

int run_t5(const T5Args& a) {
  require_at_least("--query-length", a.query_length, 0);
  require_at_least("--key-length", a.key_length, 0);
  T5BucketConfig cfg;
  cfg.num_buckets = a.num_buckets;
  cfg.max_distance = a.max_distance;
  cfg.bidirectional = !a.causal;
  validate(cfg);
  checked_elements("the int64 map [Lq, Lk]",
                   {{"--query-length", a.query_length}, {"--key-length", a.key_length}}, 8);
  std::optional<Positions> pq, pk;
  if (!a.positions_q.empty()) pq = read_positions(a.positions_q, 1, a.query_length);
  if (!a.positions_k.empty()) pk = read_positions(a.positions_k, 1, a.key_length);
  const std::vector<int64_t> map =
      t5_bucket_map(cfg, a.query_length, a.key_length, pq ? &*pq : nullptr, pk ? &*pk : nullptr);
  write_i64(a.out, {a.query_length, a.key_length}, map);
  return 0;
}

}  // namespace

Command add_t5_buckets_command(CLI::App& parent) {
  auto a = std::make_shared<T5Args>();
  CLI::App* app = parent.add_subcommand(
      "t5-buckets", "Write the T5 bucket map [query_length, key_length] (int64) to a .npy file");
  app->add_option("--query-length", a->query_length, "Lq")->required();
  app->add_option("--key-length", a->key_length, "Lk")->required();
  app->add_option("--num-buckets", a->num_buckets, "NB")->capture_default_str();
  app->add_option("--max-distance", a->max_distance, "MD")->capture_default_str();
  app->add_flag("--causal", a->causal, "Unidirectional (decoder) buckets; default bidirectional");
  app->add_option("--positions-q", a->positions_q, "int64 query positions [Lq] (.npy)");
  app->add_option("--positions-k", a->positions_k, "int64 key positions [Lk] (.npy)");
  app->add_option("--out", a->out, "Output .npy, int64 [Lq, Lk]")->required();
  return {app, [a] { return run_t5(*a); }};
}

}  // namespace posenc::cli
