"""posenc.testing: the checker passes correct implementations, fails deliberately broken ones
(one per known mistake) with the right diagnosis, and reports on transformers' own
implementations (rotary-embedding classes, T5's buckets, BLOOM's ALiBi, DeBERTa's relative
positions)."""

import numpy as np
import pytest

import posenc
import posenc.testing as T

torch = pytest.importorskip("torch")
import posenc.torch as pt  # noqa: E402

CONFIGS = __import__("os").environ.get("POSENC_TEST_CONFIGS_DIR") or str(
    __import__("pathlib").Path(__file__).resolve().parents[1] / "configs")


def config_path(name):
    return f"{CONFIGS}/{name}.json"


def diag(report):
    return " ".join(report.diagnosis)


# ---- RoPE implementations, correct and broken ---------------------------------------------------

def rope_np(x, positions, *, base=1e4, style="half", rotary_dim=None, shift=0, f32=False,
            ignore_positions=False):
    """A NumPy RoPE with angles in float64 (correct), or one of the known mistakes."""
    D = x.shape[-1]
    R = rotary_dim or D
    pos = np.asarray(positions)
    if ignore_positions:
        pos = np.broadcast_to(np.arange(pos.shape[-1]), pos.shape)
    pos = pos + shift
    if f32:
        inv = (1.0 / np.float32(base) ** (np.arange(0, R, 2, dtype=np.float32) / np.float32(R)))
        a = (pos[..., None].astype(np.float32) * inv.astype(np.float32)).astype(np.float64)
    else:
        inv = base ** (-np.arange(0, R, 2) / R)
        a = pos[..., None].astype(np.float64) * inv
    a = a[None] if a.ndim == 2 else a
    c, s = np.cos(a)[:, :, None, :], np.sin(a)[:, :, None, :]
    xf = x.astype(np.float64)
    y = xf.copy()
    if style == "half":
        x1, x2 = xf[..., :R // 2], xf[..., R // 2:R]
        y[..., :R // 2], y[..., R // 2:R] = x1 * c - x2 * s, x2 * c + x1 * s
    else:
        x1, x2 = xf[..., 0:R:2], xf[..., 1:R:2]
        y[..., 0:R:2], y[..., 1:R:2] = x1 * c - x2 * s, x2 * c + x1 * s
    return y.astype(x.dtype)


def rope_torch(x, positions, base=1e4):
    """A correct PyTorch RoPE (float64 angles, rotation in x's dtype)."""
    D = x.shape[-1]
    inv = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    a = positions.to(torch.float64)[..., None] * inv
    a = a[None] if a.dim() == 2 else a
    c, s = (f(a)[:, :, None, :].to(x.dtype) for f in (torch.cos, torch.sin))
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def test_correct_rope_passes_numpy_and_torch():
    for style in ("half", "interleaved"):
        r = T.check_rope(lambda x, p: rope_np(x, p, base=500.0, style=style), head_dim=18,
                         base=500.0, style=style)
        assert r.ok and r.diagnosis == [], str(r)
        names = [c.name for c in r.cases]
        assert "positions near 2^20" in names and "per-row positions [batch, seq]" in names
        assert all(c.max_error <= c.tolerance for c in r.cases if c.status == "pass")
    r = T.check_rope(lambda x, p: rope_np(x, p, rotary_dim=8), head_dim=20, rotary_dim=8)
    assert r.ok, str(r)
    r = T.check_rope(rope_torch, head_dim=16)   # torch: float32, bf16 and f16 cases all run
    assert r.ok, str(r)
    assert {c.dtype for c in r.cases} == {"float32", "bfloat16", "float16"}
    assert all(c.status == "pass" for c in r.cases)
    # posenc's own op, wrapped into the canonical convention
    r = T.assert_rope(lambda x, p: pt.rope(x, positions=p, base=5e5), head_dim=32, base=5e5)
    assert r.ok


def test_rope_mistakes_are_diagnosed():
    cases = [
        (dict(style="interleaved"), {}, "interleaved-style"),
        (dict(style="half"), dict(style="interleaved"), "half-style"),
        (dict(f32=True), {}, "Float32 angles at long context"),
        (dict(shift=1), {}, "off by one"),
        (dict(shift=-1), {}, "off by one"),
        (dict(ignore_positions=True), {}, "ignores the positions"),
    ]
    for impl, settings, words in cases:
        fn = (lambda kw: lambda x, p: rope_np(x, p, **kw))(impl)
        r = T.check_rope(fn, head_dim=16, dtype="float32", **settings)
        assert not r.ok, (impl, str(r))
        assert words in diag(r), (impl, str(r))
        assert "First failing case" in r.diagnosis[-1]
    # partial rotary forgotten
    r = T.check_rope(lambda x, p: rope_np(x, p), head_dim=20, rotary_dim=8, dtype="float32")
    assert not r.ok and "partial rotary" in diag(r), str(r)
    # float32 angles pass short positions and fail long ones; the float32 recipe matches
    r = T.check_rope(lambda x, p: rope_np(x, p, f32=True), head_dim=16, dtype="float32")
    by = {c.name: c for c in r.cases}
    assert by["odd sizes B=1 L=7 H=1"].status == "pass"
    assert by["positions near 2^20"].status == "fail"
    assert by["positions near 2^20"].max_error > 1e3 * by["positions near 2^20"].tolerance


def test_report_reproducible_from_seed():
    fn = lambda x, p: rope_np(x, p, shift=1)  # noqa: E731
    r = T.check_rope(fn, head_dim=16, dtype="float32", seed=7)
    f = r.first_failure
    assert f is not None and f"cases=['{f.name}']" in r.diagnosis[-1]
    again = T.check_rope(fn, head_dim=16, dtype="float32", seed=7, cases=[f.name])
    assert len(again.cases) == 1 and again.cases[0].max_error == f.max_error
    np.testing.assert_array_equal(again.first_failure.inputs["x"], f.inputs["x"])
    other = T.check_rope(fn, head_dim=16, dtype="float32", seed=8, cases=[f.name])
    assert not np.array_equal(other.first_failure.inputs["x"], f.inputs["x"])
    name, err, tol = r.cases[0]                        # a case unpacks as (name, error, tolerance)
    assert isinstance(name, str) and err > tol
    with pytest.raises(AssertionError, match="First failing case"):
        T.assert_rope(fn, head_dim=16, dtype="float32")
    assert "FAILED" in str(r) and not bool(r)


def test_bad_input_raises():
    with pytest.raises(ValueError, match="head_dim"):
        T.check_rope(rope_np)
    with pytest.raises(ValueError, match="style"):
        T.check_rope(rope_np, head_dim=8, style="sideways")
    with pytest.raises(ValueError, match="dtype"):
        T.check_rope(rope_np, head_dim=8, dtype="int8")
    with pytest.raises(ValueError, match="scheme"):
        T.check_bias(lambda a, b, c: 0, "rope")
    with pytest.raises(TypeError, match="callable"):
        T.check_rope(3, head_dim=8)
    with pytest.raises(ValueError, match="cases"):
        T.check_rope(rope_np, head_dim=8, cases=["no such case"])
    # a function that raises is reported, not propagated
    def boom(x, p):
        raise RuntimeError("kaput")
    r = T.check_rope(boom, head_dim=8, dtype="float32")
    assert not r.ok and "kaput" in diag(r)


# ---- biases -------------------------------------------------------------------------------------

def alibi_correct(q_len, k_len, heads):
    m = posenc.alibi_slopes(heads)
    pq = np.arange(q_len) + k_len - q_len
    return (-m[:, None, None] * np.abs(pq[:, None] - np.arange(k_len))[None]).astype(np.float32)


def alibi_geometric(q_len, k_len, heads):  # the power-of-two formula for every head count
    m = 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)
    pq = np.arange(q_len) + k_len - q_len
    return (-m[:, None, None] * np.abs(pq[:, None] - np.arange(k_len))[None]).astype(np.float32)


def test_alibi_bias():
    r = T.check_bias(alibi_correct, "alibi")
    assert r.ok, str(r)
    assert any(c.info["k_len"] == 65537 for c in r.cases)
    r = T.check_bias(alibi_geometric, "alibi")
    assert not r.ok
    assert "not a power of two" in diag(r) and "2^(-8·h/H)" in diag(r), str(r)
    assert all(c.status == "pass" for c in r.cases if c.info["heads"] & (c.info["heads"] - 1) == 0)
    # queries at 0..q_len-1 (the cache offset missing)
    def no_offset(q_len, k_len, heads):
        m = posenc.alibi_slopes(heads)
        return -m[:, None, None] * np.abs(np.arange(q_len)[:, None] - np.arange(k_len))[None]
    r = T.check_bias(no_offset, "alibi", heads=4)
    assert not r.ok and "position offset of the cache is missing" in diag(r), str(r)


def test_bloom_build_alibi_tensor():
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    fn = T.alibi_bias(lambda mask, h: bloom.build_alibi_tensor(mask, h, torch.float32))
    r = T.check_bias(fn, "alibi", causal=True, softmax_invariant=True)
    assert r.ok, str(r)
    plain = T.check_bias(fn, "alibi", heads=12, causal=True)
    assert not plain.ok and "constant per query row" in diag(plain), str(plain)


def test_t5_buckets():
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    bucket = t5.T5Attention._relative_position_bucket
    table = np.random.default_rng(3).standard_normal((32, 4)).astype(np.float32)
    params = {"relative_attention_bias": table}
    for bidi in (True, False):
        good = T.t5_bias(bucket, table, bidirectional=bidi)
        r = T.check_bias(good, "t5", params=params, bidirectional=bidi)
        assert r.ok, str(r)
        r = T.check_bias(good, "t5", heads=4, bidirectional=bidi)  # table-free
        assert r.ok, str(r)
        wrong = T.check_bias(good, "t5", params=params, bidirectional=not bidi)
        assert not wrong.ok
        kind = "bidirectional" if bidi else "causal"
        assert f"T5 buckets are {kind}" in diag(wrong), str(wrong)
        wrong = T.check_bias(good, "t5", heads=4, bidirectional=not bidi)  # table-free
        assert not wrong.ok and "T5 buckets are" in diag(wrong), str(wrong)
    # T5Attention.compute_bias without past_seen_tokens: queries at 0..q_len-1
    cfg = __import__("transformers").T5Config(num_heads=4, relative_attention_num_buckets=32,
                                              d_model=32, d_kv=8, is_decoder=True)
    att = t5.T5Attention(cfg, has_relative_attention_bias=True)
    tab = att.relative_attention_bias.weight.detach().numpy()
    r = T.check_bias(lambda ql, kl, h: att.compute_bias(ql, kl), "t5", bidirectional=False,
                     params={"relative_attention_bias": tab})
    assert not r.ok and "position offset of the cache is missing" in diag(r), str(r)
    r = T.check_bias(lambda ql, kl, h: att.compute_bias(ql, kl, past_seen_tokens=kl - ql), "t5",
                     bidirectional=False, params={"relative_attention_bias": tab})
    assert r.ok, str(r)


def test_deberta_relative_positions_and_p2c():
    dv2 = pytest.importorskip("transformers.models.deberta_v2.modeling_deberta_v2")
    square = [(1, 1), (7, 7), (40, 40), (300, 300)]
    kw = dict(max_relative_positions=512, position_buckets=256, shapes=square)

    def rel(q_len, k_len, heads, bucket=256):
        q, k = torch.zeros(1, q_len, 8), torch.zeros(1, k_len, 8)
        return dv2.build_relative_position(q, k, bucket_size=bucket, max_position=512)
    r = T.check_bias(rel, "deberta", **kw)
    assert r.ok, str(r)
    r = T.check_bias(rel, "deberta", max_relative_positions=512, position_buckets=256)
    assert not r.ok and "position offset of the cache is missing" in diag(r), str(r)
    K = 256

    def p2c_hf(q_len, k_len, heads):  # Hugging Face's gather with -r_pos, then the transpose
        r_pos = rel(q_len, k_len, heads)[0]
        return torch.clamp(-r_pos + K, 0, 2 * K - 1).T
    r = T.check_bias(p2c_hf, "deberta", index="p2c", **kw)
    assert r.ok, str(r)

    def p2c_paper(q_len, k_len, heads):  # δ(j, i): the paper's form, not the checkpoints'
        return torch.clamp(-rel(q_len, k_len, heads)[0] + K, 0, 2 * K - 1)
    r = T.check_bias(p2c_paper, "deberta", index="p2c", **kw)
    assert not r.ok and "p2c index is the paper's" in diag(r), str(r)
    assert T.check_bias(p2c_paper, "deberta", index="p2c", p2c="paper", **kw).ok


# ---- attention ----------------------------------------------------------------------------------

def test_attention_posenc_passes_and_mistakes_are_diagnosed():
    r = T.check_attention(pt.attention, "rope", base=500.0)
    assert r.ok, str(r)
    assert any("2^20" in c.name for c in r.cases) and any("bfloat16" in c.dtype for c in r.cases)
    r = T.check_attention(pt.attention, "alibi", dtype="float32", causal=True)
    assert r.ok, str(r)

    def rope_interleaved(q, k, v, scheme, **kw):
        kw.pop("style", None)
        return pt.attention(q, k, v, scheme, style="interleaved", **kw)
    r = T.check_attention(rope_interleaved, "rope", base=500.0, dtype="float32", causal=True)
    assert not r.ok and "interleaved-style" in diag(r), str(r)

    def alibi_geo(q, k, v, scheme, **kw):
        H = q.shape[2]
        s = torch.tensor(2.0 ** (-8.0 * np.arange(1, H + 1) / H), dtype=torch.float32)
        return pt.attention(q, k, v, "alibi", params={"slopes": s}, **kw)
    r = T.check_attention(alibi_geo, "alibi", dtype="float32", causal=True)
    assert not r.ok and "not a power of two" in diag(r), str(r)

    def decode_off_by_one(q, k, v, scheme, *, query_positions=None, key_positions=None, **kw):
        Lq, Lk = q.shape[1], k.shape[1]
        qp = torch.arange(Lq) + Lk - Lq + 1 if query_positions is None else query_positions + 1
        kp = torch.arange(Lk) if key_positions is None else key_positions
        return pt.attention(q, k, v, scheme, query_positions=qp, key_positions=kp, **kw)
    r = T.check_attention(decode_off_by_one, "rope", dtype="float32", causal=False)
    assert not r.ok and "off by one" in diag(r), str(r)

    rng = np.random.default_rng(0)
    tabs = {n: 0.5 * rng.standard_normal((8, 4, 16)).astype(np.float32)
            for n in ("pos_key", "pos_query")}

    def deberta_paper(q, k, v, scheme, **kw):
        return pt.attention(q, k, v, scheme, deberta_p2c="paper",
                            **{n: x for n, x in kw.items() if n != "deberta_p2c"})
    r = T.check_attention(deberta_paper, "deberta", params=tabs, max_relative_positions=4,
                          dtype="float32", causal=False)
    assert not r.ok and "p2c index" in diag(r), str(r)
    assert T.check_attention(pt.attention, "deberta", params=tabs, max_relative_positions=4,
                             dtype="float32", causal=False).ok

    tab = rng.standard_normal((32, 4)).astype(np.float32)

    def t5_swapped(q, k, v, scheme, *, causal=False, **kw):
        return pt.attention(q, k, v, scheme, causal=causal, bidirectional=causal, **kw)
    r = T.check_attention(t5_swapped, "t5", params={"relative_attention_bias": tab}, scale=1.0,
                          dtype="float32")
    assert not r.ok and "T5 buckets are the other kind" in diag(r), str(r)
    assert "causal mask" not in diag(r)


def test_attention_numpy_and_bhld():
    def np_attn(q, k, v, scheme, **kw):
        return posenc.attention(q, k, v, scheme, **kw)
    r = T.check_attention(np_attn, "alibi", causal=True)
    assert r.ok, str(r)
    assert not any(c.dtype == "bfloat16" for c in r.cases) and r.notes

    def sdpa(q, k, v, *, causal=False, query_positions=None, key_positions=None):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        Lq, Lk = q.shape[2], k.shape[2]
        qp = torch.arange(Lq) + Lk - Lq if query_positions is None else query_positions
        kp = torch.arange(Lk) if key_positions is None else key_positions
        qp = qp if qp.dim() == 2 else qp[None]
        kp = kp if kp.dim() == 2 else kp[None]
        mask = (kp[:, None, :] <= qp[:, :, None])[:, None] if causal else None
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    r = T.check_attention(T.from_bhld(sdpa), None)
    assert r.ok, str(r)


# ---- transformers' rotary-embedding classes -----------------------------------------------------

HF_ROPE = [  # (config file, rotary class module, class)
    ("llama-2-7b", "llama", "LlamaRotaryEmbedding"),
    ("llama-2-7b-linear-4x", "llama", "LlamaRotaryEmbedding"),
    ("llama-2-7b-dynamic-2x", "llama", "LlamaRotaryEmbedding"),
    ("llama-3.1-8b", "llama", "LlamaRotaryEmbedding"),
    ("qwen2.5-7b-yarn", "qwen2", "Qwen2RotaryEmbedding"),
    ("phi-3-mini-128k-like", "phi3", "Phi3RotaryEmbedding"),
    ("mistral-7b", "mistral", "MistralRotaryEmbedding"),
    ("gpt-neox-20b", "gpt_neox", "GPTNeoXRotaryEmbedding"),
    ("phi-2", "phi", "PhiRotaryEmbedding"),
    ("gemma-7b", "gemma", "GemmaRotaryEmbedding"),
]


def hf_rotary(name, module, cls):
    import importlib
    import json
    transformers = pytest.importorskip("transformers")
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    with open(config_path(name)) as f:
        d = json.load(f)
    cfg = transformers.AutoConfig.for_model(**d)
    return getattr(mod, cls)(cfg), mod


@pytest.mark.parametrize("name,module,cls", HF_ROPE, ids=[h[0] for h in HF_ROPE])
def test_hf_rotary_classes(name, module, cls):
    emb, mod = hf_rotary(name, module, cls)
    fn = T.hf_rope(emb, getattr(mod, "apply_rotary_pos_emb", None))
    cases = ["prefill L=33", "positions near 2^16", "positions near 2^20"]
    r = T.check_rope(fn, config=config_path(name), dtype="float32", cases=cases)
    by = {c.name: c for c in r.cases}
    # Hugging Face computes the angles in float32: fine at short positions, not at 2^20
    assert by["positions near 2^20"].status == "fail", str(r)
    assert "Float32 angles at long context" in diag(r), str(r)
    # ... and equals the float32 recipe everywhere (posenc's angles='float32')
    r32 = T.check_rope(fn, config=config_path(name), dtype="float32", angles="float32")
    assert r32.ok, str(r32)


def test_gptj_interleaved_partial_and_configs():
    gptj = pytest.importorskip("transformers.models.gptj.modeling_gptj")
    R = 16

    def fn(x, positions):  # GPT-J's own code: its sin/cos table, rotate_every_two, partial dims
        table = gptj.create_sinusoidal_positions(int(positions.max()) + 1, R)
        sin, cos = torch.split(table[positions[None]].to(x.dtype), R // 2, dim=-1)
        rot = gptj.apply_rotary_pos_emb(x[..., :R], sin, cos)
        return torch.cat([rot, x[..., R:]], dim=-1)
    short = ["prefill L=33", "odd sizes B=1 L=7 H=1", "non-contiguous x (a [B,H,L,D] view)"]
    r = T.check_rope(fn, head_dim=24, rotary_dim=R, style="interleaved", cases=short +
                     [n + " [bfloat16]" for n in short])
    assert all(c.status == "pass" for c in r.cases if c.dtype == "bfloat16"), str(r)
    r = T.check_rope(fn, head_dim=24, rotary_dim=R, style="half", dtype="float32", cases=short)
    assert not r.ok and "interleaved-style" in diag(r), str(r)
    with pytest.raises(ValueError, match="no RoPE"):
        T.check_rope(fn, config=config_path("t5-base"))
    with pytest.raises(ValueError, match="contradicts"):
        T.check_rope(fn, config=config_path("gpt-j-6b"), head_dim=64)


def test_inplace_function_and_dtype_names():
    def inplace(x, positions):
        y = rope_torch(x, positions)
        x.copy_(y)
        return x
    r = T.check_rope(inplace, head_dim=8, dtype=torch.float64)
    assert r.ok and {c.dtype for c in r.cases} == {"float64"}, str(r)
    r = T.check_rope(rope_torch, head_dim=8, dtype=[np.float32, "bf16"])
    assert r.ok and {c.dtype for c in r.cases} == {"float32", "bfloat16"}, str(r)


def test_docs_examples_run():
    import os
    import re
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "testing.md")
    with open(doc) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) == 3
    import contextlib
    import io
    out = io.StringIO()
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    cwd = os.getcwd()
    try:
        os.chdir(root)   # the page's paths are relative to the repository
        with contextlib.redirect_stdout(out):
            for i, code in enumerate(blocks):
                if i == 2:
                    pytest.importorskip("transformers")
                exec(compile(code, f"docs/testing.md (block {i})", "exec"), {})
    finally:
        os.chdir(cwd)
    assert "interleaved-style" in out.getvalue() and "status='fail'" in out.getvalue()


def test_bias_off_by_one():
    def alibi_plus1(q_len, k_len, heads):
        m = posenc.alibi_slopes(heads)
        pq = np.arange(q_len) + k_len - q_len + 1
        return -m[:, None, None] * np.abs(pq[:, None] - np.arange(k_len))[None]
    r = T.check_bias(alibi_plus1, "alibi", heads=6)
    assert not r.ok and "off by one" in diag(r) and "+ 1" in diag(r), str(r)
    tab = np.random.default_rng(1).standard_normal((32, 3))

    def t5_minus1(q_len, k_len, heads):
        pq = np.arange(q_len) + k_len - q_len - 1
        b = posenc.t5_bucket(np.arange(k_len)[None] - pq[:, None], bidirectional=False)
        return np.moveaxis(tab[b], -1, 0)
    for kw in ({"params": {"relative_attention_bias": tab}}, {"heads": 3}):
        r = T.check_bias(t5_minus1, "t5", causal=True, **kw)
        assert not r.ok and "off by one" in diag(r) and "- 1" in diag(r), str(r)


def test_cos_sin_cache_adapter_and_float32_attention():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    D = 32
    inv = 1.0 / (1e4 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = torch.arange(1 << 13, dtype=torch.float64)[:, None] * inv
    cache = (torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1))  # float64 cache
    fn = T.hf_rope(cache, llama.apply_rotary_pos_emb)
    r = T.check_rope(fn, head_dim=D, cases=["prefill L=33", "KV-cache decode: 1 token at 4097",
                                            "positions near 2^12"])
    assert r.ok, str(r)

    def f32_rope_attention(q, k, v, scheme, *, causal=False, query_positions=None,
                           key_positions=None, base=1e4):
        Lq, Lk = q.shape[1], k.shape[1]
        qp = np.arange(Lq) + Lk - Lq if query_positions is None else query_positions
        kp = np.arange(Lk) if key_positions is None else key_positions
        f = posenc.rope_frequencies(q.shape[-1], base=base, angles="float32")
        q = posenc.apply_rope(np.asarray(q, np.float32), f, positions=qp)
        k = posenc.apply_rope(np.asarray(k, np.float32), f, positions=kp)
        return posenc.attention(q, k, np.asarray(v, np.float32), causal=causal)
    r = T.check_attention(f32_rope_attention, "rope", base=1e4, dtype="float32", causal=True)
    by = {c.name: c for c in r.cases}
    assert by["positions near 2^20 causal"].status == "fail", str(r)
    assert "Float32 angles at long context" in diag(r), str(r)
    assert T.check_attention(f32_rope_attention, "rope", base=1e4, dtype="float32", causal=True,
                             angles="float32").ok


def test_wrong_layer_base_diagnosed():
    cfg = posenc.read_model_config(config_path("gemma-3-1b-it"))
    local = [la["index"] for la in cfg.layers if la["rope_theta"] == 1e4][0]
    glob = [la["index"] for la in cfg.layers if la["rope_theta"] == 1e6][0]

    def rope_of(layer):
        def fn(x, p):
            f = posenc.rope_frequencies(cfg, layer=layer, seq_len=int(p.max()) + 1)
            return posenc.apply_rope(np.asarray(x, np.float64), f, positions=p)
        return fn
    assert T.check_rope(rope_of(glob), config=cfg, layer=glob).ok
    r = T.check_rope(rope_of(local), config=cfg, layer=glob, dtype="float32")
    assert not r.ok and "base θ = 10000" in diag(r) and "another layer's RoPE" in diag(r), str(r)


def hf_deberta_attention(H, D, mrp, buckets):
    """Hugging Face's DebertaV2 DisentangledSelfAttention (its disentangled_attention_bias: c2p
    and p2c gathers) on given q, k, v and projected tables, in the canonical convention."""
    import math
    transformers = pytest.importorskip("transformers")
    dv2 = pytest.importorskip("transformers.models.deberta_v2.modeling_deberta_v2")
    cfg = transformers.DebertaV2Config(
        hidden_size=H * D, num_attention_heads=H, max_relative_positions=mrp,
        position_buckets=buckets, pos_att_type=["c2p", "p2c"], share_att_key=False,
        relative_attention=True, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    att = dv2.DisentangledSelfAttention(cfg).eval()

    def fn(q, k, v, scheme, *, params, max_relative_positions, position_buckets):
        B, Lq = q.shape[:2]
        k, v = (t.repeat_interleave(H // t.shape[2], 2) for t in (k, v))
        k2 = params["pos_key"].shape[0]
        rel = torch.eye(k2, H * D)  # rel_embeddings whose projections are the given tables
        with torch.no_grad():
            for proj, name in ((att.pos_key_proj, "pos_key"), (att.pos_query_proj, "pos_query")):
                w = torch.zeros(H * D, H * D)
                w[:, :k2] = params[name].reshape(k2, H * D).T
                proj.weight.copy_(w)
                proj.bias.zero_()
            ql, kl, vl = (t.permute(0, 2, 1, 3).reshape(B * H, t.shape[1], D) for t in (q, k, v))
            bias = att.disentangled_attention_bias(ql, kl, None, rel, 3)
            s = ql @ kl.transpose(-1, -2) / math.sqrt(3 * D) + bias
            out = torch.softmax(s, -1) @ vl
        return out.reshape(B, H, Lq, D).permute(0, 2, 1, 3)
    return fn


def test_hf_deberta_attention():
    rng = np.random.default_rng(0)
    H, D = 4, 16
    for mrp, pb in ((4, 0), (64, 8)):
        K = pb or mrp
        tabs = {n: (0.5 * rng.standard_normal((2 * K, H, D))).astype(np.float32)
                for n in ("pos_key", "pos_query")}
        r = T.check_attention(hf_deberta_attention(H, D, mrp, pb), "deberta", params=tabs,
                              max_relative_positions=mrp, position_buckets=pb, causal=False,
                              dtype="float32")
        by = {c.name: c for c in r.cases}
        assert by["MHA L=17"].status == "pass" and by["GQA 4:2 L=19"].status == "pass", str(r)
        # seq_q != seq_k: Hugging Face's gathers assume self-attention (they raise)
        assert by["decode 1 query over 37 keys"].status == "error", str(r)
        assert by["positions offset 1000"].status == "unsupported", str(r)


def test_explicit_bf16_on_a_numpy_function_fails():
    r = T.check_rope(lambda x, p: rope_np(x, p), head_dim=8, dtype="bfloat16")
    assert not r.ok and all(c.status in ("error", "unsupported") for c in r.cases), str(r)


def rope_positions_in_dtype(x, positions, base=1e4, f32_angles=False):
    """A RoPE whose position index is built in x's dtype (bf16 rounds 257 -> 256, 1001 -> 1000),
    with float64 angles or (f32_angles) Hugging Face's float32 angles as well."""
    D = x.shape[-1]
    if f32_angles:
        inv = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
        a = positions.to(x.dtype).float()[..., None] * inv
    else:
        inv = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        a = positions.to(x.dtype).to(torch.float64)[..., None] * inv
    a = a[None] if a.dim() == 2 else a
    c, s = (f(a)[:, :, None, :].to(x.dtype) for f in (torch.cos, torch.sin))
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def test_positions_in_the_inputs_dtype_are_diagnosed_as_such():
    # Only one of its failing cases looks like a shift (1001 -> 1000): not an off-by-one.
    r = T.check_rope(rope_positions_in_dtype, head_dim=16)
    assert not r.ok
    text = diag(r)
    assert "rounded to the input's dtype" in text, text
    assert "off by one" not in text, text


def test_each_matching_mistake_gets_its_sentence():
    # Positions in x's dtype and float32 angles: both sentences, neither hiding the other.
    r = T.check_rope(lambda x, p: rope_positions_in_dtype(x, p, f32_angles=True), head_dim=16)
    text = diag(r)
    assert "rounded to the input's dtype" in text and "Float32 angles at long context" in text, text
    assert "off by one" not in text, text
    # A real off-by-one is still named.
    r = T.check_rope(lambda x, p: rope_np(x, p, shift=1), head_dim=16, dtype="float32")
    assert "off by one" in diag(r) and "rounded to the input's dtype" not in diag(r)


# ---- attention mistakes real code makes ---------------------------------------------------------

def _attn_gqa_tiled(q, k, v, scheme=None, **kw):
    idx = torch.arange(q.shape[2]) % k.shape[2]  # .repeat() instead of .repeat_interleave()
    return pt.attention(q, k[:, :, idx], v[:, :, idx], scheme, **kw)


def _attn_top_left(q, k, v, scheme=None, causal=False, **kw):
    lq, lk = q.shape[1], k.shape[1]
    if causal and lq < lk:  # SDPA's is_causal rule
        m = torch.ones(lq, lk, dtype=torch.bool).tril()[None]
        extra = {"bidirectional": False} if scheme == "t5" else {}
        return pt.attention(q, k, v, scheme, mask=m, allow_fully_masked=True, **extra, **kw)
    return pt.attention(q, k, v, scheme, causal=causal, **kw)


@pytest.mark.parametrize("case", ["gqa tiled", "top-left rope", "top-left t5", "partial rotary",
                                  "full rotary", "scaling added", "scaling dropped"])
def test_attention_mistakes_of_real_code_are_diagnosed(case):
    t5 = {"params": {"relative_attention_bias":
                     np.random.default_rng(0).standard_normal((32, 6))}}
    fn, scheme, settings, expect = {
        "gqa tiled": (_attn_gqa_tiled, "rope", {}, "GQA heads are grouped in tiled order"),
        "top-left rope": (_attn_top_left, "rope", {}, "causal mask is aligned top-left"),
        "top-left t5": (_attn_top_left, "t5", t5, "causal mask is aligned top-left"),
        "partial rotary": (lambda q, k, v, s=None, **kw: pt.attention(q, k, v, s, rotary_dim=8,
                                                                      **kw),
                           "rope", {}, "Only part of the head dims is rotated (rotary_dim 8 of 16)"),
        "full rotary": (lambda q, k, v, s=None, rotary_dim=None, **kw: pt.attention(q, k, v, s,
                                                                                    **kw),
                        "rope", {"rotary_dim": 8}, "partial rotary (the dims past rotary_dim"),
        "scaling added": (lambda q, k, v, s=None, **kw: pt.attention(
            q, k, v, s, scaling={"rope_type": "linear", "factor": 4.0}, **kw), "rope", {},
            "A RoPE frequency scaling is applied where the settings give none"),
        "scaling dropped": (lambda q, k, v, s=None, scaling=None, **kw: pt.attention(q, k, v, s,
                                                                                    **kw),
                            "rope", {"scaling": {"rope_type": "linear", "factor": 2.0}},
                            "The RoPE frequency scaling (linear) is not applied"),
    }[case]
    r = T.check_attention(fn, scheme, dtype="float32", **settings)
    assert not r.ok
    text = diag(r)
    assert expect in text, text
    assert "No known mistake" not in text and "KV-cache position offset" not in text, text
    # The correct implementation with the same settings passes.
    assert T.check_attention(pt.attention, scheme, dtype="float32", **settings).ok
