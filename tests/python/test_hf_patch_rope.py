"""posenc.hf.patch on the RoPE families whose attention transformers' attention interface does
not reach: Falcon with RoPE (config.alibi false) and StableLM, against the unpatched models.

Tiny random models built from config objects (hidden size 64, 4 heads of 16, 2 layers, vocab 64,
weights drawn with std 0.2 so that the attention is far from uniform):
Falcon's new decoder architecture with 2 kv heads (broadcast to the query heads, as Falcon does),
Falcon's multi-query architecture (one kv head, sequential attention and MLP), StableLM with a
partial rotary factor 0.25 (4 of 16 dims rotate), and StableLM with factor 0.5, per-head q / k
layer norms, 2 kv heads, qkv biases and the parallel residual.

References: "eager" (the models' own attention). StableLM's eager attention takes its softmax in
float32 even in a float64 model (so it is 1e-7-exact there, and NaN on the fully masked rows of a
left-padded batch): its float64 reference is the unpatched model with "sdpa" (PyTorch's
attention, in float64); its float32 and training comparisons are against eager.

Tolerances: float64 1e-9 relative (logits and every gradient; measured ~1e-15); float32: the
patched model's error against the float64 model at most twice the unpatched float32 model's own
error plus 2e-6 of the largest magnitude (conftest.tol32's rule), logits within 1e-5 of the
unpatched float32 model; the left-padded training step as tests/python/test_hf_backend.py's
(loss 1e-5 relative, gradients 2e-5 of each tensor's max plus 1e-7 of the largest). Padded
batches compare real tokens only.
"""

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import posenc.torch as pt  # noqa: E402
from posenc.hf import backend, patch, unpatch  # noqa: E402

torch.set_num_threads(2)

LAYERS = 2


def _falcon(**kw):
    base = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=LAYERS, vocab_size=64,
                alibi=False, bias=True, attention_dropout=0.0, hidden_dropout=0.0,
                initializer_range=0.2, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    base.update(kw)
    return transformers.FalconConfig(**base)


def _stablelm(**kw):
    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                num_hidden_layers=LAYERS, vocab_size=64, intermediate_size=96,
                attention_dropout=0.0, hidden_dropout=0.0, initializer_range=0.2,
                pad_token_id=0, eos_token_id=1, bos_token_id=1)
    base.update(kw)
    return transformers.StableLmConfig(**base)


CASES = {
    "falcon-new-arch-gqa": lambda: _falcon(new_decoder_architecture=True, num_kv_heads=2),
    "falcon-multi-query": lambda: _falcon(new_decoder_architecture=False, multi_query=True,
                                          parallel_attn=False),
    "stablelm-rot0.25": lambda: _stablelm(partial_rotary_factor=0.25),
    "stablelm-rot0.5-qknorm": lambda: _stablelm(partial_rotary_factor=0.5, qk_layernorm=True,
                                                num_key_value_heads=2, use_qkv_bias=True,
                                                use_parallel_residual=True),
}
NAMES = sorted(CASES)
ROTARY = {"stablelm-rot0.25": 4, "stablelm-rot0.5-qknorm": 8}


def _attention_modules(model):
    kinds = ("FalconAttention", "StableLmAttention")
    return [m for m in model.modules() if type(m).__name__ in kinds]


def _model(cfg, impl="eager", seed=0):
    """A random model with non-zero biases and layer-norm shifts, eval mode."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            if p.dim() == 1 and bool((p == 0).all()):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _twin(model, impl):
    """The same weights under another attention implementation (a new model)."""
    other = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(model.config),
                                                          attn_implementation=impl).eval()
    other.load_state_dict(model.state_dict())
    return other.to(next(model.parameters()).dtype)


def _inputs(batch=2, length=24, seed=0, pad=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 64, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if pad == "right":
        mask[0, length - 3:] = 0
        mask[1, length - length // 2:] = 0
    elif pad == "left":
        mask[0, :3] = 0
        mask[1, :length // 2] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _loss(logits, rows, seed=3):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(logits.shape, generator=g, dtype=torch.float64).to(logits.dtype)
    return (logits * w * rows[..., None].to(logits.dtype)).sum()


def forward_backward(model, ids, mask):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    _loss(logits, mask.to(torch.bool)).backward()
    return logits.detach(), {n: p.grad.detach().double().clone()
                             for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b, rows):
    a, b = a[rows].detach().double(), b[rows].detach().double()
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of posenc.torch.attention and of the "posenc" attention function."""
    n = {"posenc": 0, "backend": 0}
    real_pt, real_be = pt.attention, backend.attention_forward

    def counting_pt(*a, **k):
        n["posenc"] += 1
        return real_pt(*a, **k)

    def counting_be(*a, **k):
        n["backend"] += 1
        return real_be(*a, **k)

    monkeypatch.setattr(pt, "attention", counting_pt)
    monkeypatch.setattr(backend, "attention_forward", counting_be)
    return n


def test_transformers_routing_of_these_families():
    """What transformers 5.24 does with the attention implementation (what patch is for): Falcon
    computes its attention inline ("eager": matmul + softmax; "sdpa", its default: a direct call of
    torch's scaled_dot_product_attention), has no entry for "posenc" (KeyError when the model is
    built) and ignores set_attn_implementation (it keeps its implementation). StableLM calls the
    attention interface: with "posenc" it already runs the backend."""
    backend.register()
    with pytest.raises(KeyError, match="posenc"):
        transformers.AutoModelForCausalLM.from_config(CASES["falcon-multi-query"](),
                                                      attn_implementation="posenc")
    falcon = _model(CASES["falcon-multi-query"]())
    falcon.set_attn_implementation("posenc")  # logged and ignored by transformers
    assert falcon.config._attn_implementation == "eager"
    assert transformers.AutoModelForCausalLM.from_config(
        CASES["falcon-multi-query"]()).config._attn_implementation == "sdpa"
    stablelm = _model(CASES["stablelm-rot0.25"](), impl="posenc")
    assert stablelm.config._attn_implementation == "posenc"


@pytest.mark.parametrize("name", NAMES)
def test_patched_forward_runs_posenc(name, calls, monkeypatch):
    cfg = CASES[name]()
    ref = _model(cfg)
    pat = patch(copy.deepcopy(ref))
    mods = _attention_modules(pat)
    assert len(mods) == LAYERS
    assert all("_posenc_state" in m.__dict__ and "forward" in m.__dict__ for m in mods)
    if name in ROTARY:
        assert all(m.rotary_ndims == ROTARY[name] for m in mods)
    ids, mask = _inputs(pad="right")
    with torch.no_grad():
        a = ref(input_ids=ids, attention_mask=mask).logits
        assert calls == {"posenc": 0, "backend": 0}
        b = pat(input_ids=ids, attention_mask=mask).logits
    assert calls == {"posenc": LAYERS, "backend": LAYERS}, "posenc ran in every layer, once"
    assert _rel(b, a, mask.to(torch.bool)) <= 1e-5
    # A model built with transformers' default ("sdpa") runs the same patched attention.
    with torch.no_grad():
        c = patch(_twin(ref, "sdpa"))(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(b, c) and calls["posenc"] == 2 * LAYERS
    # The configs name posenc's mask implementation: the layers receive a PosencMask (O(batch·L)),
    # not a [batch, 1, L, L] tensor.
    seen = []
    real = backend.attention_forward

    def recording(module, q, k, v, attention_mask, **kw):
        seen.append(type(attention_mask).__name__)
        return real(module, q, k, v, attention_mask, **kw)

    monkeypatch.setattr(backend, "attention_forward", recording)
    with torch.no_grad():
        pat(input_ids=ids, attention_mask=mask)
    assert seen == ["PosencMask"] * LAYERS


@pytest.mark.parametrize("name", NAMES)
def test_float64_logits_and_gradients_match(name):
    cfg = CASES[name]()
    ref = _model(cfg).double()
    if cfg.model_type == "stablelm":
        ref = _twin(ref, "sdpa")  # eager StableLM takes its softmax in float32
    pat = patch(copy.deepcopy(ref))
    pads = ["right", "left"]
    worst = 0.0
    for pad in pads:
        ids, mask = _inputs(pad=pad, seed=len(pad))
        rows = mask.to(torch.bool)
        lr, gr = forward_backward(ref, ids, mask)
        lp, gp = forward_backward(pat, ids, mask)
        err = _rel(lp, lr, rows)
        assert err <= 1e-9, (pad, err)
        worst = max(worst, err)
        assert set(gp) == set(gr) and len(gr) == len(list(ref.parameters()))
        floor = 1e-3 * max(float(g.abs().max()) for g in gr.values())
        for n in gr:
            err = float((gp[n] - gr[n]).abs().max()) / max(float(gr[n].abs().max()), floor)
            worst = max(worst, err)
            assert err <= 1e-9, (pad, n, err)
    print(f"\n{name}: float64 max relative difference {worst:.2e} ({', '.join(pads)} padding)")


@pytest.mark.parametrize("name", NAMES)
def test_float32_within_the_unpatched_models_error(name):
    cfg = CASES[name]()
    ref = _model(cfg)
    pat = patch(copy.deepcopy(ref))
    ref64 = copy.deepcopy(ref).double()
    if cfg.model_type == "stablelm":
        ref64 = _twin(ref64, "sdpa")
    ids, mask = _inputs(pad="left", seed=4)
    rows = mask.to(torch.bool)
    l64, g64 = forward_backward(ref64, ids, mask)
    l32, g32 = forward_backward(ref, ids, mask)
    lp, gp = forward_backward(pat, ids, mask)
    big = float(l64[rows].abs().max())
    e_ref = float((l32.double() - l64)[rows].abs().max())
    e_pat = float((lp.double() - l64)[rows].abs().max())
    assert e_pat <= 2 * e_ref + 2e-6 * big, (e_pat, e_ref)
    rel = _rel(lp, l32, rows)
    assert rel <= 1e-5
    for n in g64:
        er = float((g32[n] - g64[n]).abs().max())
        ep = float((gp[n] - g64[n]).abs().max())
        assert ep <= 2 * er + 2e-6 * max(1.0, float(g64[n].abs().max())), (n, ep, er)
    print(f"\n{name}: float32 logits vs unpatched float32 {rel:.2e}; against float64: patched "
          f"{e_pat / big:.2e}, unpatched {e_ref / big:.2e}")


def _left_padded_training_step(name, dtype):
    cfg = CASES[name]()
    ref = _model(cfg).to(dtype).train()
    pat = patch(copy.deepcopy(ref))
    ids, mask = _inputs(seed=5, length=13)
    mask[0, :4] = 0
    mask[1, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    out = []
    for model in (ref, pat):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        out.append((float(loss.detach()), {n: p.grad.double().clone()
                                          for n, p in model.named_parameters()}))
    (la, ga), (lb, gb) = out
    big = max(float(g.abs().max()) for g in ga.values())
    if dtype == torch.float64:
        assert abs(la - lb) <= 1e-9 * abs(la), (la, lb)
        for n in ga:
            scale = max(float(ga[n].abs().max()), 1e-3 * big)
            assert float((ga[n] - gb[n]).abs().max()) <= 1e-9 * scale, n
    else:
        assert abs(la - lb) <= 1e-5 * abs(la), (la, lb)
        for n in ga:
            err = float((ga[n] - gb[n]).abs().max())
            assert err <= 2e-5 * float(ga[n].abs().max()) + 1e-7 * big, (n, err)


@pytest.mark.parametrize("name", NAMES)
def test_left_padded_training_step_equals_eager(name):
    # Left padding with the usual labels (pads -100): the shifted loss scores the last pad
    # position, a query row that sees no key. Eager gives it the mean of the values over all keys
    # (and autograd the scores' gradient through a uniform softmax); so does the patched model.
    # In float32, as test_hf_backend.py (StableLM's eager is NaN on such rows in float64).
    _left_padded_training_step(name, torch.float32)


@pytest.mark.parametrize("name", ["falcon-multi-query"])
def test_left_padded_training_step_float64(name):
    # Falcon's eager attention is float64-exact, so the same step holds to 1e-9 there.
    _left_padded_training_step(name, torch.float64)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generate_with_the_cache(name, calls):
    cfg = CASES[name]()
    ref = _model(cfg)
    pat = patch(copy.deepcopy(ref))
    ids, mask = _inputs(length=10, seed=8, pad="left")
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
              pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        a = ref.generate(ids, **kw)
        assert calls["posenc"] == 0
        b = pat.generate(ids, **kw)
    assert calls["posenc"] == LAYERS * 8  # the prefill and 7 decode steps against the cache
    assert torch.equal(a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores):
        fin = torch.isfinite(sa)
        assert torch.equal(fin, torch.isfinite(sb))
        assert float((sa - sb)[fin].abs().max()) <= 1e-5 * float(sa[fin].abs().max())


@pytest.mark.parametrize("name", ["falcon-new-arch-gqa", "stablelm-rot0.5-qknorm"])
def test_generate_with_a_static_cache(name):
    cfg = CASES[name]()
    ref = _model(cfg)
    pat = patch(copy.deepcopy(ref))
    ids, mask = _inputs(length=9, seed=9, pad="left")
    kw = dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
              pad_token_id=0)
    with torch.no_grad():
        a = ref.generate(ids, **kw)
        b = pat.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_patch_changes_nothing_outside_the_model_and_unpatch_restores(name):
    # Two models built from one config object share it (from_config does not copy it): patching
    # one leaves its twin, the config and models built from it later exactly as they were.
    cfg = CASES[name]()
    torch.manual_seed(0)
    a = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    b = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    b.load_state_dict(a.state_dict())
    shared = a.config
    assert b.config is shared
    held = [(m, m.__dict__.get("config")) for m in b.modules()]
    before = (shared.to_dict(), shared._attn_implementation)
    assert patch(b) is b
    assert a.config is shared and (shared.to_dict(), shared._attn_implementation) == before
    assert b.config is not shared and b.config._attn_implementation == "posenc"
    ids, mask = _inputs(pad="right", seed=6)
    rows = mask.to(torch.bool)
    with torch.no_grad():
        want = a(input_ids=ids, attention_mask=mask).logits
        assert _rel(b(input_ids=ids, attention_mask=mask).logits, want, rows) <= 1e-5
        fresh = transformers.AutoModelForCausalLM.from_config(shared,
                                                              attn_implementation="eager").eval()
        fresh.load_state_dict(a.state_dict())
        assert fresh.config._attn_implementation == "eager"
        assert torch.equal(fresh(input_ids=ids, attention_mask=mask).logits, want)
        # The twin after the patched model ran: still eager's logits.
        assert torch.equal(a(input_ids=ids, attention_mask=mask).logits, want)
    assert unpatch(b) is b
    assert all(m.__dict__.get("config") is c for m, c in held)
    assert b.config is shared and shared._attn_implementation == "eager"
    for m in b.modules():
        assert "forward" not in m.__dict__ and "_posenc_state" not in m.__dict__
        assert "_posenc_hook" not in m.__dict__ and not m._forward_pre_hooks
    with torch.no_grad():
        assert torch.equal(b(input_ids=ids, attention_mask=mask).logits, want)
        b(input_ids=ids, output_attentions=True)  # served again by transformers


@pytest.mark.parametrize("name", NAMES)
def test_attention_weights_are_refused(name):
    cfg = CASES[name]()
    pat = patch(_model(cfg))
    ids, _ = _inputs(batch=1, length=6)
    with pytest.raises(ValueError, match="output_attentions"):
        pat(input_ids=ids, output_attentions=True)
    asked = _model(cfg)
    asked.config.output_attentions = True  # asked for by the config (set before patch: transformers
    patch(asked)                           # refuses to set it with another implementation)
    with pytest.raises(ValueError, match="output_attentions"):
        asked(input_ids=ids)
    attn = _attention_modules(pat)[0]
    with pytest.raises(ValueError, match="output_attentions"):
        attn(torch.zeros(1, 6, 64), attention_mask=None, output_attentions=True,
             position_embeddings=(torch.ones(1, 6, attn.head_dim), torch.zeros(1, 6,
                                                                               attn.head_dim)))


def test_attention_dropout_policy():
    # StableLM applies attention-probability dropout in training: skipped with a warning by
    # default, refused with attention_dropout="error"; evaluation is unaffected.
    cfg = _stablelm(partial_rotary_factor=0.25, attention_dropout=0.1)
    ref = _model(cfg)
    ids, mask = _inputs(batch=1, length=8)
    pat = patch(copy.deepcopy(ref)).train()
    with pytest.warns(RuntimeWarning, match="dropout"):
        pat(input_ids=ids)
    strict = patch(copy.deepcopy(ref), attention_dropout="error").train()
    with pytest.raises(ValueError, match="dropout"):
        strict(input_ids=ids)
    with torch.no_grad():
        assert _rel(strict.eval()(input_ids=ids).logits, ref(input_ids=ids).logits,
                    mask.to(torch.bool)) <= 1e-5
    # transformers' RoPE Falcon applies no attention dropout (config.attention_dropout only
    # drops the attention block's output, outside the attention): nothing to skip, no warning,
    # and a training step equals the unpatched one under the same random state.
    cfg = _falcon(new_decoder_architecture=False, multi_query=True, parallel_attn=False,
                  attention_dropout=0.1)
    ref = _model(cfg).double().train()
    pat = patch(copy.deepcopy(ref), attention_dropout="error")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.manual_seed(7)
        a = ref(input_ids=ids).logits
        torch.manual_seed(7)
        b = pat(input_ids=ids).logits
    assert _rel(b, a, mask.to(torch.bool)) <= 1e-9


def test_alibi_falcon_is_still_patched_as_alibi():
    from posenc.hf import _bias_alibi  # noqa: F401
    cfg = _falcon(alibi=True, new_decoder_architecture=False, multi_query=False, num_kv_heads=4)
    pat = patch(_model(cfg, impl="sdpa"))
    assert all(m._posenc_state["family"] == "falcon" for m in _attention_modules(pat))
    assert pat.config._attn_implementation == "posenc_bias"
