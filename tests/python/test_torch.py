"""posenc.torch: autograd functions (gradcheck in float64 on every scheme, q, k, v and every
table), float32 gradients against the independent PyTorch reference, and the modules."""

import os

import numpy as np
import pytest

from conftest import SCHEMES, Case, variants

torch = pytest.importorskip("torch")
import posenc  # noqa: E402
import posenc.torch as pt  # noqa: E402
import reference  # noqa: E402


def tensors(case, dtype, requires_grad=True):
    q, k, v = (torch.tensor(x, dtype=dtype, requires_grad=requires_grad)
               for x in (case.q, case.k, case.v))
    params = {n: torch.tensor(p, dtype=dtype, requires_grad=requires_grad)
              for n, p in case.params.items()}
    return q, k, v, params


@pytest.mark.parametrize("scheme,variant", [(s, v) for s in SCHEMES for v in range(variants(s))])
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_float64_every_scheme(scheme, variant, causal):
    c = Case(scheme, seed=31 + variant, batch=1, seq_q=3, seq_k=4, heads_q=2, heads_kv=1, dim=4,
             causal=causal, variant=variant, positions=False)
    q, k, v, params = tensors(c, torch.float64)
    kw = {n: x for n, x in c.kw.items()}
    names = sorted(params)

    def f(q, k, v, *tables):
        return pt.attention(q, k, v, scheme, params=dict(zip(names, tables)) or None, **kw)
    assert torch.autograd.gradcheck(f, (q, k, v, *[params[n] for n in names]))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_float32_gradients_against_the_reference_with_positions_and_gqa(scheme):
    c = Case(scheme, seed=41, causal=True, positions=True)
    q, k, v, params = tensors(c, torch.float32)
    out = pt.attention(q, k, v, scheme, params=params or None, **c.kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * dout).sum().backward()
    ref, (rq, rk, rv, rparams) = c.reference("float64", requires_grad=True)
    (ref * dout.double()).sum().backward()
    assert (out.detach().double() - ref.detach()).abs().max() < 3e-6
    for name, a, b in [("q", q, rq), ("k", k, rk), ("v", v, rv)] + \
            [(n, params[n], rparams[n]) for n in params]:
        scale = max(1.0, float(b.grad.abs().max()))
        assert float((a.grad.double() - b.grad).abs().max()) < 1e-5 * scale, name


def test_rope_function_and_module():
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([[0, 1, 2, 3, 4], [9, 7, 1000, 3, 1]])
    assert torch.autograd.gradcheck(lambda x: pt.rope(x, positions=pos, style="interleaved",
                                                      rotary_dim=4), (x,))
    f = pt._posenc.rope_frequencies(8, base=100.0)
    y = pt.rope(x.float(), f, positions=pos)
    want = reference.rope(x.detach(), pos, torch.from_numpy(f.inv_freq))
    assert (y.double() - want).abs().max() < 2e-6
    m = pt.Rope(8, base=100.0)
    assert (m.rotate(x.float(), pos) - y).abs().max() == 0
    # As an attention scheme: the fused kernel with rotation inside.
    q = torch.randn(1, 6, 2, 8)
    out = m(q, q, q, causal=True)
    qr = reference.rope(q.double(), torch.arange(6)[None], torch.from_numpy(f.inv_freq))
    want = reference.attention(qr, qr, q.double(), causal=True)
    assert (out.double() - want).abs().max() < 3e-6


def test_modules_own_tables_train_and_read_configs(configs_dir):
    torch.manual_seed(0)
    t5 = pt.T5RelativeBias.from_config(os.path.join(configs_dir, "t5-base.json"))
    assert tuple(t5.relative_attention_bias.shape) == (32, 12)
    alibi = pt.Alibi.from_config(os.path.join(configs_dir, "bloom-560m.json"))
    np.testing.assert_array_equal(alibi.slopes.numpy(), pt._posenc.alibi_slopes(16))
    deb = pt.DebertaRelative.from_config(os.path.join(configs_dir, "deberta-v3-base.json"))
    assert deb.pos_key.shape[0] == 2 * 256
    rope = pt.Rope.from_config(os.path.join(configs_dir, "llama-3.1-8b.json"))
    q = torch.randn(1, 4, 32, 128)
    k = torch.randn(1, 4, 8, 128)
    out = rope(q, k, k, causal=True)
    assert out.shape == q.shape
    # PositionalAttention from a config, and a few optimizer steps lowering a loss.
    att = pt.PositionalAttention(config=os.path.join(configs_dir, "t5-base.json"), causal=True)
    assert att.scheme == "t5" and att.heads == 12
    layer = pt.PositionalAttention("shaw", 2, 2, 8, max_relative_position=3, causal=True)
    opt = torch.optim.Adam(layer.parameters(), lr=0.05)
    q = torch.randn(2, 10, 2, 8)
    target = torch.randn(2, 10, 2, 8)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = ((layer(q, q, q) - target) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_positional_attention_layouts_and_strided_inputs(scheme):
    torch.manual_seed(1)
    opts = {"max_relative_positions": 8} if scheme == "deberta" else {}
    m = pt.PositionalAttention(scheme, 4, 2, 16, causal=True, layout="bhld", **opts)
    m_blhd = pt.PositionalAttention(scheme, 4, 2, 16, causal=True, **opts)
    m_blhd.load_state_dict(m.state_dict())
    q = torch.randn(2, 4, 9, 16, requires_grad=True)  # [B, H, L, D]
    k = torch.randn(2, 2, 9, 16, requires_grad=True)
    out = m(q, k, k)
    assert out.shape == q.shape
    want = m_blhd(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2)).transpose(1, 2)
    assert (out - want).abs().max() == 0
    out.sum().backward()
    assert q.grad is not None and k.grad is not None


def test_learned_and_sinusoidal_positions():
    torch.manual_seed(2)
    lp = pt.LearnedPositions(10, 8)
    x = torch.randn(2, 6, 8, requires_grad=True)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [9, 9, 0, 1, 2, 3]])
    y = lp(x, pos)
    assert (y - (x + lp.weight[pos])).abs().max() == 0
    y.square().sum().backward()
    w = lp.weight.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    (x2 + w[pos]).square().sum().backward()
    assert (lp.weight.grad - w.grad).abs().max() < 1e-5
    assert (x.grad - x2.grad).abs().max() < 1e-6
    with pytest.raises(ValueError, match="10"):
        lp(x, pos + 1)
    sp = pt.SinusoidalPositions(8)
    z = sp(x.detach(), 3)
    # The float64 sum rounded once (posenc.add_sinusoidal), within an ulp of x + the float32 table.
    assert torch.equal(z, torch.from_numpy(posenc.add_sinusoidal(x.detach().numpy(), positions=3)))
    want = x.detach() + torch.from_numpy(pt._posenc.sinusoidal_table(9, 8)[3:])
    assert (z - want).abs().max() <= 2.5e-7


def test_errors_and_device_checks():
    q = torch.zeros(1, 4, 4, 8)
    with pytest.raises(ValueError, match="kv heads"):
        pt.attention(q, torch.zeros(1, 4, 3, 8), torch.zeros(1, 4, 3, 8))
    with pytest.raises(TypeError):
        pt.attention(q.numpy(), q, q)
    with pytest.raises(ValueError, match="scheme"):
        pt.PositionalAttention("bogus", 4, 4, 8)
    if hasattr(torch, "device") and torch.cuda.is_available():  # pragma: no cover
        with pytest.raises(ValueError, match="CPU tensors"):
            pt.attention(q.cuda(), q.cuda(), q.cuda())


def test_rope_module_with_scaling_uses_the_sequence_length():
    m = pt.Rope(16, scaling={"rope_type": "dynamic", "factor": 2.0,
                             "original_max_position_embeddings": 8})
    q = torch.randn(1, 20, 2, 16)
    f = pt._posenc.rope_frequencies(16, scaling={"rope_type": "dynamic", "factor": 2.0,
                                                 "original_max_position_embeddings": 8},
                                    seq_len=20)
    want = pt.attention(q, q, q, "rope", freqs=f, causal=True)
    assert (m(q, q, q, causal=True) - want).abs().max() == 0
    short = pt._posenc.rope_frequencies(16)
    assert not np.array_equal(f.inv_freq, short.inv_freq)  # the scaling is in force at 20 > 8


def test_every_registry_scheme_has_a_module_or_a_clear_error(monkeypatch):
    """posenc.torch imports whatever schemes the registry lists; PositionalAttention builds each
    scheme's module, and for a scheme without one it names the function that computes it."""
    assert list(pt._SCHEMES) == list(posenc.SCHEMES)
    for name in posenc.SCHEMES:
        layer = pt.PositionalAttention(name, heads=4, head_dim=16)
        assert isinstance(layer.positions, pt._SCHEMES[name])
    monkeypatch.setitem(pt._SCHEMES, "t5", None)  # as a scheme added without a torch module
    with pytest.raises(ValueError, match=r"posenc.torch.attention\(q, k, v, 't5', params="):
        pt.PositionalAttention("t5", heads=4, head_dim=16)
