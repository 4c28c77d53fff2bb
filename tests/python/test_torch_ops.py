"""posenc's torch.library custom ops (posenc._ops): opcheck for every op and scheme,
torch.compile (fullgraph, dynamic shapes) and torch.export of a decoder block for every scheme,
the device check, and the no-copy path to the kernels."""

import json
import os
import re

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):
    pytest.skip("torch >= 2.4 (torch.library.custom_op)", allow_module_level=True)

from torch import nn  # noqa: E402

import posenc  # noqa: E402
import posenc.torch as pt  # noqa: E402
from posenc import _ops  # noqa: E402

SCHEMES = ("none", "rope", "alibi", "t5", "shaw", "xl", "deberta")
ops = torch.ops.posenc


def tables_for(scheme, heads, dim, gen, dtype=torch.float32):
    """Random learnable tables of a scheme (requires_grad)."""
    def r(*shape):
        return (torch.randn(*shape, generator=gen) * 0.3).to(dtype).requires_grad_()
    return {
        "none": {}, "rope": {},
        "alibi": {"slopes": r(heads)},
        "t5": {"relative_attention_bias": r(32, heads)},
        "shaw": {"rel_k": r(9, heads, dim), "rel_v": r(9, heads, dim)},
        "xl": {"r_w_bias": r(heads, dim), "r_r_bias": r(heads, dim), "r_net": r(heads * dim, 6)},
        "deberta": {"pos_key": r(8, heads, dim), "pos_query": r(8, heads, dim)},
    }[scheme]


SETTINGS = {"shaw": {}, "deberta": {"max_relative_positions": 4}, "t5": {"max_distance": 40}}


def attention_args(scheme, dtype=torch.float32, seed=0, positions=False):
    g = torch.Generator().manual_seed(seed)
    b, lq, lk, h, d = 2, 5, 7, 2, 8
    q = torch.randn(b, lq, h, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, lk, h, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(b, lk, h, d, generator=g).to(dtype).requires_grad_()
    tables = tables_for(scheme, h, d, g, dtype)
    names = sorted(tables)
    kw = dict(SETTINGS.get(scheme, {}), scheme=scheme, causal=True)
    qp = kp = None
    if positions:
        qp = torch.tensor([[3, 4, 5, 6, 7], [9, 10, 11, 12, 13]])
        kp = torch.tensor([[1, 2, 3, 4, 5, 6, 7], [7, 8, 9, 10, 11, 12, 13]])
    return (q, k, v, [tables[n] for n in names], names, qp, kp), kw


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_attention(scheme, dtype):
    args, kw = attention_args(scheme, dtype, positions=scheme in ("rope", "t5"))
    torch.library.opcheck(ops.attention.default, args, kw)
    q, k, v, tables, names, qp, kp = args
    out, lse = ops.attention(*args, **kw)
    dout = torch.randn_like(out)
    bargs = (q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), dout,
             [t.detach() for t in tables], names, qp, kp)
    torch.library.opcheck(ops.attention_backward.default, bargs, kw)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_attention_op_gradients_match_the_float64_reference(scheme):
    (q, k, v, tables, names, qp, kp), kw = attention_args(scheme, torch.float64, seed=3)
    assert torch.autograd.gradcheck(
        lambda q, k, v, *t: ops.attention(q, k, v, list(t), names, qp, kp, **kw)[0],
        (q, k, v, *tables), atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_opcheck_attention_half(scheme, dtype):
    (q, k, v, tables, names, qp, kp), kw = attention_args(scheme)
    half = [x.detach().to(dtype) for x in (q, k, v)]
    tables = [t.detach() for t in tables]
    torch.library.opcheck(ops.attention_half.default, (*half, tables, names, qp, kp), kw)
    # The mixed kernel: float32 q, half k and v.
    torch.library.opcheck(ops.attention_half.default,
                          (q.detach(), half[1], half[2], tables, names, qp, kp), kw)


def test_opcheck_rope_and_rerotation():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, 3, 16, generator=g, requires_grad=True)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 9, 11, 13, 15, 17]])
    scaling = '{"factor": 2.0, "original_max_position_embeddings": 8, "rope_type": "dynamic"}'
    for kw in ({"base": 100.0}, {"style": "interleaved", "rotary_dim": 8}, {"scaling": scaling},
               {"positions_offset": 3}):
        for positions in (None, pos) if "positions_offset" not in kw else (None,):
            torch.library.opcheck(ops.rope.default, (x, positions), kw)
    x64 = x.detach().double().requires_grad_()
    torch.library.opcheck(ops.rope.default, (x64, pos), {"inverse": True})
    for dtype in (torch.bfloat16, torch.float16):
        torch.library.opcheck(ops.rope_half.default, (x.detach().to(dtype), pos), {"base": 500.0})
    short = posenc.rope_frequencies(16)
    long = posenc.rope_frequencies(16, scaling={"rope_type": "dynamic", "factor": 2.0,
                                                "original_max_position_embeddings": 8},
                                   seq_len=32)
    torch.library.opcheck(ops.rope.default, (x, pos), {
        "freqs_inv_freq": list(long.inv_freq), "freqs_attention_factor": long.attention_factor,
        "freqs_angles": long.angles})
    kw = {f"{which}_{part}": getattr(f, part) for which, f in (("from_freqs", short),
                                                                ("to_freqs", long))
          for part in ("attention_factor", "angles")}
    kw.update(from_freqs_inv_freq=list(short.inv_freq), to_freqs_inv_freq=list(long.inv_freq),
              style="half")
    torch.library.opcheck(ops.rerotate_rope.default, (x, pos), kw)


def test_opcheck_absolute_positions_and_merge():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    table = torch.randn(12, 8, generator=g, requires_grad=True)
    ids = torch.tensor([[0, 1, 2, 3, 4], [11, 3, 3, 0, 7]])
    torch.library.opcheck(ops.add_learned.default, (x, table, ids))
    torch.library.opcheck(ops.add_learned.default, (x, table, None), {"positions_offset": 4})
    torch.library.opcheck(ops.learned_backward.default, (x.detach(), ids, 12))
    cfg = {"base": 1e4, "layout": "concat", "denominator": "dim", "origin": 0, "odd_dim": "error"}
    torch.library.opcheck(ops.add_sinusoidal.default, (x, ids), cfg)
    torch.library.opcheck(ops.add_sinusoidal.default, (x, None), {**cfg, "positions_offset": 3})
    torch.library.opcheck(ops.sinusoidal_encode.default, (ids, 8), cfg)
    # attention_merge of two partial attentions over disjoint key sets.
    q = torch.randn(1, 4, 2, 8, generator=g)
    k = torch.randn(1, 9, 2, 8, generator=g)
    v = torch.randn(1, 9, 2, 8, generator=g)
    oa, la = pt.attention(q, k[:, :5], v[:, :5], return_lse=True)
    ob, lb = pt.attention(q, k[:, 5:], v[:, 5:], return_lse=True)
    args = tuple(t.clone().requires_grad_() for t in (oa, la, ob, lb))
    torch.library.opcheck(ops.attention_merge.default, args)
    out, lse = pt.attention_merge(oa, la, ob, lb)
    full, full_lse = pt.attention(q, k, v, return_lse=True)
    assert torch.allclose(out, full, atol=2e-6) and torch.allclose(lse, full_lse, atol=2e-6)


def test_attention_merge_gradient_matches_autograd_of_the_formula():
    g = torch.Generator().manual_seed(7)
    oa, ob = (torch.randn(1, 3, 2, 4, generator=g, dtype=torch.float64) for _ in range(2))
    la, lb = (torch.randn(1, 2, 3, generator=g, dtype=torch.float64) for _ in range(2))
    la[0, 1, 2] = -float("inf")  # a part that saw no key in one row
    args = [t.float().requires_grad_() for t in (oa, la, ob, lb)]
    out, lse = pt.attention_merge(*args)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    (out * dout).sum().add((lse * dlse).sum()).backward()
    ref = [t.clone().requires_grad_() for t in (oa, la, ob, lb)]
    lse_r = torch.logaddexp(ref[1], ref[3])
    wa = torch.exp(ref[1] - lse_r).transpose(1, 2).unsqueeze(-1)
    wb = torch.exp(ref[3] - lse_r).transpose(1, 2).unsqueeze(-1)
    out_r = wa * ref[0] + wb * ref[2]
    (out_r * dout.double()).sum().add((lse_r * dlse.double()).sum()).backward()
    for a, r in zip(args, ref):
        assert torch.allclose(a.grad.double(), r.grad, atol=1e-5), (a.grad, r.grad)


# ---- the ops on the way to the kernels --------------------------------------------------------

@pytest.mark.parametrize("scheme", ["t5", "shaw", "rope"])
def test_eager_calls_and_the_operators_agree(scheme):
    # Eager calls on plain tensors skip the dispatcher (posenc._ops.call_attention); the values
    # and gradients are the operator's, bit for bit.
    (q, k, v, tables, names, qp, kp), kw = attention_args(scheme, positions=True)
    inputs = [q, k, v, *tables]
    out1, lse1 = _ops.call_attention(q, k, v, tables, names, qp, kp, {}, kw)
    g1 = torch.autograd.grad(out1.square().sum(), inputs)
    out2, lse2 = ops.attention(q, k, v, tables, names, qp, kp, **kw)
    g2 = torch.autograd.grad(out2.square().sum(), inputs)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    x = q.detach().clone().requires_grad_()
    r1 = _ops.call_rope(x, qp, {"base": 50.0})
    (d1,) = torch.autograd.grad(r1.sum(), x)
    r2 = ops.rope(x, qp, base=50.0)
    (d2,) = torch.autograd.grad(r2.sum(), x)
    assert torch.equal(r1, r2) and torch.equal(d1, d2)


def test_the_operators_are_seen_by_dispatch_modes_and_the_profiler():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    with Log() as log:
        pt.attention(q, q, q, "alibi", causal=True).sum().backward()
        pt.rope(q.detach())
    assert {"posenc.attention.default", "posenc.attention_backward.default",
            "posenc.rope.default"} <= set(log.ops), log.ops
    with torch.profiler.profile() as prof:
        pt.attention(q, q, q, "t5", causal=True,
                     params={"relative_attention_bias": torch.zeros(32, 2)})
    assert any("posenc::attention" in e.key for e in prof.key_averages())


def test_cpu_tensors_reach_the_kernels_without_copies(monkeypatch):
    seen = {}
    real = posenc._posenc.attention

    def spy(q, k, v, **kw):
        seen.update(q=q.__array_interface__["data"][0], k=k.__array_interface__["data"][0],
                    v=v.__array_interface__["data"][0],
                    t=kw["params"]["relative_attention_bias"].__array_interface__["data"][0])
        return real(q, k, v, **kw)

    monkeypatch.setattr(posenc._posenc, "attention", spy)
    g = torch.Generator().manual_seed(1)
    qb, kb, vb = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))  # [b, h, l, d]
    q, k, v = (x.transpose(1, 2) for x in (qb, kb, vb))  # strided views, no copy wanted
    table = torch.randn(32, 2, generator=g)
    out = pt.attention(q, k, v, "t5", params={"relative_attention_bias": table}, causal=True)
    assert seen == {"q": qb.data_ptr(), "k": kb.data_ptr(), "v": vb.data_ptr(),
                    "t": table.data_ptr()}
    # Outputs are fresh tensors.
    assert out.untyped_storage().data_ptr() not in {x.data_ptr() for x in (qb, kb, vb, table)}


@pytest.mark.parametrize("device", ["meta"])
def test_a_tensor_on_another_device_gets_one_clear_error(device):
    x = torch.empty(1, 4, 2, 8, device=device)
    c = torch.zeros(1, 4, 2, 8)
    calls = [
        lambda: pt.attention(x, c, c, "alibi", causal=True),
        lambda: pt.attention(c, x, c),
        lambda: pt.attention(c, c, c, "t5", params={"relative_attention_bias":
                                                    torch.empty(32, 2, device=device)}),
        lambda: pt.rope(x),
        lambda: pt.rope(c, positions=torch.arange(4, device=device)),
        lambda: pt.rerotate_rope(x, posenc.rope_frequencies(8), posenc.rope_frequencies(8)),
        lambda: pt.attention_merge(x, torch.zeros(1, 2, 4), c, torch.zeros(1, 2, 4)),
        lambda: pt.add_learned(x[0], torch.zeros(8, 8)),
        lambda: pt.add_sinusoidal(x[0]),
        lambda: pt.PositionalAttention("rope", 2, head_dim=8)(x, x, x),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=f"on device '{device}'.*(CPU only|CPU and CUDA)"):
            call()
    # The ops' implementations check with the same function (on the meta device the ops run
    # their shape functions instead, as torch.compile does).
    with pytest.raises(ValueError, match=f"q is on device '{device}'"):
        _ops.require_cpu(x, "q")


def test_index_tensors_on_the_cpu_follow_the_call_to_its_device():
    """Positions, documents, prefix lengths, cu_seqlens and a dense mask built on the CPU (as
    transformers' masks and posenc.hf build them) are moved to the device of a CUDA call (here
    the meta device stands for it); a CPU call keeps them, and refuses them on another device."""
    from posenc import torch as ptm
    device = torch.device("meta")
    docs = torch.zeros(2, 3, dtype=torch.int32)
    masks = ptm._split_masks({"query_documents": docs, "mask": [[[1, 0, 1]] * 3] * 2,
                              "cu_seqlens_q": torch.tensor([0, 3])}, device)
    assert {n: t.device.type for n, t in masks.items()} == {
        "query_documents": "meta", "mask": "meta", "cu_seqlens_q": "meta"}
    kw, (qpos, kpos) = ptm._split_positions({"query_positions": torch.arange(3),
                                             "key_positions": 4}, "query_positions",
                                            "key_positions", device=device)
    assert qpos.device.type == "meta" and kpos is None and kw == {"key_positions": 4}
    assert ptm._split_masks({"query_documents": docs})["query_documents"] is docs
    with pytest.raises(ValueError, match="query_documents is on device 'meta'"):
        ptm._split_masks({"query_documents": docs.to(device)})


# ---- torch.compile and torch.export -----------------------------------------------------------

class DecoderBlock(nn.Module):
    """Embedding, attention with a positional scheme (PositionalAttention), an MLP."""

    def __init__(self, scheme, vocab=40, heads=2, head_dim=8):
        super().__init__()
        d = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        options = {"shaw": {"max_relative_position": 4, "shared": False},
                   "deberta": {"max_relative_positions": 4}, "xl": {"d_model": 6},
                   "alibi": {"learnable": True}}.get(scheme, {})
        self.attn = pt.PositionalAttention(scheme, heads, heads, head_dim, causal=True,
                                           **options)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.out = nn.Linear(d, vocab)

    def forward(self, ids):
        b, n = ids.shape
        x = self.emb(ids)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).unbind(2)
        x = x + self.proj(self.attn(q, k, v).reshape(b, n, -1))
        x = x + self.mlp(x)
        return self.out(x)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_decoder_block_compiles_without_graph_breaks(scheme):
    torch.manual_seed(0)
    model = DecoderBlock(scheme)
    ids = [torch.randint(0, 40, (2, n)) for n in (7, 11, 5)]
    explained = torch._dynamo.explain(model)(ids[0])
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    # The default backend compiles one scheme (it is slow on two cores); aot_eager (dynamo,
    # AOTAutograd and the fake functions, no code generation) the others.
    backend = "inductor" if scheme in ("alibi",) else "aot_eager"
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
    for x in ids:  # several lengths: one dynamic graph
        model.zero_grad()
        want = model(x)
        want.square().mean().backward()
        want_grads = _grads(model)
        model.zero_grad()
        got = compiled(x)
        got.square().mean().backward()
        got_grads = _grads(model)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        assert want_grads.keys() == got_grads.keys()
        for n in want_grads:
            assert torch.allclose(got_grads[n], want_grads[n], atol=1e-5, rtol=1e-4), n


@pytest.mark.parametrize("scheme", SCHEMES)
def test_decoder_block_exports(scheme):
    torch.manual_seed(1)
    model = DecoderBlock(scheme).eval()
    ids = torch.randint(0, 40, (2, 9))
    seq = torch.export.Dim("seq", min=2, max=64)
    exported = torch.export.export(model, (ids,), dynamic_shapes={"ids": {1: seq}})
    names = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert any("posenc.attention" in n for n in names), names
    for n in (9, 17):
        x = torch.randint(0, 40, (2, n))
        assert torch.allclose(exported.module()(x), model(x), atol=1e-6)


TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 2,
              "num_key_value_heads": 1, "max_position_embeddings": 16, "rope_theta": 500.0,
              "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}

LOAD_AND_RUN = """
import sys
import torch
import posenc.torch  # registers the posenc ops
program = torch.export.load(sys.argv[1])
q, k, v = torch.load(sys.argv[2])
torch.save(program.module()(q, k, v), sys.argv[3])
"""


def test_an_exported_model_made_from_a_config_runs_in_another_process(tmp_path):
    # The config travels in the graph as its config.json text: the saved program needs nothing
    # of the process that made it.
    import subprocess
    import sys

    class Core(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = pt.PositionalAttention(config=posenc.read_model_config(TINY_LLAMA),
                                               causal=True)

        def forward(self, q, k, v):
            return self.attn(q, k, v)

    model = Core().eval()
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 40, 2, 16, generator=g)  # 40 > 16 tokens: dynamic NTK scales the angles
    k, v = torch.randn(1, 40, 1, 16, generator=g), torch.randn(1, 40, 1, 16, generator=g)
    exported = torch.export.export(model, (q, k, v))
    calls = [n for n in exported.graph.nodes if n.target == ops.attention.default]
    assert len(calls) == 1 and calls[0].kwargs["config"] == model.attn.positions.settings()[
        "config"].json
    torch.export.save(exported, tmp_path / "model.pt2")
    torch.save((q, k, v), tmp_path / "inputs.pt")
    subprocess.run([sys.executable, "-c", LOAD_AND_RUN, str(tmp_path / "model.pt2"),
                    str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")], check=True,
                   timeout=180)
    got = torch.load(tmp_path / "out.pt")
    want = model(q, k, v)
    assert torch.equal(got, want)
    # Not the rotation of the unscaled frequencies: the config's scaling reached the op.
    plain = pt.attention(q, k, v, "rope", causal=True, base=500.0)
    assert not torch.allclose(got, plain, atol=1e-4)


def test_messages_name_the_config_by_its_path():
    # The op carries the config's text and the path it was read from: a conflict names the file,
    # through the op as through the NumPy function.
    path = os.path.join(os.environ.get("POSENC_TEST_CONFIGS_DIR", "tests/configs"),
                        "llama-2-7b.json")
    cfg = posenc.read_model_config(path)
    assert cfg.source == path and json.loads(cfg.json)["model_type"] == "llama"
    q = torch.zeros(1, 3, 32, 128)
    for config in (path, cfg):
        with pytest.raises(ValueError, match=re.escape(path)):
            pt.attention(q, q, q, "alibi", config=config)
        with pytest.raises(ValueError, match=re.escape(path)):
            posenc.attention(q.numpy(), q.numpy(), q.numpy(), "alibi", config=config)
    # A dict has no path: "config".
    with pytest.raises(ValueError, match="conflicts with config"):
        pt.attention(q, q, q, "alibi", config=json.loads(cfg.json))


def test_the_cuda_forms_of_the_elementwise_ops_equal_the_cpu_kernels():
    # The ops run posenc._device's PyTorch forms on CUDA tensors: run here on CPU tensors, they
    # give the CPU kernels' numbers (accurate RoPE to the last bit: float64 angles, one rounding).
    from posenc import _device
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 7, 3, 16, generator=g)
    ids = torch.tensor([[3, 4, 5, 9, 100, 1000, 70000], [0, 1, 2, 3, 4, 5, 6]])
    llama = os.path.join(os.environ.get("POSENC_TEST_CONFIGS_DIR", "tests/configs"),
                         "llama-3.1-8b.json")
    settings = [{}, {"style": "interleaved"}, {"rotary_dim": 8}, {"inverse": True},
                {"positions": 5}, {"freqs": posenc.rope_frequencies(16, base=500.0)},
                {"scaling": {"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 16}},
                {"scaling": {"rope_type": "dynamic", "factor": 2.0,
                             "original_max_position_embeddings": 8}}]
    for kw in settings:
        for positions in ((ids, None) if "positions" not in kw else (None,)):
            s = _ops.typed("rope", kw, "rope")
            for t, impl, op in ((x, _ops.rope_impl, "rope"), (x.double(), _ops.rope_impl, "rope"),
                                (x.bfloat16(), _ops.rope_half_impl, "rope_half")):
                got = _device.rope(t, positions, _ops._binding_kwargs(op, s))
                assert got.dtype == t.dtype and torch.equal(got, impl(t, positions, **s)), kw
    xc = torch.randn(1, 5, 2, 128, generator=g)
    s = _ops.typed("rope", {"config": llama}, "rope")
    assert torch.equal(_device.rope(xc, None, _ops._binding_kwargs("rope", s)),
                       _ops.rope_impl(xc, None, **s))
    # float32 angles: the frameworks' float32 cos and sin, the device's own: within float32's
    # rounding of the angles' cos and sin.
    s = _ops.typed("rope", {"angles": "float32"}, "rope")
    diff = (_device.rope(x, ids, _ops._binding_kwargs("rope", s)) - _ops.rope_impl(x, ids, **s))
    assert diff.abs().max() <= 4e-7 * x.abs().max()
    # Absolute encodings.
    h = torch.randn(2, 7, 16, generator=g)
    table = torch.randn(70001, 16, generator=g)
    s = _ops.typed("add_learned", {}, "add_learned")
    assert torch.equal(_device.add_learned(h, table, ids, _ops._binding_kwargs("add_learned", s)),
                       _ops._add_learned_impl(h, table, ids, **s))
    dy = torch.randn(2, 7, 16, generator=g)
    got = _device.learned_backward(dy, ids, 70001, _ops._binding_kwargs("learned_backward", s))
    want = _ops._learned_backward_impl(dy, ids, 70001, **s)
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    for kw in ({}, {"positions": 3}, {"origin": 2}, {"base": 500.0, "layout": "concat"}):
        s = _ops.typed("add_sinusoidal", kw, "add_sinusoidal")
        positions = None if "positions" in kw or "origin" in kw else ids
        assert torch.equal(
            _device.add_sinusoidal(h, positions, _ops._binding_kwargs("add_sinusoidal", s)),
            _ops._add_sinusoidal_impl(h, positions, **s)), kw
    s = _ops.typed("sinusoidal_encode", {"base": 100.0}, "sinusoidal_encode")
    assert torch.equal(_device.sinusoidal_encode(ids, 16, _ops._binding_kwargs(
        "sinusoidal_encode", s)), _ops._sinusoidal_encode_impl(ids, 16, **s))
    # Their checks: positions outside [0, 2^48] or the table, and of the wrong shape.
    with pytest.raises(posenc.InvalidValueError, match="positions"):
        _device.rope(x, torch.tensor([-1] * 7), {})
    with pytest.raises(posenc.ShapeError, match="positions"):
        _device.rope(x, torch.arange(6), {})
    with pytest.raises(posenc.InvalidValueError, match="table of 10 positions"):
        _device.add_learned(h, table[:10], ids, {})


def test_the_cuda_forms_of_rerotation_and_merging_equal_the_cpu_functions():
    from posenc import _device
    g = torch.Generator().manual_seed(12)
    k = torch.randn(2, 9, 3, 16, generator=g)
    ids = torch.tensor([[0, 5, 9, 100, 1000, 4095, 4096, 70000, 3]] * 2)
    old, new = posenc.rope_frequencies(16, base=1e4), posenc.rope_frequencies(
        16, base=1e4, scaling={"rope_type": "dynamic", "factor": 2.0,
                               "original_max_position_embeddings": 64}, seq_len=5000)
    for style in ("half", "interleaved"):
        s = _ops.typed("rerotate_rope", {"from_freqs": old, "to_freqs": new, "style": style},
                       "rerotate_rope")
        got = _device.rerotate_rope(k, ids, _ops._binding_kwargs("rerotate_rope", s))
        assert got.dtype == k.dtype and torch.equal(got, _ops._rerotate_impl(k, ids, **s)), style
        # float64 keys (this form on the CPU too): the two rotations of the float64 reference.
        k64 = k.double()
        got = _ops._rerotate_impl(k64, ids, **s)
        back = _ops.rope_impl(k64, ids, **_ops.typed("rope", {"freqs": old, "style": style,
                                                            "inverse": True}, "rope"))
        want = _ops.rope_impl(back, ids, **_ops.typed("rope", {"freqs": new, "style": style},
                                                      "rope"))
        assert got.dtype == torch.float64 and torch.allclose(got, want, rtol=0, atol=1e-13)
    out_a, out_b = torch.randn(2, 5, 3, 8, generator=g), torch.randn(2, 5, 3, 8, generator=g)
    lse_a, lse_b = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    lse_a[0, 1, 2] = lse_b[0, 1, 2] = float("-inf")  # a row that saw no key in either part
    lse_b[1, 0, 0] = float("-inf")
    got = _device.attention_merge(out_a, lse_a, out_b, lse_b)
    want = _ops.attention_merge(out_a, lse_a, out_b, lse_b)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with pytest.raises(posenc.InvalidValueError, match="lse_b is NaN"):
        _device.attention_merge(out_a, lse_a, out_b, torch.full_like(lse_b, float("nan")))
