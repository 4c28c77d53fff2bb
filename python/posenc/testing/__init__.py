"""posenc.testing: is my RoPE / ALiBi / T5 bias / attention right? Checks against posenc's float64
oracle, with a diagnosis of the known mistakes.

``check_rope(fn, ...)``, ``check_bias(fn, scheme=...)`` and ``check_attention(fn, scheme=...)``
run a battery of cases (positions up to 2^20, KV-cache offsets, odd sizes, partial rotary dims,
GQA, seq_q != seq_k, per-row positions, bf16 / f16 inputs, the config's scaling) on a user's
function, PyTorch or NumPy, compare every result with the float64 oracle under a tolerance
derived from the dtype, and return a ``Report``: ``.ok``, ``.cases`` (name, max_error, tolerance,
...) and ``.diagnosis`` (sentences naming the mistake the error pattern matches: half vs
interleaved pairs, float32 angles, ALiBi slopes for a head count that is not a power of two, T5
buckets bidirectional vs causal, DeBERTa's p2c index, an off-by-one position offset in a KV
cache, ...). ``assert_rope`` / ``assert_bias`` / ``assert_attention`` raise ``AssertionError``
with the report (for pytest). Adapters: ``hf_rope`` (a Hugging Face rotary-embedding module, with
the model's ``apply_rotary_pos_emb(q, k, cos, sin)``), ``from_bhld`` ([batch, heads, seq,
head_dim] functions), ``t5_bias`` (a T5 bucket function and a table), ``alibi_bias`` (slopes
times distances builders such as BLOOM's).

Calling conventions (canonical):

- RoPE: ``fn(x, positions) -> rotated x``; x ``[batch, seq, heads, head_dim]``, positions int64
  ``[seq]`` (and, in the per-row case, ``[batch, seq]``: a function that rejects them is
  reported as not supporting it, not as failing).
- Bias: ``fn(q_len, k_len, heads) -> [heads, q_len, k_len]`` additive bias, query ``i`` at
  position ``k_len - q_len + i``, key ``j`` at ``j`` (leading axes of size 1 are dropped; a
  ``[q_len, k_len]`` result is taken for every head). DeBERTa: the relative positions or the
  c2p / p2c indices (``index=``).
- Attention: posenc.torch.attention's signature, ``fn(q, k, v, scheme, *, params=..., causal=...,
  query_positions=..., key_positions=..., **settings) -> out``; q ``[batch, seq_q, heads_q, D]``,
  k, v ``[batch, seq_k, heads_kv, D]``.

PyTorch or NumPy: ``framework='auto'`` calls the function with NumPy arrays first and switches
to torch tensors when that raises or returns a tensor (an ``nn.Module`` is torch); results may be
either. bf16 cases need torch (NumPy has no bfloat16).

Tolerances (eps_d: the machine epsilon of the dtype, 2^-52, 2^-23, 2^-7, 2^-10 for float64,
float32, bfloat16, float16; inputs are drawn in the dtype, so the oracle sees exactly the values
the function sees):

- RoPE: ``tol = af·max|x|·(4·eps_d + 8·eps_64·(1 + a_max))``, af the attention factor, a_max
  the largest angle |position·inv_freq|. A rotation computed in dtype d rounds cos and sin, two
  products and a sum, each within eps_d/2 of its value: at most 1.5·eps_d·(|x_i| + |x_j|) ≤
  3·eps_d·max|x| per output; the second term is the float64 rounding of the angle itself, which
  the oracle shares. Angles computed in float32 (error up to eps_32/2·a_max) do not fit at long
  positions: that is the float32-angle mistake, reported as such (``angles='float32'`` compares
  with the float32 recipe of Hugging Face instead).
- Bias: ``tol = 2·eps_d·max|bias|`` of the result's dtype (0 for integers): a bias computed in
  dtype d rounds the slope (or reads a table entry) and one product.
- Attention: ``tol = 2·eps_d·max|v|·(1 + max|s|)``, max|s| the largest score (scale, positional
  terms included): twice the error bound of a naive dtype-d implementation that rounds the scores
  (error eps_d/2·|s|, moving the output by at most 2·(eps_d/2)·max|s|·max|v|), the
  probabilities and the output (eps_d/2·max|v| each) — FlashAttention's "twice the naive error"
  rule, made a bound.

Seeds: every case has its own seed, derived from ``seed`` and the case name; a report names the
first failing case and ``cases=[name]`` with the same ``seed`` reruns exactly that case
(``report.first_failure.inputs`` holds its inputs). See docs/testing.md.

Modules: _checks (the check_* / assert_* entry points and their batteries), _oracle (the float64
references and tolerances), _diagnose_rope / _diagnose_bias / _diagnose_attention (the known
mistakes), _frameworks (dtypes, NumPy / torch, calling the function), _report (Case, Report),
_adapters (hf_rope, from_bhld, t5_bias, alibi_bias).
"""

from ._adapters import alibi_bias, from_bhld, hf_rope, t5_bias
from ._checks import (assert_attention, assert_bias, assert_rope, check_attention, check_bias,
                      check_rope)
from ._frameworks import EPS
from ._report import Case, Report

__all__ = ["Case", "Report", "check_rope", "check_bias", "check_attention", "assert_rope",
           "assert_bias", "assert_attention", "hf_rope", "from_bhld", "t5_bias", "alibi_bias",
           "EPS"]
