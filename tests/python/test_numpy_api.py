"""The NumPy API: encodings against independent NumPy / PyTorch formulas and against the C++
results (the posenc CLI), zero-copy inputs (data pointers), non-contiguous views, errors as
exceptions, thread-count invariance, float64 parameter tables kept exact."""

import json
import math
import os
import subprocess
import threading

import numpy as np
import pytest

import posenc
from conftest import SCHEMES, Case

torch = pytest.importorskip("torch")
import reference  # noqa: E402


def run_cli(cli, *args):
    r = subprocess.run([cli, *map(str, args)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r


# ---- encodings ----------------------------------------------------------------------------------

def test_sinusoidal_table_against_the_formula_and_the_seed_numbers():
    pe = posenc.sinusoidal_table(128, 16)
    p = np.arange(128)[:, None]
    w = 10000.0 ** (-np.arange(0, 16, 2) / 16)
    want = np.zeros((128, 16))
    want[:, 0::2], want[:, 1::2] = np.sin(p * w), np.cos(p * w)
    assert pe.dtype == np.float32 and np.max(np.abs(pe - want)) < 1e-7
    assert abs(float(pe[105].astype(np.float64) @ pe[106]) - 7.4852) < 5e-5
    assert abs(float(pe[5].astype(np.float64) @ pe[10]) - 6.1370) < 5e-5
    concat = posenc.ref.sinusoidal_table(8, 16, layout="concat")
    np.testing.assert_allclose(concat, np.concatenate([np.sin(p[:8] * w), np.cos(p[:8] * w)], 1),
                               rtol=0, atol=1e-15)
    w2 = posenc.sinusoidal_frequencies(16, denominator="half_minus_one")
    np.testing.assert_allclose(w2, 10000.0 ** (-np.arange(8) / 7), rtol=1e-15)


def test_add_sinusoidal_and_learned_with_positions_and_inplace():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 6, 8)).astype(np.float32)
    pos = np.array([[0, 1, 2, 3, 4, 5], [7, 3, 3, 9, 0, 1]])
    y = posenc.add_sinusoidal(x, positions=pos)
    want = x + posenc.ref.sinusoidal_table(10, 8)[pos]  # float64 PE: y is it rounded once
    np.testing.assert_allclose(y, want, rtol=0, atol=2.5e-7)
    table = rng.standard_normal((10, 8)).astype(np.float32)
    y = posenc.add_learned(x, table, positions=pos)
    np.testing.assert_array_equal(y, x + table[pos])
    z = x.copy()
    assert posenc.add_learned(z, table, positions=pos, inplace=True) is z
    np.testing.assert_array_equal(z, y)
    with pytest.raises(posenc.InvalidValueError, match="10"):
        posenc.add_learned(x, table, positions=pos + 5)
    dy = rng.standard_normal((2, 6, 8)).astype(np.float32)
    dtable = posenc.learned_backward(dy, 10, positions=pos)
    want = np.zeros((10, 8))
    np.add.at(want, pos.reshape(-1), dy.reshape(-1, 8))
    np.testing.assert_allclose(dtable, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("rotary", [16, 8])
def test_rope_apply_inverse_partial_positions(style, rotary):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 3, 16)).astype(np.float32)
    pos = np.array([[0, 1, 2, 3, 4], [1000, 5, 70000, 3, 1 << 20]])
    f = posenc.rope_frequencies(16, rotary_dim=rotary, base=10000.0)
    np.testing.assert_allclose(f.inv_freq, 10000.0 ** (-np.arange(rotary // 2) * 2 / rotary),
                               rtol=1e-15)
    y = posenc.apply_rope(x, f, style=style, positions=pos)
    want = reference.rope(torch.from_numpy(x).double(), torch.from_numpy(pos),
                          torch.from_numpy(f.inv_freq), style).numpy()
    assert np.max(np.abs(y - want)) < 2e-6
    y64 = posenc.ref.apply_rope(x, f, style=style, positions=pos)
    assert y64.dtype == np.float64 and np.max(np.abs(y64 - want)) < 1e-12
    back = posenc.rope_inverse(y, f, style=style, positions=pos)
    assert np.max(np.abs(back - x)) < 2e-6
    # Without freqs: from head_dim = x.shape[-1], rotary_dim and base.
    np.testing.assert_array_equal(
        posenc.apply_rope(x, style=style, positions=pos, rotary_dim=rotary), y)
    # q and k in one pass equal two calls.
    k = rng.standard_normal((2, 5, 1, 16)).astype(np.float32)
    q2, k2 = posenc.apply_rope_qk(x, k, f, style=style, positions=pos)
    np.testing.assert_array_equal(q2, y)
    np.testing.assert_array_equal(k2, posenc.apply_rope(k, f, style=style, positions=pos))


def test_rope_from_config_scaling_and_rerotation(configs_dir):
    cfg = posenc.read_model_config(os.path.join(configs_dir, "phi-3-mini-128k-like.json"))
    short = posenc.rope_frequencies(config=cfg, seq_len=100)
    long = posenc.rope_frequencies(config=cfg, seq_len=10000)
    assert not np.array_equal(short.inv_freq, long.inv_freq)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((1, 6, 2, cfg.head_dim)).astype(np.float32)
    pos = np.arange(6) + 4090
    cached = posenc.apply_rope(k, short, positions=pos, style=cfg.rope["style"])
    moved = posenc.rerotate_rope(cached, short, long, positions=pos, style=cfg.rope["style"])
    direct = posenc.apply_rope(k, long, positions=pos, style=cfg.rope["style"])
    assert np.max(np.abs(moved - direct)) < 1e-5
    # The dict form of a scaling equals the config's.
    scaled = posenc.rope_frequencies(64, scaling={"rope_type": "linear", "factor": 4.0})
    np.testing.assert_allclose(scaled.inv_freq, posenc.rope_frequencies(64).inv_freq / 4,
                               rtol=1e-15)
    with pytest.raises(posenc.InvalidValueError, match="unknown key"):
        posenc.rope_frequencies(64, scaling={"rope_type": "linear", "factr": 4.0})


def test_mrope_text_positions_equal_rope():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 5, 2, 16)).astype(np.float32)
    f = posenc.rope_frequencies(16)
    p = np.arange(5) + 3
    y = posenc.apply_mrope(x, f, np.stack([p, p, p]), sections=(2, 3, 3))
    np.testing.assert_array_equal(y, posenc.apply_rope(x, f, positions=p))


def test_alibi_t5_deberta_shaw_indices_against_independent_formulas():
    for h in (1, 5, 8, 12, 16, 112):
        np.testing.assert_allclose(posenc.alibi_slopes(h), reference.alibi_slopes(h), rtol=1e-15)
    rel = np.arange(-3000, 3001)
    for nb, md, bidir in [(32, 128, True), (32, 128, False), (16, 20, True), (128, 4096, False)]:
        want = reference.t5_bucket(torch.from_numpy(rel), nb, md, bidir).numpy()
        np.testing.assert_array_equal(
            posenc.t5_bucket(rel, num_buckets=nb, max_distance=md, bidirectional=bidir), want)
    assert posenc.t5_bucket(-40, bidirectional=False) == int(
        reference.t5_bucket(torch.tensor(-40), 32, 128, False))
    m = posenc.t5_bucket_map(4, 6, bidirectional=False)
    np.testing.assert_array_equal(m, posenc.t5_bucket(
        np.arange(6)[None] - (np.arange(4)[:, None] + 2), bidirectional=False))
    rho = np.arange(-5000, 5001)
    want = reference.deberta_bucket(torch.from_numpy(rho), 4096, 512).numpy()
    np.testing.assert_array_equal(
        posenc.deberta_bucket(rho, max_relative_positions=4096, position_buckets=512), want)
    got = posenc.deberta_c2p_index(np.arange(10)[:, None], np.arange(10)[None],
                                   max_relative_positions=3)
    np.testing.assert_array_equal(got, np.clip(np.arange(10)[:, None] - np.arange(10) + 3, 0, 5))
    paper = posenc.deberta_p2c_index(7, 3, max_relative_positions=3, p2c="paper")
    assert paper == min(max(-(7 - 3) + 3, 0), 5)
    np.testing.assert_array_equal(posenc.shaw_index(np.arange(-5, 6), 2),
                                  np.clip(np.arange(-5, 6), -2, 2) + 2)
    r = posenc.xl_sinusoid(7, 8)
    w = 10000.0 ** (-np.arange(4) * 2 / 8)
    np.testing.assert_allclose(r, np.concatenate([np.sin(7 * w), np.cos(7 * w)]), rtol=1e-15)


def test_model_config_from_a_path_and_a_dict(configs_dir):
    path = os.path.join(configs_dir, "t5-base.json")
    cfg = posenc.read_model_config(path)
    assert cfg.scheme == "t5" and cfg.t5["num_buckets"] == 32
    with open(path) as f:
        d = json.load(f)
    assert posenc.describe(d) == posenc.describe(path) == posenc.describe(cfg)
    d["relative_attention_num_buckets"] = "many"
    with pytest.raises(posenc.IoError, match="relative_attention_num_buckets"):
        posenc.read_model_config(d)
    with pytest.raises(posenc.IoError):
        posenc.read_model_config(os.path.join(configs_dir, "does-not-exist.json"))


# ---- against the C++ results (the CLI) -----------------------------------------------------------

@pytest.mark.parametrize("scheme", SCHEMES)
def test_attention_and_grads_equal_the_cli(cli, tmp_path, scheme):
    from safetensors_io import read_safetensors, write_safetensors
    c = Case(scheme, seed=21, causal=True)
    q, k, v = c.inputs(np.float32)
    for n, x in (("q", q), ("k", k), ("v", v)):
        np.save(tmp_path / f"{n}.npy", x)
    dout = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32)
    np.save(tmp_path / "do.npy", dout)
    args = ["--q", tmp_path / "q.npy", "--k", tmp_path / "k.npy", "--v", tmp_path / "v.npy",
            "--scheme", scheme, "--causal"]
    for key, flag in (("base", "--base"), ("rotary_dim", "--rotary-dim"), ("style", "--style"),
                      ("max_bias", "--max-bias"), ("max_distance", "--max-distance"),
                      ("max_relative_positions", "--max-relative-positions"),
                      ("position_buckets", "--position-buckets"), ("deberta_p2c", "--deberta-p2c")):
        if key in c.kw:
            args += [flag, c.kw[key]]
    kw = c.posenc_kwargs(np.float32)
    if c.params:
        write_safetensors(tmp_path / "p.safetensors", kw["params"])
        args += ["--params", tmp_path / "p.safetensors"]
    run_cli(cli, "attention", *args, "--out", tmp_path / "o.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "o.npy"), posenc.attention(q, k, v, scheme,
                                                                                 **kw))
    run_cli(cli, "attention-grad", *args, "--dout", tmp_path / "do.npy", "--out",
            tmp_path / "g.safetensors")
    want = read_safetensors(tmp_path / "g.safetensors")
    got = posenc.attention_grad(q, k, v, dout, scheme, **kw)
    assert set(got) == set(want)
    for name in got:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_cli_reference_keeps_float64_tables_exact(cli, tmp_path):
    """`posenc attention(-grad) --reference` with float64 --params equals posenc.ref with the
    same float64 tables bit for bit, and differs from the tables cut to float32."""
    from safetensors_io import read_safetensors, write_safetensors
    for scheme in ("t5", "shaw", "xl", "deberta"):
        c = Case(scheme, seed=5)
        q, k, v = c.inputs(np.float64)
        for n, x in (("q", q), ("k", k), ("v", v)):
            np.save(tmp_path / f"{n}.npy", x)
        dout = np.random.default_rng(3).standard_normal(q.shape)
        np.save(tmp_path / "do.npy", dout)
        kw = c.posenc_kwargs(np.float64)
        write_safetensors(tmp_path / "p.safetensors", kw["params"])
        args = ["--q", tmp_path / "q.npy", "--k", tmp_path / "k.npy", "--v", tmp_path / "v.npy",
                "--scheme", scheme, "--params", tmp_path / "p.safetensors", "--reference"]
        for key, flag in (("max_distance", "--max-distance"),
                          ("max_relative_positions", "--max-relative-positions")):
            if key in c.kw:
                args += [flag, c.kw[key]]
        run_cli(cli, "attention", *args, "--out-dtype", "float64", "--out", tmp_path / "o.npy")
        got = np.load(tmp_path / "o.npy")
        want = posenc.ref.attention(q, k, v, scheme, **kw)
        np.testing.assert_array_equal(got, want)
        cut = {n: p.astype(np.float32) for n, p in kw["params"].items()}
        assert np.max(np.abs(posenc.ref.attention(q, k, v, scheme, **{**kw, "params": cut}) -
                             want)) > 1e-10
        ref_out, (tq, tk, tv, tables) = c.reference("float64", requires_grad=True)
        assert np.max(np.abs(want - ref_out.detach().numpy())) <= 1e-14 * np.max(np.abs(want))
        run_cli(cli, "attention-grad", *args, "--dout", tmp_path / "do.npy", "--out",
                tmp_path / "g.safetensors")
        g = read_safetensors(tmp_path / "g.safetensors")
        (ref_out * torch.from_numpy(dout)).sum().backward()
        for n, t in tables.items():
            assert g["d" + n].dtype == np.float64
            rel = np.max(np.abs(g["d" + n] - t.grad.numpy())) / np.max(np.abs(t.grad.numpy()))
            assert rel < 1e-13, (scheme, n, rel)


# ---- zero copy, strides, dtypes -----------------------------------------------------------------

def test_inputs_are_used_in_place_when_dtype_and_strides_allow():
    rng = np.random.default_rng(6)
    big = rng.standard_normal((2, 9, 8, 24)).astype(np.float32)
    q = big[:, 1:6, ::2, 4:20]  # strided in seq, heads and an offset last dim
    k = big[:, :7, 1:5:2, 2:18]
    v = big[:, 2:9, :2, 8:24]
    assert not q.flags.c_contiguous
    table = rng.standard_normal((16, 4)).astype(np.float32)
    out = posenc.attention(q, k, v, "t5", params={"relative_attention_bias": table})
    want = posenc.attention(*(np.ascontiguousarray(x) for x in (q, k, v)), "t5",
                            params={"relative_attention_bias": table})
    np.testing.assert_array_equal(out, want)
    # Data pointers: posenc reads the caller's buffers. A read-only view proves no write, and the
    # output of a call with `out=` is that very array.
    o = np.empty((2, 5, 4, 16), np.float32)
    assert posenc.attention(q, k, v, out=o) is o
    ro = q.copy()
    ro.setflags(write=False)
    posenc.attention(ro, k, v)
    x = np.ascontiguousarray(q)
    assert posenc.apply_rope(x, inplace=True) is x
    assert posenc.add_sinusoidal(big[0], inplace=True).__array_interface__["data"][0] == \
        big[0].__array_interface__["data"][0]


def test_zero_copy_by_data_pointer():
    """The array the bindings view (posenc._posenc._viewed_address: the same conversion every
    function uses) is the caller's buffer for float32 / float64 with any non-negative strides,
    and a converted copy otherwise."""
    addr = posenc._posenc._viewed_address
    rng = np.random.default_rng(7)
    base = rng.standard_normal((2, 8, 6, 32)).astype(np.float32)
    ptr = base.__array_interface__["data"][0]
    for view in (base, base[:, 1:, ::2], base[..., 3:19], base.transpose(0, 2, 1, 3),
                 np.broadcast_to(base[:, :, :1], (2, 8, 6, 32))):
        assert addr(view, "float32") == view.__array_interface__["data"][0]
    b64 = base.astype(np.float64)
    assert addr(b64[:, ::3], "float64") == b64[:, ::3].__array_interface__["data"][0]
    # Converted once: another dtype, a negative stride.
    assert addr(b64, "float32") != b64.__array_interface__["data"][0]
    assert addr(base[:, ::-1], "float32") != base[:, ::-1].__array_interface__["data"][0]
    assert ptr == base.__array_interface__["data"][0]
    # Torch tensors through .numpy() share memory, so posenc.torch does not copy either.
    t = torch.from_numpy(base)
    assert addr(t.numpy(), "float32") == t.data_ptr()
    assert addr(t.transpose(1, 2).numpy(), "float32") == t.data_ptr()


def test_unaligned_contiguous_input_is_copied_once():
    """A contiguous float32 array whose data is not 4-byte aligned (a buffer at an odd offset)
    is converted to one aligned copy, with the same result as the aligned array."""
    addr = posenc._posenc._viewed_address
    rng = np.random.default_rng(17)
    q = rng.standard_normal((1, 5, 2, 8)).astype(np.float32)
    raw = np.zeros(q.nbytes + 1, np.uint8)
    uq = np.frombuffer(raw.data, dtype=np.float32, count=q.size, offset=1).reshape(q.shape)
    uq[...] = q
    assert uq.__array_interface__["data"][0] % 4 != 0 and uq.flags.c_contiguous
    assert addr(uq, "float32") % 4 == 0
    np.testing.assert_array_equal(posenc.attention(uq, q, q, causal=True),
                                  posenc.attention(q, q, q, causal=True))


def test_non_contiguous_last_dimension_and_broadcast_inputs():
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 4, 2, 16)).astype(np.float32)
    k = rng.standard_normal((1, 6, 2, 16)).astype(np.float32)
    qs = np.repeat(q, 2, axis=3)[..., ::2]  # last-dim stride 2: the simple path
    assert qs.strides[3] == 8
    np.testing.assert_allclose(posenc.attention(qs, k, k, causal=True),
                               posenc.attention(q, k, k, causal=True), atol=2e-6)
    kb = np.broadcast_to(k[:, :, :1], (1, 6, 2, 16))  # stride 0 over kv heads
    np.testing.assert_allclose(posenc.attention(q, kb, kb),
                               posenc.attention(q, np.ascontiguousarray(kb),
                                                np.ascontiguousarray(kb)), atol=1e-6)


# ---- errors ---------------------------------------------------------------------------------------

def test_bad_input_raises_clear_exceptions():
    q = np.zeros((1, 4, 4, 8), np.float32)
    k = np.zeros((1, 4, 3, 8), np.float32)
    with pytest.raises(posenc.ShapeError, match=r"kv heads \(3\) must divide q heads \(4\)"):
        posenc.attention(q, k, k)
    with pytest.raises(posenc.ShapeError, match="4 dimensions"):
        posenc.attention(q[0], q, q)
    with pytest.raises(posenc.InvalidValueError, match="needs parameter 'relative_attention_bias'"):
        posenc.attention(q, q, q, "t5")
    with pytest.raises(posenc.ShapeError, match="relative_attention_bias"):
        posenc.attention(q, q, q, "t5", params={"relative_attention_bias": np.zeros((32, 3))})
    with pytest.raises(posenc.InvalidValueError, match="rel_k is not a parameter of scheme t5"):
        posenc.attention(q, q, q, "t5", params={"relative_attention_bias": np.zeros((32, 4)),
                                                 "rel_k": np.zeros((3, 8))})
    with pytest.raises(posenc.InvalidValueError, match="unknown scheme"):
        posenc.attention(q, q, q, "sinusoidal")
    with pytest.raises(TypeError, match="does not apply to scheme 'rope'"):
        posenc.attention(q, q, q, "rope", max_distance=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'causl'"):
        posenc.attention(q, q, q, causl=True)
    with pytest.raises(TypeError):
        posenc.attention(q, q, q, query_positions=np.array([0.5, 1, 2, 3]))
    bad = q.copy()
    bad[0, 1, 2, 3] = np.nan
    with pytest.raises(posenc.InvalidValueError, match="non-finite value nan"):
        posenc.attention(bad, q, q)
    with pytest.raises(posenc.InvalidValueError, match="position"):
        posenc.attention(q, q, q, key_positions=np.array([0, 1, -2, 3]))
    with pytest.raises(TypeError):
        posenc.attention("q", q, q)
    with pytest.raises(posenc.InvalidValueError, match="head_dim"):
        posenc.rope_frequencies(0)
    with pytest.raises(posenc.ShapeError):
        posenc.apply_rope(np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match="inplace"):
        posenc.apply_rope(np.zeros((1, 2, 3, 4), np.float64).astype(np.int32), inplace=True)
    with pytest.raises(posenc.Error):
        posenc.attention_grad(q, q, q, np.zeros((1, 4, 4, 7), np.float32))
    assert issubclass(posenc.Error, ValueError) and issubclass(posenc.ShapeError, posenc.Error)


def test_the_interpreter_survives_hostile_inputs():
    """Bad inputs in a subprocess: exceptions, never a crash."""
    import sys
    code = r"""
import numpy as np, posenc
q = np.zeros((1, 4, 4, 8), np.float32)
bad = [
    lambda: posenc.attention(q, q, q, 'xl', params={'r_w_bias': np.zeros((4, 8)), 'r_r_bias': np.zeros((4, 8)), 'r_net': np.zeros((32, 3))}),
    lambda: posenc.attention(np.zeros((0, 0, 0, 0), np.float32), q, q),
    lambda: posenc.attention(q, q, q, query_positions=np.zeros((7, 7, 7), np.int64)),
    lambda: posenc.attention(q, q, q, query_positions=2**62),
    lambda: posenc.attention(q, q, q, 'shaw', params={'rel_k': np.zeros((4, 8))}),
    lambda: posenc.attention(q, q, q, 'deberta', params={'pos_key': np.zeros((8, 4, 8)), 'pos_query': np.zeros((6, 4, 8))}, max_relative_positions=4),
    lambda: posenc.attention(q, q, q, scale=float('nan')),
    lambda: posenc.attention(q, q, q, window=0),
    lambda: posenc.attention(q, q, q, num_threads=-1),
    lambda: posenc.attention_grad(q, q, q, q, out=q, lse=np.full((1, 4, 4), np.inf, np.float32)),
    lambda: posenc.sinusoidal_table(4, 7),
    lambda: posenc.alibi_slopes(0),
    lambda: posenc.t5_bucket(3, num_buckets=1),
    lambda: posenc.add_learned(np.zeros((1, 3, 4), np.float32), np.zeros((2, 5), np.float32)),
    lambda: posenc.attention_merge(q, np.zeros((1, 4, 3)), q, np.zeros((1, 4, 4))),
    lambda: posenc.read_model_config({'model_type': 'llama', 'rope_scaling': {'rope_type': 'yarn'}}),
    lambda: posenc.plot.heatmap(out='/nonexistent-dir/x.png'),
    lambda: posenc.plot.heatmap(lenght=3),
]
n = 0
for f in bad:
    try:
        f()
    except (ValueError, TypeError) as e:
        n += 1
print(n, len(bad))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    n, total = map(int, r.stdout.split())
    assert n == total


# ---- threads ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", SCHEMES)
def test_results_are_bit_identical_for_any_thread_count(scheme):
    c = Case(scheme, seed=9, batch=2, seq_q=70, seq_k=90, causal=True)
    q, k, v = c.inputs(np.float32)
    kw = c.posenc_kwargs(np.float32)
    dout = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)
    base = posenc.attention(q, k, v, scheme, num_threads=1, **kw)
    gbase = posenc.attention_grad(q, k, v, dout, scheme, num_threads=1, **kw)
    for t in (2, 3):
        np.testing.assert_array_equal(posenc.attention(q, k, v, scheme, num_threads=t, **kw),
                                      base)
        g = posenc.attention_grad(q, k, v, dout, scheme, num_threads=t, **kw)
        for n in gbase:
            np.testing.assert_array_equal(g[n], gbase[n], err_msg=n)


def test_calls_from_python_threads_run_concurrently_and_agree():
    """The GIL is released inside the kernels: calls from several Python threads give the same
    results as sequential ones."""
    c = Case("alibi", seed=10, seq_q=64, seq_k=64)
    q, k, v = c.inputs(np.float32)
    want = posenc.attention(q, k, v, "alibi", num_threads=1)
    results = [None] * 4

    def work(i):
        results[i] = posenc.attention(q, k, v, "alibi", num_threads=1)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        np.testing.assert_array_equal(r, want)


def test_gil_is_released_while_kernels_run():
    """A Python thread keeps running while another thread is inside a long kernel call."""
    import time
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, 1024, 4, 64)).astype(np.float32)
    ticks = []
    done = threading.Event()

    def ticker():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)
    t = threading.Thread(target=ticker)
    t.start()
    start = time.perf_counter()
    for _ in range(3):
        posenc.ref.attention_scores(q[:, :256], q[:, :256], "alibi")  # pure C++ time
        posenc.attention(q, q, q, "alibi", num_threads=1)
    end = time.perf_counter()
    done.set()
    t.join()
    inside = [x for x in ticks if start < x < end]
    assert end - start > 0.02
    assert len(inside) >= 3  # the ticker ran during the calls


def test_rope_frequencies_walks_every_layer_nope_included(configs_dir):
    path = os.path.join(configs_dir, "llama-4-scout-17b-16e-instruct.json")
    cfg = posenc.read_model_config(path)
    assert len(cfg.layers) == 48
    nope = 0
    for layer in cfg.layers:
        n = layer["index"]
        # The config positionally, as a path, or as config=: the same answer, never an error.
        f = posenc.rope_frequencies(path, layer=n)
        g = posenc.rope_frequencies(config=cfg, layer=n)
        assert isinstance(f, posenc.RopeFrequencies)
        assert isinstance(f, posenc.LayerRopeFrequencies)
        assert f.layer == n and f.nope == layer["nope"] == (not layer["rope"])
        assert f.style == "interleaved"
        np.testing.assert_array_equal(f.inv_freq, g.inv_freq)
        if f.nope:
            nope += 1
            assert f.rotary_dim == 0 and f.inv_freq.shape == (0,)
            assert f.attention_factor == 1.0
            assert f.temperature == layer["temperature"] == {"floor_scale": 8192.0,
                                                             "attn_scale": 0.1}
        else:
            assert f.rotary_dim == 128 and f.temperature is None
            assert layer["attention_chunk"] == 8192
    assert nope == 12
    # A RoPE layer's frequencies are those of the model's RoPE layers.
    np.testing.assert_array_equal(posenc.rope_frequencies(cfg, layer=0).inv_freq,
                                  posenc.rope_frequencies(config=cfg).inv_freq)
    with pytest.raises(posenc.InvalidValueError, match="out of range"):
        posenc.rope_frequencies(cfg, layer=48)
    with pytest.raises(TypeError, match="needs a config"):
        posenc.rope_frequencies(128, layer=0)
    with pytest.raises(TypeError, match="given twice"):
        posenc.rope_frequencies(path, config=cfg)
    with pytest.raises(TypeError, match="first argument"):
        posenc.rope_frequencies(1.5)
    # Gemma 3's local and global layers differ in theta: layer= picks each.
    gemma = posenc.read_model_config(os.path.join(configs_dir, "gemma-3-4b-it.json"))
    local, glob = posenc.rope_frequencies(gemma, layer=0), posenc.rope_frequencies(gemma, layer=5)
    assert not local.nope and not glob.nope
    assert not np.array_equal(local.inv_freq, glob.inv_freq)
    assert [l["rope_theta"] for l in gemma.layers[:6]] == [1e4] * 5 + [1e6]


def _scheme_tables(rng):
    """Parameter tables of each scheme that needs them, for q [1, 3, 2, 8]."""
    return {"t5": {"relative_attention_bias": rng.standard_normal((32, 2)).astype(np.float32)},
            "xl": {"r_w_bias": np.zeros((2, 8), np.float32),
                   "r_r_bias": np.zeros((2, 8), np.float32),
                   "r_net": rng.standard_normal((16, 6)).astype(np.float32)},
            "deberta": {"pos_key": rng.standard_normal((8, 2, 8)).astype(np.float32),
                        "pos_query": rng.standard_normal((8, 2, 8)).astype(np.float32)},
            "shaw": {"rel_k": rng.standard_normal((5, 8)).astype(np.float32)}}


def test_scheme_registry_is_the_one_list():
    infos = posenc.schemes()
    assert posenc.SCHEMES == tuple(s["name"] for s in infos) == (
        "none", "rope", "alibi", "t5", "shaw", "xl", "deberta")
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    for s in infos:
        assert os.path.exists(os.path.join(root, s["doc"])), s["doc"]
        for p in s["params"]:
            assert set(p) == {"name", "layout", "required", "learned", "head_axis", "help"}
            # The head axis is declared where the layout has one form with a "heads" entry.
            dims = p["layout"].strip("[]").split(", ")
            if " or " not in p["layout"] and "heads" in dims:
                assert p["head_axis"] == dims.index("heads"), p
            else:
                assert p["head_axis"] is None, p
    t5 = next(s for s in infos if s["name"] == "t5")
    assert [p["name"] for p in t5["params"]] == ["relative_attention_bias"]
    assert [k["keyword"] for k in t5["settings"]] == ["num_buckets", "max_distance",
                                                      "bidirectional"]
    # A setting of another scheme is refused, naming the schemes it is for.
    q = np.zeros((1, 3, 2, 8), np.float32)
    with pytest.raises(TypeError, match="'max_bias' does not apply to scheme 't5'.*alibi"):
        posenc.attention(q, q, q, "t5", max_bias=4.0,
                         params={"relative_attention_bias": np.zeros((32, 2), np.float32)})
    with pytest.raises(TypeError, match="'base' does not apply to scheme 'alibi'.*rope xl"):
        posenc.attention(q, q, q, "alibi", base=100.0)
    # Every settings keyword of the registry is accepted by attention() for its scheme.
    values = {"base": 1e4, "rotary_dim": 8, "style": "half", "angles": "accurate", "seq_len": 10,
              "max_bias": 8.0, "position_buckets": 0, "max_relative_positions": 4,
              "deberta_p2c": "model", "deberta_float64_log": False, "num_buckets": 32,
              "max_distance": 128, "bidirectional": True,
              "scaling": {"rope_type": "linear", "factor": 2.0}}
    tables = _scheme_tables(np.random.default_rng(1))
    for s in infos:
        for k in s["settings"]:
            if k["keyword"] in ("freqs",):
                continue
            kw = {"max_relative_positions": 4} if s["name"] == "deberta" else {}
            kw[k["keyword"]] = values[k["keyword"]]
            out = posenc.attention(q, q, q, s["name"], params=tables.get(s["name"]), **kw)
            assert out.shape == q.shape


def _out_of_range(setting):
    """Values the registry's declared type and range refuse, with the error they must raise."""
    t, lo, hi = setting["type"], setting["min"], setting["max"]
    bad = []
    if t == "int":
        bad += [(True, TypeError), (2.0, TypeError), ("3", TypeError)]
        if lo is not None:
            bad.append((lo - 1 if not setting["min_exclusive"] else lo, ValueError))
        if hi is not None:
            bad.append((hi + 1, ValueError))
    elif t == "float":
        bad += [(True, TypeError), ("1", TypeError), (float("nan"), ValueError),
                (float("inf"), ValueError)]
        if lo is not None:
            bad.append((lo if setting["min_exclusive"] else lo - 1.0, ValueError))
        if hi is not None:
            bad.append((hi * 2 + 1, ValueError))
    elif t == "bool":
        bad += [(1, TypeError), ("true", TypeError)]
    elif t == "choice":
        bad += [("nope", ValueError), (1, TypeError)]
    return bad


def test_scheme_settings_are_checked_by_their_declared_type_and_range():
    # Every setting of every scheme, from the registry's declaration alone: a value of the wrong
    # kind is a TypeError, one outside the range or choices a ValueError, both naming it.
    q = np.zeros((1, 3, 2, 8), np.float32)
    tables = _scheme_tables(np.random.default_rng(2))
    checked = 0
    for s in posenc.schemes():
        for k in s["settings"]:
            assert k["type"] in ("float", "int", "bool", "choice", "rope_frequencies",
                                 "rope_scaling"), k
            assert k["help"] and k["default"], k
            if k["type"] == "choice":
                assert k["choices"] and k["range"] == " or ".join(
                    [", ".join(k["choices"][:-1]), k["choices"][-1]] if len(k["choices"]) > 1
                    else k["choices"])
            for value, error in _out_of_range(k):
                with pytest.raises(error, match=k["keyword"]):
                    posenc.attention(q, q, q, s["name"], params=tables.get(s["name"]),
                                     **{k["keyword"]: value})
                checked += 1
    assert checked >= 30


def test_model_config_dicts_come_from_the_one_serializer(configs_dir):
    for name in ("llama-4-scout-17b-16e-instruct.json", "gemma-3-4b-it.json", "t5-base.json"):
        path = os.path.join(configs_dir, name)
        cfg = posenc.read_model_config(path)
        d = cfg.to_dict()
        assert d["model_type"] == cfg.model_type and d["scheme"] == cfg.scheme
        assert d.get("layers", []) == cfg.layers
        cli = os.environ.get("POSENC_CLI")
        if cli:  # `posenc describe --json` prints the same object
            out = subprocess.run([cli, "describe", "--json", path], check=True,
                                 capture_output=True, text=True).stdout
            assert json.loads(out) == d
    llama = posenc.read_model_config(os.path.join(configs_dir, "llama-3.1-8b.json"))
    assert llama.rope["scaling"] == llama.to_dict()["rope"]["scaling"]
    assert llama.rope["scaling"]["type"] == "llama3"
    assert set(llama.rope["scaling"]) == {"type", "factor", "original_max_position_embeddings",
                                          "low_freq_factor", "high_freq_factor"}
