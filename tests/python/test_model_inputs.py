"""What model families ask of attention beyond their scheme, done by the library for every entry
point: value heads narrower than q and k (DeepSeek's multi-head latent attention) and the query
temperature of Llama 4's NoPE layers. The Python functions behave as the CLI does."""

import numpy as np
import pytest

import posenc
from conftest import Case, load_config

WIDTH = 5  # v's head dim under q and k's 8


def _pad(x, width):
    out = np.zeros(x.shape[:3] + (width,), x.dtype)
    out[..., :x.shape[3]] = x
    return out


@pytest.mark.parametrize("scheme", ["none", "rope", "alibi", "t5", "xl", "deberta"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_narrow_values_equal_zero_padded_values(scheme, dtype):
    c = Case(scheme, seed=31, causal=True, positions=True)
    q, k, v = c.inputs(dtype)
    v = np.ascontiguousarray(v[..., :WIDTH])
    kw = c.posenc_kwargs(dtype)
    out, lse = posenc.attention(q, k, v, scheme, return_lse=True, **kw)
    assert out.shape == q.shape[:3] + (WIDTH,) and out.dtype == dtype
    full, full_lse = posenc.attention(q, k, _pad(v, q.shape[3]), scheme, return_lse=True, **kw)
    assert np.all(full[..., WIDTH:] == 0)
    # The library pads exactly as the caller would: the same bits.
    np.testing.assert_array_equal(out, full[..., :WIDTH])
    np.testing.assert_array_equal(lse, full_lse)

    dout = np.random.default_rng(5).standard_normal(out.shape).astype(dtype)
    g = posenc.attention_grad(q, k, v, dout, scheme, **kw)
    want = posenc.attention_grad(q, k, _pad(v, q.shape[3]), _pad(dout, q.shape[3]), scheme, **kw)
    assert g["dv"].shape == v.shape
    np.testing.assert_array_equal(g["dv"], want["dv"][..., :WIDTH])
    for name in set(want) - {"dv"}:
        np.testing.assert_array_equal(g[name], want[name], err_msg=name)
    # With the forward's out and lse given (what a training framework saves).
    g2 = posenc.attention_grad(q, k, v, dout, scheme, out=out, lse=lse, **kw)
    for name in g:
        np.testing.assert_array_equal(g2[name], g[name], err_msg=name)


def test_narrow_values_against_the_oracle_and_in_half_precision():
    c = Case("rope", seed=32, causal=True)
    q, k, v = c.inputs(np.float64)
    v = np.ascontiguousarray(v[..., :WIDTH])
    kw = c.posenc_kwargs()
    ref = posenc.ref.attention(q, k, v, "rope", **kw)
    out = posenc.attention(*(x.astype(np.float32) for x in (q, k, v)), "rope",
                           **c.posenc_kwargs(np.float32))
    assert np.max(np.abs(out - ref)) < 1e-5
    bits = [posenc.bf16_from_float32(x.astype(np.float32)) for x in (q, k, v)]
    half = posenc.attention_half(*bits, "rope", dtype="bfloat16", **c.posenc_kwargs(np.float32))
    assert half.shape == out.shape
    widened = posenc.attention(*(posenc.bf16_to_float32(b) for b in bits), "rope",
                               **c.posenc_kwargs(np.float32))
    np.testing.assert_array_equal(half, posenc.bf16_from_float32(widened))
    # A half KV cache under a float32 query (the mixed path).
    mixed = posenc.attention_half(q.astype(np.float32), bits[1], bits[2], "rope",
                                  dtype="bfloat16", **c.posenc_kwargs(np.float32))
    assert mixed.dtype == np.float32 and mixed.shape == out.shape


def test_deepseek_config_takes_its_narrower_value_heads():
    cfg = load_config("deepseek-v2-lite.json", num_attention_heads=2, num_key_value_heads=2,
                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    rng = np.random.default_rng(33)
    q = rng.standard_normal((1, 5, 2, 12)).astype(np.float32)
    k = rng.standard_normal((1, 5, 2, 12)).astype(np.float32)
    v = rng.standard_normal((1, 5, 2, 6)).astype(np.float32)
    out = posenc.attention(q, k, v, config=cfg, causal=True)
    assert out.shape == (1, 5, 2, 6)
    np.testing.assert_array_equal(out, posenc.attention(q, k, _pad(v, 12), config=cfg,
                                                        causal=True)[..., :6])
    ref = posenc.ref.attention(*(x.astype(np.float64) for x in (q, k, v)), config=cfg,
                               causal=True)
    assert np.max(np.abs(out - ref)) < 1e-5
    g = posenc.attention_grad(q, k, v, np.ones_like(out), config=cfg, causal=True)
    assert g["dq"].shape == q.shape and g["dv"].shape == v.shape


def test_value_head_errors():
    c = Case("none", seed=34)
    q, k, v = c.inputs(np.float32)
    with pytest.raises(posenc.ShapeError, match="same shape"):
        posenc.attention(q, k, _pad(v, 9), "none")  # wider than q
    with pytest.raises(posenc.ShapeError, match="same shape"):
        posenc.attention(q, k, v[:, :-1, :, :WIDTH], "none")  # another length than k
    with pytest.raises(posenc.ShapeError, match="out"):
        posenc.attention(q, k, v[..., :WIDTH], "none", out=np.zeros(q.shape, np.float32))
    shaw = Case("shaw", seed=35)
    q, k, v = shaw.inputs(np.float32)
    with pytest.raises(ValueError, match="rel_v"):
        posenc.attention(q, k, v[..., :WIDTH], "shaw", **shaw.posenc_kwargs(np.float32))
    # Shaw without a value table takes narrower values.
    kw = shaw.posenc_kwargs(np.float32)
    del kw["params"]["rel_v"]
    out = posenc.attention(q, k, v[..., :WIDTH], "shaw", **kw)
    np.testing.assert_array_equal(out, posenc.attention(q, k, v, "shaw", **kw)[..., :WIDTH])


def test_llama4_temperature_in_every_precision():
    cfg = load_config("llama-4-scout-17b-16e-instruct.json", num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, floor_scale=2, attn_scale=0.5)
    rng = np.random.default_rng(36)
    q = rng.standard_normal((1, 4, 2, 8)).astype(np.float32)
    k = rng.standard_normal((1, 9, 1, 8)).astype(np.float32)
    v = rng.standard_normal((1, 9, 1, 8)).astype(np.float32)
    # Default positions: queries at 5..8.
    f32 = np.float32
    factor = np.array([np.log(np.floor((f32(p) + f32(1)) / f32(2)) + f32(1)) * f32(0.5) + f32(1)
                       for p in range(5, 9)], np.float32)
    scaled = q * factor[None, :, None, None]
    out = posenc.attention(q, k, v, config=cfg, layer=3, causal=True)
    np.testing.assert_array_equal(out, posenc.attention(scaled, k, v, "none", causal=True))
    dout = rng.standard_normal(out.shape).astype(np.float32)
    g = posenc.attention_grad(q, k, v, dout, config=cfg, layer=3, causal=True)
    want = posenc.attention_grad(scaled, k, v, dout, "none", causal=True)
    np.testing.assert_allclose(g["dq"], want["dq"] * factor[None, :, None, None], rtol=1e-6,
                               atol=0)
    np.testing.assert_array_equal(g["dk"], want["dk"])
    # Half precision: the widened q scaled in float32, the result rounded once.
    bits = [posenc.bf16_from_float32(x) for x in (q, k, v)]
    half = posenc.attention_half(*bits, dtype="bfloat16", config=cfg, layer=3, causal=True)
    wide = [posenc.bf16_to_float32(b) for b in bits]
    want_half = posenc.attention(wide[0] * factor[None, :, None, None], wide[1], wide[2], "none",
                                 causal=True)
    np.testing.assert_array_equal(half, posenc.bf16_from_float32(want_half))
