"""posenc.triton: fused attention with a positional scheme, in Triton.

``attention(q, k, v, scheme, ...)`` computes posenc's attention (docs/attention.md) with fused
Triton kernels, forward and backward (FlashAttention-2 recomputation from the forward's
log-sum-exp), for the schemes none, RoPE, ALiBi, T5, Shaw, Transformer-XL and DeBERTa, with
causal, sliding-window and chunked
masks, block masks (documents, prefix-LM, global tokens, a dense mask), packed variable-length
sequences (cu_seqlens), explicit positions, GQA / MQA, soft-capping and attention sinks; float32,
float16 and bfloat16 tensors, float32 arithmetic inside. It is differentiable with respect to q, k,
v, sinks and the scheme's learned tables (tensors with requires_grad), and to lse.

Kernels run on CUDA tensors. With the environment variable TRITON_INTERPRET=1 set before this
package is imported, Triton's interpreter runs the same kernels on CPU tensors through NumPy
(slowly): that is how they are tested without a GPU. See docs/gpu.md.
"""

import torch

import posenc

from . import _backward, _forward, _prepare

__all__ = ["attention"]

INTERPRETED = _forward.INTERPRETED


def _fully_masked_error(lse, plan):
    """The error posenc.attention raises for the first query row that sees no key."""
    b, _, i = (int(x) for x in torch.nonzero(torch.isneginf(lse))[0])
    pos = int(plan.query_pos[b if plan.query_pos.shape[0] > 1 else 0, i])
    return posenc.InvalidValueError(
        f"attention: query {i} (batch {b}, position {pos}) sees no key under the mask; "
        "allow_fully_masked gives 0 for such rows")


class _Attention(torch.autograd.Function):
    """The forward and backward kernels as one autograd function. Inputs with gradients:
    q, k, v, sinks and the scheme's learned tables (plan.table_names order); outputs: out and
    lse."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, plan, names, *tables):
        keep32 = q.dtype != torch.float32 and any(ctx.needs_input_grad)
        out = torch.empty((plan.batch, plan.seq_q, plan.heads_q, plan.v_dim),
                          dtype=torch.float32 if keep32 else q.dtype, device=q.device)
        lse = torch.empty((plan.batch, plan.heads_q, plan.seq_q), dtype=torch.float32,
                          device=q.device)
        _forward.forward(q, k, v, plan, out, lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.names = plan, names
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        ctx.table_like = [(t.dtype, t.shape) for t in tables]
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        if dout is None:
            dout = torch.zeros(out.shape, dtype=q.dtype, device=q.device)
        elif dout.stride(-1) != 1:
            dout = dout.contiguous()
        need = ctx.needs_input_grad
        need_tables = need[6:]
        dq, dk, dv, dsinks, dtables = _backward.backward(
            q, k, v, out, lse, dout, dlse, plan,
            (need[0], need[1], need[2], need[3], any(need_tables)))
        grads = [None] * len(need_tables)
        for i, (name, (dtype, shape)) in enumerate(zip(ctx.names, ctx.table_like)):
            if need_tables[i]:
                grads[i] = dtables[name].reshape(shape).to(dtype)
        return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
                dsinks.to(ctx.sinks_dtype) if need[3] else None, None, None, *grads)


def attention(q, k, v, scheme="none", *, causal=False, scale=None, window=None, chunk=None,
              softcap=None, sinks=None, query_positions=None, key_positions=None, slopes=None,
              max_bias=None, relative_attention_bias=None, num_buckets=None, max_distance=None,
              bidirectional=None, rope=None, rope_style=None, rel_k=None, rel_v=None,
              r_w_bias=None, r_r_bias=None, r_net=None, base=None, pos_key=None, pos_query=None,
              position_buckets=None, max_relative_positions=None, deberta_p2c=None,
              deberta_float64_log=None, query_documents=None,
              key_documents=None, prefix=None, global_positions=None, mask=None,
              cu_seqlens_q=None, cu_seqlens_k=None, allow_fully_masked=False, return_lse=False,
              block_m=None, block_n=None):
    """Attention with a positional scheme in fused Triton kernels; posenc.attention's semantics.

    q [batch, seq_q, heads_q, head_dim], k [batch, seq_k, heads_kv, head_dim], v [batch, seq_k,
    heads_kv, v_dim] (v_dim <= head_dim <= 256), one dtype: float32, float16 or bfloat16, on one
    CUDA device (CPU under TRITON_INTERPRET=1). heads_kv divides heads_q; query head h reads kv
    head h // (heads_q / heads_kv). Returns out [batch, seq_q, heads_q, v_dim] in q's dtype, and
    with return_lse=True also lse, float32 [batch, heads_q, seq_q], the log-sum-exp of each
    row's scores (sink included). Arithmetic is float32; out is rounded once to its dtype.

    scheme: 'none', 'rope', 'alibi', 't5', 'shaw', 'xl' or 'deberta'. Each score is
    scale * (q_i . k_j + the scheme's relative terms) plus the scheme's bias, then soft-capped,
    then masked (docs/attention.md, "Score order"):

    - 'rope': q and k rotated at their positions. rope: a posenc.RopeFrequencies (default
      posenc.rope_frequencies(head_dim): base 1e4, every dim rotated); its rotary_dim, attention
      factor and angle mode apply. rope_style: 'half' (default, pairs (i, i + R/2)) or
      'interleaved' (pairs (2i, 2i + 1)).
    - 'alibi': bias -m_h |pos_q - pos_k|. slopes: a tensor [heads_q] (a parameter: it gets a
      gradient when it requires one); default posenc.alibi_slopes(heads_q, max_bias=max_bias),
      max_bias 8.
    - 't5': bias relative_attention_bias[bucket(pos_k - pos_q), h] with the table [num_buckets,
      heads_q] (required; num_buckets, when given, must match its rows), max_distance 128,
      bidirectional default not causal. T5 models need scale=1.
    - 'shaw': rel_k [2K+1, head_dim] or [2K+1, 1 or heads_q, head_dim] (required) adds
      q_i . rel_k[idx] to the content score, rel_v (optional, v_dim wide) adds
      sum_j P_ij rel_v[idx] to the output; idx = clamp(pos_k - pos_q, -K, K) + K.
    - 'xl': (q_i + r_w_bias) . k_j + (q_i + r_r_bias) . r(delta), delta = pos_q - pos_k,
      r(delta) = r_net R(delta) with R the sinusoid of width d_model (r_net [heads_q * head_dim,
      d_model]) and base (default 1e4); r_w_bias, r_r_bias [heads_q, head_dim].
    - 'deberta': q_i . k_j + q_i . pos_key[c2p] + k_j . pos_query[p2c] (pos_key, pos_query
      [2K, heads_q, head_dim]), posenc.deberta_c2p_index / deberta_p2c_index with
      position_buckets, max_relative_positions, deberta_p2c ('model' or 'paper') and
      deberta_float64_log; default scale 1 / sqrt(3 head_dim).

    scale: default 1 / sqrt(head_dim). causal: key visible iff pos_k <= pos_q. window w: iff
    |pos_k - pos_q| < w. chunk c: iff pos_k // c == pos_q // c. softcap C > 0: scores become
    C * tanh(s / C) before the masks. sinks: a tensor [heads_q] of logits, one extra entry in
    each row's softmax denominator with no value.

    Positions: None (keys at j, queries at seq_k - seq_q + i, so seq_q <= seq_k), an int offset
    (token i at offset + i), or integer ids [seq] or [batch, seq] (a tensor or array) in [0,
    2^48].

    Block masks (docs/attention.md, "Block masks"): query_documents [batch, seq_q] and
    key_documents [batch, seq_k] integer ids (a key is visible only within its query's
    document); prefix, lengths [batch] (or [num_documents], indexed by document id, with
    documents): keys at positions < prefix are seen by every query of their document; global
    positions (a list): tokens there see and are seen by every token of their document; both
    override causal, window and chunk. mask [batch or 1, seq_q, seq_k], nonzero may attend,
    is ANDed with the rest.

    Packed sequences: q [total_q, heads_q, head_dim], k and v [total_k, heads_kv, ...] with
    cu_seqlens_q and cu_seqlens_k (offsets [num_seqs + 1]); no token attends across sequences
    and positions restart in each (key j of a sequence at j, query i at len_k - len_q + i, or
    per token as given: [total] ids). Returns out [total_q, heads_q, v_dim] and lse [heads_q,
    total_q]. The sequences are the documents: prefix then has one length per sequence.

    A query row that sees no key raises posenc.InvalidValueError, as posenc.attention does
    (checked after the kernel, which costs one device synchronization), unless
    allow_fully_masked=True: then its output is 0 and its lse -inf. With sinks such a row is no
    error: out 0, lse = sink. The same check names a non-finite element of q, k or v, as
    posenc.attention does (InvalidValueError); with allow_fully_masked or sinks there is no
    check and NaN and infinity propagate.

    block_m, block_n: the tiles of query rows and keys of every kernel (powers of two >= 16, both
    or neither); by default each kernel's own, by dtype.

    Gradients flow to q, k, v, sinks and the scheme's tables (slopes, relative_attention_bias,
    rel_k, rel_v, r_w_bias, r_r_bias, r_net, pos_key, pos_query) when they require them
    (returned in each input's dtype and shape).
    """
    settings = {name: value for name, value in (
        ("rope", rope), ("rope_style", rope_style), ("slopes", slopes), ("max_bias", max_bias),
        ("relative_attention_bias", relative_attention_bias), ("num_buckets", num_buckets),
        ("max_distance", max_distance), ("bidirectional", bidirectional), ("rel_k", rel_k),
        ("rel_v", rel_v), ("r_w_bias", r_w_bias), ("r_r_bias", r_r_bias), ("r_net", r_net),
        ("base", base), ("pos_key", pos_key), ("pos_query", pos_query),
        ("position_buckets", position_buckets),
        ("max_relative_positions", max_relative_positions), ("deberta_p2c", deberta_p2c),
        ("deberta_float64_log", deberta_float64_log)) if value is not None}
    inputs = (("q", q), ("k", k), ("v", v))
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    if packed:
        if query_documents is not None or key_documents is not None:
            raise posenc.InvalidValueError("query_documents and key_documents cannot be combined "
                                           "with cu_seqlens (the sequences are the documents)")
        q, k, v, query_documents, key_documents, query_positions, key_positions = (
            _prepare.unpack(q, k, v, cu_seqlens_q, cu_seqlens_k, query_positions,
                            key_positions))
    plan = _prepare.prepare(q, k, v, scheme, causal=causal, scale=scale, window=window,
                            chunk=chunk, softcap=softcap, sinks=sinks,
                            query_positions=query_positions, key_positions=key_positions,
                            settings=settings, block_m=block_m, block_n=block_n,
                            query_documents=query_documents, key_documents=key_documents,
                            prefix=prefix, global_positions=global_positions, mask=mask)
    if q.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"q: on {q.device}; posenc.triton runs on CUDA tensors (CPU tensors "
                         "need TRITON_INTERPRET=1, set before triton is first imported)")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    names = [n for n in _prepare.SCHEME_TABLES.get(scheme, ()) if n in settings]
    out, lse = _Attention.apply(q, k, v, sinks, plan, names, *(settings[n] for n in names))
    _forward.check_result(lse, plan, inputs, allow_fully_masked)
    if packed:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out
