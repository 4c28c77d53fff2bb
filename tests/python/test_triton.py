"""posenc.triton's fused kernels against posenc's float64 reference, on CPU tensors through
Triton's interpreter (TRITON_INTERPRET=1: the kernels run through NumPy, no GPU needed).

Each case runs the forward and the backward of posenc.triton.attention and compares out, lse and
every gradient (q, k, v, sinks, ALiBi slopes, T5's table) with posenc.attention and
posenc.attention_grad on float64 copies of the same (dtype-rounded) inputs. Tolerances
(docs/attention.md, docs/precision.md): float32 inputs within 1e-5 of the largest reference
value (at least 1); float16 / bfloat16 results within half an ulp of their dtype plus
2e-5 (1 + |value|), posenc's rule for half precision; lse and parameter gradients, float32
results, within 2e-5 (1 + |value|) for half inputs. The cases are few and small (the interpreter
is slow) and each combines several factors: odd sizes, seq_q != seq_k, sequences shorter than a
tile and spanning several, GQA and MQA, head dims 16, 24 and 32, every scheme and mask (block
masks and packed sequences included), explicit positions, soft-capping, sinks, float32, float16
and bfloat16.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

# Triton decides between compiled and interpreted functions as each @triton.jit function is
# defined, its own library's included (when triton is imported), so TRITON_INTERPRET=1 must be
# set before triton's first import and stay set for the whole process. Unless the caller set it,
# the cases run in a new process with it (test_in_a_fresh_process): setting it here would change
# what every later test file of this pytest process gets from triton.
#
# On a GPU (POSENC_TRITON_DEVICE=cuda, as scripts/gpu_check.sh runs it) the same cases run the
# compiled kernels on CUDA copies of their inputs (results and gradients come back to the CPU
# through autograd), bf16 through native bf16 dot products.
DEVICE = os.environ.get("POSENC_TRITON_DEVICE", "cpu")
ON_GPU = DEVICE == "cuda"
IN_A_SUBPROCESS = not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1"

import posenc  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if not IN_A_SUBPROCESS:
    import posenc.triton as _triton

    class _OnDevice:
        """posenc.triton with every tensor argument moved to DEVICE and the results moved
        back (differentiably): the cases' CPU tensors keep their gradients."""

        _forward = _triton._forward

        @staticmethod
        def attention(*args, **kw):
            def move(x):
                return x.to(DEVICE) if isinstance(x, torch.Tensor) else x
            out = _triton.attention(*(move(a) for a in args),
                                    **{n: move(x) for n, x in kw.items()})
            if isinstance(out, tuple):
                return tuple(x.cpu() for x in out)
            return out.cpu()

    pt = _OnDevice if ON_GPU else _triton


@pytest.fixture(autouse=True)
def _interpreted(request):
    if IN_A_SUBPROCESS and request.function is not test_in_a_fresh_process:
        pytest.skip("TRITON_INTERPRET=1 is not set in this process: the cases run in "
                    "test_in_a_fresh_process")


def test_cpu_tensors_without_the_interpreter_get_a_clear_error():
    """In a process without TRITON_INTERPRET, backend='triton' on CPU tensors is posenc's
    ValueError saying where the kernels run (not an error from Triton's driver)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    code = ("import torch, posenc.torch as pt\n"
            "q = torch.randn(1, 4, 2, 16)\n"
            "try:\n"
            "    pt.attention(q, q, q, 'alibi', backend='triton')\n"
            "except ValueError as e:\n"
            "    assert 'run on CUDA tensors' in str(e) and 'TRITON_INTERPRET' in str(e), e\n"
            "    print('refused')\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "refused" in r.stdout, r.stderr[-3000:]


@pytest.mark.skipif(not IN_A_SUBPROCESS, reason="the cases run in this process")
def test_in_a_fresh_process():
    """Every case of this file, in a new Python process with TRITON_INTERPRET=1."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _ulp(ref, dtype):
    """The spacing of dtype's values at |ref| (float16: 11 significant bits, subnormals below
    2^-14; bfloat16: 8 significant bits)."""
    _, e = np.frexp(np.abs(ref))
    if dtype == F16:
        return np.exp2(np.maximum(e - 11, -24).astype(np.float64))
    return np.exp2((e - 8).astype(np.float64))


def _check(what, got, ref, dtype, half_rounded):
    """got (a tensor) against ref (float64) under the tolerance of its kind: half_rounded for
    results rounded to a half dtype, else float32 results of dtype inputs."""
    got = got.detach().double().numpy()
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, what
    inf = np.isinf(ref)
    np.testing.assert_array_equal(got[inf], ref[inf], err_msg=what)
    got, ref = got[~inf], ref[~inf]
    if dtype == F32:
        tol = 1e-5 * max(1.0, float(np.max(np.abs(ref), initial=0.0)))
    else:
        tol = 2e-5 * (1 + np.abs(ref)) + (0.5 * _ulp(ref, dtype) if half_rounded else 0.0)
    err = np.abs(got - ref)
    tol = np.broadcast_to(tol, err.shape)
    worst = int(np.argmax(err / tol)) if err.size else 0
    assert np.all(err <= tol), (f"{what}: error {err.flat[worst]:.3g} at value "
                                f"{ref.flat[worst]:.4g}, tolerance {tol.flat[worst]:.3g}")


def _reference_keywords(kw):
    """posenc.attention's spelling of posenc.triton's keywords (positions as NumPy arrays)."""
    ref = {key: value.numpy() if isinstance(value, torch.Tensor) else value
           for key, value in kw.items() if key not in ("rope", "rope_style")}
    if "rope" in kw:
        ref["freqs"] = kw["rope"]
    if "rope_style" in kw:
        ref["style"] = kw["rope_style"]
    return ref


def run_case(scheme="none", dtype=F32, *, seed=0, shape=(2, 5, 13, 4, 2, 16), v_dim=None,
             blocks=(16, 16), params=None, **kw):
    """One forward and backward against the float64 reference. shape: (batch, seq_q, seq_k,
    heads_q, heads_kv, head_dim); blocks: (block_m, block_n), or None for the kernels' own;
    params: {name: float array} passed as tensors with gradients (sinks, slopes,
    relative_attention_bias) to posenc.triton and in params to posenc. With cu_seqlens_q in kw
    the tensors are packed (rank 3, no batch: shape's batch is ignored)."""
    batch, seq_q, seq_k, heads_q, heads_kv, dim = shape
    v_dim = v_dim or dim
    rng = np.random.default_rng(seed)
    rows = () if "cu_seqlens_q" in kw else (batch,)

    def tensor(*s):
        return torch.tensor(rng.standard_normal(s), dtype=F32).to(dtype).requires_grad_()

    q, k = tensor(*rows, seq_q, heads_q, dim), tensor(*rows, seq_k, heads_kv, dim)
    v, dout = tensor(*rows, seq_k, heads_kv, v_dim), tensor(*rows, seq_q, heads_q, v_dim)
    tables = {name: torch.tensor(np.asarray(value), dtype=F32, requires_grad=True)
              for name, value in (params or {}).items()}
    if blocks is not None:
        kw = dict(kw, block_m=blocks[0], block_n=blocks[1])
    out, lse = pt.attention(q, k, v, scheme, return_lse=True, **kw, **tables)
    out.backward(dout.detach())

    def f64(t):
        return t.detach().double().numpy()

    ref_kw = _reference_keywords({key: kw[key] for key in kw if not key.startswith("block_")})
    ref_params = {name: f64(t) for name, t in tables.items()}
    ref_out, ref_lse = posenc.attention(f64(q), f64(k), f64(v), scheme, params=ref_params,
                                        return_lse=True, **ref_kw)
    grads = posenc.attention_grad(f64(q), f64(k), f64(v), f64(dout), scheme, params=ref_params,
                                  **ref_kw)
    assert out.dtype == dtype and lse.dtype == F32
    _check("out", out, ref_out, dtype, True)
    _check("lse", lse, ref_lse, dtype, False)
    for name, t in (("dq", q), ("dk", k), ("dv", v)):
        assert t.grad.dtype == dtype, name
        _check(name, t.grad, grads[name], dtype, True)
    for name, t in tables.items():
        _check("d" + name, t.grad, grads["d" + name], dtype, False)
    return out, lse


def _rows_with_gaps(batch, n, start, step):
    """Per-row position ids [batch, n], increasing with gaps that differ per row."""
    return np.stack([start + b + np.cumsum(np.arange(n) % 3 * step + 1) for b in range(batch)])


# ---- schemes and masks in float32 --------------------------------------------------------------

def test_none_bidirectional_several_tiles():
    """MHA, 13 x 13 in tiles of 16 x 16 keys: the tails of every tile masked."""
    run_case(shape=(2, 13, 13, 2, 2, 16))


def test_none_causal_gqa_rectangular():
    """GQA 4:2, seq_q 5 < seq_k 13 (queries last), head dim 32, several key tiles."""
    run_case(shape=(2, 5, 13, 4, 2, 32), causal=True)


def test_none_mqa_causal_window_one_tile():
    """MQA, a causal sliding window, sequences shorter than the kernels' default tiles."""
    run_case(shape=(1, 13, 13, 3, 1, 16), blocks=None, causal=True, window=4)


def test_none_chunk_explicit_positions_per_row():
    """Chunked attention on per-row ids with gaps, several query and key tiles; head dim 24
    (padded to 32 in the kernel) and values narrower than the keys."""
    pos = _rows_with_gaps(2, 37, 0, 2)
    run_case(shape=(2, 37, 37, 2, 2, 24), v_dim=8, causal=True, chunk=16, query_positions=pos,
             key_positions=pos)


def test_rope_half_causal_gqa():
    run_case("rope", shape=(2, 5, 13, 4, 2, 32), causal=True,
             rope=posenc.rope_frequencies(32, base=500.0))


def test_rope_interleaved_partial_far_positions():
    """GPT-J style: interleaved pairs on 16 of 32 dims, positions near 10^6 (accurate angles),
    queries placed by an int offset, shared key ids."""
    run_case("rope", shape=(1, 7, 19, 2, 2, 32), rope_style="interleaved",
             rope=posenc.rope_frequencies(32, rotary_dim=16), query_positions=1_000_010,
             key_positions=np.arange(19) + 999_995, window=12)


def test_rope_half_partial_attention_factor_sinks():
    """Half style on 8 of 16 dims with an attention factor (YaRN-like) and sinks with a
    gradient."""
    freqs = posenc.RopeFrequencies(posenc.rope_frequencies(16, rotary_dim=8).inv_freq,
                                   attention_factor=1.25)
    run_case("rope", shape=(2, 6, 11, 4, 2, 16), rope=freqs, causal=True,
             params={"sinks": [0.5, -1.0, 2.0, 0.0]})


def test_rope_float32_angles():
    run_case("rope", shape=(1, 4, 9, 2, 1, 16),
             rope=posenc.rope_frequencies(16, angles="float32"), query_positions=70_000,
             key_positions=np.arange(9) + 69_996)


def test_alibi_default_slopes_causal_gqa():
    """Slopes computed for 6 query heads (not a power of two: the in-between slopes)."""
    run_case("alibi", shape=(2, 9, 9, 6, 3, 16), causal=True)


def test_alibi_given_slopes_window_positions():
    """Slopes as a parameter with a gradient, bidirectional with a window, per-row ids."""
    run_case("alibi", shape=(2, 11, 11, 4, 2, 16), window=6,
             query_positions=_rows_with_gaps(2, 11, 3, 1),
             key_positions=_rows_with_gaps(2, 11, 0, 1),
             params={"slopes": [0.5, 0.25, 0.125, 0.3]}, allow_fully_masked=True)


def test_t5_bidirectional_mqa_table_grad():
    run_case("t5", shape=(2, 5, 13, 4, 1, 16), scale=1.0,
             params={"relative_attention_bias": np.random.default_rng(1).standard_normal((32, 4))})


def test_t5_causal_saturated_buckets():
    """Causal buckets (the default without bidirectional), max_distance 8 so that far keys fall
    in the last bucket, ids with gaps of up to 20 positions."""
    pos = _rows_with_gaps(1, 21, 0, 10)
    run_case("t5", shape=(1, 21, 21, 2, 2, 16), causal=True, max_distance=8,
             query_positions=pos, key_positions=pos,
             params={"relative_attention_bias": np.random.default_rng(2).standard_normal((8, 2))})


def _shaw_tables(rng, k, heads, dim, v_dim=None, per_head=False):
    shape = (2 * k + 1, heads) if per_head else (2 * k + 1,)
    tables = {"rel_k": 0.5 * rng.standard_normal((*shape, dim))}
    if v_dim is not None:
        tables["rel_v"] = 0.5 * rng.standard_normal((*shape, v_dim))
    return tables


def test_shaw_shared_tables_keys_and_values():
    """rel_k and rel_v shared by the heads, K = 3 (clipped on both sides), GQA, several tiles."""
    rng = np.random.default_rng(40)
    run_case("shaw", shape=(2, 21, 37, 4, 2, 16), causal=True,
             params=_shaw_tables(rng, 3, 4, 16, 16))


def test_shaw_per_head_rel_k_only_bidirectional_positions():
    """Per-head rel_k without rel_v, explicit positions with gaps (distances beyond K)."""
    rng = np.random.default_rng(41)
    run_case("shaw", shape=(2, 9, 14, 2, 2, 24), params=_shaw_tables(rng, 5, 2, 24, per_head=True),
             query_positions=torch.tensor(_rows_with_gaps(2, 9, 3, 2)),
             key_positions=torch.tensor(_rows_with_gaps(2, 14, 0, 2)))


def _xl_tables(rng, heads, dim, d_model):
    return {"r_w_bias": 0.3 * rng.standard_normal((heads, dim)),
            "r_r_bias": 0.3 * rng.standard_normal((heads, dim)),
            "r_net": 0.2 * rng.standard_normal((heads * dim, d_model))}


def test_xl_causal_memory_gqa():
    """Transformer-XL with a memory segment (seq_k > seq_q), causal, GQA: u, v and r_net get
    their gradients."""
    rng = np.random.default_rng(42)
    run_case("xl", shape=(2, 11, 29, 4, 2, 16), causal=True, params=_xl_tables(rng, 4, 16, 12))


def test_xl_bidirectional_window_base():
    """Without a causal mask distances of both signs index r; a window and another base."""
    rng = np.random.default_rng(43)
    run_case("xl", shape=(1, 17, 17, 2, 1, 16), window=6, base=500.0,
             params=_xl_tables(rng, 2, 16, 8))


def _deberta_tables(rng, span, heads, dim):
    return {"pos_key": 0.5 * rng.standard_normal((2 * span, heads, dim)),
            "pos_query": 0.5 * rng.standard_normal((2 * span, heads, dim))}


def test_deberta_log_buckets_far_positions():
    """DeBERTa-v2 log buckets (position_buckets 8, max_relative_positions 32) with distances far
    beyond them, bidirectional, MQA; default scale 1 / sqrt(3 D)."""
    rng = np.random.default_rng(44)
    run_case("deberta", shape=(2, 13, 19, 2, 1, 16), position_buckets=8,
             max_relative_positions=32, params=_deberta_tables(rng, 8, 2, 16),
             key_positions=torch.tensor(_rows_with_gaps(2, 19, 0, 7)), query_positions=40)


def test_deberta_paper_p2c_no_buckets_float64_log_causal():
    """The paper's p2c index, plain clipping at K = 6, causal, several tiles."""
    rng = np.random.default_rng(45)
    run_case("deberta", shape=(1, 23, 23, 2, 2, 16), causal=True, max_relative_positions=6,
             deberta_p2c="paper", params=_deberta_tables(rng, 6, 2, 16))


def test_relative_schemes_in_half_precision():
    """Shaw, XL and DeBERTa on float16 and bfloat16 inputs (tables float32), with documents."""
    rng = np.random.default_rng(46)
    docs = torch.tensor([[0] * 5 + [1] * 8])
    run_case("shaw", F16, shape=(1, 13, 13, 2, 1, 16), causal=True, query_documents=docs,
             key_documents=docs, params=_shaw_tables(rng, 2, 2, 16, 16))
    run_case("xl", BF16, shape=(1, 10, 15, 2, 2, 16), causal=True,
             params=_xl_tables(rng, 2, 16, 6))
    run_case("deberta", BF16, shape=(1, 12, 12, 2, 1, 16), position_buckets=4,
             max_relative_positions=10, params=_deberta_tables(rng, 4, 2, 16), softcap=3.0)


def test_softcap_alibi_sinks():
    """A small cap (scores well into tanh's curve) on ALiBi, with sinks."""
    run_case("alibi", shape=(2, 5, 13, 4, 2, 16), softcap=1.5, scale=1.0,
             params={"sinks": [1.0, -0.5, 0.0, 3.0]})


def test_sinks_rows_without_keys():
    """With sinks a row that sees no key is no error: out 0, lse = sink (query positions before
    every key, causal)."""
    out, lse = run_case(shape=(1, 4, 10, 2, 2, 16), causal=True, query_positions=[0, 1, 5, 9],
                        key_positions=np.arange(10) + 2, params={"sinks": [0.25, -2.0]})
    assert torch.all(out[0, :2] == 0)
    np.testing.assert_array_equal(lse[0, :, :2].detach().numpy(), [[0.25, 0.25], [-2.0, -2.0]])


def test_allow_fully_masked():
    """Rows that see no key: out 0, lse -inf, no gradient."""
    out, lse = run_case(shape=(1, 4, 10, 2, 1, 16), causal=True, query_positions=[0, 1, 5, 9],
                        key_positions=np.arange(10) + 2, allow_fully_masked=True)
    assert torch.all(out[0, :2] == 0) and torch.all(torch.isneginf(lse[0, :, :2]))


def test_head_dim_128_decode():
    """One query per row against 40 keys (a decode step), GQA 4:1, head dim 128."""
    run_case(shape=(2, 1, 40, 4, 1, 128), causal=True, key_positions=torch.arange(40) + 7)


def test_strided_views():
    """q, k, v as [batch, seq, heads, dim] views of [batch, heads, seq, dim] tensors give the
    results of contiguous copies, bit for bit."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(s, generator=g).transpose(1, 2) for s in ((2, 4, 9, 16),
                                                                      (2, 2, 11, 16),
                                                                      (2, 2, 11, 16)))
    kw = dict(causal=True, return_lse=True, block_m=16, block_n=16)
    out, lse = pt.attention(q, k, v, "alibi", **kw)
    ref_out, ref_lse = pt.attention(q.contiguous(), k.contiguous(), v.contiguous(), "alibi", **kw)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_queries_longer_than_keys():
    run_case(shape=(1, 21, 6, 2, 2, 16), query_positions=np.arange(21), window=9,
             allow_fully_masked=True)


# ---- block masks and packed sequences ----------------------------------------------------------

def _documents(*lengths):
    """Document ids [1, sum(lengths)] of consecutive documents of these lengths, and positions
    that restart in each."""
    docs = np.concatenate([np.full(n, d) for d, n in enumerate(lengths)])[None]
    pos = np.concatenate([np.arange(n) for n in lengths])
    return docs, pos


def test_documents_causal_alibi_gqa():
    """Three documents in one row (tiles of 16 that hold one, two or three of them), causal,
    positions restarting per document; a second row with other ids in another order."""
    docs, pos = _documents(10, 20, 7)
    docs = np.concatenate([docs, [np.arange(37) * 3 // 37 * 2 % 3]])
    run_case("alibi", shape=(2, 37, 37, 4, 2, 16), causal=True, query_documents=docs,
             key_documents=docs, query_positions=pos, key_positions=pos)


def test_prefix_per_document_rope_window():
    """Prefix-LM per document (prefix lengths indexed by document id; one is 0) with a window
    of 3 on RoPE: prefix keys are seen from every later position of their document."""
    docs, pos = _documents(12, 9, 14)
    run_case("rope", shape=(1, 35, 35, 2, 1, 16), causal=True, window=3, query_documents=docs,
             key_documents=docs, query_positions=pos, key_positions=pos,
             prefix=np.array([5, 0, 7]), rope=posenc.rope_frequencies(16, base=100.0))


def test_prefix_per_row_t5():
    """One prefix length per batch row, without documents; T5's table gradient."""
    run_case("t5", shape=(2, 21, 21, 2, 2, 16), causal=True, prefix=np.array([4, 17]),
             params={"relative_attention_bias": np.random.default_rng(6).standard_normal((16, 2))})


def test_global_positions_window_documents():
    """Longformer: global tokens at positions 0 and 9 of every document (they see and are seen
    by their whole document) and a sliding window."""
    docs, pos = _documents(19, 14)
    run_case(shape=(1, 33, 33, 2, 2, 16), window=2, global_positions=[0, 9],
             query_documents=docs, key_documents=docs, query_positions=pos, key_positions=pos)


def test_dense_mask_broadcast_causal():
    """A dense mask of one row for both batch rows, ANDed with causal; rows without a key
    allowed."""
    mask = np.random.default_rng(7).random((1, 13, 21)) < 0.4
    run_case(shape=(2, 13, 21, 2, 1, 16), causal=True, mask=mask, allow_fully_masked=True)


def test_varlen_rope_gqa_causal():
    """Packed sequences of 5, 1, 0 and 23 queries over 9, 1, 4 and 23 keys: positions restart in
    each sequence (queries last, the KV-cache convention), GQA 4:2, RoPE, causal."""
    cu_q, cu_k = np.array([0, 5, 6, 6, 29]), np.array([0, 9, 10, 14, 37])
    run_case("rope", shape=(None, 29, 37, 4, 2, 16), causal=True, cu_seqlens_q=cu_q,
             cu_seqlens_k=cu_k, rope=posenc.rope_frequencies(16, base=50.0))


def test_varlen_explicit_positions_prefix_sinks():
    """Packed sequences with per-token positions, one prefix length per sequence, sinks."""
    cu = np.array([0, 11, 25])
    pos = np.concatenate([np.arange(11) * 2, np.arange(14) + 3])
    run_case(shape=(None, 25, 25, 2, 2, 16), causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
             query_positions=pos, key_positions=pos, prefix=np.array([6, 5]),
             params={"sinks": [0.5, -1.0]})


def test_float16_documents_prefix_global():
    docs, pos = _documents(8, 17)
    run_case(dtype=F16, shape=(1, 25, 25, 2, 1, 32), causal=True, query_documents=docs,
             key_documents=docs, query_positions=pos, key_positions=pos,
             prefix=np.array([3, 2]), global_positions=[6])


def test_bfloat16_dense_mask_documents():
    docs, _ = _documents(9, 11)
    mask = np.random.default_rng(8).random((2, 20, 20)) < 0.7
    run_case("alibi", dtype=BF16, shape=(2, 20, 20, 2, 2, 16), query_documents=np.repeat(
        docs, 2, 0), key_documents=np.repeat(docs, 2, 0), mask=mask, allow_fully_masked=True)


def test_bfloat16_varlen_rope_gqa():
    cu_q, cu_k = np.array([0, 7, 8, 30]), np.array([0, 12, 13, 35])
    run_case("rope", dtype=BF16, shape=(None, 30, 35, 4, 1, 16), causal=True,
             cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, rope_style="interleaved")


def test_block_mask_errors():
    q = torch.zeros(1, 6, 2, 16)
    docs = np.zeros((1, 6), np.int32)
    with pytest.raises(posenc.InvalidValueError, match="give both"):
        pt.attention(q, q, q, query_documents=docs)
    with pytest.raises(posenc.ShapeError, match="query_documents"):
        pt.attention(q, q, q, query_documents=docs[:, :5], key_documents=docs)
    with pytest.raises(posenc.ShapeError, match="prefix"):
        pt.attention(q, q, q, prefix=np.array([1, 2]))
    with pytest.raises(posenc.InvalidValueError, match="document id"):
        pt.attention(q, q, q, query_documents=docs + 1, key_documents=docs + 1,
                     prefix=np.array([1]))
    with pytest.raises(posenc.ShapeError, match="mask"):
        pt.attention(q, q, q, mask=np.ones((1, 6, 5), bool))
    with pytest.raises(posenc.InvalidValueError, match="cu_seqlens_k"):
        pt.attention(q[0], q[0], q[0], cu_seqlens_q=[0, 6], cu_seqlens_k=[0, 5])
    with pytest.raises(posenc.InvalidValueError, match="more queries than keys"):
        pt.attention(q[0], q[0, :4], q[0, :4], cu_seqlens_q=[0, 6], cu_seqlens_k=[0, 4])


# ---- half precision ----------------------------------------------------------------------------

def test_float16_none_causal_gqa():
    run_case(dtype=F16, shape=(2, 13, 13, 4, 2, 32), causal=True)


def test_float16_t5_table_grad_window():
    """Causal buckets without the causal mask (bidirectional=False), a window."""
    run_case("t5", dtype=F16, shape=(1, 9, 13, 2, 2, 16), window=5, bidirectional=False,
             params={"relative_attention_bias": np.random.default_rng(3).standard_normal((16, 2))})


def test_bfloat16_rope_interleaved_default_frequencies():
    run_case("rope", dtype=BF16, shape=(2, 5, 13, 4, 2, 16), rope_style="interleaved",
             causal=True)


def test_bfloat16_head_dim_64_default_tiles():
    run_case(dtype=BF16, shape=(1, 40, 70, 2, 1, 64), blocks=None, causal=True, window=50)


def test_bfloat16_alibi_softcap_sinks_narrow_values():
    run_case("alibi", dtype=BF16, shape=(1, 13, 13, 2, 2, 32), v_dim=16, softcap=4.0,
             chunk=8, params={"sinks": [0.0, 1.0], "slopes": [0.5, 0.125]})


def test_bfloat16_is_emulated_under_the_interpreter():
    """Triton's interpreter multiplies bf16 tiles wrongly and truncates float32 to bf16: the
    kernels widen bf16 tiles before tl.dot and round to nearest even themselves; on a GPU they
    use its bf16 dot products."""
    assert pt._forward.EMULATE_BF16 == (not ON_GPU)


# ---- the gradient of lse -----------------------------------------------------------------------

def test_lse_gradient():
    """A loss on out and lse, against float64 autograd of the textbook formula (causal, sinks,
    GQA)."""
    rng = np.random.default_rng(4)
    q64, k64, v64 = (torch.tensor(rng.standard_normal(s), requires_grad=True)
                     for s in ((1, 6, 4, 16), (1, 9, 2, 16), (1, 9, 2, 16)))
    sinks64 = torch.tensor([0.5, -1.0, 0.0, 1.0], dtype=torch.float64, requires_grad=True)
    w_out, w_lse = torch.tensor(rng.standard_normal((1, 6, 4, 16))), torch.rand(1, 4, 6)

    kk, vv = k64.repeat_interleave(2, 2), v64.repeat_interleave(2, 2)
    s = torch.einsum("bihd,bjhd->bhij", q64, kk) / 4.0
    hidden = torch.arange(9)[None, :] > torch.arange(6)[:, None] + 3
    s = s.masked_fill(hidden, float("-inf"))
    full = torch.cat([s, sinks64[None, :, None, None].expand(1, 4, 6, 1)], -1)
    lse64 = torch.logsumexp(full, -1)
    out64 = torch.einsum("bhij,bjhd->bihd", torch.exp(s - lse64[..., None]), vv)
    ((out64 * w_out).sum() + (lse64 * w_lse).sum()).backward()

    q, k, v, sinks = (t.detach().float().requires_grad_() for t in (q64, k64, v64, sinks64))
    out, lse = pt.attention(q, k, v, causal=True, sinks=sinks, return_lse=True, block_m=16,
                            block_n=16)
    ((out * w_out.float()).sum() + (lse * w_lse.float()).sum()).backward()
    for got, ref in ((out, out64), (lse, lse64), (q.grad, q64.grad), (k.grad, k64.grad),
                     (v.grad, v64.grad), (sinks.grad, sinks64.grad)):
        _check("lse gradient", got, ref.detach().numpy(), F32, False)


# ---- errors and host-side tables ---------------------------------------------------------------

def test_fully_masked_row_is_an_error():
    q = torch.zeros(1, 3, 1, 16)
    k = torch.zeros(1, 5, 1, 16)
    with pytest.raises(posenc.InvalidValueError, match=r"query 0 \(batch 0, position 0\) sees "
                       "no key"):
        pt.attention(q, k, k, causal=True, query_positions=[0, 3, 4],
                     key_positions=np.arange(5) + 1)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy's, on the interpreter's NaN
def test_non_finite_inputs_are_named_as_posenc_names_them():
    """A NaN or an infinity in q, k or v (packed sequences and the ops too) raises posenc's
    InvalidValueError naming the tensor and the element, as posenc.attention does; with
    allow_fully_masked there is no check and it propagates."""
    import posenc.torch as ptorch
    rng = np.random.default_rng(50)
    base = {n: torch.tensor(rng.standard_normal(s), dtype=F32) for n, s in
            (("q", (2, 5, 4, 16)), ("k", (2, 7, 2, 16)), ("v", (2, 7, 2, 16)))}
    for name, at, value in (("q", (1, 3, 2, 5), float("nan")), ("k", (0, 6, 1, 0), float("inf")),
                            ("v", (1, 2, 0, 15), float("-inf"))):
        t = dict(base)
        t[name] = t[name].clone()
        t[name][at] = value
        want = f"attention: {name}: non-finite value {value} at {list(at)}"
        cpu = f"{name}: non-finite value {value} at {list(at)}"
        with pytest.raises(posenc.InvalidValueError, match=re.escape(want)):
            pt.attention(t["q"], t["k"], t["v"], "alibi", causal=True)
        with pytest.raises(posenc.InvalidValueError, match=re.escape(cpu)):
            ptorch.attention(t["q"], t["k"], t["v"], "alibi", causal=True, backend="cpu")
        with pytest.raises(posenc.InvalidValueError, match=re.escape(cpu)):
            ptorch.attention(t["q"].to(DEVICE), t["k"].to(DEVICE), t["v"].to(DEVICE), "alibi",
                             causal=True, backend="triton")
        out = pt.attention(t["q"], t["k"], t["v"], "alibi", causal=True,
                           allow_fully_masked=True)
        assert not bool(torch.isfinite(out).all())
    packed = base["v"][0].clone()
    packed[4, 1, 2] = float("nan")
    with pytest.raises(posenc.InvalidValueError, match=re.escape("v: non-finite value nan at "
                                                                 "[4, 1, 2]")):
        pt.attention(base["q"][0], base["k"][0], packed, cu_seqlens_q=torch.tensor([0, 2, 5]),
                     cu_seqlens_k=torch.tensor([0, 3, 7]))


def test_argument_errors():
    q = torch.zeros(1, 3, 4, 16)
    k = torch.zeros(1, 5, 3, 16)
    with pytest.raises(posenc.ShapeError, match="heads_kv"):
        pt.attention(q, k, k)
    k = torch.zeros(1, 5, 2, 16)
    with pytest.raises(TypeError, match="slopes: a setting of scheme 'alibi'"):
        pt.attention(q, k, k, "rope", slopes=torch.ones(4))
    with pytest.raises(posenc.InvalidValueError, match="relative_attention_bias"):
        pt.attention(q, k, k, "t5")
    with pytest.raises(posenc.InvalidValueError, match="query_positions"):
        pt.attention(torch.zeros(1, 6, 4, 16), k, k)  # default positions need seq_q <= seq_k
    with pytest.raises(TypeError, match="one dtype"):
        pt.attention(q, k.half(), k)
    with pytest.raises(posenc.InvalidValueError, match="block_m"):
        pt.attention(q, k, k, block_m=24)


def test_t5_buckets_saturate_at_max_distance():
    """The kernels clamp distances to [-max_distance, max_distance] before reading the bucket
    table: posenc's buckets do not change beyond them."""
    for bidirectional in (True, False):
        for nb, md in ((32, 128), (8, 8), (16, 20)):
            b = posenc.t5_bucket(np.array([-10**9, -md - 1, -md, md, md + 1, 10**9]),
                                 num_buckets=nb, max_distance=md, bidirectional=bidirectional)
            assert b[0] == b[1] == b[2] and b[3] == b[4] == b[5]


# ---- the kernels compile for a GPU -------------------------------------------------------------

_COMPILE = r"""
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from posenc.triton import _backward, _forward, _rope

INTS = {"QPos": "*i64", "KPos": "*i64", "QTiles": "*i64", "KTiles": "*i64", "Buckets": "*i32",
        "QDoc": "*i32", "KDoc": "*i32", "QOpen": "*i32", "KOpen": "*i32", "Dense": "*u8",
        "RelQIdx": "*i32", "RelKIdx": "*i32", "RelVIdx": "*i32", "NonFinite": "*i32",
        "Pages": "*i32", "KLen": "*i32"}

def compile(kernel, dtype, constexprs, rotated=(), types=None):
    signature = {}
    for name in inspect.signature(kernel.fn).parameters:
        if types and name in types:
            signature[name] = types[name]
        elif name in constexprs:
            signature[name] = "constexpr"
        elif name in INTS:
            signature[name] = INTS[name]
        elif name in ("Q", "K", "V", "Out", "DO", "DQ", "DK", "DV", "Y") and name not in rotated:
            signature[name] = "*" + dtype
        elif name[0].isupper():
            signature[name] = "*fp32"
        else:
            signature[name] = "fp32" if name in ("scale", "softcap") else "i32"
    triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 8})

# (dtype, scheme, rotary dim, mask flags, the relative terms REL_Q, REL_K, REL_V, Q_BIAS)
for dtype, scheme, rotary, flags, rel in (
        ("bf16", 1, 32, True, (0, 0, 0, 0)), ("fp16", 3, 0, False, (0, 0, 0, 0)),
        ("fp32", 2, 0, True, (0, 0, 0, 0)), ("fp32", 4, 0, True, (1, 0, 1, 0)),
        ("bf16", 5, 0, False, (1, 0, 0, 1)), ("fp16", 6, 0, True, (1, 1, 0, 0))):
    c = dict(SCHEME=scheme, ROTARY=rotary, INTERLEAVED=flags, CAUSAL=flags, HAS_WINDOW=flags,
             HAS_CHUNK=flags, HAS_SOFTCAP=flags, HAS_SINKS=flags, HAS_DOCS=flags,
             HAS_OPEN=flags, HAS_DENSE=flags, REL_Q=bool(rel[0]), REL_K=bool(rel[1]),
             REL_V=bool(rel[2]), Q_BIAS=bool(rel[3]), BLOCK_M=16 if rel[0] else 32,
             BLOCK_N=16 if rel[0] else 32, BLOCK_D=64, BLOCK_DV=32, EMULATE_BF16=False)
    rotated = ("DQ", "DK") if rotary else ()
    compile(_forward.attention_forward_kernel, dtype, dict(c, PAGED=flags))
    compile(_backward.attention_backward_kv_kernel, dtype, dict(c, NEED_DTABLE=scheme > 3),
            rotated)
    compile(_backward.attention_backward_q_kernel, dtype, dict(c, NEED_DTABLE=scheme > 1),
            rotated)
    if rotary:
        compile(_backward.rope_back_kernel, dtype, dict(ROTARY=rotary, INTERLEAVED=flags,
                BLOCK_L=64, BLOCK_D=64, EMULATE_BF16=False))
        for table in ("*fp64", "*fp32"):  # RoPE alone: accurate and float32 angles
            compile(_rope.rope_kernel, dtype, dict(ROTARY=rotary, INTERLEAVED=flags, BLOCK_L=32,
                    BLOCK_D=64, EMULATE_BF16=False), types={"Cos": table, "Sin": table})
print("compiled")
"""


def test_kernels_compile_for_a_gpu(tmp_path):
    """The interpreter runs the kernels as Python and checks none of Triton's compile-time rules:
    compile each kernel for sm_90 (Hopper) on this machine, no GPU needed, in a process without
    TRITON_INTERPRET: bf16 with RoPE and every mask (block masks included), soft-cap and sinks;
    f16 with T5 and its table gradient; float32 with ALiBi, its slope gradient and every
    mask; Shaw (float32, keys and values), XL (bf16) and DeBERTa (f16, every mask) with their
    table gradients; the forward on paged caches; RoPE alone with float64 and float32 tables."""
    import triton.backends
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no NVIDIA backend")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-4000:]


# ---- the ops' Triton backend: posenc.torch.attention(..., backend="triton") --------------------

def _backend_case(scheme, dtype, *, shape=(2, 5, 13, 4, 2, 16), tables=(), seed=3, **kw):
    """posenc.torch.attention with backend="triton" (through torch.ops.posenc.attention and its
    backward) against the same call on float64 copies (posenc's float64 reference), forward, lse
    and every gradient. With cu_seqlens_q in kw the tensors are packed (rank 3)."""
    import posenc.torch as ptorch
    batch, seq_q, seq_k, heads_q, heads_kv, dim = shape
    rng = np.random.default_rng(seed)
    rows = () if "cu_seqlens_q" in kw else (batch,)
    shapes = {"q": (*rows, seq_q, heads_q, dim), "k": (*rows, seq_k, heads_kv, dim),
              "v": (*rows, seq_k, heads_kv, dim), "slopes": (heads_q,),
              "relative_attention_bias": (32, heads_q), "sinks": (heads_q,),
              "rel_k": (9, dim), "rel_v": (9, heads_q, dim), "r_w_bias": (heads_q, dim),
              "r_r_bias": (heads_q, dim), "r_net": (heads_q * dim, 10),
              "pos_key": (12, heads_q, dim), "pos_query": (12, heads_q, dim)}
    data = {n: rng.standard_normal(shapes[n]) for n in ("q", "k", "v", *tables)}
    half = {n: torch.tensor(a, dtype=F32).to(dtype if n in "qkv" else F32).requires_grad_()
            for n, a in data.items()}
    wide = {n: t.detach().double().requires_grad_() for n, t in half.items()}
    # dout in q's dtype (the gradient of a half out is half), the reference its float64 copy.
    dout = torch.tensor(rng.standard_normal(shapes["q"]), dtype=F32).to(dtype).double()
    results = {}
    for name, ts, backend in (("triton", half, "triton"), ("reference", wide, "cpu")):
        call = {n: t.to(DEVICE) for n, t in ts.items()} if backend == "triton" else ts
        extra = {n: (x.to(DEVICE) if isinstance(x, torch.Tensor) and backend == "triton" else x)
                 for n, x in kw.items()}
        out, lse = ptorch.attention(call["q"], call["k"], call["v"], scheme, backend=backend,
                                    params={n: call[n] for n in tables} or None,
                                    return_lse=True, **extra)
        out, lse = out.cpu(), lse.cpu()
        assert out.dtype == ts["q"].dtype and lse.dtype == (F32 if name == "triton" else F64)
        out.backward(dout.to(out.dtype))
        results[name] = (out, lse, {n: t.grad for n, t in ts.items()})
    out, lse, grads = results["triton"]
    ref_out, ref_lse, ref_grads = results["reference"]
    _check(f"{scheme} out", out, ref_out.detach().numpy(), dtype, half_rounded=dtype != F32)
    _check(f"{scheme} lse", lse, ref_lse.numpy(), dtype, half_rounded=False)
    for n in grads:
        _check(f"{scheme} d{n}", grads[n], ref_grads[n].numpy(),
               dtype if n in "qkv" else F32, half_rounded=dtype != F32 and n in "qkv")


F64 = torch.float64


def test_backend_triton_none_gqa_window():
    _backend_case("none", F32, causal=True, window=4)


def test_backend_triton_rope_bf16_interleaved_partial():
    _backend_case("rope", BF16, causal=True, base=500.0, style="interleaved", rotary_dim=8)


def test_backend_triton_alibi_slopes_and_sinks():
    _backend_case("alibi", F32, tables=("slopes", "sinks"), causal=True, softcap=2.0)


def test_backend_triton_t5_f16():
    _backend_case("t5", F16, tables=("relative_attention_bias",), scale=1.0, max_distance=16,
                  query_positions=torch.tensor([3, 9, 10, 11, 20]))


def test_backend_triton_shaw_xl_deberta():
    """The relative-table schemes through the ops, every table with its gradient: Shaw (shared
    rel_k, per-head rel_v) in float32, XL in bfloat16 with sinks, DeBERTa in float16 with log
    buckets and the paper's p2c."""
    _backend_case("shaw", F32, tables=("rel_k", "rel_v"), causal=True)
    _backend_case("xl", BF16, tables=("r_w_bias", "r_r_bias", "r_net", "sinks"), causal=True,
                  base=300.0)
    _backend_case("deberta", F16, tables=("pos_key", "pos_query"), position_buckets=6,
                  max_relative_positions=20, deberta_p2c="paper",
                  key_positions=torch.tensor([0, 1, 2, 5, 9, 14, 20, 27, 35, 44, 54, 65, 77]))


def test_backend_triton_varlen_rope_gqa():
    """Packed sequences through the ops: out [total_q, heads_q, D], lse [heads_q, total_q]."""
    _backend_case("rope", F32, shape=(None, 11, 16, 4, 2, 16), causal=True,
                  cu_seqlens_q=torch.tensor([0, 3, 11]), cu_seqlens_k=torch.tensor([0, 8, 16]))


def test_backend_triton_documents_prefix_global_mask_f16():
    docs = torch.tensor([[0] * 6 + [1] * 7, [0] * 13])
    mask = torch.tensor(np.random.default_rng(9).random((1, 13, 13)) < 0.8)
    _backend_case("alibi", F16, shape=(2, 13, 13, 2, 1, 16), tables=("slopes",), causal=True,
                  query_documents=docs, key_documents=docs, prefix=torch.tensor([2, 3]),
                  global_positions=[8], mask=mask, allow_fully_masked=True)


def test_backend_triton_positional_attention_and_opcheck():
    import posenc.torch as ptorch
    torch.manual_seed(5)
    q, k, v = torch.randn(1, 6, 4, 16), torch.randn(1, 6, 2, 16), torch.randn(1, 6, 2, 16)
    if ON_GPU:
        q, k, v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    module = ptorch.PositionalAttention("rope", 4, 2, 16, causal=True, backend="triton")
    assert "backend='triton'" in repr(module)
    got = module(q, k, v).cpu()
    want = ptorch.PositionalAttention("rope", 4, 2, 16, causal=True, backend="cpu")(
        q.cpu(), k.cpu(), v.cpu())
    _check("module out", got, want.double().numpy(), F32, half_rounded=False)
    q.requires_grad_()
    torch.library.opcheck(torch.ops.posenc.attention.default, (q, k, v, [], []),
                          {"scheme": "alibi", "causal": True, "backend": "triton"})


def _config_path(name):
    return os.path.join(os.environ.get("POSENC_TEST_CONFIGS_DIR", os.path.join(
        os.path.dirname(__file__), "..", "configs")), name)


# (config file, layer, heads_q, heads_kv, head_dim, tables, other keywords)
_CONFIG_CASES = [
    ("llama-3.1-8b.json", None, 32, 8, 128, (), {"causal": True}),
    ("gemma-2-2b.json", 0, 8, 4, 256, (), {"causal": True, "query_positions": 4100,
                                            "key_positions": 4090}),
    ("gpt-j-6b.json", None, 16, 16, 256, (), {"causal": True}),
    ("llama-2-7b-dynamic-2x.json", None, 32, 32, 128, (), {"causal": True,
                                                           "query_positions": 9000}),
    ("qwen2.5-7b-yarn.json", None, 28, 4, 128, (), {"causal": True, "window": 3}),
    ("bloom-560m.json", None, 16, 16, 64, (), {"causal": True}),
    ("t5-base.json", None, 12, 12, 64, ("relative_attention_bias",), {}),
    ("deberta-v3-base.json", None, 12, 12, 64, ("pos_key", "pos_query"), {}),
    ("gpt-oss-20b.json", 0, 64, 8, 64, ("sinks",), {"causal": True}),
]


@pytest.mark.parametrize("case", _CONFIG_CASES, ids=[c[0] for c in _CONFIG_CASES])
def test_backend_triton_model_configs(case):
    """A model config (and a layer) through backend='triton' against backend='cpu' in float64:
    the scheme, frequencies (llama3, dynamic NTK past the context, YaRN's attention factor,
    GPT-J's interleaved partial rotary), the layer's window, soft-cap and scale (Gemma 2), the
    computed ALiBi slopes (BLOOM), T5's scale and buckets, DeBERTa's log buckets and default
    scale, gpt-oss' sinks, forward and every gradient."""
    import posenc.torch as ptorch
    name, layer, hq, hkv, dim, tables, kw = case
    lq, lk = 5, 7
    rng = np.random.default_rng(len(name))
    shapes = {"q": (1, lq, hq, dim), "k": (1, lk, hkv, dim), "v": (1, lk, hkv, dim),
              "relative_attention_bias": (32, hq), "pos_key": (512, hq, dim),
              "pos_query": (512, hq, dim), "sinks": (hq,)}
    data = {n: rng.standard_normal(shapes[n]) * (0.3 if n not in "qkv" else 1.0)
            for n in ("q", "k", "v", *tables)}
    results = []
    for backend, dtype in (("triton", F32), ("cpu", F64)):
        ts = {n: torch.tensor(a, dtype=dtype, requires_grad=True) for n, a in data.items()}
        dev = {n: t.to(DEVICE) if backend == "triton" else t for n, t in ts.items()}
        extra = {n: x.to(DEVICE) if isinstance(x, torch.Tensor) and backend == "triton" else x
                 for n, x in kw.items()}
        out = ptorch.attention(dev["q"], dev["k"], dev["v"], config=_config_path(name),
                               layer=layer, params={n: dev[n] for n in tables} or None,
                               backend=backend, **extra).cpu()
        out.backward(torch.ones_like(out))
        results.append((out, {n: t.grad for n, t in ts.items()}))
    (out, grads), (ref, ref_grads) = results
    _check(f"{name} out", out, ref.detach().numpy(), F32, half_rounded=False)
    for n in grads:
        _check(f"{name} d{n}", grads[n], ref_grads[n].numpy(), F32, half_rounded=False)


def test_backend_triton_config_refusals():
    """What the kernels lack in a config is refused by name; the config's own errors are posenc's
    (a Gemma 2 config without a layer; base with a config)."""
    import posenc.torch as ptorch
    q = torch.randn(1, 3, 40, 128)
    k = torch.randn(1, 3, 8, 128)
    with pytest.raises(ValueError, match="backend='triton'.*query temperature"):
        ptorch.attention(q, k, k, config=_config_path("llama-4-scout-17b-16e-instruct.json"),
                         layer=3, causal=True, backend="triton")
    q = torch.randn(1, 3, 8, 256)
    k = torch.randn(1, 3, 4, 256)
    with pytest.raises(ValueError, match="differ in position handling.*choose a layer"):
        ptorch.attention(q, k, k, config=_config_path("gemma-2-2b.json"), backend="triton")
    with pytest.raises(ValueError, match="base"):
        ptorch.attention(q, k, k, config=_config_path("gemma-2-2b.json"), layer=1, base=500.0,
                         backend="triton")
    with pytest.raises(ValueError, match="head_dim"):
        ptorch.attention(q[..., :64], k[..., :64], k[..., :64],
                         config=_config_path("gemma-2-2b.json"), layer=1, backend="triton")


def test_backend_triton_refuses_what_its_kernels_lack():
    import posenc.torch as ptorch
    q = torch.randn(1, 4, 2, 8)
    config = {"model_type": "llama", "hidden_size": 16, "num_attention_heads": 2,
              "num_key_value_heads": 2, "rope_theta": 1e4, "max_position_embeddings": 64}
    got = ptorch.attention(q, q, q, backend="triton", config=config, causal=True)
    want = ptorch.attention(q, q, q, backend="cpu", config=config, causal=True)
    _check("llama config", got, want.double().numpy(), F32, half_rounded=False)
    with pytest.raises(ValueError, match="backend='triton':.*query temperature.*backend='cpu'"):
        ptorch.attention(torch.randn(1, 3, 40, 128), torch.randn(1, 3, 8, 128),
                         torch.randn(1, 3, 8, 128), backend="triton",
                         config=_config_path("llama-4-scout-17b-16e-instruct.json"), layer=3)
    with pytest.raises(ValueError, match="backend: 'auto', 'cpu' or 'triton'"):
        ptorch.attention(q, q, q, backend="gpu")
    with pytest.raises(TypeError, match="backend"):
        ptorch.attention(q, q, q, backend=1)
    with pytest.raises(TypeError, match="one dtype"):
        ptorch.attention(q, q.half(), q.half(), backend="triton")
    with pytest.raises(TypeError, match="float64"):
        ptorch.attention(q.double(), q.double(), q.double(), backend="triton")


def test_paged_cache_read_in_place_as_the_cpu_kernel_reads_it():
    """posenc.triton._op.paged (the CUDA form of torch.ops.posenc.attention_paged: the forward
    kernel reads the pages through the block table) against the CPU paged kernel: rows of
    different lengths over several key tiles, sharing pages, an empty row, a table wider than
    the rows' pages with unused entries -1 (never read), both page layouts, GQA, two queries
    per row, ALiBi, RoPE, T5 with its table, a window with soft-cap and sinks, given query
    positions, float32, bfloat16 and float16 (the CPU result of the same half values in
    float32, rounded once)."""
    from posenc import _ops
    from posenc.triton import _op
    rng = np.random.default_rng(21)
    page, heads_q, heads_kv, dim, num_pages = 4, 4, 2, 16, 40
    lens = torch.tensor([77, 0, 33, 6], dtype=torch.int32)
    table = torch.full((4, 21), -1, dtype=torch.int32)
    perm = torch.tensor(rng.permutation(num_pages), dtype=torch.int32)
    table[0, :20], table[2, :9], table[3, :2] = perm[:20], perm[11:20], perm[3:5]  # shared pages
    q = torch.tensor(rng.standard_normal((4, 2, heads_q, dim)), dtype=F32)
    pool = torch.tensor(rng.standard_normal((2, num_pages, page, heads_kv, dim)), dtype=F32)
    t5 = torch.tensor(rng.standard_normal((32, heads_q)), dtype=F32)
    sinks = torch.tensor(rng.standard_normal(heads_q), dtype=F32)
    qpos = torch.tensor([[3, 80], [0, 1], [10, 32], [5, 5]])
    cases = (("alibi", F32, {}, [], None), ("rope", BF16, {}, [], None),
             ("none", F32, {}, [], None), ("t5", F16, {}, [("relative_attention_bias", t5)], None),
             ("rope", F32, {"window": 9, "softcap": 5.0}, [("sinks", sinks)], qpos),
             ("alibi", BF16, {}, [], qpos))
    for layout in ("token_major", "head_major"):
        kp, vp = pool[0], pool[1]
        if layout == "head_major":
            kp, vp = kp.transpose(1, 2).contiguous(), vp.transpose(1, 2).contiguous()
        for scheme, dtype, extra, named, positions in cases:
            settings = _ops.typed("attention_paged", {"scheme": scheme, "causal": True,
                                                      "layout": layout, "allow_fully_masked": True,
                                                      **extra}, "attention_paged")
            args = [t.to(dtype) for t in (q, kp, vp)]
            names, tables = [n for n, _ in named], [t for _, t in named]
            got = _op.paged(*(t.to(DEVICE) for t in args), table.to(DEVICE), lens.to(DEVICE),
                            [t.to(DEVICE) for t in tables], names,
                            None if positions is None else positions.to(DEVICE), settings).cpu()
            assert got.dtype == dtype and got.shape == q.shape
            want = _ops.attention_paged_impl(*(t.float() for t in args), table, lens, tables,
                                             names, positions, **settings)
            ulp = 2.0 ** (-8 if dtype == BF16 else -11)
            tol = 1e-5 if dtype == F32 else ulp * want.abs() + 1e-5
            assert torch.all((got.float() - want).abs() <= tol), (layout, scheme, dtype)
            assert not got[1].any() or positions is not None or named  # the empty row: 0


def test_paged_cache_refusals_are_the_cpu_kernels():
    """Bad paged calls are refused before a page is read, with the CPU kernel's types and
    messages: block tables and lengths of wrong types, shapes and ranges, pools that differ or
    hold no slot, head counts and dims that do not match, default positions past a short row,
    a row that sees no key."""
    from posenc import _ops
    from posenc.triton import _op
    q = torch.zeros(2, 1, 4, 16)
    kp = torch.zeros(5, 4, 2, 16)
    t = torch.zeros(2, 3, dtype=torch.int32)
    n = torch.tensor([3, 4], dtype=torch.int32)
    s = _ops.typed("attention_paged", {}, "attention_paged")
    calls = [(q, kp, kp, t.float(), n), (q, kp, kp[:4], t, n), (q[..., :8], kp, kp, t, n),
             (q[:, :, :3], kp, kp, t, n), (q, kp, kp, t[:1], n), (q, kp, kp, t, n[:1]),
             (q, kp, kp, t[0], n), (q, kp[:, :0], kp[:, :0], t, n * 0),
             (q, kp, kp, t, torch.tensor([13, 1], dtype=torch.int32)),
             (q, kp, kp, t, torch.tensor([-1, 1], dtype=torch.int32)), (q, kp, kp, t + 5, n),
             (q, kp, kp, torch.tensor([[0, 7, 2], [1, 2, 3]], dtype=torch.int32), n + 2),
             (torch.zeros(2, 5, 4, 16), kp, kp, t, n), (q, kp, kp, t, n * 0)]
    for args in calls:
        with pytest.raises((TypeError, ValueError)) as cpu:
            _ops.attention_paged_impl(*args, [], [], None, **s)
        with pytest.raises(type(cpu.value)) as tri:
            _op.paged(*(a.to(DEVICE) for a in args), [], [], None, s)
        assert str(tri.value) == str(cpu.value)


def test_rope_kernel_gives_the_pytorch_forms_numbers():
    """The CUDA form of posenc::rope and rope_half (posenc._device.rope with the Triton kernel:
    one read and one write per element) against the PyTorch form of the same recipe and the
    CPU kernels, bit for bit: half and interleaved pairs, a partial rotary dim, the inverse,
    an int offset, ids per row past 2^16, YaRN's attention factor, a model config, float32
    angles; float32, float64, bf16 and f16; 3-D x, a strided x, odd sizes over several row
    blocks; and in place."""
    from posenc import _device, _ops
    from posenc.triton import _rope
    g = torch.Generator().manual_seed(31)
    x = torch.randn(2, 37, 3, 24, generator=g)
    ids = torch.randint(0, 1 << 17, (2, 37), generator=g)
    llama = os.path.join(os.environ.get("POSENC_TEST_CONFIGS_DIR", "tests/configs"),
                         "llama-3.1-8b.json")
    settings = [{}, {"style": "interleaved"}, {"rotary_dim": 8}, {"rotary_dim": 10,
                "style": "interleaved", "inverse": True}, {"positions": 5},
                {"scaling": {"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 16}},
                {"angles": "float32"}]
    for kw in settings:
        s = _ops.typed("rope", kw, "rope")
        for t in (x, x.double(), x.bfloat16(), x.half(), x[0], x[:, :, :, :20]):
            for positions in ((ids if t.dim() == 4 else ids[0], None) if "positions" not in kw
                              else (None,)):
                op = "rope_half" if t.dtype in (BF16, F16) else "rope"
                b = _ops._binding_kwargs(op, s)
                got = _device.rope(t.to(DEVICE), positions, b, kernel=True).cpu()
                want = _device.rope(t, positions, b, kernel=False)
                assert got.dtype == t.dtype and torch.equal(got, want), (kw, t.dtype)
                if kw.get("angles") != "float32" and t.shape[-1] == 24:  # the CPU kernels' bits
                    impl = _ops.rope_half_impl if op == "rope_half" else _ops.rope_impl
                    assert torch.equal(got, impl(t, positions, **s)), (kw, t.dtype)
    xc = torch.randn(1, 5, 2, 128, generator=g)
    b = _ops._binding_kwargs("rope", _ops.typed("rope", {"config": llama}, "rope"))
    assert torch.equal(_device.rope(xc.to(DEVICE), None, b, kernel=True).cpu(),
                       _device.rope(xc, None, b, kernel=False))
    # In place: out is x.
    freqs = posenc.rope_frequencies(24)
    _, cos, sin = _device._tables(ids.numpy(), freqs, False, torch.device("cpu"))
    y = x.clone().to(DEVICE)
    _rope.rotate(y, cos.to(DEVICE), sin.to(DEVICE), 24, False, out=y)
    assert torch.equal(y.cpu(), _device.rope(x, ids, {"freqs": freqs}, kernel=False))


# ---- transformers models on the Triton kernels -------------------------------------------------

def _triton_for_every_call(monkeypatch):
    """Every posenc attention call of this test takes the Triton kernels (as CUDA tensors do
    with backend 'auto'), here through the interpreter on CPU tensors. Returns a counter of the
    Triton forwards that ran."""
    from posenc import _ops
    from posenc.triton import _op
    real = _ops.uses_triton
    monkeypatch.setattr(_ops, "uses_triton",
                        lambda q, backend: backend in ("auto", "triton") or real(q, backend))
    calls = {"n": 0}
    real_forward = _op.forward

    def counted(*a, **k):
        calls["n"] += 1
        return real_forward(*a, **k)

    monkeypatch.setattr(_op, "forward", counted)
    return calls


@pytest.mark.skipif(ON_GPU, reason="sends CPU tensors to the kernels (the interpreter's case)")
def test_transformers_llama_left_padded_training_step(monkeypatch):
    """A Llama-style model (GQA, RoPE applied by the model) with attn_implementation="posenc",
    left-padded batch with the usual labels, on the Triton kernels: loss and every parameter
    gradient as eager attention's."""
    transformers = pytest.importorskip("transformers")
    import posenc.hf
    assert posenc.hf.register() == "posenc"
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   attention_dropout=0.0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                          dtype=torch.float32)
    model.train()
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    calls = _triton_for_every_call(monkeypatch)
    out = {}
    for impl in ("eager", "posenc"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        res = model(ids, attention_mask=mask, labels=labels)
        res.loss.backward()
        out[impl] = (float(res.loss.detach()), {n: p.grad.clone() for n, p in
                                                model.named_parameters() if p.grad is not None})
    assert calls["n"] == 2  # one forward per layer, on the Triton kernels
    (la, ga), (lb, gb) = out["eager"], out["posenc"]
    assert abs(la - lb) <= 1e-5 * abs(la), (la, lb)
    big = max(float(g.abs().max()) for g in ga.values())
    for n in ga:
        err = float((ga[n] - gb[n]).abs().max())
        assert err <= 2e-5 * float(ga[n].abs().max()) + 1e-7 * big, (n, err)


@pytest.mark.skipif(ON_GPU, reason="sends CPU tensors to the kernels (the interpreter's case)")
@pytest.mark.parametrize("family", ["t5", "deberta-v3", "bloom"])
def test_transformers_patched_bias_families(monkeypatch, family):
    """posenc.hf.patch's T5 (bucketed bias table), DeBERTa-v3 (c2p and p2c over log buckets) and
    BLOOM (ALiBi) on the Triton kernels, padded batches: logits and every parameter gradient
    (the tables' included) as the unpatched model's."""
    pytest.importorskip("transformers")
    import test_hf_patch as hp
    cfg = {"t5": hp.t5_config, "deberta-v3": hp.deberta_config, "bloom": hp.bloom_config}[
        family]()
    ref, patched = hp.pair(cfg)
    ids, mask = hp.inputs(cfg, 2, 11, pad="right" if family != "bloom" else "left")
    dec_ids = dec_mask = None
    if family == "t5":
        dec_ids, dec_mask = hp.inputs(cfg, 2, 7, seed=1, pad="right")
    want, want_grads = hp.forward_backward(ref, cfg, ids, mask, dec_ids, dec_mask)
    calls = _triton_for_every_call(monkeypatch)
    got, got_grads = hp.forward_backward(patched, cfg, ids, mask, dec_ids, dec_mask)
    assert calls["n"] >= 2  # every attention layer's forward on the Triton kernels
    rows = hp.real_rows(cfg, mask, dec_mask)
    assert hp._rel(got, want, rows) <= 2e-5
    assert set(got_grads) == set(want_grads)
    for n in want_grads:
        err = float((got_grads[n] - want_grads[n]).abs().max())
        assert err <= 2e-5 * max(1.0, float(want_grads[n].abs().max())), (n, err)


# ---- hostile inputs of the relative schemes, configs and backends ----
#
# Wrong types, shapes, dtypes, devices, non-finite tables and out-of-range settings of Shaw,
# Transformer-XL, DeBERTa and T5 (posenc.triton.attention), model configs and layers
# (backend="triton"), backend="flex", and the non-finite checks of the Triton path: each is a
# TypeError or a ValueError (posenc.ShapeError / InvalidValueError) naming the argument, raised
# before any kernel runs or giant table is made, with the CPU backend's message where both
# backends check the same thing. Tiny shapes: [1, 3, 2, 16].

_H, _D = 2, 16


def _tiny_qkv(seq_q=3, seq_k=3, heads=_H, dim=_D, device=None):
    g = torch.Generator().manual_seed(7)
    return tuple(torch.randn(1, n, heads, dim, generator=g).to(device or DEVICE)
                 for n in (seq_q, seq_k, seq_k))


def _shaw_kw(**kw):
    return {"rel_k": torch.randn(5, _D), **kw}


def _xl_kw(**kw):
    return {"r_w_bias": torch.randn(_H, _D), "r_r_bias": torch.randn(_H, _D),
            "r_net": torch.randn(_H * _D, 8), **kw}


def _deberta_kw(**kw):
    return {"pos_key": torch.randn(8, _H, _D), "pos_query": torch.randn(8, _H, _D),
            "max_relative_positions": 4, **kw}


def _t5_kw(**kw):
    return {"relative_attention_bias": torch.randn(32, _H), **kw}


def _on_device(kw):
    """Tensor keywords on DEVICE (a meta tensor stays there: it is the hostile input)."""
    return {n: x.to(DEVICE) if isinstance(x, torch.Tensor) and x.device.type != "meta" else x
            for n, x in kw.items()}


def _without(kw, name):
    kw.pop(name)
    return kw


_FAR = [0, 1, 1 << 25]  # query positions whose distances to keys 0..2 span > 2^24 values

# (id, scheme, keywords (made per case), exception, message regex naming the argument)
_HOSTILE_TRITON = [
    # Shaw
    ("shaw-rel_k-list", "shaw", lambda: _shaw_kw(rel_k=[[0.0] * _D] * 5), TypeError,
     r"rel_k: a torch\.Tensor .*got list"),
    ("shaw-rel_k-numpy", "shaw", lambda: _shaw_kw(rel_k=np.zeros((5, _D))), TypeError,
     r"rel_k: a torch\.Tensor .*got ndarray"),
    ("shaw-rel_k-int", "shaw", lambda: _shaw_kw(rel_k=3), TypeError, r"rel_k: .*got int"),
    ("shaw-rel_k-bool", "shaw", lambda: _shaw_kw(rel_k=True), TypeError, r"rel_k: .*got bool"),
    ("shaw-rel_k-str", "shaw", lambda: _shaw_kw(rel_k="rel"), TypeError, r"rel_k: .*got str"),
    ("shaw-rel_k-missing", "shaw", lambda: _without(_shaw_kw(), "rel_k"),
     posenc.InvalidValueError, r"scheme shaw needs rel_k"),
    ("shaw-rel_k-even", "shaw", lambda: _shaw_kw(rel_k=torch.randn(4, _D)), posenc.ShapeError,
     r"rel_k: 2K\+1 \(odd\) rows, got 4"),
    ("shaw-rel_k-empty", "shaw", lambda: _shaw_kw(rel_k=torch.randn(0, _D)), posenc.ShapeError,
     r"rel_k: 2K\+1 \(odd\) rows, got 0"),
    ("shaw-rel_k-1d", "shaw", lambda: _shaw_kw(rel_k=torch.randn(5)), posenc.ShapeError,
     r"rel_k: shape \[5\]"),
    ("shaw-rel_k-4d", "shaw", lambda: _shaw_kw(rel_k=torch.randn(5, 1, _H, _D)),
     posenc.ShapeError, r"rel_k: shape \[5, 1, 2, 16\]"),
    ("shaw-rel_k-heads", "shaw", lambda: _shaw_kw(rel_k=torch.randn(5, 3, _D)),
     posenc.ShapeError, r"rel_k: shape \[5, 3, 16\], expected \[5, 16\] or \[5, 2, 16\]"),
    ("shaw-rel_k-width", "shaw", lambda: _shaw_kw(rel_k=torch.randn(5, 8)), posenc.ShapeError,
     r"rel_k: shape \[5, 8\]"),
    ("shaw-rel_v-width", "shaw", lambda: _shaw_kw(rel_v=torch.randn(5, 8)), posenc.ShapeError,
     r"rel_v: shape \[5, 8\], expected \[5, 16\]"),
    ("shaw-rel_v-rows", "shaw", lambda: _shaw_kw(rel_v=torch.randn(3, _D)), posenc.ShapeError,
     r"rel_v: shape \[3, 16\], expected \[5, 16\]"),
    ("shaw-rel_v-list", "shaw", lambda: _shaw_kw(rel_v=[[0.0] * _D] * 5), TypeError,
     r"rel_v: a torch\.Tensor"),
    ("shaw-rel_k-int64", "shaw", lambda: _shaw_kw(rel_k=torch.ones(5, _D, dtype=torch.int64)),
     TypeError, r"rel_k: a floating-point tensor, got torch\.int64"),
    ("shaw-rel_k-complex", "shaw",
     lambda: _shaw_kw(rel_k=torch.ones(5, _D, dtype=torch.complex64)), TypeError,
     r"rel_k: a floating-point tensor, got torch\.complex64"),
    ("shaw-rel_k-nan", "shaw", lambda: _shaw_kw(rel_k=torch.full((5, _D), float("nan"))),
     posenc.InvalidValueError, r"rel_k: non-finite values"),
    ("shaw-rel_v-inf", "shaw", lambda: _shaw_kw(rel_v=torch.full((5, _D), float("inf"))),
     posenc.InvalidValueError, r"rel_v: non-finite values"),
    ("shaw-rel_k-float64-past-float32", "shaw",
     lambda: _shaw_kw(rel_k=torch.full((5, _D), 1e300, dtype=torch.float64)),
     posenc.InvalidValueError, r"rel_k: non-finite values \(in float32\)"),
    ("shaw-rel_k-meta", "shaw", lambda: _shaw_kw(rel_k=torch.empty(5, _D, device="meta")),
     ValueError, r"rel_k: on meta, expected"),
    ("shaw-keyword-of-xl", "shaw", lambda: _shaw_kw(r_net=torch.randn(_H * _D, 8)), TypeError,
     r"r_net: a setting of scheme 'xl', not 'shaw'"),
    # Transformer-XL
    ("xl-r_net-odd", "xl", lambda: _xl_kw(r_net=torch.randn(_H * _D, 7)), posenc.ShapeError,
     r"r_net: d_model \(7\) must be even"),
    ("xl-r_net-no-columns", "xl", lambda: _xl_kw(r_net=torch.randn(_H * _D, 0)),
     posenc.ShapeError, r"r_net: d_model \(0\)"),
    ("xl-r_net-rows", "xl", lambda: _xl_kw(r_net=torch.randn(_H * _D + 1, 8)),
     posenc.ShapeError, r"r_net: shape \[33, 8\], expected \[32, d_model\]"),
    ("xl-r_net-1d", "xl", lambda: _xl_kw(r_net=torch.randn(8)), posenc.ShapeError,
     r"r_net: shape \[8\]"),
    ("xl-r_net-list", "xl", lambda: _xl_kw(r_net=[[0.0] * 8] * (_H * _D)), TypeError,
     r"r_net: a torch\.Tensor .*got list"),
    ("xl-r_net-int", "xl", lambda: _xl_kw(r_net=torch.ones(_H * _D, 8, dtype=torch.int32)),
     TypeError, r"r_net: a floating-point tensor"),
    ("xl-r_net-nan", "xl", lambda: _xl_kw(r_net=torch.full((_H * _D, 8), float("nan"))),
     posenc.InvalidValueError, r"r_net: non-finite values"),
    ("xl-r_net-meta", "xl", lambda: _xl_kw(r_net=torch.empty(_H * _D, 8, device="meta")),
     ValueError, r"r_net: on meta"),
    ("xl-r_w_bias-1d", "xl", lambda: _xl_kw(r_w_bias=torch.randn(_D)), posenc.ShapeError,
     r"r_w_bias: shape \[16\], expected \[2, 16\]"),
    ("xl-r_w_bias-heads", "xl", lambda: _xl_kw(r_w_bias=torch.randn(3, _D)),
     posenc.ShapeError, r"r_w_bias: shape \[3, 16\], expected \[2, 16\]"),
    ("xl-r_r_bias-numpy", "xl", lambda: _xl_kw(r_r_bias=np.zeros((_H, _D))), TypeError,
     r"r_r_bias: a torch\.Tensor"),
    ("xl-r_w_bias-complex", "xl",
     lambda: _xl_kw(r_w_bias=torch.ones(_H, _D, dtype=torch.complex64)), TypeError,
     r"r_w_bias: a floating-point tensor"),
    ("xl-r_w_bias-missing", "xl", lambda: _without(_xl_kw(), "r_w_bias"),
     posenc.InvalidValueError, r"scheme xl needs r_w_bias"),
    ("xl-base-1", "xl", lambda: _xl_kw(base=1.0), posenc.InvalidValueError,
     r"base: a finite number > 1, got 1\.0"),
    ("xl-base-negative", "xl", lambda: _xl_kw(base=-3), posenc.InvalidValueError,
     r"base: a finite number > 1"),
    ("xl-base-nan", "xl", lambda: _xl_kw(base=float("nan")), posenc.InvalidValueError,
     r"base: a finite number > 1, got nan"),
    ("xl-base-inf", "xl", lambda: _xl_kw(base=float("inf")), posenc.InvalidValueError,
     r"base: a finite number > 1, got inf"),
    ("xl-base-str", "xl", lambda: _xl_kw(base="1e4"), TypeError, r"base: a number, got str"),
    ("xl-base-bool", "xl", lambda: _xl_kw(base=True), TypeError, r"base: a number, got bool"),
    ("xl-base-tensor", "xl", lambda: _xl_kw(base=torch.tensor(100.0)), TypeError,
     r"base: a number, got Tensor"),
    ("xl-positions-past-2^24", "xl", lambda: _xl_kw(query_positions=_FAR, key_positions=[0, 1, 2]),
     posenc.InvalidValueError, r"positions: relative distances span 33554435 values.*"
     r"backend='cpu'"),
    ("xl-positions-sparse", "xl",
     lambda: _xl_kw(query_positions=[0, 5000, 10000], key_positions=[0, 1, 2]),
     posenc.InvalidValueError, r"positions: 10003 relative distances"),
    ("xl-keyword-of-deberta", "xl", lambda: _xl_kw(position_buckets=4), TypeError,
     r"position_buckets: a setting of scheme 'deberta', not 'xl'"),
    # DeBERTa
    ("deberta-pos_key-K", "deberta", lambda: _deberta_kw(pos_key=torch.randn(10, _H, _D)),
     posenc.ShapeError, r"pos_key: shape \[10, 2, 16\], expected \[8, 2, 16\]"),
    ("deberta-pos_key-2d", "deberta", lambda: _deberta_kw(pos_key=torch.randn(8, _D)),
     posenc.ShapeError, r"pos_key: shape \[8, 16\]"),
    ("deberta-pos_key-list", "deberta", lambda: _deberta_kw(pos_key=[[[0.0] * _D] * _H] * 8),
     TypeError, r"pos_key: a torch\.Tensor"),
    ("deberta-pos_query-missing", "deberta", lambda: _without(_deberta_kw(), "pos_query"),
     posenc.InvalidValueError, r"scheme deberta needs pos_query"),
    ("deberta-pos_key-int", "deberta",
     lambda: _deberta_kw(pos_key=torch.ones(8, _H, _D, dtype=torch.int32)), TypeError,
     r"pos_key: a floating-point tensor"),
    ("deberta-pos_query-nan", "deberta",
     lambda: _deberta_kw(pos_query=torch.full((8, _H, _D), float("nan"))),
     posenc.InvalidValueError, r"pos_query: non-finite values"),
    ("deberta-position_buckets-negative", "deberta", lambda: _deberta_kw(position_buckets=-3),
     posenc.InvalidValueError, r"position_buckets must be an integer in \[0, 2\^48\] \(got -3\)"),
    ("deberta-position_buckets-2^60", "deberta", lambda: _deberta_kw(position_buckets=1 << 60),
     posenc.InvalidValueError, r"position_buckets must be an integer in \[0, 2\^48\]"),
    ("deberta-position_buckets-1", "deberta",
     lambda: _deberta_kw(position_buckets=1, pos_key=torch.randn(2, _H, _D),
                         pos_query=torch.randn(2, _H, _D)),
     posenc.InvalidValueError, r"position_buckets must be 0 or >= 4"),
    ("deberta-max_relative_positions-0", "deberta", lambda: _deberta_kw(max_relative_positions=0),
     posenc.InvalidValueError, r"max_relative_positions: >= 1"),
    ("deberta-max_relative_positions-negative", "deberta",
     lambda: _deberta_kw(max_relative_positions=-4), posenc.InvalidValueError,
     r"max_relative_positions must be an integer in \[0, 2\^48\] \(got -4\)"),
    ("deberta-max_relative_positions-2^60", "deberta",
     lambda: _deberta_kw(max_relative_positions=1 << 60), posenc.InvalidValueError,
     r"max_relative_positions must be an integer in \[0, 2\^48\]"),
    ("deberta-position_buckets-str", "deberta", lambda: _deberta_kw(position_buckets="4"),
     TypeError, r"position_buckets: an integer, got str"),
    ("deberta-position_buckets-float", "deberta", lambda: _deberta_kw(position_buckets=4.0),
     TypeError, r"position_buckets: an integer, got float"),
    ("deberta-position_buckets-bool", "deberta", lambda: _deberta_kw(position_buckets=True),
     TypeError, r"position_buckets: an integer, got bool"),
    ("deberta-p2c-foo", "deberta", lambda: _deberta_kw(deberta_p2c="foo"),
     posenc.InvalidValueError, r"deberta_p2c: 'model' or 'paper', got 'foo'"),
    ("deberta-p2c-int", "deberta", lambda: _deberta_kw(deberta_p2c=1), TypeError,
     r"deberta_p2c: .*got int"),
    ("deberta-p2c-array", "deberta", lambda: _deberta_kw(deberta_p2c=np.array(["model", "x"])),
     TypeError, r"deberta_p2c: .*got ndarray"),
    ("deberta-float64_log-yes", "deberta", lambda: _deberta_kw(deberta_float64_log="yes"),
     TypeError, r"deberta_float64_log: a bool, got str"),
    ("deberta-float64_log-int", "deberta", lambda: _deberta_kw(deberta_float64_log=1),
     TypeError, r"deberta_float64_log: a bool, got int"),
    ("deberta-positions-past-2^24", "deberta",
     lambda: _deberta_kw(query_positions=_FAR, key_positions=[0, 1, 2]),
     posenc.InvalidValueError, r"positions: relative distances span 33554435 values"),
    ("deberta-keyword-of-xl", "deberta", lambda: _deberta_kw(base=100.0), TypeError,
     r"base: a setting of scheme 'xl', not 'deberta'"),
    # T5 (a huge max_distance must not become a table of 2 max_distance + 1 buckets)
    ("t5-table-list", "t5", lambda: _t5_kw(relative_attention_bias=[[0.0] * _H] * 32),
     TypeError, r"relative_attention_bias: a torch\.Tensor"),
    ("t5-max_distance-2^50", "t5", lambda: _t5_kw(max_distance=1 << 50),
     posenc.InvalidValueError, r"max_distance must be an integer in \[1, 2\^48\]"),
    ("t5-max_distance-2^40-far-positions", "t5",
     lambda: _t5_kw(max_distance=1 << 40, query_positions=[0, 1, 1 << 30]),
     posenc.InvalidValueError, r"positions: relative distances up to 1073741824 with "
     r"max_distance 1099511627776"),
    # q, k, v and the settings every scheme shares
    ("rope-style-array", "rope", lambda: {"rope_style": np.array(["half", "x"])},
     posenc.InvalidValueError, r"rope_style"),
    ("scheme-unknown", "nonsense", dict, posenc.InvalidValueError, r"scheme: 'nonsense'"),
    ("seq_q-past-seq_k", "shaw", lambda: _shaw_kw(_q=(5, 3)), posenc.InvalidValueError,
     r"query_positions: -2 is outside .*default positions need seq_q <= seq_k"),
    ("empty-q", "shaw", lambda: _shaw_kw(_q=(0, 3)), posenc.ShapeError, r"empty q or k"),
    ("positions-past-2^48", "shaw", lambda: _shaw_kw(query_positions=[0, 1, (1 << 48) + 1]),
     posenc.InvalidValueError, r"query_positions: ids must lie in \[0, 281474976710656\]"),
    ("positions-float", "shaw", lambda: _shaw_kw(key_positions=[0.5, 1.0, 2.0]), TypeError,
     r"key_positions: integer ids"),
]


@pytest.mark.parametrize("case", _HOSTILE_TRITON, ids=[c[0] for c in _HOSTILE_TRITON])
def test_hostile_inputs_of_the_triton_schemes(case):
    """posenc.triton.attention refuses each hostile input by name, before any kernel runs."""
    import posenc.triton as triton_attention
    _, scheme, make, error, message = case
    kw = _on_device(make())
    q, k, v = _tiny_qkv(*kw.pop("_q", (3, 3)))
    with pytest.raises(error, match=message):
        triton_attention.attention(q, k, v, scheme, **kw)


def test_hostile_values_that_work_give_the_cpu_result():
    """Inputs at the edges that are valid give the CPU backend's result: float64 / float16 /
    bfloat16 tables, Shaw over positions near 2^48 and spanning more than 2^24 distances (its
    rows are clamped, no table of distances), XL near 2^48, T5 with max_distance 2^40 (the
    bucket table covers only the distances the positions reach), DeBERTa with NumPy integer and
    bool settings."""
    import posenc.torch as ptorch
    import posenc.triton as triton_attention
    top = 1 << 48
    cases = [
        ("shaw", {"rel_k": torch.randn(5, _D, dtype=torch.float64),
                  "rel_v": torch.randn(5, _H, _D).to(BF16)},
         {"query_positions": [top - 2, top - 1, top], "key_positions": [top, top - 5, 0]}),
        ("shaw", {"rel_k": torch.randn(5, _D).half()},
         {"query_positions": _FAR, "key_positions": [0, 1, 2]}),
        ("xl", _xl_kw(), {"query_positions": [top - 2, top - 1, top], "base": np.float32(300),
                          "key_positions": [top, top - 1, top - 2]}),
        ("t5", _t5_kw(), {"max_distance": 1 << 40, "scale": 1.0}),
        ("deberta", {n: x for n, x in _deberta_kw().items() if n.startswith("pos")},
         {"max_relative_positions": np.int64(4), "deberta_float64_log": np.bool_(True)}),
    ]
    q, k, v = _tiny_qkv()
    for scheme, tables, settings in cases:
        got = triton_attention.attention(q, k, v, scheme, **_on_device({**tables, **settings}))
        cpu = {n: (x.numpy() if n.endswith("positions") and isinstance(x, torch.Tensor) else x)
               for n, x in settings.items()}
        want = ptorch.attention(q.cpu(), k.cpu(), v.cpu(), scheme, backend="cpu",
                                params={n: t.float() for n, t in tables.items()}, **cpu)
        _check(f"{scheme} out", got.cpu(), want.double().numpy(), F32, half_rounded=False)


_LLAMA = {"model_type": "llama", "hidden_size": _H * _D, "num_attention_heads": _H,
          "num_key_value_heads": _H, "rope_theta": 1e4, "max_position_embeddings": 64}

# (id, keywords of posenc.torch.attention, exception, regex): the same error from
# backend='triton' and backend='cpu' (posenc's own checks and messages).
_HOSTILE_OPS = [
    ("config-heads", {"config": {**_LLAMA, "num_attention_heads": 4, "hidden_size": 64}},
     posenc.ShapeError, r"q: heads_q 2 does not match config .*4 attention heads"),
    ("config-kv-heads", {"config": {**_LLAMA, "num_key_value_heads": 1}}, posenc.ShapeError,
     r"k: heads_kv 2 does not match config"),
    ("config-head_dim", {"config": {**_LLAMA, "hidden_size": 64}}, posenc.ShapeError,
     r"q: head_dim 16 does not match config"),
    ("config-model-type", {"config": {**_LLAMA, "model_type": "nonsense"}}, ValueError,
     r"config: model_type 'nonsense' is not supported"),
    ("config-int", {"config": 42}, TypeError, r"config: expected a path to config\.json"),
    ("config-missing-file", {"config": "/nonexistent/config.json"}, ValueError,
     r"/nonexistent/config\.json: cannot open"),
    ("config-layer-99", {"config": _LLAMA, "layer": 99}, posenc.InvalidValueError,
     r"layer 99 is out of range"),
    ("config-layer-negative", {"config": _LLAMA, "layer": -1}, posenc.InvalidValueError,
     r"layer: -1 is outside"),
    ("config-layer-str", {"config": _LLAMA, "layer": "0"}, TypeError,
     r"layer: expected an integer, got str"),
    ("config-layer-2^70", {"config": _LLAMA, "layer": 1 << 70}, posenc.InvalidValueError,
     r"layer: 1180591620717411303424 is outside"),
    ("layer-without-config", {"layer": 0}, posenc.InvalidValueError,
     r"layer 0 needs a model config"),
    ("config-fixes-base", {"config": _LLAMA, "base": 500.0}, posenc.InvalidValueError,
     r"base conflicts with config"),
    ("config-fixes-scheme", {"scheme": "alibi", "config": _LLAMA}, posenc.InvalidValueError,
     r"scheme alibi conflicts with config"),
    ("config-table-of-another-scheme", {"config": _LLAMA, "params": {"rel_k": torch.ones(5, _D)}},
     posenc.InvalidValueError, r"params: rel_k is not a parameter of scheme rope"),
    ("config-positions-past-2^48",
     {"config": _LLAMA, "query_positions": torch.tensor([0, 1, (1 << 48) + 2])},
     posenc.InvalidValueError, r"query.positions.*\[0, "),
    ("config-offset-negative", {"config": _LLAMA, "query_positions": -5},
     posenc.InvalidValueError, r"query_positions: -5 is outside"),
    ("scheme-unknown", {"scheme": "nonsense"}, posenc.InvalidValueError,
     r"unknown scheme 'nonsense'"),
    ("scheme-int", {"scheme": 3}, TypeError, r"scheme: expected a string"),
    ("keyword-of-another-scheme-base", {"scheme": "deberta", "base": 100.0}, TypeError,
     r"keyword 'base' does not apply to scheme 'deberta' \(it is for rope xl\)"),
    ("keyword-of-another-scheme-buckets",
     {"scheme": "shaw", "params": {"rel_k": torch.ones(5, _D)}, "position_buckets": 4},
     TypeError, r"keyword 'position_buckets' does not apply to scheme 'shaw'"),
    ("keyword-of-another-scheme-style", {"style": "half"}, TypeError,
     r"keyword 'style' does not apply to scheme 'none' \(it is for rope\)"),
    ("deberta-max_relative_positions-2^60",
     {"scheme": "deberta", "params": {n: t for n, t in _deberta_kw().items() if n[0] == "p"},
      "max_relative_positions": 1 << 60},
     posenc.InvalidValueError, r"max_relative_positions must be an integer in \[0, 2\^48\]"),
    ("deberta-position_buckets-negative",
     {"scheme": "deberta", "params": {n: t for n, t in _deberta_kw().items() if n[0] == "p"},
      "position_buckets": -1},
     posenc.InvalidValueError, r"position_buckets must be an integer in \[0, 2\^48\] \(got -1\)"),
    ("deberta-float64_log-yes",
     {"scheme": "deberta", "params": {n: t for n, t in _deberta_kw().items() if n[0] == "p"},
      "max_relative_positions": 4, "deberta_float64_log": "yes"},
     TypeError, r"deberta_float64_log: expected True or False"),
    ("complex-table",
     {"scheme": "shaw", "params": {"rel_k": torch.ones(5, _D, dtype=torch.complex64)}},
     TypeError, r"rel_k: expected a real tensor"),
    ("xl-base-str", {"scheme": "xl", "params": _xl_kw(), "base": "x"}, TypeError,
     r"base: expected a number, got str"),
    ("t5-max_distance-2^50",
     {"scheme": "t5", "params": _t5_kw(), "max_distance": 1 << 50},
     posenc.InvalidValueError, r"max_distance must be an integer in \[1, 2\^48\]"),
]


@pytest.mark.parametrize("case", _HOSTILE_OPS, ids=[c[0] for c in _HOSTILE_OPS])
@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_hostile_inputs_of_the_ops_backends(case, backend):
    """posenc.torch.attention(..., backend='triton') refuses hostile configs, layers, settings
    and tables as backend='cpu' does: the same exception and message (the config path resolves
    through posenc's own scheme builder)."""
    import posenc.torch as ptorch
    _, kw, error, message = case
    kw = dict(kw)
    device = DEVICE if backend == "triton" else "cpu"
    q, k, v = _tiny_qkv(device=device)
    params = kw.pop("params", None)
    if params is not None:
        params = {n: t.to(device) for n, t in params.items()}
    kw = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    scheme = kw.pop("scheme", None)
    with pytest.raises(error, match=message):
        ptorch.attention(q, k, v, scheme, params=params, backend=backend, **kw)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_hostile_inputs_of_the_flex_backend():
    """backend='flex' (posenc.torch.attention and PositionalAttention): what FlexAttention cannot
    compute is refused by name (Transformer-XL, Shaw's rel_v, a config or a layer); config=None
    and layer=None are no config, as on the other backends; a table on another device is a
    ValueError naming it (not a RuntimeError from inside the score_mod); the scheme settings'
    types are checked as posenc checks them (a string is no bool)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    import posenc.torch as ptorch
    q, k, v = _tiny_qkv(device="cpu")
    deberta = {n: t for n, t in _deberta_kw().items() if n[0] == "p"}

    def flex(scheme=None, **kw):
        return ptorch.attention(q, k, v, scheme, backend="flex", **kw)
    with pytest.raises(ValueError, match=r"Transformer-XL"):
        flex("xl", params=_xl_kw())
    with pytest.raises(ValueError, match=r"rel_v"):
        flex("shaw", params=_shaw_kw(rel_v=torch.randn(5, _D)))
    with pytest.raises(ValueError, match=r"backend='flex': 'config' is not taken"):
        flex(config=_LLAMA)
    with pytest.raises(ValueError, match=r"backend='flex': 'layer' is not taken"):
        flex(layer=0)
    got = flex(config=None, layer=None, causal=True)
    want = ptorch.attention(q, k, v, config=None, layer=None, causal=True, backend="cpu")
    _check("flex config=None", got, want.double().numpy(), F32, half_rounded=False)
    with pytest.raises(ValueError, match=r"rel_k: on device 'meta'"):
        flex("shaw", params={"rel_k": torch.empty(5, _D, device="meta")})
    with pytest.raises(TypeError, match=r"deberta_float64_log: expected True or False"):
        flex("deberta", params=deberta, max_relative_positions=4, deberta_float64_log="yes")
    with pytest.raises(TypeError, match=r"position_buckets: expected an integer, got str"):
        flex("deberta", params=deberta, position_buckets="4")
    with pytest.raises(TypeError, match=r"'base' is a setting of another scheme"):
        flex("deberta", params=deberta, max_relative_positions=4, base=100.0)
    for scheme, match in (("xl", r"Transformer-XL"), ("shaw", r"rel_v")):
        with pytest.raises(ValueError, match=match):
            ptorch.PositionalAttention(scheme, _H, _H, _D, backend="flex")(q, k, v)
    with pytest.raises(ValueError, match=r"'config' is not taken"):
        ptorch.PositionalAttention(config=_LLAMA, backend="flex")(q, k, v)
    with pytest.raises(ValueError, match=r"backend: 'auto', 'cpu', 'triton' or 'flex'"):
        ptorch.PositionalAttention("rope", _H, _H, _D, backend="gpu")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy's, on the interpreter's inf / NaN
def test_non_finite_results_of_the_relative_schemes_are_named():
    """The Triton path's check after the kernel with a table scheme: a non-finite v is named
    (as posenc names it), finite tables whose terms overflow float32 are an InvalidValueError,
    and allow_fully_masked skips the check (the non-finite value propagates)."""
    import posenc.torch as ptorch
    import posenc.triton as triton_attention
    q, k, v = _tiny_qkv()
    bad = v.clone()
    bad[0, 2, 1, 3] = float("nan")
    with pytest.raises(posenc.InvalidValueError, match=re.escape("attention: v: non-finite "
                                                                 "value nan at [0, 2, 1, 3]")):
        triton_attention.attention(q, k, bad, "xl", **_on_device(_xl_kw()))
    with pytest.raises(posenc.InvalidValueError, match=re.escape("v: non-finite value nan at "
                                                                 "[0, 2, 1, 3]")):
        ptorch.attention(q, k, bad, "shaw", params=_on_device(_shaw_kw()), backend="triton")
    huge = _on_device(_shaw_kw(rel_k=torch.full((5, _D), 3e38)))
    with pytest.raises(posenc.InvalidValueError, match=r"not finite"):
        triton_attention.attention(q, k, v, "shaw", **huge)
    out = triton_attention.attention(q, k, bad, "xl", allow_fully_masked=True,
                                     **_on_device(_xl_kw()))
    assert not bool(torch.isfinite(out).all())
