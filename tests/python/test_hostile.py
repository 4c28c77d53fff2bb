"""Hostile inputs on the newest surfaces (paged caches, keyword types, masks, soft-caps, the torch
ops): each call gives the float64 reference's answer within float32's tolerance or raises
TypeError / ValueError naming the argument, and never reads or writes outside its buffers (the
sanitized run of this file checks that part)."""

import numpy as np
import pytest

import posenc

torch = pytest.importorskip("torch")
import posenc.torch as pt  # noqa: E402

RNG = np.random.default_rng(41)


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def gathered_ref(q, kp, vp, table, lens, **kw):
    """attention_paged's answer from first principles: each row's keys gathered, float64."""
    page = kp.shape[1]
    out = np.zeros(q.shape, np.float64)
    for b in range(q.shape[0]):
        idx = [(table[b, j // page], j % page) for j in range(lens[b])]
        k = np.stack([kp[p, s] for p, s in idx])[None].astype(np.float64)
        v = np.stack([vp[p, s] for p, s in idx])[None].astype(np.float64)
        pos = np.arange(lens[b] - q.shape[1], lens[b])
        out[b:b + 1] = posenc.ref.attention(q[b:b + 1].astype(np.float64), k, v,
                                            query_positions=pos, **kw)
    return out


# ---- paged caches ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_half_decode_with_a_table_exactly_as_wide_as_the_pages(dtype, layout):
    # The decode look-ahead once read block_table[b, 2] here (a heap overflow under ASan).
    shape = (8, 16, 2, 32) if layout == "token_major" else (8, 2, 16, 32)
    kp = np.zeros(shape, np.uint16)
    table = np.array([[3, 5], [0, 1]])
    out = posenc.attention_paged(np.ones((2, 1, 8, 32), np.float32), kp, kp, table,
                                 np.array([20, 7]), dtype=dtype, layout=layout, causal=True)
    assert out.shape == (2, 1, 8, 32) and np.all(out == 0)


@pytest.mark.parametrize("which", ["k", "v", "both"])
def test_key_and_value_pools_each_read_through_their_own_strides(which):
    q = f32(2, 1, 4, 32)
    kp, vp = f32(8, 16, 2, 32), f32(8, 16, 2, 32)
    table, lens = np.array([[3, 5], [0, 1]]), np.array([20, 7])
    want = posenc.attention_paged(q, kp, vp, table, lens)
    wide_k, wide_v = f32(8, 16, 2, 64), f32(8, 16, 2, 64)
    wide_k[..., :32], wide_v[..., :32] = kp, vp
    ks = wide_k[..., :32] if which in ("k", "both") else kp
    vs = wide_v[..., :32] if which in ("v", "both") else vp
    got = posenc.attention_paged(q, ks, vs, table, lens)
    np.testing.assert_array_equal(got, want)
    ref = gathered_ref(q, kp, vp, table, lens)
    assert np.max(np.abs(got - ref)) < 1e-5
    # The torch op on strided tensors too.
    tout = pt.attention_paged(torch.from_numpy(q), torch.from_numpy(ks), torch.from_numpy(vs),
                              torch.from_numpy(table), torch.from_numpy(lens))
    np.testing.assert_array_equal(tout.numpy(), want)


def test_paged_q_float64_is_refused_not_misread():
    q, kp = f32(1, 1, 2, 8), f32(2, 4, 2, 8)
    table, lens = np.array([[0]]), np.array([3])
    with pytest.raises(TypeError, match="q: expected float32.*float64"):
        posenc.attention_paged(q.astype(np.float64), kp, kp, table, lens)
    with pytest.raises(TypeError, match="q"):
        pt.attention_paged(torch.from_numpy(q).double(), torch.from_numpy(kp),
                           torch.from_numpy(kp), torch.tensor(table), torch.tensor(lens))


def test_page_tables_are_never_cast():
    k_new, pool = torch.ones(1, 1, 2, 32), torch.zeros(4, 16, 2, 32)
    before = pool.clone()
    # 2**32 + 1 would wrap to page 1 in int32: refused, and nothing written.
    with pytest.raises(ValueError, match="block_table: value 4294967297"):
        pt.rope_append(k_new, pool, torch.tensor([[0, 2**32 + 1]]), torch.tensor([17]))
    assert torch.equal(pool, before)
    with pytest.raises(TypeError, match="block_table: expected an integer"):
        pt.rope_append(k_new, pool, torch.tensor([[0.0, 1.0]]), torch.tensor([17]))
    with pytest.raises(TypeError, match="seq_lens: expected an integer"):
        pt.attention_paged(torch.ones(1, 1, 2, 32), pool, pool, torch.tensor([[0, 1]]),
                           torch.tensor([17.5]))
    assert torch.equal(pool, before)
    # NumPy: uint64 2**64 - 1 is named as itself, not as -1.
    with pytest.raises(ValueError, match="block_table: value 18446744073709551615"):
        posenc.attention_paged(np.ones((1, 1, 2, 32), np.float32), pool.numpy(), pool.numpy(),
                               np.array([[2**64 - 1]], np.uint64), np.array([3]))


def test_paged_errors_name_the_pool_and_its_layout():
    q, kp = np.ones((1, 1, 2, 8), np.float32), np.ones((2, 4, 2, 8), np.float32)
    t, n = np.array([[0]]), np.array([3])
    with pytest.raises(TypeError, match="k_pages: expected an array.*NoneType"):
        posenc.attention_paged(q, None, kp, t, n)
    with pytest.raises(posenc.ShapeError, match=r"v_pages: expected 4 dimensions \[num_pages, "
                                                 r"heads_kv, page_size"):
        posenc.attention_paged(q, kp, kp[0], t, n, layout="head_major")
    with pytest.raises(TypeError, match="k_pages: dtype='bfloat16' pages must hold the half bits"):
        posenc.attention_paged(q, kp, kp, t, n, dtype="bfloat16")
    with pytest.raises(TypeError, match="layout: expected a string"):
        posenc.attention_paged(q, kp, kp, t, n, layout=1)


def test_paged_memory_is_bounded_before_allocation(monkeypatch):
    # A page listed 2**27 times: 2**31 - 1 keys of a 256-byte pool.
    monkeypatch.setenv("POSENC_MAX_BYTES", "256M")
    kp = np.zeros((1, 16, 1, 4), np.float32)
    table = np.zeros((1, 2**27), np.int32)
    with pytest.raises(posenc.Error, match=r"max\(seq_lens\).*POSENC_MAX_BYTES"):
        posenc.attention_paged(np.ones((1, 1, 1, 4), np.float32), kp, kp, table,
                               np.array([2**31 - 1]))


@pytest.mark.parametrize("api", ["numpy", "torch"])
def test_empty_paged_row_under_default_positions(api):
    q, kp = f32(2, 1, 2, 8), f32(4, 4, 2, 8)
    table, lens = np.array([[0, 1], [2, 3]]), np.array([0, 7])
    if api == "numpy":
        call = lambda **kw: posenc.attention_paged(q, kp, kp, table, lens, **kw)  # noqa: E731
    else:
        call = lambda **kw: pt.attention_paged(  # noqa: E731
            torch.from_numpy(q), torch.from_numpy(kp), torch.from_numpy(kp),
            torch.from_numpy(table), torch.from_numpy(lens), **kw).numpy()
    with pytest.raises(ValueError, match=r"batch 0.*sees no key"):
        call()
    out = call(allow_fully_masked=True)
    assert np.all(out[0] == 0)
    ref = gathered_ref(q[1:], kp, kp, table[1:], lens[1:])
    assert np.max(np.abs(out[1:] - ref)) < 1e-5


# ---- soft-caps, masks, dtypes ------------------------------------------------------------------

@pytest.mark.parametrize("cap", [1e-300, 1e-50, 1e-40, 1e-30, 1e300])
def test_softcap_outside_float32_range_still_caps(cap):
    q, k, v = f32(1, 6, 2, 8), f32(1, 6, 2, 8), f32(1, 6, 2, 8)
    want = posenc.ref.attention(q, k, v, softcap=cap, causal=True)
    assert np.max(np.abs(posenc.attention(q, k, v, softcap=cap, causal=True) - want)) < 1e-6
    bits = lambda x: posenc.bf16_from_float32(x)  # noqa: E731
    half = posenc.bf16_to_float32(posenc.attention_half(bits(q), bits(k), bits(v),
                                                        dtype="bfloat16", softcap=cap,
                                                        causal=True))
    wide = [posenc.bf16_to_float32(bits(x)).astype(np.float64) for x in (q, k, v)]
    assert np.max(np.abs(half - posenc.ref.attention(*wide, softcap=cap, causal=True))) < 1e-2
    # The gradient too.
    dout = f32(1, 6, 2, 8)
    g = posenc.attention_grad(q, k, v, dout, softcap=cap, causal=True)
    g64 = posenc.ref.attention_grad(q, k, v, dout, softcap=cap, causal=True)
    for n in ("dq", "dk", "dv"):
        assert np.max(np.abs(g[n] - g64[n])) < 1e-5, n


@pytest.mark.parametrize("cap", [0, -1, float("inf"), float("nan")])
def test_softcap_out_of_range_is_refused(cap):
    q = f32(1, 3, 1, 4)
    with pytest.raises(ValueError, match="softcap"):
        posenc.attention(q, q, q, softcap=cap)


@pytest.mark.parametrize("value", [256, 0.5, -3, float("nan"), True])
def test_dense_mask_nonzero_attends(value):
    q = f32(1, 5, 2, 8)
    m = np.zeros((1, 5, 5), type(value) if not isinstance(value, bool) else bool)
    m[...] = value
    np.testing.assert_array_equal(posenc.attention(q, q, q, mask=m), posenc.attention(q, q, q))
    # And a zero hides the key, whatever the dtype.
    m[0, :, 0] = 0
    want = posenc.attention(q, q[:, 1:], q[:, 1:], query_positions=np.arange(5),
                            key_positions=np.arange(1, 5), allow_fully_masked=True)
    np.testing.assert_allclose(posenc.attention(q, q, q, mask=m), want, atol=1e-6)


def test_dense_mask_of_text_or_complex_is_refused():
    q = f32(1, 2, 1, 4)
    with pytest.raises(TypeError, match="mask"):
        posenc.attention(q, q, q, mask=np.full((1, 2, 2), "a"))
    with pytest.raises(TypeError, match="mask"):
        posenc.attention(q, q, q, mask=np.ones((1, 2, 2), np.complex64))


def test_complex_and_mixed_half_inputs_are_refused():
    q = f32(1, 5, 2, 8)
    with pytest.raises(TypeError, match="q: .*complex64.*imaginary"):
        posenc.attention(q.astype(np.complex64) + 1j, q, q)
    t = torch.from_numpy(q)
    with pytest.raises(TypeError, match="q: expected a floating-point tensor"):
        pt.attention(t.to(torch.complex64), t, t)
    with pytest.raises(TypeError, match="k and v must share one dtype"):
        torch.ops.posenc.attention_half(t.bfloat16(), t.bfloat16(), t.half(), [], [])
    with pytest.raises(TypeError, match="q must be"):
        torch.ops.posenc.attention_half(t.half(), t.bfloat16(), t.bfloat16(), [], [])
    # A float16 array read as bf16 bits.
    with pytest.raises(TypeError, match="float16 array for dtype='bfloat16'"):
        posenc._posenc._attention_half(q.astype(np.float16), q.astype(np.float16),
                                       q.astype(np.float16), dtype="bfloat16")


def test_integer_inputs_exact_or_refused():
    q = np.arange(40, dtype=np.int64).reshape(1, 5, 1, 8)
    np.testing.assert_array_equal(posenc.attention(q, q, q), posenc.attention(q.astype(np.float32),
                                                                              q.astype(np.float32),
                                                                              q.astype(np.float32)))
    big = q + 2**24 + 1
    with pytest.raises(ValueError, match="q: integer values that float32 cannot hold"):
        posenc.attention(big, big, big)


# ---- keywords: the wrong type names the keyword --------------------------------------------------

@pytest.mark.parametrize("kw, error, pattern", [
    ({"window": 2.5}, TypeError, "window: expected an integer"),
    ({"window": 2**64}, ValueError, "window: 18446744073709551616 is outside"),
    ({"window": 0}, ValueError, "window"),
    ({"chunk": 2.5}, TypeError, "chunk: expected an integer"),
    ({"causal": "yes"}, TypeError, "causal: expected True or False"),
    ({"causal": 1}, TypeError, "causal: expected True or False"),
    ({"softcap": "50"}, TypeError, "softcap: expected a number"),
    ({"softcap": 1 + 2j}, TypeError, "softcap"),
    ({"scale": "1"}, TypeError, "scale: expected a number"),
    ({"scale": True}, TypeError, "scale: expected a number"),
    ({"num_threads": 1.5}, TypeError, "num_threads: expected an integer"),
    ({"num_threads": -1}, ValueError, "num_threads"),
    ({"allow_fully_masked": "no"}, TypeError, "allow_fully_masked"),
    ({"query_positions": 2**70}, ValueError, "query_positions"),
    ({"query_positions": [0.5, 1.5, 2.5]}, TypeError, "query_positions"),
    ({"key_positions": np.array([2**64 - 1] * 3, np.uint64)}, ValueError, "key_positions"),
])
@pytest.mark.parametrize("api", ["numpy", "torch"])
def test_keyword_types(kw, error, pattern, api):
    q = f32(1, 3, 2, 4)
    if api == "torch":
        if "query_positions" in kw or "key_positions" in kw:
            pytest.skip("positions tensors are checked by torch's own conversion")
        t = torch.from_numpy(q)
        with pytest.raises(error, match=pattern):
            pt.attention(t, t, t, **kw)
    else:
        with pytest.raises(error, match=pattern):
            posenc.attention(q, q, q, **kw)


def test_scheme_keywords_typed_too():
    q = f32(1, 3, 2, 4)
    for kw, pattern in [({"num_buckets": 3.0}, "num_buckets: expected an integer"),
                        ({"bidirectional": "true"}, "bidirectional"),
                        ({"max_distance": 2**80}, "max_distance")]:
        with pytest.raises((TypeError, ValueError), match=pattern):
            posenc.attention(q, q, q, "t5", **kw)
    for kw, pattern in [({"base": "1e4"}, "base: expected a number"),
                        ({"rotary_dim": 2.0}, "rotary_dim: expected an integer"),
                        ({"style": 3}, "style: expected a string"),
                        ({"freqs": [1.0]}, "freqs: expected a posenc.RopeFrequencies")]:
        with pytest.raises((TypeError, ValueError), match=pattern):
            posenc.attention(q, q, q, "rope", **kw)
    with pytest.raises(TypeError, match="scheme: expected a string"):
        posenc.attention(q, q, q, 5)


def test_rope_append_keywords_typed():
    k_new, pool = np.ones((1, 1, 2, 8), np.float32), np.zeros((2, 4, 2, 8), np.float32)
    t, n = np.array([[0]]), np.array([1])
    for kw, error, pattern in [({"offset": 1.5}, TypeError, "offset: expected an integer"),
                               ({"num_threads": "2"}, TypeError, "num_threads"),
                               ({"base": float("nan")}, ValueError, "base: must be finite"),
                               ({"rotary_dim": -2}, ValueError, "rotary_dim")]:
        before = pool.copy()
        with pytest.raises(error, match=pattern):
            posenc.rope_append(k_new, pool, t, n, **kw)
        np.testing.assert_array_equal(pool, before)


# ---- NaN under block masks: reported as the input it is ----------------------------------------

@pytest.mark.parametrize("masks", ["documents", "cu_seqlens", "prefix", "dense"])
def test_nan_with_block_masks_names_the_input(masks):
    q = f32(1, 5, 2, 8)
    qn = q.copy()
    qn[0, 1, 0, 0] = np.nan
    kw = {"documents": dict(query_documents=np.zeros((1, 5), np.int32),
                            key_documents=np.zeros((1, 5), np.int32)),
          "prefix": dict(prefix=np.array([2]), causal=True),
          "dense": dict(mask=np.ones((1, 5, 5), bool))}.get(masks)
    with pytest.raises(ValueError, match=r"q: non-finite value nan at \[0, 1, 0, 0\]"):
        if masks == "cu_seqlens":
            posenc.attention(qn[0], q[0], q[0], cu_seqlens_q=[0, 5], cu_seqlens_k=[0, 5])
        else:
            posenc.attention(qn, q, q, **kw)


# ---- the torch ops' typed arguments ------------------------------------------------------------

def test_op_argument_errors_name_the_argument_and_unnamed_tables():
    t = torch.randn(1, 3, 2, 4)
    ops = torch.ops.posenc
    # A table without a name, a name without a table, one name twice.
    with pytest.raises(ValueError, match=r"tables, table_names: 1 tensors and 0 names"):
        ops.attention(t, t, t, [torch.zeros(2)], [])
    with pytest.raises(ValueError, match=r"0 tensors and 1 names \['slopes'\]"):
        ops.attention(t, t, t, [], ["slopes"])
    with pytest.raises(ValueError, match="table_names: 'slopes' is given twice"):
        ops.attention(t, t, t, [torch.zeros(2)] * 2, ["slopes"] * 2, scheme="alibi")
    # A wrong-typed argument: the schema refuses it, naming the argument (torch's schema takes
    # an int for a bool and a bool for an int; posenc.torch's calls refuse those, below).
    for kw, name in (({"causal": "yes"}, "causal"), ({"window": 2.5}, "window"),
                     ({"scale": "big"}, "scale"), ({"scheme": 3}, "scheme"),
                     ({"global_positions": [1.5]}, "global_positions"),
                     ({"config": {"model_type": "llama"}}, "config")):
        with pytest.raises((TypeError, RuntimeError), match=name):
            ops.attention(t, t, t, [], [], **kw)
    with pytest.raises((TypeError, RuntimeError), match="causl"):
        ops.attention(t, t, t, [], [], causl=True)
    with pytest.raises((TypeError, RuntimeError), match="table_names"):
        ops.attention(t, t, t, [], [3])
    # Ranges are the NumPy function's: ValueError naming the argument.
    with pytest.raises(ValueError, match="window"):
        ops.attention(t, t, t, [], [], window=0)
    with pytest.raises(ValueError, match="scheme"):
        ops.attention(t, t, t, [], [], scheme="nope")
    # An offset and ids of the same positions, frequencies without their inv_freq.
    with pytest.raises(ValueError, match="query_positions, query_positions_offset"):
        ops.attention(t, t, t, [], [], torch.arange(3), query_positions_offset=2)
    with pytest.raises(ValueError, match="freqs_inv_freq: required"):
        ops.rope(t, freqs_attention_factor=1.0)
    # A rope_scaling that is not JSON text, a config that is not config.json text.
    with pytest.raises(ValueError, match="scaling: expected a rope_scaling dict as JSON text"):
        ops.rope(t, scaling="{bad")
    with pytest.raises(ValueError, match="config: expected a config.json as JSON text"):
        ops.attention(t, t, t, [], [], config="{bad")
    with pytest.raises(ValueError, match="config: expected a config.json as JSON text"):
        ops.attention(t, t, t, [], [], config='"tests/configs/llama-2-7b.json"')  # a path
    # posenc.torch checks each scalar before the op (the bindings' checker), naming it.
    with pytest.raises(TypeError, match="scale: expected a number"):
        pt.attention(t, t, t, scale="big")
    with pytest.raises(TypeError, match=r"attention\(\) got an unexpected keyword argument"):
        pt.attention(t, t, t, causl=True)
    with pytest.raises(ValueError, match=r"scaling\['factor'\]: must be finite"):
        pt.rope(t, scaling={"rope_type": "linear", "factor": float("inf")})
    with pytest.raises(TypeError, match="freqs: expected a posenc.RopeFrequencies"):
        pt.rope(t, freqs=[1.0, 0.5])
    with pytest.raises(TypeError, match="causal: expected True or False"):
        pt.attention(t, t, t, causal=1)
    with pytest.raises(TypeError, match="window: expected an integer"):
        pt.attention(t, t, t, window=True)
    # The same checks in a compiled call, made while tracing: the TypeError itself (with
    # fullgraph=True, torch.compile's error for an exception raised in the traced code, quoting
    # it).
    for fullgraph, error in ((False, TypeError), (True, RuntimeError)):
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: pt.attention(x, x, x, causal=1), backend="eager",
                                 fullgraph=fullgraph)
        with pytest.raises(error, match="causal: expected True or False"):
            compiled(t)


def schema_type(t):
    """An argument type as the schema language writes it (int[]?, Tensor, ...)."""
    t = str(t)
    optional = t.startswith("Optional[")
    t = t[len("Optional["):-1] if optional else t
    if t.startswith("List["):
        t = t[len("List["):-1] + "[]"
    return t + "?" * optional


def test_op_schemas_are_typed():
    # Every posenc op takes tensors and typed arguments: no options string, nothing decoded by
    # ast, no sentinel keys, no registry of objects.
    import inspect
    import re

    from posenc import _ops
    names = [n for n in dir(torch.ops.posenc)
             if isinstance(getattr(torch.ops.posenc, n), torch._ops.OpOverloadPacket)]
    assert {"attention", "attention_backward", "attention_half", "attention_paged", "rope_append",
            "rope", "rope_half", "rerotate_rope", "add_learned", "learned_backward",
            "add_sinusoidal", "sinusoidal_encode", "attention_merge"} <= set(names)
    allowed = {"Tensor", "Tensor?", "Tensor[]", "int", "int?", "float", "float?", "bool", "bool?",
               "str", "str?", "int[]?", "float[]?", "float[]", "str[]"}
    for n in names:
        schema = getattr(torch.ops.posenc, n).default._schema
        for a in schema.arguments:
            assert a.name != "options", (n, str(schema))
            assert schema_type(a.type) in allowed, (n, a.name, str(a.type))
    source = inspect.getsource(_ops)
    assert not re.search(r"^\s*(import ast|from ast )", source, re.M)
    assert "literal_eval" not in source and "\\x00" not in source and "_OBJECTS" not in source
    for gone in ("encode", "decode", "with_option", "register_object"):
        assert not hasattr(_ops, gone), gone
    # Every scheme setting of the registry is an argument of the attention op, of its type.
    schema = {a.name: schema_type(a.type)
              for a in torch.ops.posenc.attention.default._schema.arguments}
    kinds = {"float": "float?", "int": "int?", "bool": "bool?", "choice": "str?",
             "rope_scaling": "str?"}
    for s in posenc.schemes():
        for setting in s["settings"]:
            if setting["type"] == "rope_frequencies":
                for part, t in (("inv_freq", "float[]?"), ("attention_factor", "float?"),
                                ("angles", "str?")):
                    assert schema[f"{setting['keyword']}_{part}"] == t, setting
            else:
                assert schema[setting["keyword"]] == kinds[setting["type"]], setting
    # The signature the module's docstring shows is the op's.
    rope = str(torch.ops.posenc.rope.default._schema)
    assert re.sub(r"\s+", " ", rope) in re.sub(r"\s+", " ", _ops.__doc__)


def test_results_of_broadcast_inputs_are_bounded_before_allocation(monkeypatch):
    # A stride-0 view describes a million tokens in 32 bytes; its result would need 32 MB.
    monkeypatch.setenv("POSENC_MAX_BYTES", "1M")
    q = np.broadcast_to(np.ones((1, 1, 1, 8), np.float32), (1, 10**6, 1, 8))
    with pytest.raises(posenc.Error, match=r"\[1, 1000000, 1, 8\].*POSENC_MAX_BYTES"):
        posenc.attention(q, q, q)
    with pytest.raises(posenc.Error, match=r"seq_q \+ seq_k.*POSENC_MAX_BYTES"):
        posenc.attention(q[:, :10], q, q, causal=True)


def test_rope_and_plot_keywords_typed():
    x = np.ones((1, 4, 2, 8), np.float32)
    for kw, error, pattern in [({"base": "1e4"}, TypeError, "base: expected a number"),
                               ({"rotary_dim": 2.0}, TypeError, "rotary_dim: expected an integer"),
                               ({"inverse": 1}, TypeError, "inverse: expected True or False"),
                               ({"num_threads": 2**70}, ValueError, "num_threads"),
                               ({"seq_len": -1}, ValueError, "seq_len"),
                               ({"angles": 3}, TypeError, "angles: expected a string"),
                               ({"freqs": [1.0]}, TypeError, "freqs: expected a posenc.Rope")]:
        with pytest.raises(error, match=pattern):
            posenc.apply_rope(x, **kw)
        with pytest.raises(error, match=pattern):
            posenc.ref.apply_rope(x, **kw)
    with pytest.raises(TypeError, match="length: expected an integer"):
        posenc.plot.heatmap(length=2.5)
    with pytest.raises(TypeError, match="colormap: expected a string"):
        posenc.plot.heatmap(colormap=1)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_deberta_rows_that_see_no_key_read_only_the_table(dtype):
    # Queries placed before every key under a causal mask (with sinks: allowed): the DeBERTa
    # kernels' distance range of such a row lies outside the index table and was read anyway.
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal(s).astype(np.float32)
               for s in ((2, 2, 6, 15), (2, 14, 3, 15), (2, 14, 3, 15)))
    params = {"pos_key": rng.standard_normal((8, 6, 15)).astype(np.float32),
              "pos_query": rng.standard_normal((8, 6, 15)).astype(np.float32),
              "sinks": rng.standard_normal(6).astype(np.float32)}
    kw = dict(causal=True, window=2**40, chunk=2, softcap=3.0, scale=0.25, params=params,
              max_relative_positions=16, position_buckets=4,
              query_positions=np.array([[2**32 + 1, 2**32 + 2], [2**32 + 20, 2**32 + 21]]),
              key_positions=2**32 + 4 + np.stack([np.arange(14), 2 * np.arange(14)]))
    want = posenc.ref.attention(q, k, v, "deberta", **kw)
    if dtype == "float32":
        got = posenc.attention(q, k, v, "deberta", **kw)
        dout = rng.standard_normal(got.shape).astype(np.float32)
        g = posenc.attention_grad(q, k, v, dout, "deberta", **kw)
        g64 = posenc.ref.attention_grad(q, k, v, dout, "deberta", **kw)
        for n in ("dq", "dk", "dv", "dpos_key", "dpos_query", "dsinks"):
            assert np.max(np.abs(g[n] - g64[n])) < 1e-4, n
        tol = 1e-5
    else:
        h = [x.astype(np.float16) for x in (q, k, v)]
        got = posenc.attention_half(*h, "deberta", dtype="float16", **kw).astype(np.float32)
        want = posenc.ref.attention(*[x.astype(np.float64) for x in h], "deberta", **kw)
        tol = 1e-2
    assert np.max(np.abs(got - want)) < tol


def test_torch_rope_append_with_an_int_offset():
    # positions=<int> travels in the options: handed on once, not twice.
    pool = torch.zeros(2, 4, 1, 8)
    pt.rope_append(torch.ones(1, 1, 1, 8), pool, torch.tensor([[0]]), torch.tensor([1]),
                   positions=5)
    want = np.zeros((2, 4, 1, 8), np.float32)
    posenc.rope_append(np.ones((1, 1, 1, 8), np.float32), want, np.array([[0]]), np.array([1]),
                       positions=5)
    np.testing.assert_array_equal(pool.numpy(), want)
    assert np.any(want != 0)


@pytest.mark.parametrize("cap", [1e30, 1e38, 1e300])
def test_huge_softcap_is_the_identity_to_float32_precision(cap):
    # Also on the simple path (positions too far apart for the fused kernel's int32 offsets) and
    # through the backward's recomputed scores, where cap * tanh(s / cap) underflowed.
    q, k, v = f32(1, 1, 1, 4), f32(1, 3, 1, 4), f32(1, 3, 1, 4)
    sinks = {"sinks": np.array([0.5], np.float32)}
    for kp in (None, np.array([0, 1, 2**31 - 4])):
        kw = dict(softcap=cap, scale=0.25, params=sinks, key_positions=kp,
                  query_positions=None if kp is None else np.array([2]))
        want = posenc.ref.attention(q, k, v, **kw)
        assert np.max(np.abs(posenc.attention(q, k, v, **kw) - want)) < 1e-6
        dout = f32(1, 1, 1, 4)
        g, g64 = (fn(q, k, v, dout, **kw) for fn in (posenc.attention_grad,
                                                     posenc.ref.attention_grad))
        for n in ("dq", "dk", "dv", "dsinks"):
            assert np.max(np.abs(g[n] - g64[n])) < 1e-5, n


def test_packed_sequences_without_query_tokens():
    # cu_seqlens with an empty query side: the document mask is still given on both sides.
    q = np.zeros((0, 1, 2), np.float32)
    k = f32(1, 1, 2)
    out = posenc.attention(q, k, k, cu_seqlens_q=[0, 0], cu_seqlens_k=[0, 1])
    assert out.shape == (0, 1, 2)


def test_rope_append_refuses_float64_new_keys():
    pool = np.zeros((2, 4, 1, 8), np.float32)
    with pytest.raises(TypeError, match="k_new: float64"):
        posenc.rope_append(np.ones((1, 1, 1, 8)), pool, np.array([[0]]), np.array([1]))
    assert not pool.any()


def test_broadcast_queries_with_gqa_and_documents():
    # Query rows with stride 0 along the sequence (a broadcast q), GQA and a document mask: the
    # kernel's in-place query reads took stride 0 for packed rows.
    rng = np.random.default_rng(3)
    q = np.broadcast_to(rng.standard_normal((1, 1, 2, 4)).astype(np.float32), (1, 8, 2, 4))
    k = rng.standard_normal((1, 8, 1, 4)).astype(np.float32)
    d = np.array([[0, 0, 0, 1, 1, 1, 2, 2]], np.int32)
    got = posenc.attention(q, k, k, query_documents=d, key_documents=d)
    want = posenc.ref.attention(q, k, k, query_documents=d, key_documents=d)
    assert np.max(np.abs(got - want)) < 1e-6


def test_no_key_under_block_masks_is_refused_in_half_too():
    h, e = np.ones((1, 2, 1, 4), np.float16), np.ones((1, 0, 1, 4), np.float16)
    for kw in (dict(prefix=np.array([1])), dict(global_positions=[0])):
        with pytest.raises(ValueError, match="sees no key"):
            posenc.attention_half(h, e, e, dtype="float16", query_positions=5, **kw)
        with pytest.raises(ValueError, match="sees no key"):
            posenc.attention(h.astype(np.float32), e.astype(np.float32), e.astype(np.float32),
                             query_positions=5, **kw)
        out = posenc.attention_half(h, e, e, dtype="float16", query_positions=5,
                                    allow_fully_masked=True, **kw)
        assert np.all(out == 0)


def test_torch_takes_numpy_masks_of_any_strides_and_numpy_offsets():
    q = torch.randn(2, 4, 1, 2)
    m = np.ones((2, 4, 4), bool)
    m[0, :, 1] = False
    want = pt.attention(q, q, q, mask=torch.from_numpy(m[::-1].copy()))
    torch.testing.assert_close(pt.attention(q, q, q, mask=m[::-1]), want, rtol=0, atol=0)
    b = np.broadcast_to(m[:1], (2, 4, 4))  # read-only
    torch.testing.assert_close(pt.attention(q, q, q, mask=b),
                               pt.attention(q, q, q, mask=torch.from_numpy(b.copy())))
    x = np.ones((1, 4, 1, 4), np.float32)
    np.testing.assert_array_equal(posenc.attention(x, x, x, query_positions=np.int64(3),
                                                   key_positions=np.int64(3)),
                                  posenc.attention(x, x, x, query_positions=3, key_positions=3))


def test_op_arguments_keep_the_types():
    # causal=1 and causal=True compare equal, but only True is a bool: the checker refuses 1.
    t = torch.randn(1, 3, 1, 4)
    pt.attention(t, t, t, causal=True)
    with pytest.raises(TypeError, match="causal: expected True or False"):
        pt.attention(t, t, t, causal=1)
    pt.attention(t, t, t, window=2)
    with pytest.raises(TypeError, match="window: expected an integer"):
        pt.attention(t, t, t, window=2.0)


def test_query_longer_than_keys_names_the_positions():
    x = np.ones((1, 4, 1, 8), np.float32)
    with pytest.raises(ValueError, match="query_positions and key_positions"):
        posenc.attention(x, x[:, :3], x[:, :3])


@pytest.mark.parametrize("scaling,match", [
    ({"rope_type": "proportional", "partial_rotary_factor": "0.25"}, r"scaling\['partial_rotary_factor'\]"),
    ({"rope_type": "proportional", "partial_rotary_factor": float("nan")}, r"scaling\['partial_rotary_factor'\]"),
    ({"rope_type": "linear", "factor": [2.0]}, r"scaling\['factor'\]"),
    ({"rope_type": 3}, r"scaling\['rope_type'\]"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2.5},
     r"scaling\['original_max_position_embeddings'\]"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
      "truncate": "no"}, r"scaling\['truncate'\]"),
])
def test_rope_scaling_dict_values_are_checked_by_name(scaling, match):
    with pytest.raises((TypeError, ValueError), match=match):
        posenc.rope_frequencies(64, scaling=scaling)


def test_proportional_scaling_dict():
    f = posenc.rope_frequencies(64, base=1e6, scaling={"rope_type": "proportional",
                                                       "partial_rotary_factor": 0.25})
    inv = np.asarray(f.inv_freq)
    assert np.count_nonzero(inv) == 8 and np.all(inv[8:] == 0)
    np.testing.assert_allclose(inv[:8], 1e6 ** (-2.0 * np.arange(8) / 64), rtol=1e-15)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        posenc.rope_frequencies(64, scaling={"rope_type": "proportional",
                                             "partial_rotary_factor": 1.5})
