"""Half precision (bf16, f16): posenc.attention_half and posenc.apply_rope_half against the
float32 functions on the exactly widened inputs, rounded once (bit for bit, every scheme), the
mixed float32-q path, strided inputs without copies, thread-count invariance, the bf16 helpers
against a pure-NumPy reference, posenc.torch with bf16 / f16 tensors (with and without
gradients), and the errors."""

import os
import struct

import numpy as np
import pytest

import posenc
from conftest import SCHEMES, Case, load_config, variants

DTYPES = ("bfloat16", "float16")


def to_half(x, dtype):
    """float32 values -> the NumPy form of dtype: bf16 bits (uint16) or float16 (each rounded
    to nearest even)."""
    x = np.asarray(x, np.float32)
    return posenc.bf16_from_float32(x) if dtype == "bfloat16" else x.astype(np.float16)


def widen(h, dtype):
    """The exact float32 values of a half array."""
    return posenc.bf16_to_float32(h) if dtype == "bfloat16" else h.astype(np.float32)


def bits(h):
    return np.ascontiguousarray(h).view(np.uint16)


def half_type(dtype):
    return np.uint16 if dtype == "bfloat16" else np.float16


def assert_rounded_once(out, want32, dtype):
    """out (half) is want32 (float32) rounded once to dtype, bit for bit."""
    assert out.dtype == half_type(dtype) and out.shape == want32.shape
    assert out.flags.c_contiguous
    assert np.array_equal(bits(out), bits(to_half(want32, dtype)))


def half_case(case, dtype):
    """(q, k, v) of a Case in dtype and their widened float32 values."""
    h = [to_half(x, dtype) for x in case.inputs(np.float32)]
    return h, [widen(x, dtype) for x in h]


# ---- attention: the rounding guarantee ----------------------------------------------------------

@pytest.mark.parametrize("scheme,variant", [(s, v) for s in SCHEMES for v in range(variants(s))])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("positions", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_half_is_the_float32_result_of_widened_inputs_rounded_once(
        scheme, variant, causal, positions, dtype):
    # GQA (4 query heads, 2 kv heads), seq_q < seq_k, explicit positions with gaps.
    c = Case(scheme, seed=100 + variant, causal=causal, variant=variant, positions=positions)
    (q, k, v), (q32, k32, v32) = half_case(c, dtype)
    kw = c.posenc_kwargs(np.float32)
    want = posenc.attention(q32, k32, v32, scheme, **kw)
    assert_rounded_once(posenc.attention_half(q, k, v, scheme, dtype=dtype, **kw), want, dtype)
    # Mixed: float32 q with a half KV cache is the float32 result of the widened k, v (no
    # rounding of the output).
    qf = c.inputs(np.float32)[0]
    mixed = posenc.attention_half(qf, k, v, scheme, dtype=dtype, **kw)
    assert mixed.dtype == np.float32
    assert np.array_equal(mixed, posenc.attention(qf, k32, v32, scheme, **kw))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_half_keywords_mean_what_they_mean_for_attention(dtype):
    rng = np.random.default_rng(1)
    q32, k32, v32 = (rng.standard_normal(s).astype(np.float32)
                     for s in ((2, 9, 4, 16), (2, 12, 1, 16), (2, 12, 1, 16)))  # MQA
    q, k, v = (to_half(x, dtype) for x in (q32, k32, v32))
    q32, k32, v32 = (widen(x, dtype) for x in (q, k, v))
    sinks = rng.standard_normal(4).astype(np.float32)
    cases = [
        ("rope", dict(causal=True, window=3, base=100.0, style="interleaved", rotary_dim=8)),
        ("rope", dict(causal=True, chunk=4, scale=0.3, seq_len=64, angles="float32")),
        ("alibi", dict(causal=True, params={"sinks": sinks}, allow_fully_masked=True,
                       window=2, max_bias=4.0)),
        ("t5", dict(params={"relative_attention_bias": rng.standard_normal((32, 4))},
                    num_buckets=32, max_distance=16, bidirectional=True, scale=1.0)),
        ("deberta", dict(params={"pos_key": rng.standard_normal((8, 4, 16)),
                                 "pos_query": rng.standard_normal((8, 4, 16))},
                         position_buckets=4, max_relative_positions=16, deberta_p2c="paper")),
        ("none", dict(query_positions=5, key_positions=np.arange(12) * 2, causal=True,
                      num_threads=1)),
        (None, dict(config=load_config("llama-3.1-8b.json", head_dim=16, num_attention_heads=4,
                                       num_key_value_heads=1), causal=True)),
    ]
    for scheme, kw in cases:
        want = posenc.attention(q32, k32, v32, scheme, **kw)
        out = posenc.attention_half(q, k, v, scheme, dtype=dtype, **kw)
        assert_rounded_once(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_half_with_model_layers(dtype):
    """config= and layer=: gpt-oss (window, sinks) and a Llama 4 NoPE layer, whose queries are
    scaled by the attention temperature (a half q is widened, scaled in float32 as the float32
    path scales it, and the result rounded once)."""
    rng = np.random.default_rng(2)
    gpt = load_config("gpt-oss-20b.json", num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, sliding_window=3)
    llama4 = load_config("llama-4-scout-17b-16e-instruct.json", num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, floor_scale=4, attn_scale=0.5)
    for cfg, heads, kv, layers, extra in (
            (gpt, 4, 2, (0, 1), {"params": {"sinks": np.float32([0.1, 0.2, -0.3, 1.0])}}),
            (llama4, 2, 1, (0, 3), {"query_positions": [3, 8, 12, 13, 20, 21],
                                    "key_positions": np.arange(22)})):
        seq_k = 22 if cfg is llama4 else 6
        q, k, v = (to_half(rng.standard_normal(s), dtype)
                   for s in ((1, 6, heads, 8), (1, seq_k, kv, 8), (1, seq_k, kv, 8)))
        q32, k32, v32 = (widen(x, dtype) for x in (q, k, v))
        for layer in layers:
            kw = dict(config=cfg, layer=layer, causal=True, **extra)
            want = posenc.attention(q32, k32, v32, **kw)
            assert_rounded_once(posenc.attention_half(q, k, v, dtype=dtype, **kw), want, dtype)
            mixed = posenc.attention_half(q32, k, v, dtype=dtype, **kw)
            assert np.array_equal(mixed, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_half_results_do_not_depend_on_the_thread_count(dtype):
    rng = np.random.default_rng(3)
    q, k, v = (to_half(rng.standard_normal(s), dtype)
               for s in ((2, 70, 4, 32), (2, 70, 2, 32), (2, 70, 2, 32)))
    t5 = {"relative_attention_bias": rng.standard_normal((32, 4)).astype(np.float32)}
    for scheme, kw in (("rope", {}), ("t5", {"params": t5}), ("alibi", {})):
        one = posenc.attention_half(q, k, v, scheme, dtype=dtype, causal=True, num_threads=1, **kw)
        two = posenc.attention_half(q, k, v, scheme, dtype=dtype, causal=True, num_threads=2, **kw)
        assert np.array_equal(bits(one), bits(two))
    x = to_half(rng.standard_normal((2, 70, 4, 32)), dtype)
    one = posenc.apply_rope_half(x, dtype=dtype, num_threads=1, positions=np.arange(70) * 3)
    two = posenc.apply_rope_half(x, dtype=dtype, num_threads=2, positions=np.arange(70) * 3)
    assert np.array_equal(bits(one), bits(two))


# ---- strides and copies -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_half_inputs_are_read_in_place(dtype):
    addr = posenc._posenc._viewed_address_half
    rng = np.random.default_rng(4)
    big = to_half(rng.standard_normal((2, 9, 8, 24)), dtype)
    q = big[:, 1:6, ::2, 4:20]  # strided in seq, heads and an offset last dimension
    k = big[:, :7, 1:5:2, 2:18]
    v = big.transpose(0, 2, 1, 3)[:, :7, :2, 8:24]  # seq and heads swapped
    assert not q.flags.c_contiguous and not v.flags.c_contiguous
    for x in (q, k, v, big[..., ::2], np.broadcast_to(big[:, :, :1], big.shape)):
        assert addr(x, dtype) == x.__array_interface__["data"][0]
    table = rng.standard_normal((16, 4)).astype(np.float32)
    kw = dict(params={"relative_attention_bias": table}, causal=True)
    out = posenc.attention_half(q, k, v, "t5", dtype=dtype, **kw)
    want = posenc.attention_half(*(np.ascontiguousarray(x) for x in (q, k, v)), "t5",
                                 dtype=dtype, **kw)
    assert np.array_equal(bits(out), bits(want))
    # Read-only and broadcast inputs are fine (nothing is written).
    kb = np.broadcast_to(k[:, :, :1], k.shape)
    out = posenc.attention_half(q, kb, kb, dtype=dtype)
    assert np.array_equal(bits(out), bits(posenc.attention_half(
        q, np.ascontiguousarray(kb), np.ascontiguousarray(kb), dtype=dtype)))
    # Copied once: negative strides, unaligned data (then the answer is the same).
    neg = big[:, ::-1]
    assert addr(neg, dtype) != neg.__array_interface__["data"][0]
    raw = np.zeros(2 * q.size + 1, np.uint8)
    odd = np.frombuffer(raw.data, dtype=q.dtype, count=q.size, offset=1).reshape(q.shape)
    odd[...] = q
    assert addr(odd, dtype) != odd.__array_interface__["data"][0]
    negq = neg[:, 1:6, ::2, 4:20]
    for a, b in ((negq, np.ascontiguousarray(negq)), (odd, q)):
        assert np.array_equal(bits(posenc.attention_half(a, k, v, dtype=dtype)),
                              bits(posenc.attention_half(b, k, v, dtype=dtype)))


def test_dtype_conventions_of_the_numpy_api():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 4, 2, 8)).astype(np.float32)
    h = x.astype(np.float16)
    # float16: float16 in and out; uint16 / int16 bits are accepted as the same numbers.
    out = posenc.attention_half(h, h, h, dtype="float16")
    assert out.dtype == np.float16
    for view in (np.uint16, np.int16):
        hb = h.view(view)
        assert np.array_equal(bits(posenc.attention_half(hb, hb, hb, dtype="float16")), bits(out))
    # bfloat16: uint16 bits in and out (int16 bits too).
    b = posenc.bf16_from_float32(x)
    out = posenc.attention_half(b, b, b, dtype="bfloat16")
    assert out.dtype == np.uint16
    assert np.array_equal(posenc.attention_half(b.view(np.int16), b, b, dtype="bfloat16"), out)
    # posenc.attention is unchanged: float16 input is converted to float32, out float32.
    assert posenc.attention(h, h, h).dtype == np.float32


# ---- RoPE -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("rotary", [16, 8])
def test_rope_half_is_apply_rope_of_the_widened_input_rounded_once(dtype, style, rotary):
    rng = np.random.default_rng(6)
    x = to_half(rng.standard_normal((2, 7, 3, 16)) * 4, dtype)
    x32 = widen(x, dtype)
    pos = np.array([[0, 1, 2, 3, 4, 5, 6], [9, 7, 1000, 3, 1, 70000, 12]])
    for kw in (dict(), dict(positions=pos), dict(positions=pos, inverse=True), dict(positions=5),
               dict(base=500.0, angles="float32"),
               dict(scaling={"rope_type": "dynamic", "factor": 2.0,
                             "original_max_position_embeddings": 2048}, seq_len=5000)):
        kw.update(style=style, rotary_dim=rotary)
        want = posenc.apply_rope(x32, **kw)
        assert_rounded_once(posenc.apply_rope_half(x, dtype=dtype, **kw), want, dtype)
    # 3-D input, explicit frequencies, rope_inverse's direction.
    f = posenc.rope_frequencies(16, rotary_dim=rotary, base=300.0)
    want = posenc.rope_inverse(x32[0], f, style=style)
    assert_rounded_once(posenc.apply_rope_half(x[0], f, dtype=dtype, style=style, inverse=True),
                        want, dtype)


def test_rope_half_from_a_config(configs_dir):
    rng = np.random.default_rng(7)
    cfg = os.path.join(configs_dir, "llama-3.1-8b.json")
    for dtype in DTYPES:
        x = to_half(rng.standard_normal((1, 5, 2, 128)), dtype)
        pos = np.arange(5) + 100000
        want = posenc.apply_rope(widen(x, dtype), config=cfg, positions=pos)
        assert_rounded_once(posenc.apply_rope_half(x, dtype=dtype, config=cfg, positions=pos),
                            want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_half_inplace(dtype):
    rng = np.random.default_rng(8)
    x = to_half(rng.standard_normal((2, 5, 4, 16)), dtype)
    want = posenc.apply_rope_half(x, dtype=dtype, positions=3)
    y = x.copy()
    assert posenc.apply_rope_half(y, dtype=dtype, positions=3, inplace=True) is y
    assert np.array_equal(bits(y), bits(want))
    # A strided view of a bigger buffer is written in place (the data pointer is the caller's).
    big = to_half(rng.standard_normal((2, 5, 8, 20)), dtype)
    keep = big.copy()
    view = big[:, :, ::2, 2:18]
    view[...] = x
    want = posenc.apply_rope_half(np.ascontiguousarray(view), dtype=dtype)
    assert posenc.apply_rope_half(view, dtype=dtype, inplace=True) is view
    assert np.array_equal(bits(big[:, :, ::2, 2:18]), bits(want))
    untouched = np.ones(big.shape, bool)
    untouched[:, :, ::2, 2:18] = False
    assert np.array_equal(bits(big)[untouched], bits(keep)[untouched])
    # inplace needs the caller's writable memory.
    ro = x.copy()
    ro.setflags(write=False)
    with pytest.raises(TypeError, match="inplace"):
        posenc.apply_rope_half(ro, dtype=dtype, inplace=True)
    with pytest.raises(TypeError, match="inplace"):
        posenc.apply_rope_half(x[:, ::-1], dtype=dtype, inplace=True)


# ---- bf16 helpers -----------------------------------------------------------------------------

def _f32_bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _bits_f32(u):
    return struct.unpack("<f", struct.pack("<I", u))[0]


def reference_bf16(x):
    """bf16 bits of a float32 value, by comparing distances to the two bf16 neighbours in
    float64 (ties to the even bit pattern); None for NaN."""
    x = float(x)
    if x != x:
        return None
    u = _f32_bits(x)
    sign, mag = u & 0x80000000, u & 0x7FFFFFFF
    if mag >= 0x7F800000:  # infinity
        return (sign | mag) >> 16
    lo = mag >> 16
    lo_val = _bits_f32(lo << 16)
    hi_val = 2.0 ** 128 if lo + 1 == 0x7F80 else _bits_f32((lo + 1) << 16)
    a = _bits_f32(mag)
    d_lo, d_hi = a - lo_val, hi_val - a
    up = d_hi < d_lo or (d_hi == d_lo and lo % 2 == 1)
    return (sign >> 16) | (lo + 1 if up else lo)


def test_bf16_from_float32_rounds_to_nearest_even():
    ties = [0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x00008000, 0x00018000, 0x7F7F8000,
            0x7F7FFFFF, 0x7F7F7FFF, 0x00000001, 0x80000000, 0x7F800000, 0x0080FFFF]
    vals = np.array(ties + [t | 0x80000000 for t in ties], np.uint32).view(np.float32)
    want = {0x3F808000: 0x3F80, 0x3F818000: 0x3F82, 0x3F807FFF: 0x3F80, 0x3F808001: 0x3F81,
            0x00008000: 0x0000, 0x00018000: 0x0002, 0x7F7F8000: 0x7F80, 0x7F7FFFFF: 0x7F80,
            0x7F7F7FFF: 0x7F7F, 0x7F800000: 0x7F80}
    got = posenc.bf16_from_float32(vals)
    assert got.dtype == np.uint16 and got.shape == vals.shape
    for u, g in zip(vals.view(np.uint32), got):
        assert g == reference_bf16(_bits_f32(int(u))), hex(u)
        if int(u) in want:
            assert g == want[int(u)], hex(u)
    # A few hundred random values over the whole range, and the exact round trip.
    rng = np.random.default_rng(9)
    u = rng.integers(0, 2 ** 32, 400, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([u.view(np.float32), rng.standard_normal(200).astype(np.float32)])
    got = posenc.bf16_from_float32(x)
    for xi, g in zip(x, got):
        r = reference_bf16(xi)
        if r is None:
            assert np.isnan(posenc.bf16_to_float32(g)) and (g >> 15) == (_f32_bits(xi) >> 31)
        else:
            assert g == r, (xi, hex(int(g)), hex(r))
    back = posenc.bf16_to_float32(got)
    assert back.dtype == np.float32
    assert np.array_equal(posenc.bf16_from_float32(back), got)
    # Shapes (0-d, 2-D) and float64 input (converted to float32 first).
    assert posenc.bf16_from_float32(np.float32(1.0)).shape == ()
    assert posenc.bf16_from_float32(1.0) == 0x3F80
    assert posenc.bf16_from_float32(np.ones((2, 3))).shape == (2, 3)


def test_bf16_nan_and_infinities():
    nans = np.array([0x7FC00000, 0x7F800001, 0xFFC00001, 0x7FFFFFFF, 0xFF800001], np.uint32)
    got = posenc.bf16_from_float32(nans.view(np.float32))
    assert np.all(np.isnan(posenc.bf16_to_float32(got)))  # a signalling payload stays NaN
    assert list(got >> 15) == [0, 0, 1, 0, 1]  # sign kept
    inf = posenc.bf16_from_float32(np.float32([np.inf, -np.inf, 3.4e38, -3.4e38]))
    assert list(inf) == [0x7F80, 0xFF80, 0x7F80, 0xFF80]
    assert list(posenc.bf16_to_float32(np.uint16([0x7F80, 0xFF80]))) == [np.inf, -np.inf]


def test_bf16_to_float32_is_exact_for_every_pattern():
    allbits = np.arange(1 << 16, dtype=np.uint16)
    got = posenc.bf16_to_float32(allbits)
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), allbits.astype(np.uint32) << 16)
    rng = np.random.default_rng(10)
    for b in rng.integers(0, 1 << 16, 300):
        want = struct.unpack("<f", struct.pack("<HH", 0, int(b)))[0]
        g = posenc.bf16_to_float32(np.uint16(b))
        assert (np.isnan(g) and want != want) or g == want
    assert np.array_equal(posenc.bf16_to_float32(allbits.view(np.int16)).view(np.uint32),
                          got.view(np.uint32))
    assert posenc.bf16_to_float32([0x3F80, 0x4000]).tolist() == [1.0, 2.0]
    with pytest.raises(TypeError):
        posenc.bf16_to_float32(np.float32([1.0]))
    with pytest.raises(ValueError):
        posenc.bf16_to_float32([70000])


# ---- errors -------------------------------------------------------------------------------------

def test_half_errors():
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, 4, 2, 8)).astype(np.float16)
    k = rng.standard_normal((1, 6, 1, 8)).astype(np.float16)
    for bad in ("float32", "bf16", None, np.float16):
        with pytest.raises(ValueError, match="'bfloat16' or 'float16'"):
            posenc.attention_half(q, k, k, dtype=bad)
        with pytest.raises(ValueError, match="'bfloat16' or 'float16'"):
            posenc.apply_rope_half(q, dtype=bad)
    with pytest.raises(ValueError, match="'bfloat16' or 'float16'"):
        posenc._posenc._attention_half(q, k, k, dtype="float32")
    with pytest.raises(TypeError):
        posenc.attention_half(q, k, k)  # dtype is required
    # A non-2-byte array where a half one is needed: TypeError naming it and its dtype.
    with pytest.raises(TypeError, match="k: .*float64"):
        posenc.attention_half(q, k.astype(np.float64), k, dtype="float16")
    with pytest.raises(TypeError, match="v: .*float32"):
        posenc.attention_half(q, k, k.astype(np.float32), dtype="float16")
    with pytest.raises(TypeError, match="q: .*float64"):
        posenc.attention_half(q.astype(np.float64), k, k, dtype="float16")
    with pytest.raises(TypeError, match="x: .*float32"):
        posenc.apply_rope_half(q.astype(np.float32), dtype="float16")
    with pytest.raises(TypeError, match="k: .*list"):
        posenc.attention_half(q, k.tolist(), k, dtype="float16")
    # float16 arrays are not bf16 bits.
    with pytest.raises(TypeError, match="bfloat16"):
        posenc.attention_half(q, k, k, dtype="bfloat16")
    with pytest.raises(TypeError, match="bfloat16"):
        posenc.apply_rope_half(q, dtype="bfloat16")
    # No lse, no out=.
    with pytest.raises(TypeError, match="return_lse"):
        posenc.attention_half(q, k, k, dtype="float16", return_lse=True)
    with pytest.raises(TypeError, match="out"):
        posenc.attention_half(q, k, k, dtype="float16", out=np.empty_like(q))
    with pytest.raises(TypeError, match="out"):
        posenc.apply_rope_half(q, dtype="float16", out=np.empty_like(q))
    # The attention keywords' own errors.
    with pytest.raises(TypeError, match="unexpected keyword argument 'causl'"):
        posenc.attention_half(q, k, k, dtype="float16", causl=True)
    with pytest.raises(TypeError, match="max_bias"):
        posenc.attention_half(q, k, k, "rope", dtype="float16", max_bias=2.0)
    with pytest.raises(ValueError, match="style"):
        posenc.apply_rope_half(q, dtype="float16", style="sideways")
    # Shapes: the library's ShapeError.
    with pytest.raises(posenc.ShapeError, match="4 dimensions"):
        posenc.attention_half(q[0], k, k, dtype="float16")
    with pytest.raises(posenc.ShapeError, match="kv heads"):
        posenc.attention_half(q, np.concatenate([k] * 3, 2), np.concatenate([k] * 3, 2),
                              dtype="float16")
    with pytest.raises(posenc.ShapeError):
        posenc.apply_rope_half(q[0, 0], dtype="float16")
    # NaN: what the float32 path raises, with its message.
    bad = q.copy()
    bad[0, 1, 0, 2] = np.nan
    with pytest.raises(posenc.InvalidValueError) as half_err:
        posenc.attention_half(bad, k, k, dtype="float16")
    with pytest.raises(posenc.InvalidValueError) as f32_err:
        posenc.attention(bad.astype(np.float32), k.astype(np.float32), k.astype(np.float32))
    assert str(half_err.value) == str(f32_err.value)
    kb = posenc.bf16_from_float32(k.astype(np.float32))
    kb[0, 0, 0, 0] = 0x7FC0  # bf16 NaN in the cache of the mixed path
    with pytest.raises(posenc.InvalidValueError, match="attention: k"):
        posenc.attention_half(q.astype(np.float32), kb, kb, dtype="bfloat16")


# ---- PyTorch ----------------------------------------------------------------------------------

def _torch():
    return pytest.importorskip("torch")


def _np_half(t):
    """The NumPy form of a half tensor: float16, or bf16 bits as uint16."""
    torch = _torch()
    a = t.detach().view(torch.int16).numpy()
    return a.view(np.float16) if t.dtype == torch.float16 else a.view(np.uint16)


def _tdtype(dtype):
    torch = _torch()
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_half_without_grad_keeps_the_dtype_and_equals_numpy(scheme, dtype):
    torch = _torch()
    import posenc.torch as pt
    td = _tdtype(dtype)
    c = Case(scheme, seed=12, causal=True, positions=True)
    q, k, v = (torch.tensor(x, dtype=torch.float32).to(td) for x in (c.q, c.k, c.v))
    params = {n: torch.tensor(p, dtype=torch.float32) for n, p in c.params.items()}
    kw = {n: (torch.from_numpy(x) if isinstance(x, np.ndarray) else x) for n, x in c.kw.items()}
    out = pt.attention(q, k, v, scheme, params=params or None, **kw)
    assert out.dtype == td and out.shape == q.shape
    want = posenc.attention_half(_np_half(q), _np_half(k), _np_half(v), scheme, dtype=dtype,
                                 **c.posenc_kwargs(np.float32))
    assert np.array_equal(bits(_np_half(out)), bits(want))
    # ... which is the float32 result of the widened tensors, rounded once (torch rounds to
    # nearest even too).
    want32 = pt.attention(q.float(), k.float(), v.float(), scheme, params=params or None, **kw)
    assert torch.equal(out.view(torch.int16), want32.to(td).view(torch.int16))
    # Mixed: float32 q with a half cache gives float32, the NumPy mixed path.
    mixed = pt.attention(q.float(), k, v, scheme, params=params or None, **kw)
    assert mixed.dtype == torch.float32
    assert torch.equal(mixed, want32)
    # Half tables (a model converted with .to(bfloat16)) are widened.
    hp = {n: p.to(td) for n, p in params.items()}
    out = pt.attention(q, k, v, scheme, params=hp or None, **kw)
    want = pt.attention(q.float(), k.float(), v.float(), scheme,
                        params={n: p.float() for n, p in hp.items()} or None, **kw)
    assert torch.equal(out.view(torch.int16), want.to(td).view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_half_strided_tensors_are_not_copied(dtype):
    torch = _torch()
    import posenc.torch as pt
    td = _tdtype(dtype)
    g = torch.Generator().manual_seed(13)
    qb, kb, vb = (torch.randn(2, h, 9, 16, generator=g).to(td) for h in (4, 2, 2))  # bhld
    q, k, v = (x.transpose(1, 2) for x in (qb, kb, vb))
    addr = posenc._posenc._viewed_address_half
    for x, base in ((q, qb), (k, kb)):
        assert not x.is_contiguous()
        assert addr(posenc._ops._bits(x, "x"), dtype) == base.data_ptr()
    out = pt.attention(q, k, v, "alibi", causal=True)
    want = pt.attention(q.contiguous(), k.contiguous(), v.contiguous(), "alibi", causal=True)
    assert out.dtype == td and torch.equal(out.view(torch.int16), want.view(torch.int16))
    m = pt.PositionalAttention("rope", 4, 2, 16, causal=True, layout="bhld")
    with torch.no_grad():
        out = m(qb, kb, vb)
    assert out.dtype == td and out.shape == qb.shape


@pytest.mark.parametrize("scheme", ["none", "alibi", "t5", "shaw", "deberta"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_half_with_grad_matches_the_float32_gradients_cast(scheme, dtype):
    torch = _torch()
    import posenc.torch as pt
    td = _tdtype(dtype)
    c = Case(scheme, seed=14, causal=True, positions=True, variant=1 if scheme == "alibi" else 0)
    q, k, v = (torch.tensor(x, dtype=torch.float32).to(td).requires_grad_()
               for x in (c.q, c.k, c.v))
    params = {n: torch.tensor(p, dtype=torch.float32, requires_grad=True)
              for n, p in c.params.items()}
    kw = dict(c.kw)
    out = pt.attention(q, k, v, scheme, params=params or None, **kw)
    assert out.dtype == td and out.requires_grad
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(td)
    out.backward(dout)
    # The same with float32 leaves on the widened values, dout widened.
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    p32 = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
    out32 = pt.attention(q32, k32, v32, scheme, params=p32 or None, **kw)
    out32.backward(dout.float())
    assert torch.equal(out.detach().view(torch.int16), out32.detach().to(td).view(torch.int16))
    for a, b in ((q, q32), (k, k32), (v, v32)):
        assert a.grad.dtype == td
        assert torch.equal(a.grad.view(torch.int16), b.grad.to(td).view(torch.int16))
    for n in params:
        assert params[n].grad.dtype == torch.float32
        assert torch.equal(params[n].grad, p32[n].grad)
    # The forward with gradients is the no-grad native result.
    with torch.no_grad():
        native = pt.attention(q, k, v, scheme, params=params or None, **kw)
    assert torch.equal(native.view(torch.int16), out.detach().view(torch.int16))


def test_torch_bf16_module_trains():
    """A PositionalAttention converted to bfloat16 (its T5 table and sinks bf16 too) trains:
    gradients reach every parameter in bf16 and the loss goes down."""
    torch = _torch()
    import posenc.torch as pt
    torch.manual_seed(0)
    m = pt.PositionalAttention("t5", 4, 2, 16, causal=True, sinks=True).to(torch.bfloat16)
    x = torch.randn(2, 12, 4, 16).to(torch.bfloat16)
    kx = x[:, :, :2].clone().requires_grad_()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    losses = []
    for _ in range(5):
        out = m(x, kx, kx)
        assert out.dtype == torch.bfloat16
        loss = (out.float() - x.float().roll(1, 1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        losses.append(loss.item())
        for p in m.parameters():
            assert p.grad is not None and p.grad.dtype == torch.bfloat16
        opt.step()
    assert kx.grad.dtype == torch.bfloat16
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_rope_half(dtype):
    torch = _torch()
    import posenc.torch as pt
    td = _tdtype(dtype)
    x = torch.randn(2, 5, 3, 8, generator=torch.Generator().manual_seed(15)).to(td)
    pos = torch.tensor([[0, 1, 2, 3, 4], [9, 7, 1000, 3, 1]])
    kw = dict(positions=pos, style="interleaved", rotary_dim=4, base=100.0)
    y = pt.rope(x, **kw)
    assert y.dtype == td
    want = posenc.apply_rope_half(_np_half(x), dtype=dtype, positions=pos.numpy(),
                                  style="interleaved", rotary_dim=4, base=100.0)
    assert np.array_equal(bits(_np_half(y)), bits(want))
    assert torch.equal(y.view(torch.int16), pt.rope(x.float(), **kw).to(td).view(torch.int16))
    # A strided tensor (bhld transposed) without a copy, the same bits.
    xb = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert not xb.is_contiguous()
    assert torch.equal(pt.rope(xb, **kw).view(torch.int16), y.view(torch.int16))
    # With gradients: the float32 path, cast; the gradient is the inverse rotation, in x's dtype.
    xg = x.clone().requires_grad_()
    yg = pt.rope(xg, **kw)
    assert yg.dtype == td and torch.equal(yg.detach().view(torch.int16), y.view(torch.int16))
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(16)).to(td)
    yg.backward(dy)
    assert xg.grad.dtype == td
    x32 = x.float().requires_grad_()
    pt.rope(x32, **kw).backward(dy.float())
    assert torch.equal(xg.grad.view(torch.int16), x32.grad.to(td).view(torch.int16))


def test_the_docs_half_precision_example_runs():
    _torch()
    import contextlib
    import io
    import re
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "python.md")
    with open(doc) as f:
        section = f.read().split("## Half precision (bf16, f16)\n", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"```python\n(.*?)```", section, re.S)
    assert code
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code[0], "docs/python.md (half precision)", "exec"), {})
