"""posenc.torch on CUDA tensors against the same calls on CPU tensors: every op with a CUDA form
(attention and attention_half through the Triton kernels, RoPE, the absolute encodings and the
paged cache's rope_append through posenc._device), forward and backward, eager and under
torch.compile(fullgraph=True) and torch.export. Skipped without a CUDA device
(scripts/gpu_check.sh runs it on a GPU machine)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import posenc  # noqa: E402
import posenc.torch as pt  # noqa: E402
from posenc import _ops  # noqa: E402

CUDA = torch.device("cuda")


def _pair(*shape, seed=0, dtype=torch.float32):
    """A CPU tensor and its CUDA copy, both requiring gradients."""
    g = torch.Generator().manual_seed(seed)
    cpu = torch.randn(*shape, generator=g).to(dtype).requires_grad_()
    return cpu, cpu.detach().to(CUDA).requires_grad_()


@pytest.mark.parametrize("kw", [{}, {"style": "interleaved", "rotary_dim": 32},
                                {"base": 5e5, "scaling": {"rope_type": "llama3", "factor": 8.0,
                                                          "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 64}},
                                {"positions": 7}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_on_cuda_equals_the_cpu_kernel(kw, dtype):
    cpu, gpu = _pair(2, 300, 4, 64, dtype=dtype)
    ids = torch.randint(0, 1 << 20, (2, 300))
    extra = {} if "positions" in kw else {"positions": ids}
    a = pt.rope(cpu, **kw, **extra)
    b = pt.rope(gpu, **kw, **{n: v.to(CUDA) for n, v in extra.items()})
    assert b.device.type == "cuda" and torch.equal(a, b.cpu())
    a.sum().backward()
    b.sum().backward()
    assert torch.equal(cpu.grad, gpu.grad.cpu())


def test_absolute_encodings_on_cuda_equal_the_cpu_kernels():
    cpu, gpu = _pair(2, 50, 32)
    table_cpu, table_gpu = _pair(100, 32, seed=1)
    a, b = pt.add_learned(cpu, table_cpu, 20), pt.add_learned(gpu, table_gpu, 20)
    assert torch.equal(a, b.cpu())
    a.square().sum().backward()
    b.square().sum().backward()
    assert torch.allclose(table_cpu.grad, table_gpu.grad.cpu(), rtol=0, atol=1e-5)
    assert torch.equal(pt.add_sinusoidal(cpu, 3), pt.add_sinusoidal(gpu, 3).cpu())


def test_rerotation_and_merging_on_cuda_equal_the_cpu_functions():
    cpu, gpu = _pair(2, 64, 4, 32)
    old = posenc.rope_frequencies(32)
    new = posenc.rope_frequencies(32, scaling={"rope_type": "dynamic", "factor": 2.0,
                                               "original_max_position_embeddings": 16},
                                  seq_len=64)
    assert torch.equal(pt.rerotate_rope(cpu, old, new),
                       pt.rerotate_rope(gpu, old, new).cpu())
    out_a, out_a_gpu = _pair(2, 16, 4, 32, seed=7)
    out_b, out_b_gpu = _pair(2, 16, 4, 32, seed=8)
    lse_a, lse_a_gpu = _pair(2, 4, 16, seed=9)
    lse_b, lse_b_gpu = _pair(2, 4, 16, seed=10)
    a = pt.attention_merge(out_a, lse_a, out_b, lse_b)
    b = pt.attention_merge(out_a_gpu, lse_a_gpu, out_b_gpu, lse_b_gpu)
    assert all(torch.equal(x, y.cpu()) for x, y in zip(a, b))


def test_paged_attention_on_cuda_against_the_cpu_kernel():
    g = torch.Generator().manual_seed(13)
    q = torch.randn(3, 1, 8, 64, generator=g)
    k_pages, v_pages = torch.randn(20, 16, 2, 64, generator=g), torch.randn(20, 16, 2, 64,
                                                                            generator=g)
    table = torch.tensor([[0, 4, 9], [3, 4, -1], [11, 12, 13]], dtype=torch.int32)
    lens = torch.tensor([40, 20, 48], dtype=torch.int32)
    want = pt.attention_paged(q, k_pages, v_pages, table, lens, "alibi", causal=True)
    got = pt.attention_paged(q.to(CUDA), k_pages.to(CUDA), v_pages.to(CUDA), table.to(CUDA),
                             lens.to(CUDA), "alibi", causal=True)
    assert got.device.type == "cuda" and (got.cpu() - want).abs().max() <= 1e-5


# The learned tables of each scheme's case: shapes, and a scale for their values.
_TABLES = {"t5": {"relative_attention_bias": (32, 8)},
           "shaw": {"rel_k": (33, 64), "rel_v": (33, 8, 64)},
           "xl": {"r_w_bias": (8, 64), "r_r_bias": (8, 64), "r_net": (512, 32)},
           "deberta": {"pos_key": (64, 8, 64), "pos_query": (64, 8, 64)}}


@pytest.mark.parametrize("scheme,kw", [("none", {}), ("rope", {"base": 5e5}), ("alibi", {}),
                                       ("t5", {"scale": 1.0}), ("shaw", {}), ("xl", {}),
                                       ("deberta", {"position_buckets": 32,
                                                    "max_relative_positions": 128})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_on_cuda_against_the_float64_reference(scheme, kw, dtype):
    q, qg = _pair(2, 300, 8, 64, seed=2, dtype=dtype)
    k, kg = _pair(2, 300, 2, 64, seed=3, dtype=dtype)
    v, vg = _pair(2, 300, 2, 64, seed=4, dtype=dtype)
    params = gparams = None
    if scheme in _TABLES:
        pairs = {n: _pair(*shape, seed=5 + i) for i, (n, shape) in
                 enumerate(_TABLES[scheme].items())}
        params = {n: (c * 0.1).detach().requires_grad_() for n, (c, _) in pairs.items()}
        gparams = {n: (g * 0.1).detach().requires_grad_() for n, (_, g) in pairs.items()}
    ref = pt.attention(q.double(), k.double(), v.double(), scheme, causal=True,
                       params=None if params is None else {n: x.double() for n, x in
                                                           params.items()}, **kw)
    out = pt.attention(qg, kg, vg, scheme, causal=True, params=gparams, **kw)
    assert out.device.type == "cuda" and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (out.cpu().double() - ref).abs().max() <= tol * max(1.0, ref.abs().max())
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(dtype)
    ref.backward(dout.double())
    out.backward(dout.to(CUDA))
    for name, a, b in (("q", q, qg), ("k", k, kg), ("v", v, vg)):
        assert (b.grad.cpu().double() - a.grad).abs().max() <= (
            tol * max(1.0, a.grad.abs().max())), name
    for name in params or {}:  # float32 tables: float32 gradients, summed by atomics
        a, b = params[name].grad, gparams[name].grad
        assert (b.cpu().double() - a).abs().max() <= 1e-4 * max(1.0, a.abs().max()), name


def test_positional_attention_compiles_and_exports_on_cuda():
    module = pt.PositionalAttention("rope", 8, 2, 64, causal=True, base=5e5).to(CUDA)
    q = torch.randn(2, 128, 8, 64, device=CUDA, dtype=torch.bfloat16)
    k = torch.randn(2, 128, 2, 64, device=CUDA, dtype=torch.bfloat16)
    v = torch.randn(2, 128, 2, 64, device=CUDA, dtype=torch.bfloat16)
    eager = module(q, k, v)
    compiled = torch.compile(module, fullgraph=True)(q, k, v)
    assert torch.equal(eager, compiled)
    exported = torch.export.export(module, (q, k, v))
    assert torch.equal(exported.module()(q, k, v), eager)


def test_what_the_triton_kernels_lack_is_refused_on_cuda():
    q = torch.randn(1, 8, 2, 16, device=CUDA)
    config = {"model_type": "llama4_text", "hidden_size": 32, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 5e5,
              "max_position_embeddings": 64, "num_hidden_layers": 4,
              "no_rope_layers": [1, 1, 1, 0], "attn_temperature_tuning": True,
              "floor_scale": 8192, "attn_scale": 0.1}
    with pytest.raises(ValueError, match="backend='triton'.*query temperature"):
        pt.attention(q, q, q, config=config, layer=3)
    with pytest.raises(ValueError, match="CPU only"):
        pt.attention(q, q, q, backend="cpu")
    assert posenc.attention is not None


# ---- rope_append and attention_half ------------------------------------------------------------

def _pages(layout, dtype, seed=14, dim=64):
    """Random pages of 4 slots (12 of them), a table whose rows share page 3 (read only) and have
    unused entries -1, and lengths that count 5 new tokens per row (row 0's cross a page)."""
    g = torch.Generator().manual_seed(seed)
    shape = (12, 4, 2, dim) if layout == "token_major" else (12, 2, 4, dim)
    k_pages, v_pages = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    table = torch.tensor([[3, 0, 7, -1], [3, 9, 10, -1], [11, 2, 5, 8]], dtype=torch.int32)
    return k_pages, v_pages, table, torch.tensor([11, 9, 14], dtype=torch.int32)


def _bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_append_on_cuda_equals_the_cpu_kernel(layout, dtype):
    k_pages, v_pages, table, lens = _pages(layout, dtype)
    g = torch.Generator().manual_seed(15)
    k_new, v_new = torch.randn(3, 5, 2, 64, generator=g), torch.randn(3, 5, 2, 64, generator=g)
    ids = torch.randint(0, 1 << 20, (3, 5), generator=g)
    cases = [({"base": 5e5}, None), ({"style": "interleaved", "rotary_dim": 32}, ids),
             ({"rotary_dim": 16, "offset": 48}, ids[0]),
             ({"scaling": {"rope_type": "dynamic", "factor": 2.0,
                           "original_max_position_embeddings": 4}}, None),
             ({"positions": 7}, None)]
    for kw, positions in cases:
        settings = _ops.typed("rope_append", dict(kw, layout=layout), "rope_append")
        for new in sorted({torch.float32, dtype}, key=str):
            kn, vn = k_new.to(new), v_new.to(new)
            cpu = [k_pages.clone(), v_pages.clone()]
            gpu = [k_pages.to(CUDA), v_pages.to(CUDA)]
            torch.ops.posenc.rope_append(kn, vn, *cpu, table, lens, positions, **settings)
            # The tables may stay on the CPU or move to the device.
            torch.ops.posenc.rope_append(kn.to(CUDA), vn.to(CUDA), *gpu, table.to(CUDA), lens,
                                         None if positions is None else positions.to(CUDA),
                                         **settings)
            for a, b in zip(cpu, gpu):
                assert b.device.type == "cuda" and torch.equal(_bits(a), _bits(b.cpu())), kw
            assert not torch.equal(cpu[0], k_pages)


def test_rope_append_on_cuda_rounds_and_refuses_as_the_cpu_kernel():
    # The float64 rotation rounded to float32, then to bf16 / f16: a key just above a tie in
    # float64 that float32 rounds onto the tie ends on the even neighbour, as on the CPU.
    freqs = posenc.RopeFrequencies([1.0, 0.01], attention_factor=1 + 2.0 ** -30)
    settings = _ops.typed("rope_append", {"freqs": freqs}, "rope_append")
    for dtype, x in ((torch.bfloat16, 1 + 2.0 ** -8), (torch.float16, 1 + 2.0 ** -11)):
        k_new = torch.full((1, 1, 1, 4), x)
        pages = [torch.zeros(1, 2, 1, 4, dtype=dtype), torch.zeros(1, 2, 1, 4, dtype=dtype,
                                                                   device=CUDA)]
        for kn, kp in ((k_new, pages[0]), (k_new.to(CUDA), pages[1])):
            torch.ops.posenc.rope_append(kn, None, kp, None, torch.tensor([[0]]),
                                         torch.tensor([1]), torch.tensor([0]), **settings)
        assert torch.equal(pages[0], pages[1].cpu()) and pages[0][0, 0, 0, 0].item() == 1.0
    # A refused call writes nothing: a page index in use outside the pool, seq_lens beyond the
    # row's pages, keys on another device.
    k_pages, v_pages, table, lens = _pages("token_major", torch.bfloat16)
    kp, vp = k_pages.to(CUDA), v_pages.to(CUDA)
    kn = torch.randn(3, 5, 2, 64, device=CUDA)
    bad = table.clone()
    bad[2, 3] = 12
    with pytest.raises(posenc.InvalidValueError, match=r"block_table\[2\]\[3\] = 12 is outside"):
        torch.ops.posenc.rope_append(kn, kn, kp, vp, bad.to(CUDA), lens.to(CUDA))
    with pytest.raises(posenc.InvalidValueError, match=r"seq_lens\[1\] = 17 exceeds"):
        torch.ops.posenc.rope_append(kn, kn, kp, vp, table, torch.tensor([11, 17, 14]))
    with pytest.raises(ValueError, match="k_new is on device 'cpu'"):
        torch.ops.posenc.rope_append(kn.cpu(), None, kp, None, table, lens)
    assert torch.equal(kp.cpu(), k_pages) and torch.equal(vp.cpu(), v_pages)


def _ulp(ref, dtype):
    _, e = np.frexp(np.abs(ref))
    if dtype == torch.float16:
        return np.exp2(np.maximum(e - 11, -24).astype(np.float64))
    return np.exp2((e - 8).astype(np.float64))


@pytest.mark.parametrize("scheme,kw", [("none", {}), ("rope", {"base": 5e5}),
                                       ("rope", {"rotary_dim": 32, "style": "interleaved"}),
                                       ("alibi", {})])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_half_on_cuda_against_the_cpu_kernel(scheme, kw, dtype):
    g = torch.Generator().manual_seed(16)
    q = torch.randn(2, 300, 8, 64, generator=g).to(dtype)
    k = torch.randn(2, 300, 2, 64, generator=g).to(dtype)
    v = torch.randn(2, 300, 2, 64, generator=g).to(dtype)
    settings = _ops.typed("attention_half", dict(kw, scheme=scheme, causal=True),
                          "attention_half")
    want = torch.ops.posenc.attention_half(q, k, v, [], [], **settings)
    got = torch.ops.posenc.attention_half(q.to(CUDA), k.to(CUDA), v.to(CUDA), [], [],
                                          **settings)
    assert got.device.type == "cuda" and got.dtype == want.dtype == dtype
    ref = pt.attention(q.double(), k.double(), v.double(), scheme, causal=True, **kw).numpy()
    got = got.cpu().double().numpy()
    # posenc's half-precision rule (test_triton.py): half an ulp plus 2e-5 (1 + |value|) of the
    # float64 reference; the CPU kernel's result, rounded too, within one more half ulp.
    tol = 2e-5 * (1 + np.abs(ref)) + 0.5 * _ulp(ref, dtype)
    assert np.all(np.abs(got - ref) <= tol)
    assert np.all(np.abs(got - want.double().numpy()) <= tol + 0.5 * _ulp(ref, dtype))
    args = (q.to(CUDA), k.to(CUDA), v.to(CUDA))
    compiled = torch.compile(lambda *t: torch.ops.posenc.attention_half(*t, [], [], **settings),
                             fullgraph=True)
    assert torch.equal(compiled(*args), torch.ops.posenc.attention_half(*args, [], [],
                                                                        **settings))


def test_attention_half_on_cuda_takes_one_dtype():
    q = torch.randn(1, 8, 2, 16, device=CUDA)
    k = torch.randn(1, 8, 2, 16, device=CUDA, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="the Triton kernels take q, k and v of one dtype"):
        torch.ops.posenc.attention_half(q, k, k, [], [])
    with pytest.raises(ValueError, match="CPU only"):
        torch.ops.posenc.attention_half(q.bfloat16(), k, k, [], [], backend="cpu")
