"""posenc.hf.patch against transformers' UMT5 and DeBERTa (v1) models.

Shrunk random models (from_config), compared with the unpatched model (eager attention), with the
tolerances of test_hf_patch.py: float64 logits and every gradient to 1e-9 relative of the largest
magnitude; float32 within twice the unpatched float32 model's own error against the float64 model
plus 2e-6 of the largest magnitude. Padded batches compare the real tokens only.

UMT5: every self-attention layer owns a bucket table (random, non-zero). 32 buckets and max
distance 20 over 40 encoder tokens and 30 decoder tokens: the exact, the logarithmic and the
clamped buckets are all used, bidirectional (encoder) and causal (decoder).

DeBERTa v1: max_relative_positions 12 at 40 tokens clips the distances (the span is 12); -1
(max_position_embeddings, 256) at 40 tokens gives the span min(L, 256) = 40 (no clipping).
DebertaLayerNorm normalises in float32 even in a float64 model (hidden_states.float()): both
models round the same float64 values to float32 there, so the float64 comparison of the whole
model holds as long as no value lies within rounding (1e-16) of a float32 rounding boundary; the
attention module alone is also compared in float64 without that step.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from posenc.hf import patch, unpatch  # noqa: E402
from posenc.hf.patch import SUPPORTED_MODEL_TYPES  # noqa: E402
from test_hf_patch import _ShapeRecorder, _square  # noqa: E402

torch.set_num_threads(2)


def umt5_config(**kw):
    from transformers import AutoConfig
    base = dict(d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2, num_decoder_layers=2,
                vocab_size=64, dropout_rate=0.0, relative_attention_num_buckets=32,
                relative_attention_max_distance=20, decoder_start_token_id=0, pad_token_id=0,
                eos_token_id=1, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    base.update(kw)
    return AutoConfig.for_model("umt5", **base)


def deberta_v1_config(**kw):
    from transformers import AutoConfig
    base = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_hidden_layers=2,
                vocab_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                max_position_embeddings=256, relative_attention=True,
                pos_att_type=["c2p", "p2c"], max_relative_positions=12)
    base.update(kw)
    return AutoConfig.for_model("deberta", **base)


def _build(cfg, encoder_only=False):
    """The model class's random model for cfg (eager attention)."""
    from transformers import AutoModelForMaskedLM, AutoModelForSeq2SeqLM, UMT5EncoderModel
    if cfg.model_type == "umt5" and encoder_only:
        return UMT5EncoderModel._from_config(cfg, attn_implementation="eager")
    auto = AutoModelForSeq2SeqLM if cfg.model_type == "umt5" else AutoModelForMaskedLM
    return auto.from_config(cfg, attn_implementation="eager")


def _randomize(model, seed):
    with torch.no_grad():  # random, non-zero biases and tables everywhere (init zeros some)
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if (p.dim() == 1 and bool((p == 0).all())) or "relative_attention_bias" in name:
                p.copy_((1.0 if "relative_attention_bias" in name else 0.1)
                        * torch.randn(p.shape, generator=g))
            elif "rel_embeddings" in name:
                p.copy_(torch.randn(p.shape, generator=g))


def pair(cfg, seed=0, encoder_only=False):
    """(unpatched eager model, patched deep copy), eval mode, float32."""
    torch.manual_seed(seed)
    ref = _build(cfg, encoder_only).eval()
    _randomize(ref, seed)
    return ref, patch(copy.deepcopy(ref))


def inputs(cfg, batch, length, seed=0, pad=None):
    """Token ids and a mask; pad 'right': the first row loses 3 tokens, the last half."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, cfg.vocab_size, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if pad == "right":
        mask[0, length - 3:] = 0
        mask[-1, length - length // 2:] = 0
    return ids, mask


def run(model, ids, mask, dec_ids=None, dec_mask=None):
    kw = {}
    if dec_ids is not None:
        kw.update(decoder_input_ids=dec_ids, decoder_attention_mask=dec_mask)
    out = model(input_ids=ids, attention_mask=mask, **kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _rel(a, b, rows):
    a, b = a[rows].double(), b[rows].double()
    return float((a - b).abs().max() / b.abs().max())


def _loss(out, rows, seed=3):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    return (out * w * rows[..., None].to(out.dtype)).sum()


def forward_backward(model, case):
    ids, mask, dec_ids, dec_mask, rows = case
    model.zero_grad(set_to_none=True)
    out = run(model, ids, mask, dec_ids, dec_mask)
    _loss(out, rows).backward()
    return out.detach(), {n: p.grad.detach().double().clone()
                          for n, p in model.named_parameters() if p.grad is not None}


CASES = {
    # name: (config factory, batch, encoder length, decoder length or None, encoder-only model)
    "umt5": (umt5_config, 2, 40, 30, False),
    "umt5-encoder": (umt5_config, 2, 40, None, True),
    "deberta-v1": (deberta_v1_config, 2, 40, None, False),
    "deberta-v1-c2p": (lambda: deberta_v1_config(pos_att_type=["c2p"]), 2, 40, None, False),
    "deberta-v1-p2c": (lambda: deberta_v1_config(pos_att_type=["p2c"]), 2, 40, None, False),
    "deberta-v1-unclipped": (lambda: deberta_v1_config(max_relative_positions=-1), 2, 40, None,
                             False),
    "deberta-v1-p2p-in-scale": (lambda: deberta_v1_config(pos_att_type="c2p|p2c|p2p"), 2, 20,
                                None, False),
    "deberta-v1-absolute": (lambda: deberta_v1_config(relative_attention=False), 2, 20, None,
                            False),
}


def _case(name):
    factory, batch, length, dec_length, encoder_only = CASES[name]
    cfg = factory()
    ids, mask = inputs(cfg, batch, length, pad="right")
    dec_ids = dec_mask = None
    rows = mask.to(torch.bool)
    if dec_length is not None:
        dec_ids, dec_mask = inputs(cfg, batch, dec_length, seed=1, pad="right")
        dec_ids[:, 0] = 0
        dec_mask[:, 0] = 1
        rows = dec_mask.to(torch.bool)
    return cfg, encoder_only, (ids, mask, dec_ids, dec_mask, rows)


@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_logits_and_gradients_match(name):
    cfg, encoder_only, case = _case(name)
    ref, pat = pair(cfg, encoder_only=encoder_only)
    ref.double()
    pat.double()
    lr, gr = forward_backward(ref, case)
    lp, gp = forward_backward(pat, case)
    worst = _rel(lp, lr, case[-1])
    assert worst <= 1e-9
    assert set(gp) == set(gr), set(gp) ^ set(gr)
    # A gradient that vanishes in exact arithmetic is rounding noise: relative to 1e-3 of the
    # largest gradient at least (as in test_hf_patch.py).
    floor = 1e-3 * max(float(g.abs().max()) for g in gr.values())
    for n in gr:
        scale = max(float(gr[n].abs().max()), floor)
        err = float((gp[n] - gr[n]).abs().max()) / scale
        worst = max(worst, err)
        assert err <= 1e-9, (n, err)
    print(f"\n{name}: float64 max relative difference {worst:.2e}")


@pytest.mark.parametrize("name", ["umt5", "deberta-v1", "deberta-v1-c2p", "deberta-v1-p2c"])
def test_float32_within_the_unpatched_models_error(name):
    cfg, encoder_only, case = _case(name)
    ref, pat = pair(cfg, encoder_only=encoder_only)
    ref64 = copy.deepcopy(ref).double()
    rows = case[-1]
    l64, g64 = forward_backward(ref64, case)
    l32, g32 = forward_backward(ref, case)
    lp, gp = forward_backward(pat, case)
    e_ref = float((l32.double() - l64)[rows].abs().max())
    e_pat = float((lp.double() - l64)[rows].abs().max())
    big = float(l64[rows].abs().max())
    assert e_pat <= 2 * e_ref + 2e-6 * big, (e_pat, e_ref)
    rel = _rel(lp, l32, rows)
    assert rel <= 1e-5
    print(f"\n{name}: float32 logits vs unpatched float32 {rel:.2e} (relative); against float64: "
          f"patched {e_pat / big:.2e}, unpatched {e_ref / big:.2e}")
    for n in g64:
        e_ref = float((g32[n] - g64[n]).abs().max())
        e_pat = float((gp[n] - g64[n]).abs().max())
        assert e_pat <= 2 * e_ref + 2e-6 * max(1.0, float(g64[n].abs().max())), n


@pytest.mark.parametrize("pos_att_type", [["c2p", "p2c"], ["c2p"], ["p2c"]])
def test_deberta_v1_attention_module_float64(pos_att_type):
    # The attention alone (no float32 layer norm around it): the model's own encoder inputs
    # (its [B, 1, L, L] mask and relative positions) against the patched encoder's.
    cfg = deberta_v1_config(pos_att_type=pos_att_type)
    ref, pat = pair(cfg)
    ref.double()
    pat.double()
    ids, mask = inputs(cfg, 2, 40, pad="right")
    rows = mask.to(torch.bool)
    g = torch.Generator().manual_seed(5)
    h = torch.randn(2, 40, 32, generator=g, dtype=torch.float64)
    w = torch.randn(2, 40, 32, generator=g, dtype=torch.float64) * rows[..., None]
    results = []
    for model in (ref, pat):
        enc = model.deberta.encoder
        attn = enc.layer[1].attention.self
        model.zero_grad(set_to_none=True)
        x = h.clone().requires_grad_(True)
        out, _ = attn(x, enc.get_attention_mask(mask), relative_pos=enc.get_rel_pos(x),
                      rel_embeddings=enc.get_rel_embedding())
        (out * w).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.detach(), x.grad.clone(), grads))
    (o_r, x_r, g_r), (o_p, x_p, g_p) = results
    worst = max(_rel(o_p, o_r, rows), _rel(x_p, x_r, rows))
    assert set(g_p) == set(g_r)
    want = {"encoder.rel_embeddings.weight", "attention.self.in_proj.weight",
            "attention.self.q_bias", "attention.self.v_bias"}
    if "c2p" in pos_att_type:
        want.add("attention.self.pos_proj.weight")
    if "p2c" in pos_att_type:
        want |= {"attention.self.pos_q_proj.weight", "attention.self.pos_q_proj.bias"}
    assert {n.split("layer.1.")[-1].removeprefix("deberta.") for n in g_r} == want
    for n in g_r:
        assert float(g_r[n].abs().max()) > 0, n
        worst = max(worst, float((g_p[n] - g_r[n]).abs().max() / g_r[n].abs().max()))
    assert worst <= 1e-12
    print(f"\nDeBERTa v1 attention {'|'.join(pos_att_type)}: float64 max relative difference "
          f"{worst:.2e}")


def test_umt5_every_layers_table_gets_its_gradient():
    cfg, _, case = _case("umt5")
    ref, pat = pair(cfg)
    _, gr = forward_backward(ref, case)
    _, gp = forward_backward(pat, case)
    tables = sorted(n for n in gp if "relative_attention_bias" in n)
    assert tables == sorted(f"{s}.block.{i}.layer.0.SelfAttention.relative_attention_bias.weight"
                            for s in ("encoder", "decoder") for i in range(2))
    for n in tables:
        assert float(gp[n].abs().max()) > 0
        assert float((gp[n] - gr[n]).abs().max()) <= 1e-5 * float(gr[n].abs().max()), n


def test_umt5_buckets_beyond_max_distance_are_used():
    # The comparison cases must reach the clamped bucket: a table whose last bucket alone is
    # changed changes the patched model's output (encoder, both directions; decoder).
    cfg, _, case = _case("umt5")
    _, pat = pair(cfg)
    ids, mask, dec_ids, dec_mask, rows = case
    with torch.no_grad():
        base = run(pat, ids, mask, dec_ids, dec_mask)
        for name, last in (("encoder", (15, 31)), ("decoder", (31,))):
            table = getattr(pat, name).block[0].layer[0].SelfAttention.relative_attention_bias
            for b in last:
                saved = table.weight[b].clone()
                table.weight[b] += 1.0
                assert _rel(run(pat, ids, mask, dec_ids, dec_mask), base, rows) > 1e-3
                table.weight[b] = saved


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_umt5_padded_encoder_batch(cache):
    cfg = umt5_config()
    ref, pat = pair(cfg, seed=2)
    ids, mask = inputs(cfg, 2, 18, seed=7, pad="right")
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
              suppress_tokens=[0, 1], no_repeat_ngram_size=1)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        want = ref.generate(ids, **kw)
        got = pat.generate(ids, **kw)
    assert want.shape[1] == 7 and torch.equal(got, want)
    assert len(set(want[:, 1:].flatten().tolist())) > 1


def test_dense_mask_from_the_caller_deberta_v1():
    g = torch.Generator().manual_seed(11)
    cfg = deberta_v1_config()
    ref, pat = pair(cfg)
    ids, _ = inputs(cfg, 2, 16)
    m3 = (torch.rand(2, 16, 16, generator=g) < 0.6) | torch.eye(16, dtype=torch.bool)
    with torch.no_grad():
        h = ref.deberta.embeddings(input_ids=ids)
        a = ref.deberta.encoder(h, m3.long()).last_hidden_state
        b = pat.deberta.encoder(h, m3.long()).last_hidden_state
    assert _rel(b, a, torch.ones(2, 16, dtype=torch.bool)) <= 1e-5


@pytest.mark.parametrize("name", ["umt5", "deberta-v1"])
def test_no_length_squared_tensor_is_built(name):
    cfg = CASES[name][0]()
    length = 130
    ids, mask = inputs(cfg, 2, length, pad="right")
    dec_ids = dec_mask = None
    if cfg.model_type == "umt5":
        dec_ids, dec_mask = inputs(cfg, 2, length, seed=1, pad="right")
    rows = (dec_mask if dec_mask is not None else mask).to(torch.bool)
    ref, pat = pair(cfg)
    for model, expect in ((ref, True), (pat, False)):
        rec = _ShapeRecorder()
        with rec:
            _loss(run(model, ids, mask, dec_ids, dec_mask), rows).backward()
        found = _square(rec.shapes, length)
        assert bool(found) == expect, found[:3]


def test_requests_that_cannot_be_fused_raise():
    cfg = umt5_config()
    _, pat = pair(cfg)
    ids, _ = inputs(cfg, 1, 6)
    with pytest.raises(ValueError, match="output_attentions"):
        pat(input_ids=ids, decoder_input_ids=ids[:, :2], output_attentions=True)
    attn = pat.encoder.block[1].layer[0].SelfAttention
    with pytest.raises(ValueError, match="position_bias"):
        attn(torch.zeros(1, 4, 32), position_bias=torch.zeros(1, 4, 4, 4))
    cfg = deberta_v1_config()
    _, pat = pair(cfg)
    with pytest.raises(ValueError, match="output_attentions"):
        pat(input_ids=ids, output_attentions=True)
    enc = pat.deberta.encoder
    h = torch.zeros(1, 6, 32)
    attn = enc.layer[0].attention.self
    from transformers.models.deberta.modeling_deberta import build_relative_position
    full = enc.get_attention_mask(torch.ones(1, 6))
    with pytest.raises(ValueError, match="relative_pos"):
        attn(h, full, relative_pos=build_relative_position(h, h),
             rel_embeddings=enc.get_rel_embedding())
    with pytest.raises(ValueError, match="query_states"):
        attn(h, full, query_states=h,
             relative_pos=enc.get_rel_pos(h), rel_embeddings=enc.get_rel_embedding())


def test_attention_dropout_policy_umt5_and_deberta_v1():
    for cfg in (umt5_config(dropout_rate=0.1), deberta_v1_config(attention_probs_dropout_prob=0.1)):
        ref = _build(cfg)
        pat = patch(ref, attention_dropout="error").train()
        ids, _ = inputs(cfg, 1, 6)
        kw = {"decoder_input_ids": ids[:, :2]} if cfg.model_type == "umt5" else {}
        with pytest.raises(ValueError, match="dropout"):
            pat(input_ids=ids, **kw)


def test_talking_head_is_refused():
    cfg = deberta_v1_config(talking_head=True)
    from transformers import AutoModelForMaskedLM
    model = AutoModelForMaskedLM.from_config(cfg, attn_implementation="eager")
    assert model.deberta.encoder.layer[0].attention.self.head_logits_proj is not None
    with pytest.raises(TypeError, match="talking_head"):
        patch(model)
    # Nothing was changed.
    assert all("_posenc_state" not in m.__dict__ for m in model.modules())
    assert "get_rel_pos" not in model.deberta.encoder.__dict__


def test_model_types_are_registered():
    assert SUPPORTED_MODEL_TYPES["umt5"] == "umt5"
    assert SUPPORTED_MODEL_TYPES["deberta"] == "deberta-v1"


@pytest.mark.parametrize("name", ["umt5", "deberta-v1"])
def test_patch_changes_nothing_outside_the_model_and_unpatch_restores(name):
    # Two models built from one config object share it: patching one leaves its twin, the config
    # and models built from it later exactly as they were; unpatch restores the patched model.
    cfg, _, case = _case(name)
    ids, mask, dec_ids, dec_mask, rows = case
    torch.manual_seed(0)
    a = _build(cfg).eval()
    _randomize(a, 0)
    b = _build(cfg).eval()
    b.load_state_dict(a.state_dict())
    shared = a.config
    held = [(m, m.__dict__.get("config")) for m in b.modules()]
    forwards = [m.forward.__func__ for m in b.modules()]
    before = (shared.to_dict(), shared._attn_implementation)
    patch(b)
    assert any("_posenc_state" in m.__dict__ for m in b.modules())
    assert a.config is shared and (shared.to_dict(), shared._attn_implementation) == before
    with torch.no_grad():
        want = run(a, ids, mask, dec_ids, dec_mask)
        assert _rel(run(b, ids, mask, dec_ids, dec_mask), want, rows) <= 1e-5
        fresh = _build(shared).eval()
        fresh.load_state_dict(a.state_dict())
        assert torch.equal(run(fresh, ids, mask, dec_ids, dec_mask), want)
        assert torch.equal(run(a, ids, mask, dec_ids, dec_mask), want)
    assert unpatch(b) is b
    assert all(m.__dict__.get("config") is c for m, c in held)
    assert [m.forward.__func__ for m in b.modules()] == forwards
    assert all(not k.startswith("_posenc") and k not in ("forward", "get_rel_pos",
                                                          "get_attention_mask")
               for m in b.modules() for k in m.__dict__)
    with torch.no_grad():
        assert torch.equal(run(b, ids, mask, dec_ids, dec_mask), want)


@pytest.mark.parametrize("name", ["umt5", "deberta-v1"])
def test_bfloat16_within_the_unpatched_models_error(name):
    cfg, encoder_only, case = _case(name)
    ids, mask, dec_ids, dec_mask, rows = case
    ref, pat = pair(cfg, encoder_only=encoder_only)
    with torch.no_grad():
        l32 = run(ref, ids, mask, dec_ids, dec_mask).double()
        ref.to(torch.bfloat16)
        pat.to(torch.bfloat16)
        lb = run(ref, ids, mask, dec_ids, dec_mask).double()
        lpb = run(pat, ids, mask, dec_ids, dec_mask).double()
    e_ref = float((lb - l32)[rows].abs().max())
    e_pat = float((lpb - l32)[rows].abs().max())
    big = float(l32[rows].abs().max())
    assert e_pat <= 2 * e_ref + 2e-6 * big, (e_pat, e_ref)
    print(f"\n{name}: bf16 against float32 (relative): patched {e_pat / big:.2e}, unpatched "
          f"{e_ref / big:.2e}")
