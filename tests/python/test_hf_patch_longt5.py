"""posenc.hf.patch on LongT5 against transformers itself: local and transient-global encoders.

Tiny random LongT5 models (d_model 32, 4 heads of 8, 2 encoder and 2 decoder layers,
local_radius 4 or 5, global_block_size 4, 32 buckets, max distance 20, random non-zero tables),
inputs of 23 to 41 tokens (not multiples of the block lengths), compared with the unpatched
model ("eager" attention in the decoder).

LongT5's encoder attention takes its softmax in float32 even in a float64 model
(``softmax(scores.float())``): each probability carries a float32 rounding. The float64 test
therefore compares with the unpatched model twice: with that cast lifted (``Tensor.float`` keeps
float64 tensors as they are while the reference runs; nothing else in the model calls it on a
float64 tensor), where both evaluate the same formulas in double (relative 1e-9), and with the
model as it is (relative 1e-6, as BLOOM and MPT in test_hf_patch.py). The float32 rule is the
project's: the patched model's error against the float64 model at most twice the unpatched
float32 model's own error plus 2e-6 of the largest magnitude. Padded batches compare the real
tokens only.
"""

import copy
from unittest import mock

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from posenc.hf import patch, unpatch  # noqa: E402

torch.set_num_threads(2)

KINDS = ("local", "transient-global")


def longt5_config(kind, radius=4, **kw):
    base = dict(d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2, num_decoder_layers=2,
                vocab_size=64, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                eos_token_id=1, local_radius=radius, global_block_size=4,
                relative_attention_num_buckets=32, relative_attention_max_distance=20,
                encoder_attention_type=kind)
    base.update(kw)
    return transformers.LongT5Config(**base)


def _randomize(model, seed):
    with torch.no_grad():  # random, non-zero tables and norms everywhere
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if "relative_attention_bias" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))


def pair(cfg, seed=0, cls=None):
    """(unpatched model, patched deep copy), eval mode, float32."""
    torch.manual_seed(seed)
    cls = cls or transformers.LongT5ForConditionalGeneration
    ref = cls._from_config(cfg, attn_implementation="eager").eval()
    _randomize(ref, seed)
    return ref, patch(copy.deepcopy(ref))


def inputs(batch, length, seed=0, pad=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 64, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if pad == "right":
        mask[0, length - 3:] = 0
        mask[-1, length - length // 2:] = 0
    elif pad == "left":
        mask[0, :3] = 0
        mask[-1, :length // 2] = 0
    return ids, mask


# name: (kind, local_radius, batch, encoder length, encoder padding, decoder padding)
CASES = {
    "local": ("local", 4, 2, 37, "right", "right"),
    "local-r5": ("local", 5, 2, 23, None, None),
    "tglobal": ("transient-global", 4, 2, 41, "right", "right"),
    "tglobal-r5-left": ("transient-global", 5, 2, 29, "left", None),
}


def _case(name):
    kind, radius, batch, length, pad, dec_pad = CASES[name]
    cfg = longt5_config(kind, radius)
    ids, mask = inputs(batch, length, pad=pad)
    dec_ids, dec_mask = inputs(batch, 13, seed=1, pad=dec_pad)
    dec_ids[:, 0] = 0
    dec_mask[:, 0] = 1
    return cfg, (ids, mask, dec_ids, dec_mask)


_FLOAT = torch.Tensor.float


def _keep_float64(self):
    return self if self.dtype == torch.float64 else _FLOAT(self)


def float64_softmax():
    """Lifts LongT5's float32 softmax cast (scores.float()) while a float64 reference runs."""
    return mock.patch.object(torch.Tensor, "float", _keep_float64)


def _loss(logits, rows):
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3),
                    dtype=torch.float64).to(logits.dtype)
    return (logits * w * rows[..., None].to(logits.dtype)).sum()


def forward_backward(model, data, lifted=False):
    ids, mask, dec_ids, dec_mask = data
    model.zero_grad(set_to_none=True)
    ctx = float64_softmax() if lifted else mock.MagicMock()
    with ctx:
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec_ids,
                       decoder_attention_mask=dec_mask).logits
        _loss(logits, dec_mask.to(torch.bool)).backward()
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return logits.detach(), grads


def _rel(a, b, rows):
    a, b = a[rows].double(), b[rows].double()
    return float((a - b).abs().max() / b.abs().max())


def _worst(lp, gp, lr, gr, rows):
    """The largest relative difference of the logits and of every gradient (a gradient is
    measured against its own largest entry, or 1e-3 of the largest gradient: a gradient that
    vanishes in exact arithmetic is rounding noise)."""
    assert set(gp) == set(gr), set(gp) ^ set(gr)
    worst = {"logits": _rel(lp, lr, rows)}
    floor = 1e-3 * max(float(g.abs().max()) for g in gr.values())
    for n in gr:
        worst[n] = float((gp[n] - gr[n]).abs().max()) / max(float(gr[n].abs().max()), floor)
    return worst


@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_logits_and_gradients_match(name):
    cfg, data = _case(name)
    ref, pat = pair(cfg)
    ref.double()
    pat.double()
    rows = data[3].to(torch.bool)
    lp, gp = forward_backward(pat, data)
    lr, gr = forward_backward(ref, data, lifted=True)
    exact = _worst(lp, gp, lr, gr, rows)
    bad = {n: e for n, e in exact.items() if e > 1e-9}
    assert not bad, bad
    lr, gr = forward_backward(ref, data)
    as_is = _worst(lp, gp, lr, gr, rows)
    bad = {n: e for n, e in as_is.items() if e > 1e-6}
    assert not bad, bad
    tables = sorted(n for n in gp if "relative_attention_bias" in n)
    local = cfg.encoder_attention_type == "local"
    layer = "LocalSelfAttention" if local else "TransientGlobalSelfAttention"
    want = ["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            f"encoder.block.0.layer.0.{layer}.relative_attention_bias.weight"]
    if not local:
        want.append(f"encoder.block.0.layer.0.{layer}.global_relative_attention_bias.weight")
    assert tables == sorted(want)  # the tables of layer 0 of each stack, as the model shares
    assert all(float(gp[n].abs().max()) > 0 for n in tables)
    print(f"\n{name}: float64 max relative difference {max(exact.values()):.2e} (float32 softmax "
          f"cast lifted), {max(as_is.values()):.2e} (the model as it is)")


@pytest.mark.parametrize("name", ["local", "tglobal"])
def test_float32_within_the_unpatched_models_error(name):
    cfg, data = _case(name)
    ref, pat = pair(cfg)
    ref64 = copy.deepcopy(ref).double()
    rows = data[3].to(torch.bool)
    l64, g64 = forward_backward(ref64, data, lifted=True)
    l32, g32 = forward_backward(ref, data)
    lp, gp = forward_backward(pat, data)
    e_ref = float((l32.double() - l64)[rows].abs().max())
    e_pat = float((lp.double() - l64)[rows].abs().max())
    big = float(l64[rows].abs().max())
    assert e_pat <= 2 * e_ref + 2e-6 * big, (e_pat, e_ref)
    rel = _rel(lp, l32, rows)
    assert rel <= 1e-5
    logits = f"patched {e_pat / big:.2e}, unpatched {e_ref / big:.2e}"
    worst = 0.0
    for n in g64:
        e_ref = float((g32[n] - g64[n]).abs().max())
        e_pat = float((gp[n] - g64[n]).abs().max())
        top = max(1.0, float(g64[n].abs().max()))
        assert e_pat <= 2 * e_ref + 2e-6 * top, n
        worst = max(worst, float((gp[n] - g32[n]).abs().max()) / float(g32[n].abs().max()))
    print(f"\n{name}: float32 logits vs unpatched float32 {rel:.2e}, gradients {worst:.2e} "
          f"(relative); logits against float64: {logits}")


@pytest.mark.parametrize("name", ["local", "tglobal"])
def test_bfloat16_within_the_unpatched_models_error(name):
    cfg, (ids, mask, dec_ids, dec_mask) = _case(name)
    ref, pat = pair(cfg)
    rows = dec_mask.to(torch.bool)
    kw = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=dec_ids,
              decoder_attention_mask=dec_mask)
    with torch.no_grad():
        l32 = ref(**kw).logits.double()
        ref.to(torch.bfloat16)
        pat.to(torch.bfloat16)
        lb = ref(**kw).logits.double()
        lpb = pat(**kw).logits.double()
    e_ref = float((lb - l32)[rows].abs().max())
    e_pat = float((lpb - l32)[rows].abs().max())
    big = float(l32[rows].abs().max())
    assert e_pat <= 2 * e_ref + 2e-6 * big, (e_pat, e_ref)
    print(f"\n{name}: bf16 against float32 (relative): patched {e_pat / big:.2e}, unpatched "
          f"{e_ref / big:.2e}")


@pytest.mark.parametrize("length", [3, 4, 7, 9])
def test_encoder_shorter_than_a_few_global_blocks(length):
    # Fewer tokens than a global block: no side keys; then one or two global blocks, the tail
    # joined to the last full one. Encoder-only model, float64.
    cfg = longt5_config("transient-global", 4)
    ref, pat = pair(cfg, cls=transformers.LongT5EncoderModel)
    ref.double()
    pat.double()
    ids, mask = inputs(2, length)
    mask[1, length - 1:] = 0
    with torch.no_grad(), float64_softmax():
        want = ref(input_ids=ids, attention_mask=mask).last_hidden_state
    with torch.no_grad():
        got = pat(input_ids=ids, attention_mask=mask).last_hidden_state
    assert _rel(got, want, mask.to(torch.bool)) <= 1e-9


@pytest.mark.parametrize("kind", KINDS)
def test_generate_padded_encoder_batch(kind):
    cfg = longt5_config(kind, 4)
    ref, pat = pair(cfg, seed=2)
    ids, mask = inputs(2, 31, seed=7, pad="right")
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
              suppress_tokens=[0, 1], no_repeat_ngram_size=1, output_scores=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        a = ref.generate(ids, **kw)
        b = pat.generate(ids, **kw)
    assert a.sequences.shape[1] == 9 and torch.equal(a.sequences, b.sequences)
    assert len(set(a.sequences[:, 1:].flatten().tolist())) > 1
    for sa, sb in zip(a.scores, b.scores):
        fin = torch.isfinite(sa)
        assert torch.equal(fin, torch.isfinite(sb))
        assert float((sa - sb)[fin].abs().max()) <= 1e-5 * float(sa[fin].abs().max())


class _ShapeRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_no_side_bias_or_one_hot_tensor_is_built():
    # Transient-global at L = 150: 37 global blocks (no other size of the model is 37). The
    # unpatched encoder builds [B, H, L, G] side biases and a [B, L, G + 1] one-hot matrix, the
    # decoder [B, H, L, L] scores; the patched model builds none of them.
    cfg = longt5_config("transient-global", 4)
    ids, mask = inputs(2, 150, pad="right")
    dec = torch.randint(2, 64, (2, 150), generator=torch.Generator().manual_seed(4))
    ref, pat = pair(cfg)
    g = 150 // 4
    for model, expect in ((ref, True), (pat, False)):
        rec = _ShapeRecorder()
        with rec:
            logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
            logits.sum().backward()
        found = [s for s in rec.shapes if len(s) >= 2 and s[-2] >= 150
                 and (s[-1] >= 150 or s[-1] in (g, g + 1))]
        assert bool(found) == expect, found[:3]


def test_requests_that_cannot_be_fused_raise():
    for kind in KINDS:
        cfg = longt5_config(kind, 4)
        _, pat = pair(cfg)
        ids, mask = inputs(1, 12)
        with pytest.raises(ValueError, match="output_attentions"):
            pat(input_ids=ids, decoder_input_ids=ids[:, :2], output_attentions=True)
        layer = pat.encoder.block[1].layer[0]
        attn = getattr(layer, "LocalSelfAttention", None) or layer.TransientGlobalSelfAttention
        h = torch.randn(1, 12, 32)
        with pytest.raises(ValueError, match="position_bias"):
            attn(h, mask=mask, position_bias=torch.zeros(1, 3, 4, 5, 15))
        with pytest.raises(ValueError, match="attention mask"):
            attn(h, mask=None)
    # A local mask that is not a padding pattern within the window.
    cfg = longt5_config("local", 4)
    _, pat = pair(cfg)
    from transformers.models.longt5 import modeling_longt5 as ml
    attn = pat.encoder.block[0].layer[0].LocalSelfAttention
    local = ml._get_local_attention_mask(torch.ones(1, 12), 5, torch.device("cpu")).clone()
    local[0, 0, 1, 2, 4] = False
    with pytest.raises(ValueError, match="not the model's"):
        attn(torch.randn(1, 12, 32), mask=local)
    cfg = longt5_config("transient-global", 4)
    _, pat = pair(cfg)
    attn = pat.encoder.block[0].layer[0].TransientGlobalSelfAttention
    with pytest.raises(ValueError, match="0 and 1"):
        attn(torch.randn(1, 12, 32), mask=torch.full((1, 12), 2))


def test_attention_dropout_policy():
    cfg = longt5_config("transient-global", 4, dropout_rate=0.1)
    _, pat = pair(cfg)
    ids, _ = inputs(1, 10)
    dec = torch.zeros(1, 3, dtype=torch.long)
    pat.train()
    with pytest.warns(RuntimeWarning, match="dropout"):
        pat(input_ids=ids, decoder_input_ids=dec)
    _, strict = pair(cfg)
    strict = patch(unpatch(strict), attention_dropout="error").train()
    with pytest.raises(ValueError, match="dropout"):
        strict(input_ids=ids, decoder_input_ids=dec)


@pytest.mark.parametrize("kind", KINDS)
def test_patch_changes_nothing_outside_the_model_and_unpatch_restores(kind):
    cfg = longt5_config(kind, 4)
    ids, mask = inputs(2, 27, pad="right")
    dec = torch.randint(2, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    cls = transformers.LongT5ForConditionalGeneration
    a = cls._from_config(cfg, attn_implementation="eager").eval()
    _randomize(a, 0)
    b = cls._from_config(cfg, attn_implementation="eager").eval()
    b.load_state_dict(a.state_dict())
    shared = a.config
    held = [(m, m.__dict__.get("config")) for m in b.modules()]
    before = (shared.to_dict(), shared._attn_implementation)
    assert patch(b) is b
    assert a.config is shared and (shared.to_dict(), shared._attn_implementation) == before
    run = lambda m: m(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits  # noqa
    with torch.no_grad():
        want = run(a)
        assert _rel(run(b), want, torch.ones(2, 9, dtype=torch.bool)) <= 1e-5
        fresh = cls._from_config(shared, attn_implementation="eager").eval()
        fresh.load_state_dict(a.state_dict())
        assert torch.equal(run(fresh), want)
        assert torch.equal(run(a), want)
    assert unpatch(b) is b
    assert all(m.__dict__.get("config") is c for m, c in held)
    assert all("forward" not in m.__dict__ and "_posenc_state" not in m.__dict__
               for m in b.modules())
    with torch.no_grad():
        assert torch.equal(run(b), want)
