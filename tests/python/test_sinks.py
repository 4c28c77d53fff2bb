"""Attention sinks (gpt-oss) and chunked local attention (Llama 4) through the Python API:
posenc.attention / attention_grad (params={'sinks': ...}, chunk=...) against the independent
PyTorch reference (reference.py) for every scheme, gradcheck of posenc.torch.attention with
sinks, fully masked rows, PositionalAttention(sinks=True), and layer= with model configs.

float32 tolerance as test_attention.py (STYLE.md): max |posenc - ref64| <= 2 max |naive32 - ref64|
+ 2e-6 max(1, |ref|); float64: 1e-12 relative.
"""

import json
import os
import zlib

import numpy as np
import pytest

import posenc
from conftest import Case, SCHEMES, load_config, maxerr, tol32, variants

torch = pytest.importorskip("torch")
import posenc.torch as pt  # noqa: E402


def cases():
    for scheme in SCHEMES:
        for variant in range(variants(scheme)):
            for causal, chunk, sinks in ((False, None, True), (True, 3, True), (True, 2, False),
                                         (False, 4, True)):
                yield pytest.param(scheme, variant, causal, chunk, sinks,
                                   id=f"{scheme}-v{variant}-{'causal' if causal else 'bidir'}"
                                      f"-chunk{chunk}{'-sinks' if sinks else ''}")


@pytest.mark.parametrize("scheme,variant,causal,chunk,sinks", list(cases()))
def test_sinks_and_chunk_against_the_pytorch_reference(scheme, variant, causal, chunk, sinks):
    seed = zlib.crc32(repr((scheme, variant, causal, chunk, sinks)).encode())  # not hash(): salted
    c = Case(scheme, seed=seed, causal=causal,
             variant=variant, positions=True, sinks=sinks, chunk=chunk)
    if not sinks:
        c.kw["allow_fully_masked"] = True
        c.ref_kw["allow_fully_masked"] = True
    dout, ref, naive, ref_grads, naive_grads = c.reference_grads(5)
    ref_out = ref.detach().numpy()
    assert ("dsinks" in ref_grads) == sinks

    out32, lse32 = posenc.attention(*c.inputs(np.float32), c.scheme, return_lse=True,
                                    **c.posenc_kwargs(np.float32))
    assert maxerr(out32, ref_out) <= tol32(ref_out, naive.detach().numpy())
    g32 = posenc.attention_grad(*c.inputs(np.float32), dout.astype(np.float32), c.scheme,
                                out=out32, lse=lse32, **c.posenc_kwargs(np.float32))
    assert set(g32) == set(ref_grads)
    for name, want in ref_grads.items():
        assert maxerr(g32[name], want.numpy()) <= tol32(want.numpy(), naive_grads[name].numpy()), \
            name

    out64 = posenc.ref.attention(*c.inputs(np.float64), c.scheme, **c.posenc_kwargs())
    scale = max(1.0, float(np.max(np.abs(ref_out))))
    assert maxerr(out64, ref_out) <= 1e-12 * scale
    g64 = posenc.ref.attention_grad(*c.inputs(np.float64), dout, c.scheme, **c.posenc_kwargs())
    for name, want in ref_grads.items():
        assert maxerr(g64[name], want.numpy()) <= 1e-12 * max(1.0, float(want.abs().max())), name


@pytest.mark.parametrize("scheme", SCHEMES)
def test_gradcheck_float64_with_sinks_and_chunk(scheme):
    c = Case(scheme, seed=61, batch=1, seq_q=4, seq_k=5, heads_q=2, heads_kv=1, dim=4,
             causal=True, sinks=True, chunk=2)
    params = {n: torch.tensor(p, dtype=torch.float64, requires_grad=True)
              for n, p in c.params.items()}
    q, k, v = (torch.tensor(x, requires_grad=True) for x in (c.q, c.k, c.v))
    names = sorted(params)
    assert "sinks" in names

    def f(q, k, v, *tables):
        return pt.attention(q, k, v, scheme, params=dict(zip(names, tables)), **c.kw)
    assert torch.autograd.gradcheck(f, (q, k, v, *[params[n] for n in names]))


def test_fully_masked_rows_with_sinks():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 3, 2, 4)).astype(np.float32)
    k = rng.standard_normal((1, 4, 1, 4)).astype(np.float32)
    v = rng.standard_normal((1, 4, 1, 4)).astype(np.float32)
    sinks = np.array([0.5, -2.0], np.float32)
    # Queries at 0, 1 see no key (keys at 5..8, causal); query 9 sees all of them.
    out, lse = posenc.attention(q, k, v, causal=True, params={"sinks": sinks},
                                query_positions=[0, 1, 9], key_positions=[5, 6, 7, 8],
                                return_lse=True)
    assert np.all(out[0, :2] == 0)
    np.testing.assert_array_equal(lse[0, :, :2], np.stack([sinks, sinks], axis=1))
    assert np.all(lse[0, :, 2] > sinks)
    with pytest.raises(posenc.InvalidValueError, match="sees no key"):
        posenc.attention(q, k, v, causal=True, query_positions=[0, 1, 9],
                         key_positions=[5, 6, 7, 8])
    with pytest.raises(posenc.ShapeError, match="sinks"):
        posenc.attention(q, k, v, params={"sinks": np.zeros(3, np.float32)})
    with pytest.raises(posenc.InvalidValueError, match=r"chunk: 0 is outside \[1, "):
        posenc.attention(q, k, v, chunk=0)


def test_positional_attention_owns_learnable_sinks():
    torch.manual_seed(0)
    m = pt.PositionalAttention("rope", 4, 2, 8, causal=True, sinks=True, chunk=3)
    assert isinstance(m.sinks, torch.nn.Parameter) and m.sinks.shape == (4,)
    assert any(p is m.sinks for p in m.parameters())
    q = torch.randn(2, 6, 4, 8, requires_grad=True)
    k = torch.randn(2, 6, 2, 8)
    v = torch.randn(2, 6, 2, 8)
    with torch.no_grad():
        m.sinks.copy_(torch.tensor([0.0, 1.0, -1.0, 2.0]))
    out = m(q, k, v)
    out.square().sum().backward()
    assert m.sinks.grad is not None and torch.all(m.sinks.grad != 0)
    # The same as the functional form with the module's sinks and chunk.
    want = pt.attention(q.detach(), k, v, "rope", causal=True, chunk=3, rotary_dim=0, base=1e4,
                        style="half", params={"sinks": m.sinks.detach()})
    torch.testing.assert_close(out.detach(), want, rtol=0, atol=0)
    # sinks=False has none.
    assert pt.PositionalAttention("none", 4, 2, 8).sinks is None


def test_gpt_oss_layer_needs_sinks_and_uses_its_window():
    cfg = load_config("gpt-oss-20b.json", num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  sliding_window=3)
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, 6, 4, 8)).astype(np.float32)
    k = rng.standard_normal((1, 6, 2, 8)).astype(np.float32)
    v = rng.standard_normal((1, 6, 2, 8)).astype(np.float32)
    sinks = np.array([0.1, 0.2, -0.3, 1.0], np.float32)
    with pytest.raises(Exception, match="layer"):
        posenc.attention(q, k, v, config=cfg, causal=True, params={"sinks": sinks})
    with pytest.raises(Exception, match="sinks"):
        posenc.attention(q, k, v, config=cfg, layer=0, causal=True)
    # Layer 0 is a sliding layer (window 3), layer 1 a full one: same RoPE, different masks.
    out0 = posenc.attention(q, k, v, config=cfg, layer=0, causal=True, params={"sinks": sinks})
    out1 = posenc.attention(q, k, v, config=cfg, layer=1, causal=True, params={"sinks": sinks})
    freqs = posenc.rope_frequencies(config=posenc.read_model_config(cfg), seq_len=6)
    want0 = posenc.attention(q, k, v, "rope", freqs=freqs, causal=True, window=3,
                             params={"sinks": sinks})
    want1 = posenc.attention(q, k, v, "rope", freqs=freqs, causal=True, params={"sinks": sinks})
    np.testing.assert_allclose(out0, want0, rtol=0, atol=1e-6)
    np.testing.assert_allclose(out1, want1, rtol=0, atol=1e-6)
    assert maxerr(out0, out1) > 1e-3
    g = posenc.attention_grad(q, k, v, np.ones_like(q), config=cfg, layer=0, causal=True,
                              params={"sinks": sinks})
    assert g["dsinks"].shape == (4,)


def test_llama4_nope_layer_scales_queries_by_the_temperature():
    cfg = load_config("llama-4-scout-17b-16e-instruct.json", num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, floor_scale=4, attn_scale=0.5)
    rng = np.random.default_rng(12)
    q = rng.standard_normal((1, 3, 2, 8))
    k = rng.standard_normal((1, 5, 1, 8))
    v = rng.standard_normal((1, 5, 1, 8))
    qpos, kpos = [3, 8, 12], [0, 3, 7, 8, 12]
    out = posenc.ref.attention(q, k, v, config=cfg, layer=3, causal=True, query_positions=qpos,
                               key_positions=kpos)
    # log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1, in float32 as the model's code.
    f32 = np.float32
    factor = np.array([np.log(np.floor((f32(p) + f32(1)) / f32(4)) + f32(1)) * f32(0.5) + f32(1)
                       for p in qpos], np.float64)
    assert np.all(factor > 1)
    want = posenc.ref.attention(q * factor[None, :, None, None], k, v, "none", causal=True,
                                query_positions=qpos, key_positions=kpos)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-12)
    # dq through the scaling: finite differences of sum(dout * out) in float64.
    dout = rng.standard_normal(out.shape)
    g = posenc.ref.attention_grad(q, k, v, dout, config=cfg, layer=3, causal=True,
                                  query_positions=qpos, key_positions=kpos)
    h, idx = 1e-6, (0, 1, 1, 3)
    qp, qm = q.copy(), q.copy()
    qp[idx] += h
    qm[idx] -= h
    f = [float(np.sum(dout * posenc.ref.attention(x, k, v, config=cfg, layer=3, causal=True,
                                                  query_positions=qpos, key_positions=kpos)))
         for x in (qp, qm)]
    assert abs((f[0] - f[1]) / (2 * h) - g["dq"][idx]) < 1e-6
    # A RoPE layer of the same model is chunked: chunk 8192 from the config.
    layer0 = posenc.ref.attention(q, k, v, config=cfg, layer=0, causal=True,
                                  query_positions=qpos, key_positions=kpos)
    assert layer0.shape == q.shape


def test_cli_sinks_chunk_and_layer(cli, tmp_path):
    import subprocess

    from safetensors_io import read_safetensors, write_safetensors

    rng = np.random.default_rng(13)
    q = rng.standard_normal((1, 6, 4, 8)).astype(np.float32)
    k = rng.standard_normal((1, 6, 2, 8)).astype(np.float32)
    v = rng.standard_normal((1, 6, 2, 8)).astype(np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    sinks = np.array([0.5, -1.0, 0.25, 2.0], np.float32)
    for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        np.save(tmp_path / f"{name}.npy", x)
    write_safetensors(tmp_path / "p.safetensors", {"sinks": sinks})

    def run(*args):
        return subprocess.run([cli, *map(str, args)], capture_output=True, text=True)
    io = ["--q", tmp_path / "q.npy", "--k", tmp_path / "k.npy", "--v", tmp_path / "v.npy"]
    r = run("attention-grad", *io, "--dout", tmp_path / "dout.npy", "--scheme", "none",
            "--causal", "--chunk", 4, "--params", tmp_path / "p.safetensors", "--lse",
            "--out", tmp_path / "g.safetensors")
    assert r.returncode == 0, r.stderr
    got = read_safetensors(tmp_path / "g.safetensors")
    want = posenc.attention_grad(q, k, v, dout, "none", causal=True, chunk=4,
                                 params={"sinks": sinks})
    assert set(got) == {"dq", "dk", "dv", "dsinks", "lse"}
    for name in ("dq", "dk", "dv", "dsinks"):
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-6, err_msg=name)
    r = run("attention", *io, "--scheme", "none", "--chunk", 0, "--out", tmp_path / "o.npy")
    assert r.returncode == 2 and "--chunk" in r.stderr
    # --layer: needs --config; required when layers differ; gpt-oss layers need sinks.
    cfg = load_config("gpt-oss-20b.json", num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  sliding_window=3)
    with open(tmp_path / "oss.json", "w") as f:
        json.dump(cfg, f)
    r = run("attention", *io, "--scheme", "none", "--layer", 0, "--out", tmp_path / "o.npy")
    assert r.returncode == 2 and "--layer needs --config" in r.stderr
    r = run("attention", *io, "--config", tmp_path / "oss.json", "--causal",
            "--params", tmp_path / "p.safetensors", "--out", tmp_path / "o.npy")
    assert r.returncode == 2 and "--layer" in r.stderr
    r = run("attention", *io, "--config", tmp_path / "oss.json", "--layer", 0, "--causal",
            "--out", tmp_path / "o.npy")
    assert r.returncode == 2 and "'sinks'" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "o.npy")
    r = run("attention", *io, "--config", tmp_path / "oss.json", "--layer", 0, "--causal",
            "--params", tmp_path / "p.safetensors", "--out", tmp_path / "o.npy")
    assert r.returncode == 0, r.stderr
    want = posenc.attention(q, k, v, config=cfg, layer=0, causal=True, params={"sinks": sinks})
    np.testing.assert_array_equal(np.load(tmp_path / "o.npy"), want)
