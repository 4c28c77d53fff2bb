"""posenc.torch on CUDA tensors against the same calls on CPU tensors: every op with a CUDA form
(attention through the Triton kernels, RoPE and the absolute encodings through posenc._device),
forward and backward, eager and under torch.compile(fullgraph=True) and torch.export. Skipped
without a CUDA device (scripts/gpu_check.sh runs it on a GPU machine)."""

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import posenc  # noqa: E402
import posenc.torch as pt  # noqa: E402

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
    config = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 2,
              "num_key_value_heads": 2, "rope_theta": 1e4, "max_position_embeddings": 64}
    with pytest.raises(ValueError, match="backend='triton'"):
        pt.attention(q, q, q, config=config)
    with pytest.raises(ValueError, match="CPU only"):
        pt.attention(q, q, q, backend="cpu")
    assert posenc.attention is not None
