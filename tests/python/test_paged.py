"""posenc.attention_paged and posenc.rope_append (paged KV caches) against posenc.attention on
the gathered keys: float32 and half pages, both layouts, shuffled block tables, ragged rows."""
import numpy as np
import pytest

import posenc


def make_cache(rng, lens, heads, dim, page_size, layout, dtype=np.float32):
    """Pages (NaN where unused), a shuffled block table and the per-row keys / values."""
    need = sum(-(-n // page_size) for n in lens)
    num_pages = need + 2
    max_pages = max(-(-n // page_size) for n in lens) + 1
    order = rng.permutation(num_pages)
    table = np.full((len(lens), max_pages), -1, np.int32)
    shape = ((num_pages, page_size, heads, dim) if layout == "token_major"
             else (num_pages, heads, page_size, dim))
    kp = np.full(shape, np.nan, np.float32)
    vp = np.full(shape, np.nan, np.float32)
    krows, vrows, at = [], [], 0
    for b, n in enumerate(lens):
        k = rng.standard_normal((n, heads, dim)).astype(np.float32)
        v = rng.standard_normal((n, heads, dim)).astype(np.float32)
        if dtype != np.float32:  # values representable in the half type
            k = to_half(k, dtype)[1]
            v = to_half(v, dtype)[1]
        for p in range(-(-n // page_size)):
            table[b, p] = order[at]
            at += 1
        for j in range(n):
            page, slot = table[b, j // page_size], j % page_size
            if layout == "token_major":
                kp[page, slot], vp[page, slot] = k[j], v[j]
            else:
                kp[page, :, slot], vp[page, :, slot] = k[j], v[j]
        krows.append(k)
        vrows.append(v)
    return kp, vp, table, np.array(lens, np.int32), krows, vrows


def to_half(x, dtype):
    """(bits as the bindings take them, the float32 values they hold)."""
    if dtype == "bfloat16":
        bits = posenc.bf16_from_float32(x)
        return bits, posenc.bf16_to_float32(bits)
    h = np.asarray(x, np.float32).astype(np.float16)
    return h, h.astype(np.float32)


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("scheme", ["none", "rope", "alibi"])
def test_matches_attention_on_gathered_keys(layout, page_size, scheme):
    rng = np.random.default_rng(page_size)
    lens = [37, 5, 70]
    kp, vp, table, seq_lens, krows, vrows = make_cache(rng, lens, 2, 16, page_size, layout)
    seq_q = 2
    q = rng.standard_normal((3, seq_q, 4, 16)).astype(np.float32)
    out = posenc.attention_paged(q, kp, vp, table, seq_lens, scheme, layout=layout, causal=True)
    assert out.shape == q.shape and out.dtype == np.float32
    for b, n in enumerate(lens):
        want = posenc.attention(q[b:b + 1], krows[b][None], vrows[b][None], scheme, causal=True)
        np.testing.assert_allclose(out[b:b + 1], want, rtol=1e-5, atol=1e-6)


def test_equal_lengths_bit_for_bit_and_keywords():
    rng = np.random.default_rng(1)
    kp, vp, table, seq_lens, krows, vrows = make_cache(rng, [50, 50], 2, 16, 16, "head_major")
    q = rng.standard_normal((2, 1, 4, 16)).astype(np.float32)
    k, v = np.stack(krows), np.stack(vrows)
    for kw in ({"causal": True}, {"causal": True, "window": 9}, {"scale": 0.3},
               {"causal": True, "base": 5e5}, {"query_positions": np.array([[10], [49]])}):
        scheme = "rope" if "base" in kw else None
        got = posenc.attention_paged(q, kp, vp, table, seq_lens, scheme, layout="head_major", **kw)
        want = posenc.attention(q, k, v, scheme, **kw)
        assert np.array_equal(got, want), kw


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_pages(dtype):
    rng = np.random.default_rng(2)
    lens = [33, 20]
    kp, vp, table, seq_lens, krows, vrows = make_cache(rng, lens, 2, 16, 16, "token_major", dtype)
    kbits, vbits = to_half(kp, dtype)[0], to_half(vp, dtype)[0]
    q = rng.standard_normal((2, 1, 4, 16)).astype(np.float32)
    out = posenc.attention_paged(q, kbits, vbits, table, seq_lens, dtype=dtype, causal=True)
    assert out.dtype == np.float32
    qb, qf = to_half(q, dtype)
    out_h = posenc.attention_paged(qb, kbits, vbits, table, seq_lens, dtype=dtype, causal=True)
    for b in range(2):
        want = posenc.attention(q[b:b + 1], krows[b][None], vrows[b][None], causal=True)
        np.testing.assert_allclose(out[b:b + 1], want, rtol=1e-5, atol=1e-6)
        want_h = posenc.attention_half(qb[b:b + 1], to_half(krows[b][None], dtype)[0],
                                       to_half(vrows[b][None], dtype)[0], dtype=dtype,
                                       causal=True)
        assert np.array_equal(np.asarray(out_h[b:b + 1]).view(np.uint16),
                              np.asarray(want_h).view(np.uint16))


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_rope_append_then_attention(layout):
    """Unrotated keys appended with RoPE, then scheme None on a rotated q, equal scheme 'rope'
    on the unrotated keys."""
    rng = np.random.default_rng(3)
    lens = [21, 9]
    kp, vp, table, seq_lens, krows, vrows = make_cache(rng, lens, 2, 16, 4, layout)
    kr = np.full_like(kp, np.nan)
    vr = np.full_like(vp, np.nan)
    # Prefill of each row's keys but the last, then one decoded token.
    for step_lens, part in ((seq_lens - 1, slice(None, -1)), (seq_lens, slice(-1, None))):
        n = 8 if part.stop == -1 else 1
        kn = np.stack([krows[b][part][-n:] for b in range(2)])
        vn = np.stack([vrows[b][part][-n:] for b in range(2)])
        posenc.rope_append(kn, kr, table, step_lens, v_new=vn, v_pages=vr, layout=layout)
    # Row 0's first 12 tokens (positions 0..11), row 1 has 8 + 1 = 9.
    posenc.rope_append(krows[0][None, :12], kr, table[:1], np.array([12], np.int32),
                       v_new=vrows[0][None, :12], v_pages=vr, layout=layout)
    q = rng.standard_normal((2, 1, 4, 16)).astype(np.float32)
    want = posenc.attention_paged(q, kp, vp, table, seq_lens, "rope", layout=layout, causal=True)
    qr = posenc.apply_rope(q, positions=(seq_lens - 1)[:, None])
    got = posenc.attention_paged(qr, kr, vr, table, seq_lens, layout=layout, causal=True)
    assert np.array_equal(got, want)


def test_rope_append_half_rounds_once():
    rng = np.random.default_rng(4)
    kp = np.zeros((4, 4, 2, 8), np.uint16)
    table = np.array([[2, 0]], np.int32)
    kn = rng.standard_normal((1, 3, 2, 8)).astype(np.float32)
    posenc.rope_append(kn, kp, table, np.array([6]), dtype="bfloat16", base=100.0)
    want = posenc.bf16_from_float32(posenc.apply_rope(kn, positions=np.arange(3, 6), base=100.0))
    got = np.stack([kp[2, 3], kp[0, 0], kp[0, 1]])
    assert np.array_equal(got, want[0])


def test_errors():
    rng = np.random.default_rng(5)
    kp, vp, table, seq_lens, _, _ = make_cache(rng, [10, 6], 2, 8, 4, "token_major")
    q = np.zeros((2, 1, 4, 8), np.float32)
    bad = table.copy()
    bad[0, 1] = 99
    with pytest.raises(posenc.Error, match=r"block_table\[0\]\[1\] = 99"):
        posenc.attention_paged(q, kp, vp, bad, seq_lens)
    with pytest.raises(posenc.Error, match="exceeds max_pages"):
        posenc.attention_paged(q, kp, vp, table, np.array([10, 99]))
    with pytest.raises(posenc.Error, match="negative"):
        posenc.attention_paged(q, kp, vp, table, np.array([-1, 6]))
    with pytest.raises(posenc.ShapeError):
        posenc.attention_paged(q[:, :, :3], kp, vp, table, seq_lens)
    with pytest.raises(TypeError, match="key_positions"):
        posenc.attention_paged(q, kp, vp, table, seq_lens, key_positions=np.arange(10))
    with pytest.raises(TypeError, match="integer"):
        posenc.attention_paged(q, kp, vp, table.astype(np.float32), seq_lens)
    with pytest.raises(posenc.Error, match="layout"):
        posenc.attention_paged(q, kp, vp, table, seq_lens, layout="rows")
    with pytest.raises(TypeError, match="k_pages: pages of dtype float64"):
        posenc.rope_append(np.zeros((2, 1, 2, 8), np.float32), kp.astype(np.float64), table,
                           seq_lens)
    with pytest.raises(posenc.Error, match="less than the number of new tokens"):
        posenc.rope_append(np.zeros((2, 7, 2, 8), np.float32), kp, table, seq_lens)


# ---- PyTorch: posenc.torch.attention_paged / rope_append and their ops -------------------------

torch = pytest.importorskip("torch")


def torch_cache(dtype=torch.float32, layout="token_major"):
    rng = np.random.default_rng(6)
    kp, vp, table, seq_lens, krows, vrows = make_cache(rng, [21, 9], 2, 16, 4, layout)
    kp, vp = np.nan_to_num(kp), np.nan_to_num(vp)
    return (torch.from_numpy(kp).to(dtype), torch.from_numpy(vp).to(dtype),
            torch.from_numpy(table), torch.from_numpy(seq_lens), krows, vrows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_attention_paged(dtype):
    import posenc.torch as pt
    kp, vp, table, seq_lens, krows, vrows = torch_cache(dtype, "head_major")
    q = torch.randn(2, 1, 4, 16, generator=torch.Generator().manual_seed(1))
    out = pt.attention_paged(q, kp, vp, table, seq_lens, "alibi", layout="head_major",
                             causal=True)
    assert out.dtype == torch.float32
    want = posenc.attention_paged(q.numpy(), kp.float().numpy(), vp.float().numpy(),
                                  table.numpy(), seq_lens.numpy(), "alibi", layout="head_major",
                                  causal=True)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)
    if dtype != torch.float32:
        qh = q.to(dtype)
        out_h = pt.attention_paged(qh, kp, vp, table, seq_lens, layout="head_major", causal=True)
        assert out_h.dtype == dtype and out_h.shape == q.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_rope_append_in_place(dtype):
    import posenc.torch as pt
    kp, vp, table, seq_lens, krows, vrows = torch_cache(dtype)
    kp.zero_()
    vp.zero_()
    kn = torch.randn(2, 3, 2, 16, generator=torch.Generator().manual_seed(2))
    pt.rope_append(kn, kp, table, seq_lens, v_new=kn, v_pages=vp, base=100.0)
    bits = np.zeros(tuple(kp.shape), np.float32)
    posenc.rope_append(kn.numpy(), bits, table.numpy(), seq_lens.numpy(), base=100.0)
    if dtype == torch.float32:
        assert np.array_equal(kp.numpy(), bits)
    else:
        np.testing.assert_allclose(kp.float().numpy(), bits, rtol=1e-2, atol=1e-2)
    assert vp.abs().sum() > 0


def test_opcheck_paged_ops():
    ops = torch.ops.posenc
    kp, vp, table, seq_lens, _, _ = torch_cache()
    q = torch.randn(2, 1, 4, 16, generator=torch.Generator().manual_seed(3))
    settings = {"scheme": "rope", "causal": True}
    torch.library.opcheck(ops.attention_paged.default,
                          (q, kp, vp, table, seq_lens, [], [], None), settings)
    torch.library.opcheck(ops.attention_paged.default,
                          (q.bfloat16(), kp.bfloat16(), vp.bfloat16(), table, seq_lens, [], [],
                           torch.tensor([[20], [8]])), settings)
    kn = torch.randn(2, 3, 2, 16, generator=torch.Generator().manual_seed(4))
    torch.library.opcheck(ops.rope_append.default,
                          (kn, kn, kp.clone(), vp.clone(), table, seq_lens, None), {"base": 100.0})
    torch.library.opcheck(ops.rope_append.default,
                          (kn, None, kp.clone(), None, table, seq_lens, torch.tensor([5, 6, 7])))
