"""posenc.hf.register(): transformers models with attn_implementation="posenc" against HF's own
"eager" attention, on small random models built from the shipped config.json files.

Every model is shrunk the same way (shrink() below): 2 decoder layers (4 for Llama 4, so that
one NoPE layer is among them), hidden size 64 (Phi-3, GPT-NeoX: heads x head_dim, their head dim follows
the hidden size), 4 query heads with the config's kind of grouping (MHA stays MHA, GQA becomes 4/2),
the config's head_dim, a 128-token vocabulary, 4 experts for MoE models. The positional settings
stay as written (rope_theta, rope_scaling / rope_parameters, partial rotary factors, Gemma's
query_pre_attn_scalar and soft-capping, gpt-oss' YaRN and sinks, DeepSeek's MLA dims), except the
lengths that must be short to be exercised by 13-token inputs: sliding_window becomes 5, Llama 4's
attention_chunk_size 6 and its floor_scale 4.

Tolerances (float32): posenc and eager compute the same attention in float32 in different orders
(a fused online softmax against matmul + softmax), so each layer's output differs by a few float32
roundings (~1e-7 relative); two to four layers, the MLPs and the LM head keep that at ~1e-6 of the
logits' scale (measured: 9e-8 to 6e-7, bench/hf_rope_bench.py --accuracy). The bound, relative
error <= 1e-5 of max |logits|, is thus over 10x the measured error. Gradients: each weight's
gradient within 2e-5 of that tensor's max |gradient| plus 1e-7 of the largest gradient of the model
(the backward runs the same float32 roundings about twice over: measured 6e-7 to 1.7e-6 of each
tensor's max, so 2e-5 is again over 10x; the absolute term covers tensors whose gradients are
all tiny). bf16: posenc's bf16 attention is the float32 result rounded once; eager's runs its matmuls
in bf16. Both are compared with the float32 eager model of the same (bf16-rounded) weights, and
posenc's error must be at most twice eager's (plus 1e-3 of the logits' scale).
"""

import copy
import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import posenc.hf  # noqa: E402
import posenc.torch as pt  # noqa: E402
from posenc.hf import backend as hfb  # noqa: E402

CONFIGS = os.path.abspath(os.environ.get(
    "POSENC_TEST_CONFIGS_DIR", os.path.join(os.path.dirname(__file__), "..", "configs")))

# (config file, number of decoder layers, what it exercises)
FAMILIES = [
    ("llama-2-7b.json", 2, "MHA, default RoPE"),
    ("llama-3.1-8b.json", 2, "GQA, llama3 scaling"),
    ("mistral-7b.json", 2, "sliding window on every layer"),
    ("qwen2.5-7b-yarn.json", 2, "YaRN, GQA 7:1"),
    ("qwen3-8b", 2, "q / k norms, GQA 4:1 (Qwen3-8B's published settings, inline)"),
    ("phi-3-mini-128k-like.json", 2, "LongRoPE, fused qkv"),
    ("phi-2.json", 2, "partial rotary (0.4)"),
    ("gpt-neox-20b.json", 2, "rotary_pct 0.25"),
    ("gemma-7b.json", 2, "head_dim 256"),
    ("gemma-2-2b.json", 2, "soft-capping, sliding / global layers, query_pre_attn_scalar"),
    ("gemma-3-1b-it.json", 2, "local / global layers with two RoPE bases"),
    ("gemma-3-4b-it.json", 2, "text_config, linear scaling on global layers"),
    ("gemma-4", 3, "proportional RoPE and 512-dim heads on the global layer, scale 1"),
    ("gemma-4-k-eq-v", 3, "global layer with its own key/value heads (attention_k_eq_v)"),
    ("gpt-oss-20b.json", 2, "sinks, sliding / full layers, YaRN"),
    ("llama-4-scout-17b-16e-instruct.json", 4, "chunked attention, NoPE layer, temperature"),
    ("deepseek-v2-lite.json", 2, "MLA: 192-dim q, k over 128-dim v, YaRN mscale"),
    ("deepseek-v3.json", 2, "MLA with interleaved RoPE, q LoRA"),
]
IDS = [f[0].removesuffix(".json") for f in FAMILIES]

REL_LOGITS = 1e-5


# Published settings of models without a shipped file.
INLINE = {"qwen3-8b": {"model_type": "qwen3", "hidden_size": 4096, "num_attention_heads": 32,
                       "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000.0,
                       "max_position_embeddings": 40960, "num_hidden_layers": 36,
                       "tie_word_embeddings": False},
          # Gemma 4 (E2B's published attention settings): sliding layers of 256-dim heads with
          # default RoPE, global layers of 512-dim heads with proportional RoPE (a quarter of
          # the angle pairs rotate), q / k / v norms, score scale 1.
          "gemma-4": {"model_type": "gemma4_text", "hidden_size": 1536, "num_attention_heads": 8,
                      "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
                      "num_hidden_layers": 35, "sliding_window": 512,
                      "final_logit_softcapping": 30.0, "max_position_embeddings": 131072},
          "gemma-4-k-eq-v": {"model_type": "gemma4_text", "hidden_size": 2816,
                             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
                             "global_head_dim": 512, "attention_k_eq_v": True,
                             "num_global_key_value_heads": 2, "num_hidden_layers": 30,
                             "sliding_window": 1024, "max_position_embeddings": 262144}}


def load_config(name):
    """A config.json as a flat dict of the text model (multimodal files: their text_config)."""
    if name in INLINE:
        return copy.deepcopy(INLINE[name])
    with open(os.path.join(CONFIGS, name)) as f:
        d = json.load(f)
    if "text_config" in d:
        text = dict(d["text_config"])
        mt = text.get("model_type", d["model_type"])
        text["model_type"] = mt if mt.endswith("_text") else mt + "_text"
        d = text
    return d


def shrink(d, layers=2, window=5, chunk=6):
    """The shrunk config dict (module docstring)."""
    d = copy.deepcopy(d)
    for k in ("quantization_config", "auto_map", "architectures", "_name_or_path", "torch_dtype",
              "dtype", "cache_implementation"):
        d.pop(k, None)
    heads = d.get("num_attention_heads", 32)
    kv = d.get("num_key_value_heads") or heads
    hd = d.get("head_dim") or d["hidden_size"] // heads
    if "qk_rope_head_dim" not in d:  # DeepSeek derives its head dims from the MLA sizes
        d["head_dim"] = hd
    d["num_attention_heads"] = 4
    d["num_key_value_heads"] = 4 if kv == heads else (1 if kv == 1 else 2)
    d["hidden_size"] = 4 * hd if d.get("model_type") in ("phi3", "gpt_neox") else 64
    d["intermediate_size"] = 64
    for k in ("moe_intermediate_size", "intermediate_size_mlp"):
        if k in d:
            d[k] = 64
    d["vocab_size"] = 128
    d["bos_token_id"], d["eos_token_id"], d["pad_token_id"] = 1, 2, 0
    if "attn_temperature_tuning" in d:  # Llama 4's file writes 4; the v5 class wants a bool
        d["attn_temperature_tuning"] = bool(d["attn_temperature_tuning"])
    d["num_hidden_layers"] = layers
    for k in ("layer_types", "no_rope_layers", "moe_layers"):
        if isinstance(d.get(k), list):
            d[k] = d[k][:layers]
    if d.get("sliding_window") and d.get("use_sliding_window", True) is not False:
        d["sliding_window"] = window
    if d.get("attention_chunk_size"):
        d["attention_chunk_size"] = chunk
    for k, v in (("num_local_experts", 4), ("n_routed_experts", 4), ("num_experts_per_tok", 2),
                 ("experts_per_token", 2), ("n_group", 1), ("topk_group", 1),
                 ("n_shared_experts", 1), ("kv_lora_rank", 32), ("first_k_dense_replace", 1)):
        if k in d:
            d[k] = v
    if d.get("q_lora_rank"):
        d["q_lora_rank"] = 32
    if d.get("model_type") == "gemma4_text":  # Gemma 4's per-layer input embeddings
        d["vocab_size_per_layer_input"] = 128
        d["hidden_size_per_layer_input"] = 8
    if "floor_scale" in d:
        d["floor_scale"] = 4
    d["attention_dropout"] = 0.0
    return d


def make_model(name, layers, seed=0, **overrides):
    """A random float32 model of the shrunk config, with eager attention."""
    d = shrink(load_config(name), layers=layers)
    d.update(overrides)
    mt = d.pop("model_type")
    cfg = transformers.AutoConfig.for_model(mt, **d)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                          dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module", autouse=True)
def _registered():
    assert posenc.hf.register() == "posenc"


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of posenc.torch.attention (proof that posenc ran)."""
    n = {"calls": 0}
    real = pt.attention

    def counting(*a, **k):
        n["calls"] += 1
        return real(*a, **k)

    monkeypatch.setattr(pt, "attention", counting)
    return n


def rel(a, b):
    """max |a - b| / max |a|."""
    return float((a.double() - b.double()).abs().max() / a.double().abs().max())


def _ids(batch, length, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=g)


@pytest.mark.parametrize("name,layers,what", FAMILIES, ids=IDS)
def test_logits_and_gradients_match_eager(name, layers, what, calls):
    model = make_model(name, layers)
    model.train()  # attention dropout is 0: train mode changes nothing but the flags
    ids = _ids(2, 13)
    out = {}
    for impl in ("eager", "posenc"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        res = model(ids, labels=ids)
        res.loss.backward()
        out[impl] = (res.logits.detach(), {n: None if p.grad is None else p.grad.clone()
                                           for n, p in model.named_parameters()})
    assert calls["calls"] == layers, "posenc ran in every layer, once"
    (la, ga), (lb, gb) = out["eager"], out["posenc"]
    # Within REL_LOGITS (gradients: 2e-5) of eager's; or, for a model whose own float32 error is
    # larger (Gemma 4: unscaled scores of normalised q and k), within the float32 rule against
    # the float64 model: posenc's error at most twice eager's plus 2e-6 of the largest value.
    ref64 = {}

    def float64_model():
        if not ref64:
            ref = copy.deepcopy(model).double()
            ref.set_attn_implementation("eager")
            ref.zero_grad()
            res = ref(ids, labels=ids)
            res.loss.backward()
            ref64["logits"] = res.logits.detach()
            ref64["grads"] = {n: p.grad for n, p in ref.named_parameters()}
        return ref64

    if rel(la, lb) > REL_LOGITS:
        l64 = float64_model()["logits"]
        assert rel(l64, lb) <= 2 * rel(l64, la) + 2e-6, (what, rel(l64, la), rel(l64, lb))
    big = max(float(g.abs().max()) for g in ga.values() if g is not None)
    far = []
    for n in ga:
        assert (ga[n] is None) == (gb[n] is None), n
        if ga[n] is None:
            continue
        err = float((ga[n] - gb[n]).abs().max())
        if err > 2e-5 * float(ga[n].abs().max()) + 1e-7 * big:
            far.append(n)
    if far:
        # The float32 rule over the model's gradient as one vector, in the 2-norm: each entry
        # sums the rounding of every layer's float32 code, so its maximum is a noisy statistic
        # (Gemma 4: eager's own error 4e-5 to 1e-3 of the norm; posenc's 0.6 to 1.5 times it).
        g64 = float64_model()["grads"]
        names = [n for n in ga if ga[n] is not None]
        ref_v = torch.cat([g64[n].flatten() for n in names])
        own = float((torch.cat([ga[n].double().flatten() for n in names]) - ref_v).norm())
        ours = float((torch.cat([gb[n].double().flatten() for n in names]) - ref_v).norm())
        assert ours <= 2 * own + 2e-6 * float(ref_v.norm()), (what, far, own, ours)


@pytest.mark.parametrize("name,layers,what", FAMILIES, ids=IDS)
def test_padded_batches_and_greedy_generation(name, layers, what, calls):
    model = make_model(name, layers)
    ids = _ids(2, 13, seed=2)
    # Row 0 left padded by 3, row 1 right padded by 4.
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, -4:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        a = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("posenc")
        b = model(ids, attention_mask=mask).logits
    real = mask.bool()
    assert rel(a[real], b[real]) <= REL_LOGITS, what
    assert calls["calls"] == layers

    # Greedy decoding with the KV cache, a left-padded batch of prompts; the decode steps have
    # one query each (and pass the sliding windows and chunks of 5 / 6 tokens).
    prompt = _ids(2, 7, seed=3)
    pmask = torch.ones_like(prompt)
    pmask[1, :2] = 0
    prompt = prompt.masked_fill(pmask == 0, 0)
    gen = {}
    for impl in ("eager", "posenc"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            res = model.generate(prompt, attention_mask=pmask, max_new_tokens=6, do_sample=False,
                                 pad_token_id=0, eos_token_id=None, output_scores=True,
                                 return_dict_in_generate=True)
        gen[impl] = res
    assert torch.equal(gen["eager"].sequences, gen["posenc"].sequences), what
    for sa, sb in zip(gen["eager"].scores, gen["posenc"].scores):
        assert rel(sa, sb) <= REL_LOGITS
    assert calls["calls"] == layers * (1 + 6)  # the padded forward; prefill and 5 decode steps


@pytest.mark.parametrize("name,layers,what", FAMILIES, ids=IDS)
def test_bf16(name, layers, what, calls):
    model = make_model(name, layers).to(torch.bfloat16)
    ids = _ids(2, 11, seed=4)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager16 = model(ids).logits.float()
        posenc16 = None
        model.set_attn_implementation("posenc")
        posenc16 = model(ids).logits.float()
        model.float()
        model.set_attn_implementation("eager")
        exact = model(ids).logits
    e_eager = float((eager16 - exact).abs().max())
    e_posenc = float((posenc16 - exact).abs().max())
    assert e_posenc <= 2 * e_eager + 1e-3 * float(exact.abs().max()), (what, e_posenc, e_eager)
    assert calls["calls"] == layers


def test_decode_step_by_step_equals_full_forward():
    """Prefill then one-query decode steps through the cache give the full forward's logits."""
    model = make_model("gemma-2-2b.json", 2)
    model.set_attn_implementation("posenc")
    ids = _ids(1, 12, seed=5)
    with torch.no_grad():
        full = model(ids).logits
        res = model(ids[:, :4], use_cache=True)
        steps = [res.logits]
        cache = res.past_key_values
        for t in range(4, 12):
            res = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            cache = res.past_key_values
            steps.append(res.logits)
    assert rel(full, torch.cat(steps, 1)) <= REL_LOGITS


def test_static_cache_generation():
    """cache_implementation="static": keys of the whole cache length, the unused slots masked."""
    model = make_model("llama-3.1-8b.json", 2)
    prompt = _ids(2, 6, seed=6)
    out = {}
    for impl in ("eager", "posenc"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0,
                                       eos_token_id=None, cache_implementation="static")
    assert torch.equal(out["eager"], out["posenc"])


def test_packed_sequences_use_documents():
    """position_ids restarting inside a row (packed sequences, no attention mask): transformers'
    packed-sequence mask becomes posenc documents and positions, not a dense mask."""
    model = make_model("mistral-7b.json", 2)
    ids = _ids(1, 14, seed=7)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 1, 2, 3]])
    seen = []
    real = hfb.posenc_mask

    def spy(*a, **k):
        m = real(*a, **k)
        seen.append(m)
        return m

    with torch.no_grad():
        model.set_attn_implementation("eager")
        a = model(ids, position_ids=pos, use_cache=False).logits
        model.set_attn_implementation("posenc")
        transformers.masking_utils.AttentionMaskInterface.register("posenc", spy)
        try:
            b = model(ids, position_ids=pos, use_cache=False).logits
        finally:
            posenc.hf.register()
    assert rel(a, b) <= REL_LOGITS
    assert seen and all(m.dense is None and m.documents is not None for m in seen)


def test_unrecognised_pattern_goes_dense_and_exact():
    """A mask pattern outside transformers' known ones (an or_mask_function, as vision models
    add for image tokens) is evaluated into a dense mask: the same result as eager's."""
    from transformers import masking_utils as mu
    from transformers.models.llama.modeling_llama import eager_attention_forward
    model = make_model("llama-3.1-8b.json", 2)
    layer = _layer(model)
    ids = _ids(2, 10, seed=8)
    inputs = model.model.embed_tokens(ids)
    pad = torch.ones_like(ids)
    pad[1, :2] = 0

    def image_block(b, h, q, kv):  # tokens 4..7 see each other both ways
        return (q >= 4) & (q <= 7) & (kv >= 4) & (kv <= 7)

    masks = {}
    for impl in ("eager", "posenc"):
        model.set_attn_implementation(impl)
        masks[impl] = mu.create_causal_mask(config=model.config, inputs_embeds=inputs,
                                            attention_mask=pad, cache=None,
                                            or_mask_function=image_block)
    m = masks["posenc"]
    assert isinstance(m, hfb.PosencMask) and m.dense is not None
    assert m.dense[0, 4, 7] and not m.dense[0, 3, 7] and not m.dense[1, 5, 1]
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(2, 4, 10, 16, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    want, _ = eager_attention_forward(layer, q, k, v, masks["eager"], scaling=0.25)
    got, _ = hfb.attention_forward(layer, q, k, v, m, scaling=0.25)
    # row 1's two padding queries see no key: eager averages, posenc gives 0; compare the rest
    assert rel(want[1, 2:], got[1, 2:]) <= 1e-6 and rel(want[0], got[0]) <= 1e-6


def test_mask_descriptions():
    """The mask function reads transformers' patterns into posenc options."""
    from transformers import masking_utils as mu
    pad = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    m = hfb.posenc_mask(2, 8, 8, mask_function=mu.sliding_window_causal_mask_function(3),
                        attention_mask=pad)
    assert (m.causal, m.window, m.chunk, m.dense) == (True, 3, None, None)
    assert torch.equal(m.padding, pad)
    left = torch.tensor([2, 0])
    m = hfb.posenc_mask(2, 8, 8, mask_function=mu.chunked_causal_mask_function(3, left))
    assert m.chunk == 3 and m.causal and m.chunk_shift.tolist() == [1, 0]
    m = hfb.posenc_mask(1, 1, 9, q_offset=8, kv_offset=0)
    assert (m.q_offset, m.kv_offset, m.causal, m.padding) == (8, 0, True, None)
    m = hfb.posenc_mask(1, 6, 6, mask_function=mu.sliding_window_bidirectional_mask_function(2))
    assert (m.causal, m.window) == (False, 3)  # |q - k| <= 2 is posenc's |rel| < 3


def _layer(model):
    return model.model.layers[0].self_attn


def _qkv(lq=5, lk=5, h=4, d=16):
    g = torch.Generator().manual_seed(9)
    return (torch.randn(1, h, lq, d, generator=g), torch.randn(1, h, lk, d, generator=g),
            torch.randn(1, h, lk, d, generator=g))


def test_4d_masks_exact_or_refused():
    model = make_model("llama-3.1-8b.json", 2)
    layer = _layer(model)
    q, k, v = _qkv()
    keep = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    keep[3, 1] = False
    want = pt.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask=keep[None])
    for m4 in (keep[None, None], torch.where(keep, 0.0, float("-inf"))[None, None],
               torch.where(keep, 0.0, torch.finfo(torch.float32).min)[None, None]):
        out, w = hfb.attention_forward(layer, q, k, v, m4, scaling=0.25)
        assert w is None and torch.equal(out, want)
    bias = torch.where(keep, 0.0, float("-inf")).clone()
    bias[4, 0] = -0.5  # an additive bias, not a mask
    with pytest.raises(ValueError, match=r"llama.*layer 0.*additive"):
        hfb.attention_forward(layer, q, k, v, bias[None, None], scaling=0.25)
    per_head = keep[None, None].repeat(1, 4, 1, 1).clone()
    per_head[0, 1, 4, 0] = False
    with pytest.raises(ValueError, match="per-head"):
        hfb.attention_forward(layer, q, k, v, per_head, scaling=0.25)
    with pytest.raises(ValueError, match="2-D"):
        hfb.attention_forward(layer, q, k, v, torch.ones(1, 5, dtype=torch.bool), scaling=0.25)
    with pytest.raises(ValueError, match="BlockMask|type"):
        hfb.attention_forward(layer, q, k, v, object(), scaling=0.25)
    # a mask made for other sizes than the layer's tensors
    wrong = hfb.posenc_mask(1, 5, 6)
    with pytest.raises(ValueError, match="6 keys"):
        hfb.attention_forward(layer, q, k, v, wrong, scaling=0.25)


def test_dropout_in_training_is_refused():
    model = make_model("llama-3.1-8b.json", 2, attention_dropout=0.1)
    model.set_attn_implementation("posenc")
    model.train()
    with pytest.raises(ValueError, match="attention dropout"):
        model(_ids(1, 5))
    model.eval()  # dropout is off in eval mode: runs
    with torch.no_grad():
        model(_ids(1, 5))


def test_from_pretrained_and_registration(tmp_path):
    """A saved model loads with attn_implementation="posenc"; registering twice is harmless."""
    model = make_model("qwen2.5-7b-yarn.json", 2)
    model.save_pretrained(tmp_path)
    posenc.hf.register()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path,
                                                               attn_implementation="posenc")
    assert loaded.config._attn_implementation == "posenc"
    ids = _ids(1, 9)
    with torch.no_grad():
        assert rel(model(ids).logits, loaded.eval()(ids).logits) <= REL_LOGITS


def test_a_known_looking_pattern_with_another_meaning_goes_dense():
    """The description is checked against transformers' own mask function: a function that
    looks like the sliding-window overlay but means something else is taken as it is (dense)."""
    from transformers import masking_utils as mu

    def sliding_window_overlay(sliding_window):  # same name, one key more
        def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
            return kv_idx >= q_idx - sliding_window
        return inner_mask

    fn = mu.and_masks(sliding_window_overlay(3), mu.causal_mask_function)
    m = hfb.posenc_mask(1, 9, 9, mask_function=fn)
    assert m.dense is not None
    want = mu.sdpa_mask(1, 9, 9, mask_function=fn, allow_is_causal_skip=False)[:, 0]
    assert torch.equal(m.dense, want)
    m = hfb.posenc_mask(1, 9, 9, mask_function=mu.sliding_window_causal_mask_function(3))
    assert m.dense is None and m.window == 3


@pytest.mark.parametrize("name", ["llama-3.1-8b.json", "qwen2.5-7b-yarn.json",
                                  "gemma-2-2b.json"])
def test_left_padded_training_step_equals_eager(name, calls):
    # Left padding with the usual labels (pads -100): the shifted loss scores the last pad
    # position (it predicts the first real token). Eager attention gives that fully masked query
    # row the mean of the values over all keys (and autograd the scores' gradient); so does
    # posenc, so the loss and every gradient agree.
    model = make_model(name, 2)
    model.train()
    ids = _ids(2, 13, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[1, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    out = {}
    for impl in ("eager", "posenc"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        res = model(ids, attention_mask=mask, labels=labels)
        res.loss.backward()
        out[impl] = (float(res.loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()
                                       if p.grad is not None})
    assert calls["calls"] == 2
    (la, ga), (lb, gb) = out["eager"], out["posenc"]
    assert abs(la - lb) <= 1e-5 * abs(la), (la, lb)
    big = max(float(g.abs().max()) for g in ga.values())
    assert set(ga) == set(gb)
    for n in ga:
        err = float((ga[n] - gb[n]).abs().max())
        assert err <= 2e-5 * float(ga[n].abs().max()) + 1e-7 * big, (n, err)
