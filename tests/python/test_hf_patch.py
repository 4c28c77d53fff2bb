"""posenc.hf.patch against transformers itself: T5 / mT5, BLOOM, MPT, Falcon-RW, DeBERTa-v2/v3.

Every model is a shrunk random model built from the shipped config.json (few layers, small
hidden size, the positional settings intact: bucket counts, max distances, DeBERTa's
position_buckets and max_relative_positions, ALiBi on), compared with the unpatched model.

Tolerances:
- float64 (patched model on posenc's float64 reference path vs the unpatched model in float64):
  both evaluate the same formulas in double, so logits and every gradient agree to rounding:
  relative 1e-9 of the largest magnitude (1e-12-level differences measured; ALiBi cases use
  power-of-two head counts, whose slopes times positions are exact in the models' float32 bias).
- float32: the patched model's error against the float64 model is at most twice the unpatched
  float32 model's own error against it, plus 2e-6 of the largest magnitude (the project's
  float32 rule, conftest.tol32): the fused kernel may round differently, not worse.
- bfloat16: the same rule with the bfloat16 models against the float32 model (both round every
  layer's activations to bfloat16; the fused kernel keeps float32 scores inside).
Padded batches compare the real tokens only (outputs at padded query positions are undefined in
both models).
"""

import copy
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import posenc.hf  # noqa: E402
from posenc.hf import patch, unpatch  # noqa: E402

CONFIGS = os.environ.get("POSENC_TEST_CONFIGS_DIR",
                         os.path.join(os.path.dirname(__file__), "..", "configs"))

torch.set_num_threads(2)


def _config(name, **shrink):
    """A config.json from tests/configs (or a model type), shrunk."""
    from transformers import AutoConfig
    path = os.path.join(CONFIGS, name + ".json")
    if os.path.exists(path):
        with open(path) as f:
            d = json.load(f)
    else:
        d = {"model_type": name}
    for k in ("_name_or_path", "architectures"):
        d.pop(k, None)
    if isinstance(d.get("attn_config"), dict) and "attn_config" in shrink:
        d["attn_config"] = {**d["attn_config"], **shrink.pop("attn_config")}
    d.update(shrink)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def t5_config(**kw):
    base = dict(d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2, num_decoder_layers=2,
                vocab_size=64, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                eos_token_id=1)
    base.update(kw)
    return _config("t5-base", **base)


def mt5_config():
    return _config("mt5", d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2,
                   num_decoder_layers=1, vocab_size=64, dropout_rate=0.0,
                   relative_attention_num_buckets=32, relative_attention_max_distance=128,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                   feed_forward_proj="gated-gelu", tie_word_embeddings=False)


def bloom_config(heads=4):
    return _config("bloom-560m", hidden_size=8 * heads, n_head=heads, n_layer=2, vocab_size=64,
                   attention_dropout=0.0, hidden_dropout=0.0)


def mpt_config(heads=4):
    return _config("mpt-7b", d_model=8 * heads, n_heads=heads, n_layers=2, vocab_size=64,
                   max_seq_len=256, attn_config={"attn_pdrop": 0})


def falcon_config(heads=4):
    return _config("falcon-rw-1b", hidden_size=8 * heads, num_attention_heads=heads,
                   num_kv_heads=heads, num_hidden_layers=2, vocab_size=64,
                   attention_dropout=0.0, hidden_dropout=0.0)


def deberta_config(**kw):
    base = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                num_hidden_layers=2, vocab_size=64, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0, type_vocab_size=0)
    base.update(kw)
    return _config("deberta-v3-base", **base)


def _auto(cfg):
    from transformers import (AutoModelForCausalLM, AutoModelForMaskedLM,
                              AutoModelForSeq2SeqLM)
    if cfg.model_type in ("t5", "mt5"):
        return AutoModelForSeq2SeqLM
    if cfg.model_type == "deberta-v2":
        return AutoModelForMaskedLM
    return AutoModelForCausalLM


def pair(cfg, seed=0):
    """(unpatched model with the reference attention, patched deep copy), eval mode, float32.
    The reference is "eager", except Falcon: its eager path adds ALiBi twice (once in the 4-D mask,
    once in the scores); its default "sdpa" path adds it once, as the model was trained."""
    torch.manual_seed(seed)
    impl = "sdpa" if cfg.model_type == "falcon" else "eager"
    ref = _auto(cfg).from_config(cfg, attn_implementation=impl).eval()
    with torch.no_grad():  # random, non-zero biases everywhere (init may zero them)
        g = torch.Generator().manual_seed(seed + 1)
        for p in ref.parameters():
            if p.dim() == 1 and bool((p == 0).all()):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for name, p in ref.named_parameters():
            if "relative_attention_bias" in name:  # T5: spread the buckets' values
                p.copy_(torch.randn(p.shape, generator=g))
    return ref, patch(copy.deepcopy(ref))


def inputs(cfg, batch, length, seed=0, pad=None):
    """Token ids and an attention mask (pad: 'left', 'right', 'hole' or None)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, cfg.vocab_size, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if pad == "left":
        mask[0, :3] = 0
        mask[-1, :length // 2] = 0
    elif pad == "right":
        mask[0, length - 3:] = 0
        mask[-1, length - length // 2:] = 0
    elif pad == "hole":
        mask[0, 4:7] = 0
        mask[-1, 10:12] = 0
        mask[-1, length - 1:] = 0
    return ids, mask


def run(model, cfg, ids, mask, *, dec_ids=None, dec_mask=None):
    kw = {"attention_mask": mask}
    if cfg.model_type in ("t5", "mt5"):
        kw.update(decoder_input_ids=dec_ids, decoder_attention_mask=dec_mask)
    return model(input_ids=ids, **kw).logits


def real_rows(cfg, mask, dec_mask):
    """[B, L] bool: the logits rows that belong to real tokens."""
    m = dec_mask if cfg.model_type in ("t5", "mt5") else mask
    return m.to(torch.bool)


def _rel(a, b, rows):
    a, b = a[rows].double(), b[rows].double()
    return float((a - b).abs().max() / b.abs().max())


def _loss(logits, rows, seed=3):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(logits.shape, generator=g, dtype=torch.float64).to(logits.dtype)
    return (logits * w * rows[..., None].to(logits.dtype)).sum()


def _grads(model):
    return {n: p.grad.detach().double().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def forward_backward(model, cfg, ids, mask, dec_ids, dec_mask):
    model.zero_grad(set_to_none=True)
    logits = run(model, cfg, ids, mask, dec_ids=dec_ids, dec_mask=dec_mask)
    _loss(logits, real_rows(cfg, mask, dec_mask)).backward()
    return logits.detach(), _grads(model)


CASES = {
    # name: (config factory, batch, length, padding, decoder padding). Float64 cases avoid left
    # padding in decoders: transformers' float64 eager models give NaN on fully masked rows.
    "t5": (t5_config, 2, 40, "right", "right"),
    "t5-long": (lambda: t5_config(num_layers=1, num_decoder_layers=1), 1, 150, None, None),
    "mt5": (mt5_config, 2, 24, "right", None),
    "bloom": (lambda: bloom_config(4), 2, 24, "right", None),
    "bloom-hole": (lambda: bloom_config(8), 2, 20, "hole", None),
    "mpt": (lambda: mpt_config(4), 2, 24, "right", None),
    "falcon": (lambda: falcon_config(4), 2, 24, "right", None),
    "deberta-v3": (deberta_config, 2, 40, "right", None),
    "deberta-v3-long": (lambda: deberta_config(num_hidden_layers=1), 1, 170, None, None),
    "deberta-separate-c2p": (lambda: deberta_config(share_att_key=False, pos_att_type="c2p",
                                                    position_buckets=-1,
                                                    max_relative_positions=12,
                                                    norm_rel_ebd="none"), 2, 20, "right", None),
}


def _case(name):
    factory, batch, length, pad, dec_pad = CASES[name]
    cfg = factory()
    ids, mask = inputs(cfg, batch, length, pad=pad)
    dec_ids = dec_mask = None
    if cfg.model_type in ("t5", "mt5"):
        dec_ids, dec_mask = inputs(cfg, batch, max(length // 2, 5), seed=1, pad=dec_pad)
        dec_ids[:, 0] = 0
        dec_mask[:, 0] = 1
    return cfg, ids, mask, dec_ids, dec_mask


# BLOOM and MPT take their softmax in float32 even in a float64 model (softmax(..., dtype=float32),
# scores.float()): each probability carries a float32 rounding (2^-24 relative), so their float64
# comparison holds to 1e-6 relative, not 1e-9.
F64_TOL = {"bloom": 1e-6, "mpt": 1e-6}


@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_logits_and_gradients_match(name):
    cfg, ids, mask, dec_ids, dec_mask = _case(name)
    ref, pat = pair(cfg)
    ref.double()
    pat.double()
    rows = real_rows(cfg, mask, dec_mask)
    lr, gr = forward_backward(ref, cfg, ids, mask, dec_ids, dec_mask)
    lp, gp = forward_backward(pat, cfg, ids, mask, dec_ids, dec_mask)
    tol = F64_TOL.get(cfg.model_type, 1e-9)
    worst = _rel(lp, lr, rows)
    assert worst <= tol
    assert set(gp) == set(gr), set(gp) ^ set(gr)
    # A gradient that vanishes in exact arithmetic (a key bias under softmax's shift invariance)
    # is rounding noise: relative to 1e-3 of the largest gradient at least.
    floor = 1e-3 * max(float(g.abs().max()) for g in gr.values())
    for n in gr:
        scale = max(float(gr[n].abs().max()), floor)
        err = float((gp[n] - gr[n]).abs().max()) / scale
        worst = max(worst, err)
        assert err <= tol, (n, err)
    print(f"\n{name}: float64 max relative difference {worst:.2e}")


@pytest.mark.parametrize("name", ["t5", "mt5", "bloom", "mpt", "falcon", "deberta-v3"])
def test_float32_within_the_unpatched_models_error(name):
    cfg, ids, mask, dec_ids, dec_mask = _case(name)
    ref, pat = pair(cfg)
    ref64 = copy.deepcopy(ref).double()
    rows = real_rows(cfg, mask, dec_mask)
    l64, g64 = forward_backward(ref64, cfg, ids, mask, dec_ids, dec_mask)
    l32, g32 = forward_backward(ref, cfg, ids, mask, dec_ids, dec_mask)
    lp, gp = forward_backward(pat, cfg, ids, mask, dec_ids, dec_mask)
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


def _alibi_nonpow2(family):
    return {"bloom": lambda: bloom_config(6), "mpt": lambda: mpt_config(6),
            "falcon": lambda: falcon_config(6)}[family]()


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_alibi_heads_not_a_power_of_two(family):
    cfg = _alibi_nonpow2(family)
    ids, mask = inputs(cfg, 2, 24, pad="right")
    ref, pat = pair(cfg)
    slopes = next(m for m in pat.modules() if "_posenc_state" in m.__dict__)
    slopes = slopes.__dict__["_posenc_state"]["slopes"].double().numpy()
    # The model's slopes are posenc's ALiBi slopes (rounded to float32 by the model's code).
    np.testing.assert_allclose(slopes, posenc.alibi_slopes(6), rtol=2e-7)
    ref64 = copy.deepcopy(ref).double()
    rows = mask.to(torch.bool)
    with torch.no_grad():
        l64 = run(ref64, cfg, ids, mask)
        l32 = run(ref, cfg, ids, mask)
        lp = run(pat, cfg, ids, mask)
    e_ref = float((l32.double() - l64)[rows].abs().max())
    e_pat = float((lp.double() - l64)[rows].abs().max())
    big = float(l64[rows].abs().max())
    assert e_pat <= 2 * e_ref + 2e-6 * big
    print(f"\n{family} 6 heads: against float64: patched {e_pat / big:.2e}, unpatched "
          f"{e_ref / big:.2e}; vs unpatched float32 {_rel(lp, l32, rows):.2e}")


def test_falcon_heads_not_a_power_of_two_float32_bias():
    # Falcon forms slope·position in bfloat16 (transformers' build_alibi_tensor); posenc uses the
    # exact product of the (bfloat16-rounded) slope and the distance. With the product formed in
    # float32 instead, the unpatched model matches posenc to float32 rounding.
    from unittest import mock

    from transformers.models.falcon import modeling_falcon as mf
    cfg = _alibi_nonpow2("falcon")
    ids, mask = inputs(cfg, 2, 24, pad="left")
    ref, pat = pair(cfg)
    orig = mf.build_alibi_tensor

    def f32_product(attention_mask, num_heads, dtype):
        ones = torch.ones(1, 2, dtype=torch.long)
        slopes = orig(ones, num_heads, torch.float32)[:, 0, 1]
        pos = ((attention_mask.cumsum(-1) - 1) * attention_mask)[:, None, :]
        alibi = slopes[None, :, None] * pos
        return alibi.reshape(-1, 1, attention_mask.shape[1]).to(dtype)

    with torch.no_grad(), mock.patch.object(mf, "build_alibi_tensor", f32_product):
        l32 = run(ref, cfg, ids, mask)
        lp = run(pat, cfg, ids, mask)
    rel = _rel(lp, l32, mask.to(torch.bool))
    assert rel <= 1e-5
    print(f"\nfalcon 6 heads (float32 ALiBi product): {rel:.2e} (relative)")


@pytest.mark.parametrize("name", ["t5", "mt5", "bloom", "mpt", "falcon", "deberta-v3"])
def test_bfloat16_within_the_unpatched_models_error(name):
    cfg, ids, mask, dec_ids, dec_mask = _case(name)
    ref, pat = pair(cfg)
    rows = real_rows(cfg, mask, dec_mask)
    with torch.no_grad():
        l32 = run(ref, cfg, ids, mask, dec_ids=dec_ids, dec_mask=dec_mask).double()
        ref.to(torch.bfloat16)
        pat.to(torch.bfloat16)
        lb = run(ref, cfg, ids, mask, dec_ids=dec_ids, dec_mask=dec_mask).double()
        lpb = run(pat, cfg, ids, mask, dec_ids=dec_ids, dec_mask=dec_mask).double()
    e_ref = float((lb - l32)[rows].abs().max())
    e_pat = float((lpb - l32)[rows].abs().max())
    big = float(l32[rows].abs().max())
    assert e_pat <= 2 * e_ref + 2e-6 * big, (e_pat, e_ref)
    print(f"\n{name}: bf16 against float32 (relative): patched {e_pat / big:.2e}, unpatched "
          f"{e_ref / big:.2e}; patched vs unpatched bf16 {_rel(lpb, lb, rows):.2e}")


@pytest.mark.parametrize("family", ["bloom", "mpt", "falcon"])
def test_left_padding_float32(family):
    # Left padding leaves the first queries of a row with no visible key: transformers' float64
    # models give NaN there, so float32 against float32: relative 1e-5 on the real tokens.
    cfg = {"bloom": bloom_config, "mpt": mpt_config, "falcon": falcon_config}[family](4)
    ids, mask = inputs(cfg, 3, 20, seed=5, pad="left")
    ref, pat = pair(cfg)
    with torch.no_grad():
        lr = run(ref, cfg, ids, mask)
        lp = run(pat, cfg, ids, mask)
    rel = _rel(lp, lr, mask.to(torch.bool))
    assert rel <= 1e-5
    print(f"\n{family} left padding: float32 vs unpatched {rel:.2e} (relative)")


def test_generate_t5_padded_encoder_batch():
    cfg = t5_config()
    ref, pat = pair(cfg)
    ids, mask = inputs(cfg, 2, 18, seed=7, pad="right")
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    with torch.no_grad():
        a = ref.generate(ids, **kw)
        b = pat.generate(ids, **kw)
    assert a.shape[1] == 9 and torch.equal(a, b)


@pytest.mark.parametrize("family", ["bloom", "mpt", "falcon"])
def test_generate_decoder_with_cache_left_padded(family):
    cfg = {"bloom": bloom_config, "mpt": mpt_config, "falcon": falcon_config}[family](4)
    cfg.pad_token_id = 0
    ref, pat = pair(cfg)
    ids, mask = inputs(cfg, 2, 10, seed=8, pad="left")
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
              pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        a = ref.generate(ids, **kw)
        b = pat.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores):  # every step's logits (-inf: tokens suppressed)
        fin = torch.isfinite(sa)
        assert torch.equal(fin, torch.isfinite(sb))
        assert float((sa - sb)[fin].abs().max()) <= 1e-5 * float(sa[fin].abs().max())


class _ShapeRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the shapes of every tensor an op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def _square(shapes, length):
    return [s for s in shapes if len(s) >= 2 and s[-1] >= length and s[-2] >= length]


@pytest.mark.parametrize("name", ["t5", "bloom", "mpt", "falcon", "deberta-v3"])
def test_no_length_squared_tensor_is_built(name):
    # Hidden sizes and vocabularies are below the length: any tensor whose last two dims are both
    # >= L is a score, bias or mask (e.g. [B, H, L, L], [B, 1, L, L], [1, L, L]).
    cfg = CASES[name][0]()
    length = 130
    ids, mask = inputs(cfg, 2, length, pad="right")
    dec_ids = dec_mask = None
    if cfg.model_type == "t5":
        dec_ids, dec_mask = inputs(cfg, 2, length, seed=1, pad="right")
    ref, pat = pair(cfg)
    for model, expect in ((ref, True), (pat, False)):
        rec = _ShapeRecorder()
        with rec:
            logits = run(model, cfg, ids, mask, dec_ids=dec_ids, dec_mask=dec_mask)
            _loss(logits, real_rows(cfg, mask, dec_mask)).backward()
        found = _square(rec.shapes, length)
        assert bool(found) == expect, found[:3]


def test_t5_table_gradient_reaches_both_stacks():
    cfg = t5_config()
    _, pat = pair(cfg)
    cfg_, ids, mask, dec_ids, dec_mask = _case("t5")
    _, grads = forward_backward(pat, cfg, ids, mask, dec_ids, dec_mask)
    tables = [n for n in grads if "relative_attention_bias" in n]
    table = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert sorted(tables) == ["decoder." + table, "encoder." + table]
    assert all(float(grads[n].abs().max()) > 0 for n in tables)


def test_requests_that_cannot_be_fused_raise():
    cfg = bloom_config(4)
    _, pat = pair(cfg)
    ids, mask = inputs(cfg, 1, 6)
    with pytest.raises(ValueError, match="output_attentions"):
        pat(input_ids=ids, output_attentions=True)
    for cfg in (mpt_config(4), falcon_config(4), deberta_config()):
        _, pat = pair(cfg)
        with pytest.raises(ValueError, match="output_attentions"):
            pat(input_ids=ids, output_attentions=True)
    cfg = deberta_config()
    _, pat = pair(cfg)
    with pytest.raises(ValueError, match="output_attentions"):
        pat(input_ids=ids, output_attentions=True)
    cfg = t5_config()
    _, pat = pair(cfg)
    with pytest.raises(ValueError, match="output_attentions"):
        pat(input_ids=ids, decoder_input_ids=ids[:, :2], output_attentions=True)
    attn = pat.encoder.block[1].layer[0].SelfAttention
    with pytest.raises(ValueError, match="position_bias"):
        attn(torch.zeros(1, 4, 32), position_bias=torch.zeros(1, 4, 4, 4))


def test_unsupported_models_raise_type_error():
    from transformers import AutoModelForCausalLM
    gpt2 = AutoModelForCausalLM.from_config(_config("gpt2", n_embd=32, n_head=4, n_layer=1,
                                                    vocab_size=64))
    with pytest.raises(TypeError, match="gpt2"):
        patch(gpt2)
    llama = AutoModelForCausalLM.from_config(_config(
        "llama", hidden_size=32, num_attention_heads=4, num_hidden_layers=1, vocab_size=64,
        intermediate_size=32))
    with pytest.raises(TypeError, match="attn_implementation='posenc'"):
        patch(llama)  # a RoPE model that calls the attention interface: the backend's
    with pytest.raises(TypeError):
        patch("t5")
    with pytest.raises(ValueError, match="attention_dropout"):
        patch(gpt2, attention_dropout="sometimes")


def test_attention_dropout_policy_and_unpatch():
    cfg = t5_config(dropout_rate=0.1)
    ref, pat = pair(cfg)
    ids, mask = inputs(cfg, 1, 6)
    dec = torch.zeros(1, 3, dtype=torch.long)
    pat.train()
    with pytest.warns(RuntimeWarning, match="dropout"):
        pat(input_ids=ids, decoder_input_ids=dec)
    copied = copy.deepcopy(ref)
    assert patch(copied, attention_dropout="error") is copied  # patched in place, returned
    strict = copied.train()
    with pytest.raises(ValueError, match="dropout"):
        strict(input_ids=ids, decoder_input_ids=dec)
    pat.eval()
    assert unpatch(pat) is pat
    assert pat.config._attn_implementation == "eager"
    assert all("_posenc_state" not in m.__dict__ for m in pat.modules())
    with torch.no_grad():
        assert torch.equal(pat(input_ids=ids, decoder_input_ids=dec).logits,
                           ref(input_ids=ids, decoder_input_ids=dec).logits)


def test_generate_with_a_static_cache():
    # A static cache holds max_cache_len key slots: the free ones are masked, positions follow
    # the cache's offset.
    cfg = bloom_config(4)
    cfg.pad_token_id = 0
    ref, pat = pair(cfg)
    ids, mask = inputs(cfg, 2, 9, seed=9, pad="left")
    kw = dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
              pad_token_id=0)
    with torch.no_grad():
        a = ref.generate(ids, **kw)
        b = pat.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(a, b)


def test_dense_masks_from_the_caller():
    # Masks that are not a padding pattern reach the kernel as posenc's dense mask: a [B, L, L]
    # mask given to DeBERTa's encoder, a 4-D additive mask given to T5's encoder.
    g = torch.Generator().manual_seed(11)
    cfg = deberta_config()
    ref, pat = pair(cfg)
    ids, _ = inputs(cfg, 2, 16)
    m3 = (torch.rand(2, 16, 16, generator=g) < 0.6) | torch.eye(16, dtype=torch.bool)
    with torch.no_grad():  # the encoder takes [B, L, L] masks (the embeddings do not)
        h = ref.deberta.embeddings(input_ids=ids)
        a = ref.deberta.encoder(h, m3.long()).last_hidden_state
        b = pat.deberta.encoder(h, m3.long()).last_hidden_state
    assert _rel(b, a, torch.ones(2, 16, dtype=torch.bool)) <= 1e-5
    cfg = t5_config()
    ref, pat = pair(cfg)
    m4 = ((torch.rand(2, 1, 16, 16, generator=g) < 0.6) | torch.eye(16, dtype=torch.bool))
    m4 = torch.zeros(m4.shape).masked_fill(~m4, torch.finfo(torch.float32).min)  # additive
    with torch.no_grad():
        a = ref.encoder(input_ids=ids, attention_mask=m4).last_hidden_state
        b = pat.encoder(input_ids=ids, attention_mask=m4).last_hidden_state
    assert _rel(b, a, torch.ones(2, 16, dtype=torch.bool)) <= 1e-5


def test_mpt_alibi_bias_max_follows_transformers():
    # transformers' MPT builds its slopes with alibi_bias_max 8 whatever the config says: patch
    # follows the model's code (so the outputs still match) and warns.
    cfg = _config("mpt-7b", d_model=32, n_heads=4, n_layers=1, vocab_size=64, max_seq_len=64,
                  attn_config={"attn_pdrop": 0, "alibi_bias_max": 16})
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with pytest.warns(RuntimeWarning, match="alibi_bias_max"):
        pat = patch(copy.deepcopy(ref))
    ids, mask = inputs(cfg, 1, 12)
    with torch.no_grad():
        assert _rel(pat(input_ids=ids).logits, ref(input_ids=ids).logits,
                    mask.to(torch.bool)) <= 1e-5


@pytest.mark.parametrize("name", ["t5", "bloom", "mpt", "falcon"])
def test_patch_changes_nothing_outside_the_model(name):
    # Two models built from one config object share it (from_config does not copy it): patching
    # one leaves its twin, the config and models built from it later exactly as they were.
    cfg, ids, mask, dec_ids, dec_mask = _case(name)
    impl = "sdpa" if cfg.model_type == "falcon" else "eager"
    torch.manual_seed(0)
    a = _auto(cfg).from_config(cfg, attn_implementation=impl).eval()
    b = _auto(cfg).from_config(cfg, attn_implementation=impl).eval()
    b.load_state_dict(a.state_dict())
    shared = a.config
    held = [(m, m.__dict__.get("config")) for m in b.modules()]
    before = (shared.to_dict(), shared._attn_implementation)
    patch(b)
    assert a.config is shared and (shared.to_dict(), shared._attn_implementation) == before
    rows = real_rows(cfg, mask, dec_mask)
    with torch.no_grad():
        want = run(a, cfg, ids, mask, dec_ids=dec_ids, dec_mask=dec_mask)
        assert _rel(run(b, cfg, ids, mask, dec_ids=dec_ids, dec_mask=dec_mask), want, rows) <= 1e-5
        fresh = _auto(cfg).from_config(shared, attn_implementation=impl).eval()
        fresh.load_state_dict(a.state_dict())
        assert torch.equal(run(fresh, cfg, ids, mask, dec_ids=dec_ids, dec_mask=dec_mask), want)
        # The twin after the patched model ran: still eager's logits.
        assert torch.equal(run(a, cfg, ids, mask, dec_ids=dec_ids, dec_mask=dec_mask), want)
    # unpatch restores the model exactly: every module holds the config object it held before.
    unpatch(b)
    assert all(m.__dict__.get("config") is c for m, c in held)
    with torch.no_grad():
        assert torch.equal(run(b, cfg, ids, mask, dec_ids=dec_ids, dec_mask=dec_mask), want)


@pytest.mark.parametrize("pad", [None, "right", "left"])
def test_generate_t5_with_a_static_cache(pad):
    # generate() with a static cache builds each step's mask before the model's forward and hands
    # it in as attention_mask: the patched T5 keeps that mask as transformers keeps a 4-D one.
    cfg = t5_config()
    ref, pat = pair(cfg, seed=2)
    ids, mask = inputs(cfg, 2, 9, seed=9, pad=pad)
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
              suppress_tokens=[0, 1], no_repeat_ngram_size=1)  # a random model repeats a token
    with torch.no_grad():
        want = ref.generate(ids, cache_implementation="static", **kw)
        assert torch.equal(want, ref.generate(ids, **kw))
        got = pat.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(got, want)
    assert len(set(want[:, 1:].flatten().tolist())) > 1  # a sequence, not one repeated token
