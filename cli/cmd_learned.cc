// cli/cmd_learned.cc - `posenc learned`: add a learned absolute position table
// (docs/learned.md).
#include <CLI/CLI.hpp>
#include <memory>
#include <optional>
#include <string>

#include "common.h"
#include "posenc/learned.h"

namespace posenc::cli {

namespace {

struct LearnedArgs {
  std::string table;
  std::string name = "position_embeddings";
  bool name_given = false;
  std::string in;
  std::string out;
  std::optional<int64_t> offset;
  std::string positions;
};

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The table, float32 and finite: a .npy file (mapped, not copied, when it is float32), or a
// named tensor of a .safetensors file. Without an explicit --name, the usual checkpoint names are
// tried after `position_embeddings`.
FloatInput load_table(const LearnedArgs& a) {
  const std::string layout = "[max_positions, dim]";
  if (!ends_with(a.table, ".safetensors")) return map_float_npy(a.table, 2, layout, true);
  SafetensorsFile f = read_safetensors(a.table);
  const Tensor* t = nullptr;
  if (!a.name_given) {
    for (const char* n :
         {"position_embeddings", "wpe.weight", "transformer.wpe.weight",
          "embeddings.position_embeddings.weight", "bert.embeddings.position_embeddings.weight"}) {
      if ((t = find_tensor(f, n)) != nullptr) break;
    }
  }
  if (t == nullptr) t = &require_tensor(f, a.name, a.table, "posenc learned");
  require_rank(*t, 2, layout, a.table);
  return FloatInput::owning(to_float_array(*t, a.table, true));
}

int run_learned(const LearnedArgs& a) {
  const FloatInput table = load_table(a);

  const Tensor x_t = read_npy(a.in);
  if (x_t.shape.size() != 2 && x_t.shape.size() != 3) {
    require_rank(x_t, 3, "[batch, seq, dim] (or [seq, dim])", a.in);
  }
  FloatArray x = to_float_array(x_t, a.in, true);
  const std::vector<int64_t> out_shape = x.shape;
  if (x.shape.size() == 2) x.shape.insert(x.shape.begin(), 1);
  const int64_t batch = x.shape[0], seq = x.shape[1];
  const Positions positions = positions_from_flags(a.offset, a.positions, batch, seq);
  add_learned(table.view<2>(), x.mutable_view<3>(), &positions);
  write_f32(a.out, out_shape, x.data);
  return 0;
}

}  // namespace

Command add_learned_command(CLI::App& parent) {
  auto a = std::make_shared<LearnedArgs>();
  CLI::App* app = parent.add_subcommand(
      "learned", "Add a learned position table to x [batch, seq, dim]: y = x + W[p]");
  app->add_option("--table", a->table,
                  "Table W [max_positions, dim]: .npy, or .safetensors with --name")
      ->required();
  app->add_option_function<std::string>(
      "--name",
      [a](const std::string& n) {
        a->name = n;
        a->name_given = true;
      },
      "Tensor name in a .safetensors table (default position_embeddings, then wpe.weight, "
      "embeddings.position_embeddings.weight)");
  app->add_option("--in", a->in, "Input .npy, float32 (or float64) [batch, seq, dim]")->required();
  app->add_option("--out", a->out, "Output .npy, float32, same shape")->required();
  auto* offset = app->add_option("--offset", a->offset, "Token i at position K + i (default 0)");
  auto* positions = app->add_option("--positions", a->positions,
                                    "int64 position ids [seq] or [batch, seq] (.npy)");
  offset->excludes(positions);
  return {app, [a] { return run_learned(*a); }};
}

}  // namespace posenc::cli
