"""posenc.torch.flex: posenc's schemes on FlexAttention, on the CPU, against posenc's kernels.

Each case runs the same call three ways: posenc.torch.attention on float64 tensors (the float64
oracle, forward and backward), posenc.torch.attention on float32 tensors (the fused kernel and
its fused backward) and posenc.torch.flex.attention on float32 tensors (eager flex_attention,
forward and backward; two cases through torch.compile'd flex_attention, forward only: on the
CPU the compiled kernel has no backward).

Tolerance (STYLE.md, tests/python/conftest.py tol32), tensor by tensor, out and every gradient:
max |flex - oracle| <= 2 max |fused32 - oracle| + 2e-6 max(1, max |oracle|): FlexAttention may
be at most twice as far from the exact result as posenc's float32 kernel, plus a few float32
ulps of the largest value (FlexAttention sums the scheme's terms in another order). Masks and
bucket indices are exact, so a wrong position, bucket or mask would show as an O(1) error.
"""

import warnings
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
fa = pytest.importorskip("torch.nn.attention.flex_attention")
import posenc.torch as pt  # noqa: E402
from conftest import maxerr, tol32  # noqa: E402

fx = pt.flex
warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def _rng(name):
    return np.random.default_rng(zlib.crc32(name.encode()))


def _tensor(rng, *shape, scale=1.0):
    return torch.from_numpy(rng.standard_normal(shape) * scale)


class Problem:
    """q, k, v (float64), tables, keywords; runs the three implementations."""

    def __init__(self, name, scheme, *, B=2, Lq=13, Lk=21, Hq=4, Hk=2, D=16, Dv=None,
                 params=None, **kw):
        rng = _rng(name)
        self.scheme, self.kw = scheme, kw
        self.q = _tensor(rng, B, Lq, Hq, D)
        self.k = _tensor(rng, B, Lk, Hk, D)
        self.v = _tensor(rng, B, Lk, Hk, Dv or D)
        self.params = {n: f(rng) for n, f in (params or {}).items()}
        self.dout_rng = rng

    def run(self, fn, dtype, grad, device="cpu"):
        def leaf(x):
            return x.to(dtype).to(device).detach().requires_grad_(grad)
        q, k, v = (leaf(x) for x in (self.q, self.k, self.v))
        params = {n: leaf(t) for n, t in self.params.items()}
        out = fn(q, k, v, self.scheme, params=params or None, **self.kw)
        res = {"out": out.detach()}
        if grad:
            (out * self.dout.to(out.dtype).to(device)).sum().backward()
            res.update(dq=q.grad, dk=k.grad, dv=v.grad)
            res.update({"d" + n: t.grad for n, t in params.items()})
        return {n: t.detach().cpu().double().numpy() for n, t in res.items()}

    def check(self, grad, flex_kw=None, device="cpu", dtype=torch.float32, report=False):
        """Compares flex (on device, in dtype) with the oracle; returns [(tensor, err, tol)].

        dtype torch.bfloat16 (scripts/flex_gpu.py): the inputs are rounded to bf16 first, the
        oracle runs on the rounded values, the yardstick is posenc's bf16 result (float32
        arithmetic rounded once to bf16) and the tolerance 2 max |posenc_bf16 - oracle| +
        2^-6 max(1, max |oracle|): FlexAttention also rounds the probabilities to bf16 before
        P·V (a relative 2^-9 each) and its backward works on bf16 operands; 2^-6 is four bf16
        ulps (2^-8) of the largest value."""
        if grad:
            shape = self.q.shape[:3] + self.v.shape[3:]
            self.dout = torch.from_numpy(self.dout_rng.standard_normal(tuple(shape)))
        if dtype == torch.bfloat16:
            for name in ("q", "k", "v"):
                setattr(self, name, getattr(self, name).bfloat16().double())
            self.params = {n: t.bfloat16().double() for n, t in self.params.items()}
            if grad:
                self.dout = self.dout.bfloat16().double()
        ref = self.run(pt.attention, torch.float64, grad)
        fused = self.run(pt.attention, dtype, grad)

        def flex(*a, **kw):
            return fx.attention(*a, **kw, **(flex_kw or {}))
        got = self.run(flex, dtype, grad, device)
        assert set(got) == set(ref)
        rows = []
        for n in ref:
            err = maxerr(got[n], ref[n])
            if dtype == torch.bfloat16:
                tol = 2 * maxerr(fused[n], ref[n]) + 2.0 ** -6 * max(1.0, float(np.abs(
                    ref[n]).max()))
            else:
                tol = tol32(ref[n], fused[n])
            rows.append((n, err, tol))
            assert report or err <= tol, f"{n}: max error {err:.3g} > tolerance {tol:.3g}"
        return rows


def _t5(nb, h):
    return lambda rng: _tensor(rng, nb, h)


def _pos_rows(B, L, start, gap):
    """Per-row ids with a gap (non-contiguous positions, as a KV cache that dropped tokens)."""
    ids = np.stack([np.arange(L) + start + 7 * b for b in range(B)])
    ids[:, L // 2:] += gap
    return torch.from_numpy(ids)


# Two rows of 21 tokens in three documents each (packed sequences; positions continue).
_DOCS = np.stack([np.repeat([0, 1, 2], [7, 7, 7]), np.repeat([0, 1, 2], [5, 5, 11])]).astype(
    np.int32)

# (name, scheme, problem keywords): every scheme with its tables, masks, positions and GQA
FORWARD_AND_BACKWARD = [
    ("none-bidir-mha", "none", dict(Hk=4)),
    ("none-causal-mqa-lq1", "none", dict(Lq=1, Hk=1, causal=True)),
    ("none-causal-window-chunk", "none", dict(causal=True, window=5, chunk=6)),
    ("rope-causal-gqa", "rope", dict(causal=True, base=500.0)),
    ("rope-interleaved-partial-positions", "rope",
     dict(Hk=4, style="interleaved", rotary_dim=8,
          query_positions=_pos_rows(2, 13, 30, 100), key_positions=_pos_rows(2, 21, 22, 100),
          causal=True)),
    ("rope-dynamic-scaling", "rope",
     dict(causal=True, scaling={"rope_type": "dynamic", "factor": 2.0,
                                "original_max_position_embeddings": 8})),
    ("alibi-12-heads-causal-window", "alibi", dict(Hq=12, Hk=4, causal=True, window=9)),
    ("alibi-bidir-max-bias", "alibi", dict(Hq=6, Hk=3, max_bias=4.0)),
    ("alibi-learned-slopes", "alibi",
     dict(causal=True, params={"slopes": lambda rng: torch.from_numpy(rng.uniform(0.1, 1, 4))})),
    ("t5-bidir", "t5", dict(params={"relative_attention_bias": _t5(32, 4)}, scale=1.0,
                            max_distance=12)),
    ("t5-causal-chunk-softcap", "t5",
     dict(params={"relative_attention_bias": _t5(16, 4)}, causal=True, chunk=8, softcap=3.0,
          max_distance=20)),
    ("t5-causal-buckets-bidir-positions", "t5",
     dict(params={"relative_attention_bias": _t5(8, 4)}, bidirectional=True, causal=True,
          max_distance=9, query_positions=torch.arange(13) * 3 + 40,
          key_positions=torch.arange(21) * 3)),
    ("shaw-shared-causal", "shaw",
     dict(params={"rel_k": lambda rng: _tensor(rng, 9, 16)}, causal=True)),
    ("shaw-per-head-positions", "shaw",
     dict(params={"rel_k": lambda rng: _tensor(rng, 7, 4, 16)},
          query_positions=_pos_rows(2, 13, 5, 3), key_positions=_pos_rows(2, 21, 0, 3))),
    ("deberta-plain", "deberta",
     dict(params={"pos_key": lambda rng: _tensor(rng, 12, 4, 16),
                  "pos_query": lambda rng: _tensor(rng, 12, 4, 16)},
          max_relative_positions=6)),
    ("deberta-buckets-paper-causal", "deberta",
     dict(params={"pos_key": lambda rng: _tensor(rng, 8, 4, 16),
                  "pos_query": lambda rng: _tensor(rng, 8, 4, 16)},
          max_relative_positions=40, position_buckets=4, deberta_p2c="paper", causal=True,
          key_positions=torch.arange(21) * 2, query_positions=torch.arange(13) * 3)),
    ("sinks-window-fully-masked", "alibi",
     dict(params={"sinks": lambda rng: _tensor(rng, 4)}, causal=True, window=2,
          query_positions=torch.arange(13) + 30, key_positions=torch.arange(21) * 4)),
    ("sinks-t5-gqa", "t5",
     dict(Hq=8, params={"sinks": lambda rng: _tensor(rng, 8),
                        "relative_attention_bias": _t5(32, 8)})),
    ("block-masks", "alibi",
     dict(B=2, Lq=21, causal=True, query_documents=_DOCS, key_documents=_DOCS,
          prefix=np.array([3, 2, 4]), global_positions=[10])),
    ("dense-mask-vdim", "t5",
     dict(Dv=8, params={"relative_attention_bias": _t5(32, 4)},
          mask=torch.from_numpy(_rng("mask").random((1, 13, 21)) < 0.7), allow_fully_masked=True)),
]


@pytest.mark.parametrize("name,scheme,kw", FORWARD_AND_BACKWARD, ids=[c[0] for c in
                                                                       FORWARD_AND_BACKWARD])
def test_forward_and_backward_match_posenc(name, scheme, kw):
    Problem(name, scheme, **kw).check(grad=True)


def test_packed_sequences():
    rng = _rng("packed")
    cu = torch.tensor([0, 5, 6, 13])
    q, k, v = (_tensor(rng, 13, 4, 16) for _ in range(3))
    table = _tensor(rng, 32, 4)
    kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    ref, ref_lse = pt.attention(q, k, v, "t5", params={"relative_attention_bias": table},
                                return_lse=True, **kw)
    f32 = [x.float() for x in (q, k, v)]
    fused = pt.attention(*f32, "t5", params={"relative_attention_bias": table.float()}, **kw)
    out, lse = fx.attention(*f32, "t5", params={"relative_attention_bias": table.float()},
                            return_lse=True, **kw)
    assert out.shape == (13, 4, 16) and lse.shape == (4, 13)
    assert maxerr(out, ref) <= tol32(ref.numpy(), fused)
    assert maxerr(lse, ref_lse) <= 2e-6 * max(1.0, float(ref_lse.abs().max()))


def test_lse_matches_posenc():
    p = Problem("lse", "shaw", params={"rel_k": lambda rng: _tensor(rng, 5, 16)}, causal=True)
    q, k, v = (x.float() for x in (p.q, p.k, p.v))
    params = {"rel_k": p.params["rel_k"].float()}
    _, ref = pt.attention(p.q, p.k, p.v, "shaw", params=p.params, causal=True, return_lse=True)
    out, lse = fx.attention(q, k, v, "shaw", params=params, causal=True, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 13)
    # lse is a log of a sum of float32 exponentials: float32 rounding of values of size |lse|
    assert maxerr(lse, ref) <= 4e-6 * max(1.0, float(ref.abs().max()))


# Compiled flex_attention (torch.compile on the CPU: inference only). One case, because each
# compilation takes tens of seconds here; it holds everything that reaches the score_mod through
# captured tensors (per-row DeBERTa tables, the bucket map, per-row positions, the soft-cap) and
# a mask that differs between batch rows, with GQA.
COMPILED = [
    ("compiled-deberta-buckets-positions-softcap", "deberta",
     dict(params={"pos_key": lambda rng: _tensor(rng, 16, 4, 16),
                  "pos_query": lambda rng: _tensor(rng, 16, 4, 16)},
          max_relative_positions=64, position_buckets=8, causal=True, window=11, softcap=2.0,
          query_positions=_pos_rows(2, 13, 30, 9), key_positions=_pos_rows(2, 21, 20, 9))),
]


@pytest.mark.parametrize("name,scheme,kw", COMPILED, ids=[c[0] for c in COMPILED])
def test_compiled_forward_matches_posenc(name, scheme, kw):
    Problem(name, scheme, **kw).check(grad=False, flex_kw={"compile": True})


def test_user_calls_flex_attention_with_score_mod_and_block_mask():
    """score_mod and block_mask for a caller of flex_attention, in its [B, H, L, D] layout."""
    rng = _rng("user")
    q, k, v = (_tensor(rng, 2, 4, 11, 8).float() for _ in range(3))
    pos_key, pos_query = (_tensor(rng, 8, 4, 8).float() for _ in range(2))
    params = {"pos_key": pos_key, "pos_query": pos_query}
    mod = fx.score_mod("deberta", q, k, layout="bhld", params=params, max_relative_positions=4)
    bm = fx.block_mask(11, 11, causal=True, window=4)
    out = fa.flex_attention(q, k, v, score_mod=mod, block_mask=bm, scale=mod.scale)
    want = pt.attention(*(x.transpose(1, 2) for x in (q, k, v)), "deberta", params=params,
                        max_relative_positions=4, causal=True, window=4)
    assert maxerr(out.transpose(1, 2), want) <= 5e-6
    # apply_sinks on the caller's result equals posenc's sinks
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    mod = fx.score_mod("alibi", heads=4, q_len=11, k_len=11, scale=0.3)
    o, aux = fa.flex_attention(q, k, v, score_mod=mod, block_mask=bm, scale=mod.scale,
                               return_aux=fa.AuxRequest(lse=True))
    o, lse = fx.apply_sinks(o, aux.lse, sinks)
    want, want_lse = pt.attention(*(x.transpose(1, 2) for x in (q, k, v)), "alibi",
                                  params={"sinks": sinks}, causal=True, window=4, scale=0.3,
                                  return_lse=True)
    assert maxerr(o.transpose(1, 2), want) <= 5e-6 and maxerr(lse, want_lse) <= 5e-6


def test_refused_schemes_name_posencs_kernel():
    q = torch.randn(1, 4, 2, 8)
    xl = {"r_w_bias": torch.zeros(2, 8), "r_r_bias": torch.zeros(2, 8),
          "r_net": torch.zeros(16, 8)}
    for scheme, params in (("xl", xl), ("shaw", {"rel_k": torch.zeros(3, 8),
                                                 "rel_v": torch.zeros(3, 8)})):
        for call in (lambda: fx.attention(q, q, q, scheme, params=params),
                     lambda: fx.score_mod(scheme, q, q, params=params)):
            with pytest.raises(fx.UnsupportedScheme, match=r"posenc\.torch\.attention"):
                call()
    assert issubclass(fx.UnsupportedScheme, ValueError)
    assert issubclass(fx.UnsupportedScheme, NotImplementedError)


def test_errors():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="query 0 of batch row 0"):
        fx.attention(q, q, q, causal=True, query_positions=[0, 1, 2, 3],
                     key_positions=[5, 6, 7, 8])
    out = fx.attention(q, q, q, causal=True, query_positions=[0, 1, 2, 3],
                       key_positions=[5, 6, 7, 8], allow_fully_masked=True)
    assert torch.equal(out, torch.zeros_like(out))
    bad = q.clone()
    bad[0, 2, 1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"k: non-finite value nan at \[0, 2, 1, 3\]"):
        fx.attention(q, bad, q, causal=True)
    with pytest.raises(TypeError, match="another scheme"):
        fx.attention(q, q, q, "alibi", num_buckets=32)
    with pytest.raises(TypeError, match="unexpected keyword"):
        fx.attention(q, q, q, casual=True)
    with pytest.raises(ValueError, match="kv heads"):
        fx.attention(q, torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8))
    with pytest.raises(ValueError, match="relative_attention_bias"):
        fx.attention(q, q, q, "t5", params={"relative_attention_bias": torch.zeros(32, 3)})
    with pytest.raises(ValueError, match="rel_k"):
        fx.attention(q, q, q, "shaw", params={"rel_k": torch.zeros(4, 8)})
    with pytest.raises(ValueError, match="pos_key"):
        fx.attention(q, q, q, "deberta", params={"pos_key": torch.zeros(8, 2, 8),
                                                 "pos_query": torch.zeros(8, 2, 8)})
    with pytest.raises(ValueError, match="not a table"):
        fx.attention(q, q, q, "none", params={"slopes": torch.zeros(2)})
    with pytest.raises(ValueError, match="window"):
        fx.attention(q, q, q, window=0)
    with pytest.raises(ValueError, match="seq_q"):
        fx.attention(torch.randn(1, 5, 2, 8), q, q)
    with pytest.raises(ValueError, match="outside"):
        fx.attention(q, q, q, key_positions=[0, 1, 2, -1])
    with pytest.raises(ValueError, match="sinks"):
        fx.attention(q, q, q, params={"sinks": torch.zeros(3)})
    with pytest.raises(ValueError, match="posenc.torch.rope"):
        fx.score_mod("rope", q, q)
    with pytest.raises(NotImplementedError, match="compile=False"):
        fx.attention(q, q, q, params={"sinks": torch.zeros(2)}, compile=True)


@pytest.mark.parametrize("kw", [
    dict(style="half", base=1e4),
    dict(style="interleaved", rotary_dim=6, base=500.0),
    dict(style="half", scaling={"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 8}),
], ids=["half", "interleaved-partial", "yarn"])
def test_rope_off_the_cpu_equals_posencs_rope(kw):
    """The rotation used for tensors on other devices (GPUs: posenc's op is CPU-only), run here
    on CPU tensors, against posenc.torch.rope: float64 angles, cos/sin rounded to float32, so
    it differs from posenc's kernel by the float32 roundings of the rotation: at most 4 ulps
    (2^-23 each) of max |x|."""
    from posenc.torch.flex import _Pos, _rope_torch
    x = torch.randn(2, 9, 3, 16)
    ids = torch.tensor([[0, 1, 2, 3, 9, 10, 11, 100000, 1 << 20],
                        [5, 6, 7, 8, 9, 10, 11, 12, 13]])
    for pos, positions in ((_Pos(ids=ids), ids), (_Pos(offset=1000), 1000)):
        want = pt.rope(x, positions=positions, seq_len=(1 << 20) + 1, **kw)
        got = _rope_torch(x, pos, kw, (1 << 20) + 1)
        assert maxerr(got, want) <= 4 * 2.0 ** -23 * float(x.abs().max())


def test_empty_problems():
    q = torch.randn(1, 3, 2, 8)
    empty = torch.randn(1, 0, 2, 8)
    out = fx.attention(empty, q, q, causal=True)
    assert out.shape == (1, 0, 2, 8)
    with pytest.raises(ValueError, match="sees no key"):
        fx.attention(q, empty, empty, query_positions=[0, 1, 2])
    out, lse = fx.attention(q, empty, empty, query_positions=[0, 1, 2], return_lse=True,
                            params={"sinks": torch.tensor([0.5, 1.0])})
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.tensor([0.5, 1.0])[None, :, None].expand(1, 2, 3))


def test_compiled_cpu_has_no_backward():
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="compile=False"):
        fx.attention(q, q, q, compile=True)
    with torch.no_grad():  # inputs that require grad, but no graph: FlexAttention's CPU path runs
        assert maxerr(fx.attention(q, q, q, causal=True), pt.attention(q, q, q, causal=True)) \
            <= 1e-6


def test_docs_examples_run():
    """The Python blocks of docs/flex.md run as written (in order, sharing names)."""
    import os
    import re
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "flex.md")
    with open(doc) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) == 2
    env = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/flex.md (block {i})", "exec"), env)
    assert env["o"].shape == (2, 8, 64, 32) and env["lse"].shape == (2, 8, 64)
    assert env["table"].grad is not None


def test_score_mod_from_sizes_and_tables():
    """score_mod without q and k: heads from the table, lengths from the positions or equal,
    the scale left to flex_attention (1/sqrt(head_dim), posenc's default)."""
    rng = _rng("sizes")
    q, k, v = (_tensor(rng, 1, 3, 9, 8).float() for _ in range(3))  # [B, H, L, D]
    table = _tensor(rng, 32, 3).float()
    want = pt.attention(*(x.transpose(1, 2) for x in (q, k, v)), "t5", causal=True,
                        params={"relative_attention_bias": table})
    mod = fx.score_mod("t5", params={"relative_attention_bias": table}, causal=True)
    assert mod.scale is None
    out = fa.flex_attention(q, k, v, score_mod=mod, block_mask=fx.block_mask(9, 9, causal=True))
    assert maxerr(out.transpose(1, 2), want) <= 5e-6
    with pytest.raises(ValueError, match="heads"):
        fx.score_mod("alibi")


def test_backend_flex_of_posenc_torch_and_the_modules():
    """backend="flex" on posenc.torch.attention and PositionalAttention runs posenc.torch.flex
    with the same keywords (the module's settings as keywords): the same out and gradients as
    posenc.torch.flex.attention, within its tolerance of the float64 oracle; what FlexAttention
    cannot take is refused by name."""
    rng = _rng("backend_flex")
    q, k, v = (_tensor(rng, 1, 9, 4, 16) for _ in range(3))
    slopes = torch.tensor(np.abs(rng.standard_normal(4)) * 0.3)
    kw = {"causal": True, "window": 5}
    runs = {}
    for name, call in (
            ("backend", lambda q, k, v, s: pt.attention(q, k, v, "alibi", backend="flex",
                                                        params={"slopes": s}, **kw)),
            ("flex", lambda q, k, v, s: fx.attention(q, k, v, "alibi", params={"slopes": s},
                                                     **kw)),
            ("oracle", lambda q, k, v, s: pt.attention(q, k, v, "alibi", backend="cpu",
                                                       params={"slopes": s}, **kw))):
        dtype = torch.float64 if name == "oracle" else torch.float32
        ts = [t.to(dtype).requires_grad_() for t in (q, k, v, slopes)]
        out = call(*ts)
        out.backward(torch.ones_like(out))
        runs[name] = [out.detach()] + [t.grad for t in ts]
    for got, want, ref in zip(runs["backend"], runs["flex"], runs["oracle"]):
        assert torch.equal(got, want)
        assert maxerr(got, ref) <= 2e-6 * max(1.0, float(ref.abs().max()))
    module = pt.PositionalAttention("rope", 4, 2, 16, causal=True, base=500.0, backend="flex")
    assert "backend='flex'" in repr(module)
    q32, k32, v32 = q.float(), k[:, :, :2].float(), v[:, :, :2].float()
    got = module(q32, k32, v32)
    want = fx.attention(q32, k32, v32, "rope", causal=True, base=500.0)
    assert torch.equal(got, want)
    with pytest.raises(fx.UnsupportedScheme, match="Transformer-XL"):
        pt.attention(q, q, q, "xl", backend="flex")
    with pytest.raises(ValueError, match="backend='flex': 'config'"):
        pt.attention(q, q, q, backend="flex", config={"model_type": "llama", "hidden_size": 64,
                                                      "num_attention_heads": 4})
    with pytest.raises(ValueError, match="'auto', 'cpu', 'triton' or 'flex'"):
        pt.PositionalAttention("alibi", 4, 4, 16, backend="sdpa")


def test_distance_tables_follow_the_positions_and_settings_are_checked_first():
    """A huge max_distance costs no more than the positions reach (the result is posenc's);
    positions reaching more distances than a table holds are refused by name; DeBERTa's settings
    are checked before the tables' shapes (their own range errors, not a shape error)."""
    rng = _rng("distance_tables")
    q, k = _tensor(rng, 1, 5, 2, 16).float(), _tensor(rng, 1, 7, 2, 16).float()
    table = _tensor(rng, 32, 2).float()
    kw = {"max_distance": 2 ** 40, "scale": 1.0, "causal": True}
    got = fx.attention(q, k, k, "t5", params={"relative_attention_bias": table}, **kw)
    want = pt.attention(q, k, k, "t5", params={"relative_attention_bias": table}, **kw)
    assert maxerr(got, want) <= 2e-6 * max(1.0, float(want.abs().max()))
    with pytest.raises(ValueError, match="t5: the positions reach distances.*posenc.torch"):
        fx.attention(q, k, k, "t5", params={"relative_attention_bias": table}, scale=1.0,
                     max_distance=2 ** 40, key_positions=torch.tensor([0, 1, 2, 3, 4, 5, 2 ** 40]))
    tables = {"pos_key": torch.randn(8, 2, 16), "pos_query": torch.randn(8, 2, 16)}
    for setting, text in (({"position_buckets": -1}, "position_buckets must be >= 0"),
                          ({"max_relative_positions": 2 ** 60},
                           "max_relative_positions must be <= 2")):
        with pytest.raises(ValueError, match=text):
            fx.attention(q, k, k, "deberta", params=tables, **setting)
