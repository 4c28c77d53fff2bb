"""posenc.attention / attention_grad / posenc.ref against the independent PyTorch reference
(reference.py) for every scheme: forward and backward, causal and bidirectional, GQA, Lq != Lk,
explicit per-row positions, float32 (fused kernels) and float64 (reference path).

float32 tolerance (STYLE.md): max |posenc - ref64| <= 2 max |naive32 - ref64| + 2e-6 max(1, |ref|)
where naive32 is the same PyTorch reference run in float32. float64: 1e-12 relative.
"""

import zlib

import numpy as np
import pytest

import posenc
from conftest import Case, SCHEMES, maxerr, tol32, variants

torch = pytest.importorskip("torch")


def cases():
    for scheme in SCHEMES:
        for variant in range(variants(scheme)):
            for causal in (False, True):
                for pos in (False, True):
                    yield pytest.param(scheme, variant, causal, pos,
                                       id=f"{scheme}-v{variant}-{'causal' if causal else 'bidir'}"
                                          f"{'-positions' if pos else ''}")


@pytest.mark.parametrize("scheme,variant,causal,pos", list(cases()))
def test_forward_and_backward_against_the_pytorch_reference(scheme, variant, causal, pos):
    seed = zlib.crc32(repr((scheme, variant, causal, pos)).encode())  # not hash(): salted per run
    c = Case(scheme, seed=seed, causal=causal,
             variant=variant, positions=pos)
    dout, ref, naive, ref_grads, naive_grads = c.reference_grads(7)
    ref_out = ref.detach().numpy()

    # float32: the fused kernels.
    out32, lse32 = posenc.attention(*c.inputs(np.float32), c.scheme,
                                    return_lse=True, **c.posenc_kwargs(np.float32))
    assert out32.dtype == np.float32 and lse32.shape == (2, 4, 5)
    assert maxerr(out32, ref_out) <= tol32(ref_out, naive.detach().numpy())
    g32 = posenc.attention_grad(*c.inputs(np.float32), dout.astype(np.float32), c.scheme,
                                out=out32, lse=lse32, **c.posenc_kwargs(np.float32))
    assert set(g32) == set(ref_grads)
    for name, want in ref_grads.items():
        want = want.numpy()
        assert g32[name].shape == want.shape, name
        assert maxerr(g32[name], want) <= 2 * maxerr(naive_grads[name].numpy(), want) + \
            2e-6 * max(1.0, float(np.max(np.abs(want)))), name

    # float64: the reference path, exact tables.
    out64 = posenc.attention(*c.inputs(np.float64), c.scheme, **c.posenc_kwargs(np.float64))
    assert out64.dtype == np.float64
    assert maxerr(out64, ref_out) <= 1e-12 * max(1.0, float(np.max(np.abs(ref_out))))
    g64 = posenc.ref.attention_grad(*c.inputs(np.float64), dout, c.scheme,
                                    **c.posenc_kwargs(np.float64))
    for name, want in ref_grads.items():
        want = want.numpy()
        assert maxerr(g64[name], want) <= 1e-11 * max(1.0, float(np.max(np.abs(want)))), name


@pytest.mark.parametrize("scheme", SCHEMES)
def test_lse_is_the_log_sum_exp_of_the_reference_scores(scheme):
    c = Case(scheme, seed=11, causal=True)
    q, k, v = c.inputs(np.float64)
    _, lse = posenc.ref.attention(q, k, v, scheme, return_lse=True, **c.posenc_kwargs())
    for b in range(2):
        for h in range(4):
            s = posenc.ref.attention_scores(q, k, scheme, batch_index=b, head=h,
                                            **c.posenc_kwargs())
            rel = np.arange(7)[None, :] - (np.arange(5)[:, None] + 2)
            s = np.where(rel <= 0, s, -np.inf)
            want = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)
            np.testing.assert_allclose(lse[b, h], want, rtol=1e-13)


def test_window_and_fully_masked_rows():
    c = Case("alibi", seed=3, causal=True)
    q, k, v = c.inputs(np.float32)
    ref, _ = c.reference()
    import reference
    tq, tk, tv = (torch.from_numpy(x).double() for x in c.inputs(np.float64))
    want = reference.attention(tq, tk, tv, "alibi", causal=True, window=2, max_bias=4.0).numpy()
    got = posenc.attention(q, k, v, "alibi", causal=True, window=2, max_bias=4.0)
    assert maxerr(got, want) < 1e-5
    # Queries before every key: an error unless allowed (then 0).
    pk = np.arange(7) + 10
    with pytest.raises(posenc.InvalidValueError, match="sees no key"):
        posenc.attention(q, k, v, causal=True, query_positions=np.arange(5), key_positions=pk)
    out = posenc.attention(q, k, v, causal=True, query_positions=np.arange(5), key_positions=pk,
                           allow_fully_masked=True)
    assert np.all(out == 0)


def test_merge_of_two_key_shards_equals_the_whole():
    c = Case("t5", seed=5)
    q, k, v = c.inputs(np.float32)
    kw = c.posenc_kwargs(np.float32)
    whole = posenc.attention(q, k, v, "t5", **kw)
    pa, pb = np.arange(4), np.arange(4, 7)
    qp = np.arange(5) + 2
    oa, la = posenc.attention(q, k[:, :4], v[:, :4], "t5", return_lse=True, query_positions=qp,
                              key_positions=pa, **kw)
    ob, lb = posenc.attention(q, k[:, 4:], v[:, 4:], "t5", return_lse=True, query_positions=qp,
                              key_positions=pb, **kw)
    merged, _ = posenc.attention_merge(oa, la, ob, lb)
    assert maxerr(merged, whole) < 1e-5


def test_rope_scaling_from_a_config_matches_the_reference(configs_dir):
    cfg = posenc.read_model_config(f"{configs_dir}/llama-3.1-8b.json")
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 3, cfg.heads_q, cfg.head_dim)).astype(np.float32)
    k = rng.standard_normal((1, 3, cfg.heads_kv, cfg.head_dim)).astype(np.float32)
    pos = np.array([100000, 150000, 200000])
    out = posenc.attention(q, k, k, config=cfg, causal=True, query_positions=pos,
                           key_positions=pos)
    f = posenc.rope_frequencies(config=cfg, seq_len=200001)
    import reference
    want = reference.attention(*(torch.from_numpy(x).double() for x in (q, k, k)), "rope",
                               causal=True, query_positions=pos, key_positions=pos,
                               rope_inv_freq=torch.from_numpy(f.inv_freq),
                               rope_attention_factor=f.attention_factor).numpy()
    assert maxerr(out, want) < 2e-5
