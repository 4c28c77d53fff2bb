"""What engines feed attention, through the Python API and the CLI: logit soft-capping
(softcap=, --softcap) against the independent PyTorch reference (reference.py) for every scheme,
forward and gradients, float64 gradcheck and torch.compile of posenc.torch.attention with it,
Gemma 2 configs, and bad values.

float32 tolerance as test_attention.py: max |posenc - ref64| <= 2 max |naive32 - ref64| +
2e-6 max(1, |ref|); float64: 1e-12 relative.
"""

import json
import subprocess
import zlib

import numpy as np
import pytest

import posenc
from conftest import Case, SCHEMES, load_config, maxerr, tol32, variants

torch = pytest.importorskip("torch")
import posenc.torch as pt  # noqa: E402


# ---- soft-capping ------------------------------------------------------------------------------

def softcap_cases():
    for scheme in SCHEMES:
        for variant in range(variants(scheme)):
            for causal, cap in ((True, 2.0), (False, 0.75)):
                yield pytest.param(scheme, variant, causal, cap,
                                   id=f"{scheme}-v{variant}-{'causal' if causal else 'bidir'}-{cap}")


@pytest.mark.parametrize("scheme,variant,causal,cap", list(softcap_cases()))
def test_softcap_against_the_pytorch_reference(scheme, variant, causal, cap):
    seed = zlib.crc32(repr((scheme, variant, causal, cap)).encode())
    c = Case(scheme, seed=seed, causal=causal, variant=variant, positions=True, seq_q=6, seq_k=9)
    c.q *= 3  # scores past the cap
    c.kw["softcap"] = cap
    c.ref_kw["softcap"] = cap
    dout, ref, naive, ref_grads, naive_grads = c.reference_grads(7)
    ref_out = ref.detach().numpy()
    out32, lse32 = posenc.attention(*c.inputs(np.float32), c.scheme, return_lse=True,
                                    **c.posenc_kwargs(np.float32))
    assert maxerr(out32, ref_out) <= tol32(ref_out, naive.detach().numpy())
    g32 = posenc.attention_grad(*c.inputs(np.float32), dout.astype(np.float32), c.scheme,
                                out=out32, lse=lse32, **c.posenc_kwargs(np.float32))
    for name, want in ref_grads.items():
        assert maxerr(g32[name], want.numpy()) <= tol32(want.numpy(), naive_grads[name].numpy()), \
            name
    out64 = posenc.ref.attention(*c.inputs(np.float64), c.scheme, **c.posenc_kwargs())
    assert maxerr(out64, ref_out) <= 1e-12 * max(1.0, float(np.max(np.abs(ref_out))))
    # The cap changes the result (the test would not pass without it).
    plain = posenc.attention(*c.inputs(np.float32), c.scheme,
                             **{k: v for k, v in c.posenc_kwargs(np.float32).items()
                                if k != "softcap"})
    assert maxerr(plain, ref_out) > 100 * tol32(ref_out, naive.detach().numpy())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_softcap_gradcheck_and_compile(scheme):
    c = Case(scheme, seed=81, batch=1, seq_q=4, seq_k=5, heads_q=2, heads_kv=1, dim=4, causal=True)
    params = {n: torch.tensor(p, dtype=torch.float64, requires_grad=True)
              for n, p in c.params.items()}
    q, k, v = (torch.tensor(3 * x, requires_grad=True) for x in (c.q, c.k, c.v))
    names = sorted(params)

    def f(q, k, v, *tables):
        return pt.attention(q, k, v, scheme, params=dict(zip(names, tables)), softcap=1.5, **c.kw)
    assert torch.autograd.gradcheck(f, (q, k, v, *[params[n] for n in names]))
    q32, k32, v32 = (x.detach().float() for x in (q, k, v))
    p32 = {n: t.detach().float() for n, t in params.items()}

    def g(q, k, v):
        return pt.attention(q, k, v, scheme, params=p32, softcap=1.5, **c.kw)
    compiled = torch.compile(g, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q32, k32, v32), g(q32, k32, v32), rtol=0, atol=0)


def test_gemma2_layer_softcaps(tmp_path, cli):
    cfg = load_config("gemma-2-2b.json", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      attn_logit_softcapping=2.0)
    rng = np.random.default_rng(5)
    q = 4 * rng.standard_normal((1, 7, 4, 16)).astype(np.float32)
    k = 4 * rng.standard_normal((1, 7, 2, 16)).astype(np.float32)
    v = rng.standard_normal((1, 7, 2, 16)).astype(np.float32)
    got = posenc.attention(q, k, v, config=cfg, layer=1, causal=True)
    want = posenc.attention(q, k, v, "rope", causal=True, softcap=2.0, scale=256 ** -0.5)
    np.testing.assert_array_equal(got, want)
    assert maxerr(got, posenc.attention(q, k, v, "rope", causal=True, scale=256 ** -0.5)) > 1e-3
    # An explicit softcap= overrides the layer's.
    np.testing.assert_array_equal(
        posenc.attention(q, k, v, config=cfg, layer=1, causal=True, softcap=9.0),
        posenc.attention(q, k, v, "rope", causal=True, softcap=9.0, scale=256 ** -0.5))
    # The CLI: --config --layer, and --softcap.
    with open(tmp_path / "gemma2.json", "w") as f:
        json.dump(cfg, f)
    for name, x in (("q", q), ("k", k), ("v", v)):
        np.save(tmp_path / f"{name}.npy", x)
    io = ["--q", tmp_path / "q.npy", "--k", tmp_path / "k.npy", "--v", tmp_path / "v.npy"]

    def run(*args):
        return subprocess.run([cli, *map(str, args)], capture_output=True, text=True)
    r = run("attention", *io, "--config", tmp_path / "gemma2.json", "--layer", 1, "--causal",
            "--out", tmp_path / "o.npy")
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "o.npy"), got)
    r = run("attention", *io, "--scheme", "rope", "--causal", "--softcap", 2,
            "--scale", 256 ** -0.5, "--out", tmp_path / "o2.npy")
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(np.load(tmp_path / "o2.npy"), want, rtol=0, atol=1e-6)
    r = run("attention", *io, "--scheme", "rope", "--causal", "--softcap", 2, "--reference",
            "--out", tmp_path / "o3.npy")
    assert r.returncode == 0, r.stderr
    for bad in ("0", "-3", "nan", "inf"):
        r = run("attention", *io, "--scheme", "none", "--softcap", bad, "--out",
                tmp_path / "bad.npy")
        assert r.returncode == 2 and "--softcap" in r.stderr, (bad, r.stderr)
    assert not (tmp_path / "bad.npy").exists()
    desc = run("describe", tmp_path / "gemma2.json", "--json")
    assert desc.returncode == 0, desc.stderr
    assert all(layer["softcap"] == 2.0 for layer in json.loads(desc.stdout)["layers"])


def test_softcap_bad_values_raise():
    x = np.ones((1, 2, 1, 4), np.float32)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softcap"):
            posenc.attention(x, x, x, softcap=bad)
    with pytest.raises(ValueError, match="softcap"):
        pt.attention(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4),
                     softcap=-2.0)


# ---- packed variable-length sequences ----------------------------------------------------------

def packing(rng, n, max_len, prefill=False, empty=False):
    lens_k = rng.integers(1, max_len + 1, n)
    lens_q = lens_k.copy() if prefill else np.array([rng.integers(1, x + 1) for x in lens_k])
    if empty:
        lens_q[n // 2] = 0
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int64)
    return cu_q, cu_k


def per_sequence_reference(c, q, k, v, cu_q, cu_k, dtype, dout=None):
    """The PyTorch reference on each sequence alone, concatenated (and, with dout, the gradients
    of sum(dout * out): table gradients summed over the sequences)."""
    import reference
    td = getattr(torch, dtype)
    qt, kt, vt = (torch.tensor(x, dtype=td, requires_grad=True) for x in (q, k, v))
    params = {n: torch.tensor(p, dtype=td, requires_grad=True) for n, p in c.params.items()}
    kw = {n: x for n, x in c.ref_kw.items() if n not in ("query_positions", "key_positions")}
    if "rope_inv_freq" in kw:
        kw["rope_inv_freq"] = kw["rope_inv_freq"].to(td)
    outs = []
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        if q1 == q0:
            continue
        outs.append(reference.attention(qt[None, q0:q1], kt[None, k0:k1], vt[None, k0:k1],
                                        c.scheme, params, **kw)[0])
    out = torch.cat(outs)
    grads = None
    if dout is not None:
        (out * torch.from_numpy(dout).to(td)).sum().backward()
        grads = {"dq": qt.grad, "dk": kt.grad, "dv": vt.grad}
        grads.update({"d" + n: t.grad for n, t in params.items()})
    return out.detach(), grads


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_against_the_per_sequence_reference(scheme, causal):
    seed = zlib.crc32(repr(("varlen", scheme, causal)).encode())
    rng = np.random.default_rng(seed)
    c = Case(scheme, seed=seed, causal=causal, heads_q=4, heads_kv=2, dim=8)
    cu_q, cu_k = packing(rng, 6, 30, prefill=not causal, empty=causal)
    q = rng.standard_normal((cu_q[-1], 4, 8))
    k = rng.standard_normal((cu_k[-1], 2, 8))
    v = rng.standard_normal((cu_k[-1], 2, 8))
    dout = rng.standard_normal(q.shape)
    ref, ref_grads = per_sequence_reference(c, q, k, v, cu_q, cu_k, "float64", dout)
    naive, naive_grads = per_sequence_reference(c, q, k, v, cu_q, cu_k, "float32", dout)
    kw = dict(c.posenc_kwargs(np.float32), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    f32 = [x.astype(np.float32) for x in (q, k, v)]
    out, lse = posenc.attention(*f32, scheme, return_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == (4, cu_q[-1])
    assert maxerr(out, ref) <= tol32(ref.numpy(), naive.numpy())
    g = posenc.attention_grad(*f32, dout.astype(np.float32), scheme, out=out, lse=lse, **kw)
    assert set(g) == set(ref_grads)
    for name, want in ref_grads.items():
        assert g[name].shape == tuple(want.shape), name
        assert maxerr(g[name], want.numpy()) <= tol32(want.numpy(), naive_grads[name].numpy()), \
            name
    # float64: the oracle.
    out64 = posenc.ref.attention(q, k, v, scheme, **dict(c.posenc_kwargs(), cu_seqlens_q=cu_q,
                                                          cu_seqlens_k=cu_k))
    assert maxerr(out64, ref) <= 1e-12 * max(1.0, float(ref.abs().max()))
    # Half precision: the float32 result of the widened inputs, rounded once.
    b16 = [posenc.bf16_from_float32(x) for x in f32]
    half = posenc.attention_half(*b16, scheme, dtype="bfloat16", **kw)
    wide = posenc.attention(*[posenc.bf16_to_float32(x) for x in b16], scheme, **kw)
    np.testing.assert_array_equal(half, posenc.bf16_from_float32(wide))


def test_varlen_torch_gradients_and_compile():
    rng = np.random.default_rng(11)
    cu_q, cu_k = packing(rng, 4, 9, prefill=True)
    cu_qt, cu_kt = torch.from_numpy(cu_q), torch.from_numpy(cu_k)
    table = torch.randn(8, 2, dtype=torch.float64, requires_grad=True)
    q = torch.randn(int(cu_q[-1]), 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(int(cu_k[-1]), 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(int(cu_k[-1]), 1, 4, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, table):
        return pt.attention(q, k, v, "t5", params={"relative_attention_bias": table},
                            causal=True, max_distance=6, cu_seqlens_q=cu_qt, cu_seqlens_k=cu_kt)
    assert torch.autograd.gradcheck(f, (q, k, v, table))
    args = [x.detach().float().requires_grad_() for x in (q, k, v, table)]
    out = f(*args)
    assert out.shape == (cu_q[-1], 2, 4)
    out.square().sum().backward()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    args2 = [x.detach().clone().requires_grad_() for x in args]
    out2 = compiled(*args2)
    out2.square().sum().backward()
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    for a, b in zip(args, args2):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)
    # The ops directly: opcheck with the mask tensors.
    qd, kd, vd = (x.detach() for x in args[:3])
    torch.library.opcheck(torch.ops.posenc.attention.default, (qd, kd, vd, [], []),
                          {"cu_seqlens_q": cu_qt, "cu_seqlens_k": cu_kt, "scheme": "none",
                           "causal": True})


def test_varlen_bad_arguments():
    x = np.ones((5, 1, 4), np.float32)
    with pytest.raises(ValueError, match="cu_seqlens_k is missing"):
        posenc.attention(x, x, x, cu_seqlens_q=[0, 5])
    with pytest.raises(ValueError, match="cu_seqlens_q ends at 4"):
        posenc.attention(x, x, x, cu_seqlens_q=[0, 4], cu_seqlens_k=[0, 5])
    with pytest.raises(ValueError, match="non-decreasing"):
        posenc.attention(x, x, x, cu_seqlens_q=[0, 3, 2, 5], cu_seqlens_k=[0, 1, 2, 5])
    with pytest.raises(TypeError, match="integers"):
        posenc.attention(x, x, x, cu_seqlens_q=[0.0, 5.0], cu_seqlens_k=[0, 5])
    with pytest.raises(posenc.ShapeError, match="3 dimensions"):
        posenc.attention(x[None], x[None], x[None], cu_seqlens_q=[0, 5], cu_seqlens_k=[0, 5])
    with pytest.raises(ValueError, match="sees no key"):
        posenc.attention(x, x[:2], x[:2], cu_seqlens_q=[0, 3, 5], cu_seqlens_k=[0, 2, 2],
                         query_positions=[0, 1, 2, 0, 1])
    out = posenc.attention(x, x[:2], x[:2], cu_seqlens_q=[0, 3, 5], cu_seqlens_k=[0, 2, 2],
                           query_positions=[0, 1, 2, 0, 1], allow_fully_masked=True)
    assert np.all(out[3:] == 0) and np.all(out[:3] == 1)


def test_cli_varlen(cli, tmp_path):
    from safetensors_io import read_safetensors
    rng = np.random.default_rng(21)
    cu_q, cu_k = packing(rng, 5, 12)
    q = rng.standard_normal((cu_q[-1], 4, 8)).astype(np.float32)
    k = rng.standard_normal((cu_k[-1], 2, 8)).astype(np.float32)
    v = rng.standard_normal((cu_k[-1], 2, 8)).astype(np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout), ("cq", cu_q), ("ck", cu_k)):
        np.save(tmp_path / f"{name}.npy", x)

    def run(*args):
        return subprocess.run([cli, *map(str, args)], capture_output=True, text=True)
    io = ["--q", tmp_path / "q.npy", "--k", tmp_path / "k.npy", "--v", tmp_path / "v.npy",
          "--cu-seqlens-q", tmp_path / "cq.npy", "--cu-seqlens-k", tmp_path / "ck.npy"]
    r = run("attention", *io, "--scheme", "alibi", "--causal", "--softcap", 3,
            "--out", tmp_path / "o.npy")
    assert r.returncode == 0, r.stderr
    got = np.load(tmp_path / "o.npy")
    want = posenc.attention(q, k, v, "alibi", causal=True, softcap=3.0, cu_seqlens_q=cu_q,
                            cu_seqlens_k=cu_k)
    assert got.shape == (cu_q[-1], 4, 8)
    np.testing.assert_array_equal(got, want)
    r = run("attention", *io, "--scheme", "alibi", "--causal", "--reference",
            "--out", tmp_path / "o64.npy")
    assert r.returncode == 0, r.stderr
    assert maxerr(np.load(tmp_path / "o64.npy"),
                  posenc.attention(q, k, v, "alibi", causal=True, cu_seqlens_q=cu_q,
                                   cu_seqlens_k=cu_k)) < 1e-5
    r = run("attention-grad", *io, "--scheme", "rope", "--causal", "--dout", tmp_path / "dout.npy",
            "--lse", "--out", tmp_path / "g.safetensors")
    assert r.returncode == 0, r.stderr
    g = read_safetensors(tmp_path / "g.safetensors")
    want = posenc.attention_grad(q, k, v, dout, "rope", causal=True, cu_seqlens_q=cu_q,
                                 cu_seqlens_k=cu_k)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(g[name], want[name], rtol=0, atol=1e-6, err_msg=name)
    assert g["lse"].shape == (4, cu_q[-1])
    # Bad input: exit status 2, no output written.
    np.save(tmp_path / "bad.npy", np.array([0, 2, 1], np.int64))
    for args, what in ((["--cu-seqlens-q", tmp_path / "bad.npy"], "--cu-seqlens-k"),
                       (["--cu-seqlens-q", tmp_path / "bad.npy", "--cu-seqlens-k",
                         tmp_path / "ck.npy"], "cu_seqlens")):
        r = run("attention", "--q", tmp_path / "q.npy", "--k", tmp_path / "k.npy", "--v",
                tmp_path / "v.npy", *args, "--scheme", "none", "--out", tmp_path / "x.npy")
        assert r.returncode == 2 and what in r.stderr, r.stderr
    r = run("attention", "--q", tmp_path / "q.npy", "--k", tmp_path / "k.npy", "--v",
            tmp_path / "v.npy", "--scheme", "none", "--out", tmp_path / "x.npy")
    assert r.returncode == 2 and "4 dimensions" in r.stderr or "rank" in r.stderr, r.stderr
    assert not (tmp_path / "x.npy").exists()


# ---- block masks -------------------------------------------------------------------------------

def visibility(b, lq, lk, causal, window, qdoc=None, kdoc=None, prefix=None, glob=(), dense=None):
    """The documented rule, written here: [b, lq, lk] booleans (default positions)."""
    pq = np.arange(lq) + lk - lq
    pk = np.arange(lk)
    rel = pk[None, :] - pq[:, None]
    base = np.ones((lq, lk), bool)
    if causal:
        base &= rel <= 0
    if window is not None:
        base &= np.abs(rel) < window
    vis = np.broadcast_to(base, (b, lq, lk)).copy()
    opened = np.isin(pq, glob)[:, None] | np.isin(pk, glob)[None, :]
    vis |= opened[None]
    if prefix is not None:
        at = kdoc if kdoc is not None else np.arange(b)[:, None].repeat(lk, 1)
        vis |= (pk[None, :] < np.asarray(prefix)[at])[:, None, :]
    if qdoc is not None:
        vis &= qdoc[:, :, None] == kdoc[:, None, :]
    if dense is not None:
        vis &= dense
    return vis


@pytest.mark.parametrize("scheme", SCHEMES)
def test_block_masks_against_the_pytorch_reference(scheme):
    seed = zlib.crc32(repr(("blockmask", scheme)).encode())
    rng = np.random.default_rng(seed)
    b, lq, lk = 2, 40, 70
    c = Case(scheme, seed=seed, batch=b, seq_q=lq, seq_k=lk, heads_q=4, heads_kv=2, dim=8)
    kdoc = np.cumsum(rng.random((b, lk)) < 0.1, axis=1).astype(np.int32)
    qdoc = np.ascontiguousarray(kdoc[:, lk - lq:])
    dense = rng.random((1, lq, lk)) < 0.8
    prefix = rng.integers(0, 20, int(kdoc.max()) + 1)
    cases = [
        (True, None, dict(query_documents=qdoc, key_documents=kdoc)),
        (True, None, dict(query_documents=qdoc, key_documents=kdoc, prefix=prefix)),
        (True, None, dict(prefix=[5, 30])),
        (False, 6, dict(global_positions=[0, 31, 69])),
        (True, 20, dict(mask=dense, global_positions=[45])),
    ]
    for causal, window, masks in cases:
        vis = visibility(b, lq, lk, causal, window, masks.get("query_documents"),
                         masks.get("key_documents"), masks.get("prefix"),
                         masks.get("global_positions", ()), masks.get("mask"))
        c.kw.update(causal=causal, window=window, allow_fully_masked=True)
        c.ref_kw.update(causal=False, window=None, allow_fully_masked=True, mask=vis)
        if scheme == "t5":  # the buckets follow causal
            c.kw["bidirectional"] = c.ref_kw["bidirectional"] = not causal
        dout, ref, naive, ref_grads, naive_grads = c.reference_grads(3)
        kw = dict(c.posenc_kwargs(np.float32), **masks)
        out, lse = posenc.attention(*c.inputs(np.float32), scheme, return_lse=True, **kw)
        assert maxerr(out, ref.detach().numpy()) <= tol32(ref.detach().numpy(),
                                                          naive.detach().numpy()), masks
        g = posenc.attention_grad(*c.inputs(np.float32), dout.astype(np.float32), scheme,
                                  out=out, lse=lse, **kw)
        for name, want in ref_grads.items():
            assert maxerr(g[name], want.numpy()) <= tol32(want.numpy(),
                                                          naive_grads[name].numpy()), (name, masks)
        # The torch op with the mask tensors.
        tq, tk, tv = (torch.from_numpy(x) for x in c.inputs(np.float32))
        params = {n: torch.from_numpy(np.asarray(p, np.float32)) for n, p in c.params.items()}
        tkw = {n: x for n, x in kw.items() if n != "params"}
        np.testing.assert_array_equal(pt.attention(tq, tk, tv, scheme, params=params, **tkw).numpy(),
                                      out)


def test_block_mask_bad_arguments():
    x = np.ones((1, 4, 1, 4), np.float32)
    docs = np.zeros((1, 4), np.int32)
    with pytest.raises(ValueError, match="key_documents is missing"):
        posenc.attention(x, x, x, query_documents=docs)
    with pytest.raises(posenc.ShapeError, match="key_documents"):
        posenc.attention(x, x, x, query_documents=docs, key_documents=np.zeros((1, 3), np.int32))
    with pytest.raises(ValueError, match="negative"):
        posenc.attention(x, x, x, prefix=[-1])
    with pytest.raises(posenc.ShapeError, match="dense"):
        posenc.attention(x, x, x, mask=np.ones((1, 4, 3), bool))
    with pytest.raises(TypeError, match="integers"):
        posenc.attention(x, x, x, prefix=[1.5])
    with pytest.raises(ValueError, match="sees no key"):
        posenc.attention(x, x, x, mask=np.zeros((1, 4, 4), bool))
