// examples/quickstart.cc - RoPE + causal attention with posenc, and the seeds' checks.
#include <cstdio>
#include <vector>

#include "posenc/posenc.h"

int main() {
  using namespace posenc;
  const int64_t batch = 1, seq = 6, heads_q = 4, heads_kv = 2, head_dim = 8;
  std::vector<float> q(batch * seq * heads_q * head_dim), k(batch * seq * heads_kv * head_dim);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>((i * 37 % 11) - 5) / 5.0f;
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>((i * 17 % 7) - 3) / 3.0f;
  std::vector<float> v = k, out(q.size());

  // Llama-style rotary embedding, GQA (4 query heads share 2 kv heads), causal mask.
  const RopeConfig rope{.head_dim = head_dim, .base = 10000.0, .style = RopeStyle::kHalf};
  const PositionScheme scheme = Rope{rope_frequencies(rope), rope.style};
  attention(View<const float, 4>::contiguous(q.data(), {batch, seq, heads_q, head_dim}),
            View<const float, 4>::contiguous(k.data(), {batch, seq, heads_kv, head_dim}),
            View<const float, 4>::contiguous(v.data(), {batch, seq, heads_kv, head_dim}), scheme,
            AttentionOptions{.causal = true},
            View<float, 4>::contiguous(out.data(), {batch, seq, heads_q, head_dim}));
  std::printf("posenc %s: out[0] = %.6f\n", POSENC_VERSION_STRING, out[0]);

  // ALiBi slopes for BLOOM's 12 heads.
  for (double m : alibi_slopes(AlibiConfig{.heads = 12})) std::printf("%.6g ", m);
  std::printf("\n");

  bool ok = true;
  for (const CheckResult& r : run_checks()) ok = ok && r.pass;
  std::printf(ok ? "all checks passed\n" : "some checks FAILED\n");
  return ok ? 0 : 1;
}
