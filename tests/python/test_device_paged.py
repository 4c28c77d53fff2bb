"""The CUDA forms of the paged cache's rope_append and of the op attention_half, run on CPU tensors.

posenc._device.rope_append is what torch.ops.posenc.rope_append runs on CUDA tensors: here it
writes copies of CPU pages and must leave them equal, to the last bit, to the pages the CPU
kernel writes (float32, bf16 and f16 pages, both layouts, default / explicit / offset positions,
partial and offset rotary dims, interleaved pairs, length-dependent scaling, a model config,
rows of different lengths, a row whose new tokens cross a page boundary), and refuse what the CPU
op refuses with the same error, writing nothing.

torch.ops.posenc.attention_half with the Triton backend (CUDA tensors, or backend='triton' on CPU
tensors through Triton's interpreter) runs posenc.triton's kernels on q, k, v of one half dtype:
here under TRITON_INTERPRET=1 against posenc's float64 reference (the half-precision tolerance of
tests/python/test_triton.py) and the CPU half kernel. Unless the variable is already set, those
cases run in a fresh process with it (test_attention_half_triton_in_a_fresh_process), so that the
rest of the pytest process keeps Triton's compiled mode. test_cuda.py runs both on a GPU.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import posenc  # noqa: E402
from posenc import _device, _ops  # noqa: E402

I32 = torch.int32
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CONFIGS = os.environ.get("POSENC_TEST_CONFIGS_DIR", "tests/configs")


# ---- rope_append --------------------------------------------------------------------------------

def _cache(layout, dtype, seed=0, num_pages=12, page_size=4, heads=2, dim=16):
    """Random pages of the layout (so that a write to a wrong slot shows), a block table with
    shuffled pages, unused entries -1 and page 3 shared by rows 0 and 1 (a common prefix: read
    only, both rows' new tokens lie beyond it), and the rows' lengths (which count the 5 new
    tokens of each row)."""
    g = torch.Generator().manual_seed(seed)
    shape = ((num_pages, page_size, heads, dim) if layout == "token_major"
             else (num_pages, heads, page_size, dim))
    k_pages = torch.randn(shape, generator=g).to(dtype)
    v_pages = torch.randn(shape, generator=g).to(dtype)
    table = torch.tensor([[3, 0, 7, -1], [3, 9, 10, -1], [11, 2, 5, 8]], dtype=I32)
    return k_pages, v_pages, table, torch.tensor([11, 9, 14], dtype=I32)


def _append_both(k_new, v_new, k_pages, v_pages, table, lens, ids=None, **kw):
    """(the CPU op's pages, the device form's pages): each writes its own copies. ids: the
    positions tensor; kw: the op's keywords (positions: an int offset)."""
    settings = _ops.typed("rope_append", kw, "rope_append")
    cpu = [k_pages.clone(), None if v_pages is None else v_pages.clone()]
    dev = [k_pages.clone(), None if v_pages is None else v_pages.clone()]
    _ops.rope_append_impl(k_new, v_new, cpu[0], cpu[1], table, lens, ids, **settings)
    _device.rope_append(k_new, v_new, dev[0], dev[1], table, lens, ids,
                        _ops._binding_kwargs("rope_append", settings))
    return cpu, dev


def _same_pages(cpu, dev, before):
    for a, b, old in zip(cpu, dev, before):
        if a is None:
            continue
        assert a.dtype == b.dtype == old.dtype
        # Bit for bit, and something was written.
        bits = torch.int32 if a.dtype == F32 else torch.int16
        assert torch.equal(a.view(bits), b.view(bits))
        assert not torch.equal(a, old)


SETTINGS = [
    {"base": 100.0},
    {"base": 100.0, "style": "interleaved"},
    {"rotary_dim": 8},                                   # rotary_dim < head_dim
    {"rotary_dim": 6, "offset": 4, "style": "interleaved"},  # DeepSeek's decoupled dims
    # Length-dependent scaling: its length is max(seq_lens) unless seq_len says otherwise.
    {"scaling": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4}},
    {"scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4},
     "seq_len": 64},
    {"freqs": posenc.RopeFrequencies(list(posenc.rope_frequencies(16, base=500.0).inv_freq),
                                     attention_factor=1.25)},
    {"positions": 1000},                                 # an int offset: 1000 + i in each row
]


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("dtype,new_dtype", [(F32, F32), (BF16, F32), (BF16, BF16), (F16, F32),
                                             (F16, F16)])
def test_rope_append_device_form_equals_the_cpu_op(layout, dtype, new_dtype):
    k_pages, v_pages, table, lens = _cache(layout, dtype)
    g = torch.Generator().manual_seed(1)
    # Rows of 11, 9 and 14 tokens, 5 new in each: row 0 writes cache indices 6..10 (pages 0 and
    # 7: across a page boundary), row 1 4..8 (pages 9 and 10), row 2 9..13 (pages 5 and 8).
    k_new = torch.randn(3, 5, 2, 16, generator=g).to(new_dtype)
    v_new = torch.randn(3, 5, 2, 16, generator=g).to(new_dtype)
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 3, 2, 70000, 1 << 40], [13, 12, 11, 10, 9]])
    for kw in SETTINGS:
        for positions in ((None, ids, ids[1]) if "positions" not in kw else (None,)):
            cpu, dev = _append_both(k_new, v_new, k_pages, v_pages, table, lens, positions,
                                    layout=layout, **kw)
            _same_pages(cpu, dev, (k_pages, v_pages))
    # Keys only (no values), and a model config (its frequencies and style; head_dim 128).
    cpu, dev = _append_both(k_new, None, k_pages, None, table, lens, ids, layout=layout,
                            base=100.0)
    _same_pages(cpu, dev, (k_pages,))
    kp, vp, table, lens = _cache(layout, dtype, dim=128)
    k_new = torch.randn(3, 5, 2, 128, generator=g).to(new_dtype)
    config = os.path.join(CONFIGS, "llama-2-7b-dynamic-2x.json")
    cpu, dev = _append_both(k_new, k_new, kp, vp, table, lens, None, layout=layout,
                            config=config)
    _same_pages(cpu, dev, (kp, vp))


def test_rope_append_device_form_writes_exactly_the_new_slots():
    """Every other element of the pages is left as it was; the new tokens' slots hold the
    rotated keys (posenc.torch.rope at the slots' positions, rounded to the pages' dtype) and
    the values."""
    k_pages, v_pages, table, lens = _cache("head_major", BF16)
    g = torch.Generator().manual_seed(2)
    k_new, v_new = torch.randn(3, 5, 2, 16, generator=g), torch.randn(3, 5, 2, 16, generator=g)
    kp, vp = k_pages.clone(), v_pages.clone()
    _device.rope_append(k_new, v_new, kp, vp, table, lens, None, {"layout": "head_major",
                                                                  "base": 100.0})
    written = torch.zeros(kp.shape, dtype=torch.bool)
    ids = (lens[:, None] - 5 + torch.arange(5)).long()
    rotated = _ops.rope_impl(k_new, ids, **_ops.typed("rope", {"base": 100.0, "seq_len": 14},
                                                      "rope"))
    for b in range(3):
        for i in range(5):
            j = int(ids[b, i])
            page, slot = int(table[b, j // 4]), j % 4
            written[page, :, slot] = True
            assert torch.equal(kp[page, :, slot], rotated[b, i].to(BF16))
            assert torch.equal(vp[page, :, slot], v_new[b, i].to(BF16))
    assert torch.equal(kp[~written], k_pages[~written])
    assert torch.equal(vp[~written], v_pages[~written])


def test_rope_append_device_form_rounds_as_the_cpu_kernel():
    """The CPU kernel rounds the float64 rotation to float32 and that to the pages' dtype: a key
    whose float64 rotation lies just above a bf16 / f16 tie but rounds to the tie in float32 ends
    on the even neighbour, as the CPU kernel leaves it (a single rounding from float64 would
    give the other one)."""
    # Position 0: the rotation is the attention factor f; x * f = x + 2^-30 x.
    freqs = posenc.RopeFrequencies([1.0, 0.01], attention_factor=1 + 2.0 ** -30)
    for dtype, x in ((BF16, 1 + 2.0 ** -8), (F16, 1 + 2.0 ** -11)):
        k_new = torch.full((1, 1, 1, 4), x)
        k_pages = torch.zeros(1, 2, 1, 4, dtype=dtype)
        cpu, dev = _append_both(k_new, None, k_pages, None, torch.tensor([[0]], dtype=I32),
                                torch.tensor([1], dtype=I32), torch.tensor([0]), freqs=freqs)
        assert torch.equal(cpu[0], dev[0]) and cpu[0][0, 0, 0, 0].item() == 1.0, dtype


def _refusals():
    """(name, call arguments) of calls the CPU op refuses, one fault each."""
    k_pages, v_pages, table, lens = _cache("token_major", F32, dim=8)
    g = torch.Generator().manual_seed(3)
    kn = torch.randn(3, 5, 2, 8, generator=g)
    base = dict(k_new=kn, v_new=kn, k_pages=k_pages, v_pages=v_pages, table=table, lens=lens,
                positions=None, kw={})

    def case(name, **change):
        kw = change.pop("kw", {})
        return name, dict(base, **change, kw=dict(base["kw"], **kw))

    head_major = torch.randn(12, 2, 4, 8, generator=g)
    return [
        case("values without pages", v_pages=None),
        case("float64 pages", k_pages=k_pages.double(), v_pages=v_pages.double()),
        case("pages of two dtypes", v_pages=v_pages.bfloat16()),
        case("float64 keys", k_new=kn.double(), v_new=kn.double()),
        case("f16 keys, bf16 pages", k_new=kn.half(), v_new=kn.half(),
             k_pages=k_pages.bfloat16(), v_pages=v_pages.bfloat16()),
        case("keys and values of two dtypes", v_new=kn.bfloat16(), k_pages=k_pages.bfloat16(),
             v_pages=v_pages.bfloat16()),
        case("pages of 3 dimensions", k_pages=k_pages[0], v_pages=v_pages[0]),
        case("strided last dimension", k_pages=k_pages.transpose(1, 3)),
        case("keys of 3 dimensions", k_new=kn[0], v_new=kn[0]),
        case("float block table", table=table.float()),
        case("bool block table", table=table.bool()),
        case("block table beyond int32", table=table.long() + (1 << 32)),
        case("block table of 1 dimension", table=table[0]),
        case("seq_lens of 2 dimensions", lens=lens[None]),
        case("block table rows", table=table[:2]),
        case("seq_lens rows", lens=lens[:2]),
        case("negative length", lens=torch.tensor([11, -1, 14], dtype=I32)),
        case("length beyond the row's pages", lens=torch.tensor([11, 9, 17], dtype=I32)),
        case("length below the new tokens", lens=torch.tensor([11, 4, 14], dtype=I32)),
        case("page index beyond the pool", table=torch.tensor([[3, 0, 12, -1], [3, 9, 10, -1],
                                                               [11, 2, 5, 8]], dtype=I32)),
        case("negative page index in use",
             table=torch.tensor([[3, 0, 7, -1], [3, 9, 10, -1], [11, 2, 5, -1]], dtype=I32)),
        case("heads of the keys", k_new=kn[:, :, :1], v_new=kn[:, :, :1]),
        case("head_dim of the keys", k_new=kn[..., :4], v_new=kn[..., :4]),
        case("values' shape", v_new=kn[:, :4]),
        case("pools' shapes", v_pages=v_pages[:5]),
        case("head-major pools' shapes", k_pages=head_major, v_pages=head_major[:, :, :2],
             kw={"layout": "head_major"}),
        case("no heads", k_new=kn[:, :, :0], v_new=kn[:, :, :0], k_pages=k_pages[:, :, :0],
             v_pages=v_pages[:, :, :0]),
        case("positions of another length", positions=torch.tensor([1, 2, 3])),
        case("positions of other rows", positions=torch.zeros(2, 5, dtype=torch.long)),
        case("positions of one row for three", positions=torch.zeros(1, 5, dtype=torch.long)),
        case("positions of 3 dimensions", positions=torch.zeros(3, 5, 1, dtype=torch.long)),
        case("float positions", positions=torch.zeros(5)),
        case("a negative position", positions=torch.tensor([[0, 1, 2, 3, 4], [0, 1, -2, 3, 4],
                                                            [0, 1, 2, 3, 4]])),
        case("a position beyond 2^48", positions=torch.tensor([0, 1, (1 << 48) + 1, 3, 4])),
        case("an offset beyond 2^48", kw={"positions": (1 << 48) - 2}),
        case("a negative offset", kw={"positions": -1}),
        case("ids and an offset", positions=torch.arange(5), kw={"positions": 3}),
        case("rotary_dim beyond head_dim", kw={"rotary_dim": 10}),
        case("an odd rotary_dim", kw={"rotary_dim": 5}),
        case("offset + rotary_dim beyond head_dim", kw={"offset": 2}),
        case("a negative rope offset", kw={"offset": -1}),
        case("frequencies of a wider head", kw={"freqs": posenc.rope_frequencies(16)}),
        case("an unknown style", kw={"style": "pairs"}),
        case("an unknown layout", kw={"layout": "page_major"}),
        case("unknown angles", kw={"angles": "fast"}),
        case("a negative base", kw={"base": -1.0}),
        case("an infinite base", kw={"base": float("inf")}),
        case("a negative rotary_dim", kw={"rotary_dim": -2}),
        case("a negative seq_len", kw={"seq_len": -1}),
        case("negative threads", kw={"num_threads": -1}),
    ]


@pytest.mark.parametrize("name,call", _refusals(), ids=[n for n, _ in _refusals()])
def test_rope_append_device_form_refuses_what_the_cpu_op_refuses(name, call):
    """The same error (type and message) as the CPU op, and nothing written by either."""
    settings = _ops.typed("rope_append", call["kw"], "rope_append")
    args = [call[n] for n in ("k_new", "v_new", "k_pages", "v_pages", "table", "lens",
                              "positions")]
    pools = [t for t in (call["k_pages"], call["v_pages"]) if t is not None]
    before = [t.clone() for t in pools]
    with pytest.raises(Exception) as cpu:
        _ops.rope_append_impl(*args, **settings)
    assert all(torch.equal(t, b) for t, b in zip(pools, before)), name
    with pytest.raises(type(cpu.value), match=f"^{re.escape(str(cpu.value))}$"):
        _device.rope_append(*args, _ops._binding_kwargs("rope_append", settings))
    assert all(torch.equal(t, b) for t, b in zip(pools, before)), name


def test_rope_append_dispatch(monkeypatch):
    """The op sends CUDA tensors to posenc._device's form and CPU tensors to the CPU kernel:
    with the test's CPU tensors taken for CUDA ones, torch.ops.posenc.rope_append writes the
    device form's pages (the CPU kernel's bits); refused calls leave them unchanged."""
    k_pages, v_pages, table, lens = _cache("head_major", F16)
    kn = torch.randn(3, 5, 2, 16, generator=torch.Generator().manual_seed(4))
    want_k, want_v = k_pages.clone(), v_pages.clone()
    torch.ops.posenc.rope_append(kn, kn, want_k, want_v, table, lens, layout="head_major",
                                 base=100.0)
    calls = []
    real = _device.rope_append

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(_device, "rope_append", spy)
    kp, vp = k_pages.clone(), v_pages.clone()
    torch.ops.posenc.rope_append(kn, kn, kp, vp, table, lens, layout="head_major", base=100.0)
    assert not calls  # CPU tensors: the CPU kernel
    monkeypatch.setattr(_ops, "device_path", lambda t: isinstance(t, torch.Tensor))
    for call in (lambda: torch.ops.posenc.rope_append(kn, kn, kp, vp, table, lens,
                                                      layout="head_major", base=100.0),
                 lambda: _ops.call_rope_append(kn, kn, kp, vp, table, lens, None,
                                               {"layout": "head_major", "base": 100.0})):
        kp.copy_(k_pages)
        vp.copy_(v_pages)
        call()
        assert torch.equal(kp, want_k) and torch.equal(vp, want_v)
    assert len(calls) == 2
    kp.copy_(k_pages)
    with pytest.raises(posenc.InvalidValueError, match=r"block_table\[1\]\[1\] = 12"):
        torch.ops.posenc.rope_append(kn, None, kp, None, torch.tensor(
            [[3, 0, 7], [3, 12, 0], [11, 2, 5]], dtype=I32), lens, layout="head_major")
    assert torch.equal(kp, k_pages)


def test_rope_append_refuses_keys_and_values_of_two_dtypes_on_the_cpu():
    """float32 keys with half values (or the reverse): the CPU kernel would read the half
    values' bits as numbers; both forms refuse the call."""
    k_pages, v_pages, table, lens = _cache("token_major", BF16)
    kn = torch.randn(3, 5, 2, 16)
    before = v_pages.clone()
    with pytest.raises(TypeError, match="k_new and v_new must share one dtype"):
        torch.ops.posenc.rope_append(kn, kn.bfloat16(), k_pages, v_pages, table, lens)
    assert torch.equal(v_pages, before)


# ---- attention_half on the Triton kernels -------------------------------------------------------

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
triton_case = pytest.mark.skipif(not INTERPRETED, reason="TRITON_INTERPRET=1 is not set: the "
                                 "cases run in test_attention_half_triton_in_a_fresh_process")


@pytest.mark.skipif(INTERPRETED, reason="the cases run in this process")
def test_attention_half_triton_in_a_fresh_process():
    """This file's attention_half_triton cases, in a new Python process with TRITON_INTERPRET=1
    (set before triton's first import, for that process only)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.abspath(__file__), "-k", "attention_half_triton"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-6000:] + r.stderr[-2000:]


def _ulp(ref, dtype):
    _, e = np.frexp(np.abs(ref))
    if dtype == F16:
        return np.exp2(np.maximum(e - 11, -24).astype(np.float64))
    return np.exp2((e - 8).astype(np.float64))


def _half_case(scheme, dtype, *, shape=(2, 5, 13, 4, 2, 16), tables=None, seed=0, **kw):
    """torch.ops.posenc.attention_half with backend='triton' on q, k, v of one half dtype against
    posenc's float64 reference (half an ulp of the dtype plus 2e-5 (1 + |value|), the rule of
    test_triton.py for half results) and the CPU half kernel (one ulp plus that bound)."""
    batch, seq_q, seq_k, heads_q, heads_kv, dim = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_q, heads_q, dim, generator=g).to(dtype)
    k = torch.randn(batch, seq_k, heads_kv, dim, generator=g).to(dtype)
    v = torch.randn(batch, seq_k, heads_kv, dim, generator=g).to(dtype)
    tables = tables or {}
    names, tensors = list(tables), [torch.as_tensor(t, dtype=F32) for t in tables.values()]
    qpos = kw.pop("query_positions", None)
    settings = _ops.typed("attention_half", dict(kw, scheme=scheme, backend="triton"),
                          "attention_half")
    if qpos is not None:
        kw["query_positions"] = qpos
        qpos = torch.as_tensor(qpos)
    out = torch.ops.posenc.attention_half(q, k, v, tensors, names, qpos, **settings)
    assert out.dtype == dtype and out.shape == q.shape
    ref = posenc.ref.attention(*(t.double().numpy() for t in (q, k, v)), scheme,
                               params={n: t.double().numpy() for n, t in zip(names, tensors)}
                               or None, **kw)
    got = out.double().numpy()
    tol = 2e-5 * (1 + np.abs(ref)) + 0.5 * _ulp(ref, dtype)
    assert np.all(np.abs(got - ref) <= tol), float(np.max(np.abs(got - ref) / tol))
    cpu = torch.ops.posenc.attention_half(q, k, v, tensors, names, qpos,
                                          **dict(settings, backend="cpu"))
    assert cpu.dtype == dtype
    assert np.all(np.abs(got - cpu.double().numpy()) <= tol + 0.5 * _ulp(ref, dtype))
    return out


@triton_case
def test_attention_half_triton_rope_causal_gqa():
    _half_case("rope", BF16, causal=True, base=500.0)
    _half_case("rope", F16, causal=True, rotary_dim=8, style="interleaved", seed=1)


@triton_case
def test_attention_half_triton_alibi_causal_window():
    _half_case("alibi", F16, causal=True, window=6, seed=2)
    _half_case("alibi", BF16, shape=(1, 7, 7, 4, 1, 16), seed=3,  # MQA, given slopes
               tables={"slopes": [0.5, 0.25, 0.125, 0.0625]}, causal=True)


@triton_case
def test_attention_half_triton_none_and_t5_explicit_positions():
    _half_case("none", BF16, shape=(1, 9, 9, 2, 2, 32), causal=True, seed=4)
    _half_case("t5", F16, tables={"relative_attention_bias": np.random.default_rng(5)
                                  .standard_normal((32, 4))},
               scale=1.0, query_positions=np.array([3, 9, 10, 11, 20]), seed=5)


@triton_case
def test_attention_half_triton_errors_and_fake():
    q = torch.randn(1, 4, 2, 16)
    k = torch.randn(1, 6, 2, 16)
    ops = torch.ops.posenc
    # float32 q with half k and v: the CPU's mixed kernel; the Triton kernels take one dtype.
    with pytest.raises(TypeError, match="the Triton kernels take q, k and v of one dtype"):
        ops.attention_half(q, k.bfloat16(), k.bfloat16(), [], [], backend="triton")
    assert ops.attention_half(q, k.bfloat16(), k.bfloat16(), [], []).dtype == F32  # CPU mixed
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        ops.attention_half(q, k, k, [], [], backend="triton")
    with pytest.raises(TypeError, match="must be torch.float16 or torch.float32"):
        ops.attention_half(q.bfloat16(), k.half(), k.half(), [], [], backend="triton")
    with pytest.raises(ValueError, match="backend: 'auto', 'cpu' or 'triton'"):
        ops.attention_half(q.half(), k.half(), k.half(), [], [], backend="gpu")
    # The fake function agrees: out of q's half dtype; the same refusal.
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fq, fk = mode.from_tensor(q), mode.from_tensor(k)
        out = ops.attention_half(fq.half(), fk.half(), fk.half(), [], [], backend="triton")
        assert out.dtype == F16 and tuple(out.shape) == (1, 4, 2, 16)
        with pytest.raises(TypeError, match="one dtype"):
            ops.attention_half(fq, fk.half(), fk.half(), [], [], backend="triton")
    # Under torch.compile (the fake function's dtype and shape), the same numbers.
    qh, kh = q.half(), k.half()
    settings = {"scheme": "alibi", "causal": True, "backend": "triton"}
    compiled = torch.compile(lambda *t: ops.attention_half(*t, [], [], **settings),
                             backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(qh, kh, kh), ops.attention_half(qh, kh, kh, [], [], **settings))
    # posenc.torch.attention with half tensors and backend='cpu' reaches the CPU half kernel.
    import posenc.torch as pt
    assert pt.attention(q.half(), k.half(), k.half(), backend="cpu").dtype == F16
    torch.library.opcheck(ops.attention_half.default, (q.half(), k.half(), k.half(), [], []),
                          {"scheme": "alibi", "causal": True, "backend": "triton"})
