"""posenc's reading of model configs against the installed transformers itself.

For every model type posenc reads, and for every RoPE type in the installed transformers'
ROPE_INIT_FUNCTIONS, the same config.json (a shipped file, the configuration class' defaults, or
a synthetic scaling dict) goes to posenc.read_model_config and to transformers' configuration
class; then

- the inverse frequencies and the attention factor of posenc.rope_frequencies(config, layer=i)
  equal those of the model's own rotary-embedding module (per layer type where the model has
  several), to float32 rounding (both compute in float64 or float32 from the same formulas:
  relative 1e-6; transformers computes its inverse frequencies in float32);
- per decoder layer, the choices of the model's attention module (built on the meta device: no
  memory) equal posenc's layer entry: RoPE or NoPE, the sliding window, the softmax scale, the
  logit soft-capping, attention sinks, the attention chunk.

A RoPE type that transformers has and posenc does not read must be refused by posenc with an
error naming it (never read as something else); the test of its values then fails strictly until
posenc implements it, so an upgrade of transformers that adds a type is caught.
"""

import copy
import importlib
import inspect
import json
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import posenc  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

CONFIGS = os.path.abspath(os.environ.get(
    "POSENC_TEST_CONFIGS_DIR", os.path.join(os.path.dirname(__file__), "..", "configs")))

# The RoPE model types posenc reads (docs/model-configs.md, "What is read, per family").
ROPE_TYPES_READ = [
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi", "phi3",
    "gpt_neox", "gemma", "gemma2", "stablelm", "starcoder2", "olmo", "falcon", "qwen2_vl",
    "qwen2_5_vl", "qwen3_vl", "gptj", "codegen", "llama4", "llama4_text", "deepseek_v2",
    "deepseek_v3", "kimi_k2", "gpt_oss", "gemma3", "gemma3_text", "gemma4", "gemma4_text",
]

# RoPE types of transformers that posenc refuses by name (the test checks the refusal).
NOT_YET = {}

# Class defaults on which posenc's table and the installed transformers disagree (found by this
# test): strictly failing until posenc follows transformers.
DEFAULTS_DISAGREE = {}

# Class defaults with which transformers' own model cannot run: posenc refuses them by name.
DEFAULTS_REFUSED = {"qwen2_vl": "mrope_section", "qwen2_5_vl": "mrope_section"}

REL = 1e-6


def _shipped():
    out = {}
    for f in sorted(os.listdir(CONFIGS)):
        if f.endswith(".json"):
            with open(os.path.join(CONFIGS, f)) as fh:
                d = json.load(fh)
            out[f] = d
    return out


SHIPPED = _shipped()


def _hf_config(raw):
    """transformers' configuration object of a config.json dict, and its text config."""
    d = copy.deepcopy(raw)
    mt = d.pop("model_type")
    for k in ("quantization_config", "auto_map", "architectures"):
        d.pop(k, None)
    if mt == "kimi_k2" and mt not in CONFIG_MAPPING:
        mt = "deepseek_v3"  # Kimi K2 runs DeepSeek-V3's code (its remote code subclasses it)
    assert mt in CONFIG_MAPPING, f"transformers {transformers.__version__} has no {mt!r}"
    # Two published files that transformers 5's strict classes refuse as written; given the
    # values their model code uses: Llama 4 writes attn_temperature_tuning 4 (a truthy int where
    # the class wants a bool); Phi-3-vision writes original_max_position_embeddings at the top
    # level only, where the class wants it in the longrope dict too.
    text = d.get("text_config", d)
    if "attn_temperature_tuning" in text:
        text["attn_temperature_tuning"] = bool(text["attn_temperature_tuning"])
    rs = text.get("rope_scaling")
    if isinstance(rs, dict) and rs.get("type", rs.get("rope_type")) in ("longrope", "su") \
            and "original_max_position_embeddings" in text:
        rs.setdefault("original_max_position_embeddings", text["original_max_position_embeddings"])
    cfg = transformers.AutoConfig.for_model(mt, **d)
    return cfg, cfg.get_text_config()


def _rotary(text_cfg):
    """The model's rotary-embedding module for a text config: {layer type or None: (inv_freq,
    attention_scaling)}."""
    mod = importlib.import_module(type(text_cfg).__module__.replace("configuration_", "modeling_"))
    classes = [c for n, c in vars(mod).items() if inspect.isclass(c)
               and n.endswith("RotaryEmbedding") and "Vision" not in n]
    assert len(classes) == 1, classes
    rot = classes[0](config=text_cfg)
    found = {}
    if hasattr(rot, "inv_freq"):
        found[None] = (rot.inv_freq.double().numpy(), float(rot.attention_scaling))
    elif hasattr(rot, "embed_positions"):
        # GPT-J / CodeGen keep a [positions, sin | cos] table: position 1 gives the angles
        row = rot.embed_positions[1].double()
        half = row.shape[0] // 2
        found[None] = (torch.atan2(row[:half], row[half:]).numpy(), 1.0)
    for lt in set(getattr(text_cfg, "layer_types", None) or ()):
        if hasattr(rot, f"{lt}_inv_freq"):
            found[lt] = (getattr(rot, f"{lt}_inv_freq").double().numpy(),
                         float(getattr(rot, f"{lt}_attention_scaling")))
    return found


def _attention_layers(text_cfg):
    """The attention modules of every decoder layer, built on the meta device (no memory)."""
    cfg = copy.deepcopy(text_cfg)
    for k, v in (("num_local_experts", 2), ("n_routed_experts", 2), ("num_experts", 2)):
        if hasattr(cfg, k) and getattr(cfg, k):
            setattr(cfg, k, v)
    if hasattr(cfg, "n_group"):
        cfg.n_group, cfg.topk_group = 1, 1
    if getattr(cfg, "num_experts_per_tok", None):
        cfg.num_experts_per_tok = 1
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(cfg)
    layers = getattr(model, "layers", None)
    if layers is None:
        layers = getattr(getattr(model, "language_model", model), "layers", None)
    if layers is None:
        layers = model.h
    out = []
    for layer in layers:
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attn", None) or \
            getattr(layer, "self_attention", None) or getattr(layer, "attention", None)
        out.append(attn)
    return out


def _compare_rope(raw, what):
    """Compares every layer's RoPE (posenc vs the model's rotary module)."""
    cfg, text = _hf_config(raw)
    rot = _rotary(text)
    pc = posenc.read_model_config(raw)
    types = getattr(text, "layer_types", None)
    for i, layer in enumerate(pc.layers):
        f = posenc.rope_frequencies(pc, layer=i)
        lt = types[i] if types else None
        if f.nope:
            continue
        inv, scaling = rot[lt] if lt in rot else rot[None]
        got = np.asarray(f.inv_freq, np.float64)
        assert got.shape == inv.shape, (what, i, got.shape, inv.shape)
        np.testing.assert_allclose(got, inv, rtol=REL, atol=0, err_msg=f"{what} layer {i}")
        assert math.isclose(f.attention_factor, scaling, rel_tol=REL), (what, i)
    return cfg, text, pc


def _rope_model_files():
    out = []
    for f, d in SHIPPED.items():
        mt = d.get("model_type")
        if mt in ROPE_TYPES_READ and not (mt == "falcon" and d.get("alibi")):
            out.append(f)
    return out


@pytest.mark.parametrize("name", _rope_model_files())
def test_shipped_configs_rope_and_layers(name):
    """Every shipped RoPE config: frequencies, attention factor and per-layer attention choices."""
    raw = SHIPPED[name]
    cfg, text, pc = _compare_rope(raw, name)
    _compare_layers(text, pc, name)


def _compare_layers(text, pc, what):
    attns = _attention_layers(text)
    assert len(attns) == len(pc.layers), what
    for i, (attn, layer) in enumerate(zip(attns, pc.layers)):
        # RoPE / NoPE (Llama 4)
        if hasattr(attn, "use_rope"):
            assert bool(attn.use_rope) == bool(layer["rope"]), (what, i)
        # softmax scale
        if getattr(attn, "scaling", None) is not None:
            assert math.isclose(float(attn.scaling), layer["softmax_scale"], rel_tol=1e-6), \
                (what, i, attn.scaling, layer["softmax_scale"])
        # sliding window
        hf_window = getattr(attn, "sliding_window", None)
        if hf_window is None and getattr(text, "layer_types", None) is None and \
                getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
            hf_window = text.sliding_window  # models whose every layer slides (Mistral)
        assert (hf_window or None) == (layer["sliding_window"] or None), \
            (what, i, hf_window, layer["sliding_window"])
        # soft-capping (Gemma 2)
        cap = getattr(attn, "attn_logit_softcapping", None)
        assert (cap or None) == (layer["softcap"] or None), (what, i, cap, layer["softcap"])
        # the layer's head dim and key/value heads (Gemma 4's global layers differ)
        if hasattr(attn, "head_dim") and hasattr(attn, "num_key_value_groups"):
            assert attn.head_dim == layer["head_dim"], (what, i, attn.head_dim, layer["head_dim"])
            assert text.num_attention_heads // attn.num_key_value_groups == layer["heads_kv"], \
                (what, i, attn.num_key_value_groups, layer["heads_kv"])
        # sinks (gpt-oss)
        assert hasattr(attn, "sinks") == bool(layer["attention_sinks"]), (what, i)
        # chunked attention (Llama 4)
        types = getattr(text, "layer_types", None)
        if types and types[i] == "chunked_attention":
            assert layer["attention_chunk"] == text.attention_chunk_size, (what, i)
        else:
            assert layer["attention_chunk"] is None, (what, i)


@pytest.mark.parametrize("mt", ROPE_TYPES_READ)
def test_class_defaults(mt):
    """A config.json with only model_type: posenc's defaults are the configuration class'."""
    raw = {"model_type": mt}
    if mt in DEFAULTS_REFUSED:
        with pytest.raises(Exception, match=DEFAULTS_REFUSED[mt]):
            posenc.read_model_config(raw)
        return
    if mt in DEFAULTS_DISAGREE:
        try:
            _check_defaults(raw, mt)
        except AssertionError:
            pytest.xfail(DEFAULTS_DISAGREE[mt])
        pytest.fail(f"{mt}: posenc now agrees with transformers' defaults; drop it from "
                    "DEFAULTS_DISAGREE")
    _check_defaults(raw, mt)


def _check_defaults(raw, mt):
    cfg, text, pc = _compare_rope(raw, mt)
    assert pc.heads_q == text.num_attention_heads
    assert pc.hidden_size == text.hidden_size
    kv = getattr(text, "num_key_value_heads", None)
    if mt == "falcon":
        kv = 1 if (getattr(text, "multi_query", True) and not text.new_decoder_architecture) \
            else text.num_kv_heads
    assert pc.heads_kv == (kv or text.num_attention_heads), mt
    _compare_layers_light(text, pc, mt)


def _compare_layers_light(text, pc, what):
    """Layer count and layer types without building the (full-size) modules."""
    assert len(pc.layers) == text.num_hidden_layers, what
    types = getattr(text, "layer_types", None)
    if types:
        for i, layer in enumerate(pc.layers):
            assert layer["attention"] == types[i], (what, i)


# Synthetic scaling dicts for each RoPE type, on a llama config (and a partial-rotary one).
SCALINGS = {
    "default": [{"rope_type": "default"}],
    "linear": [{"rope_type": "linear", "factor": 4.0}],
    "dynamic": [{"rope_type": "dynamic", "factor": 2.0}],
    "yarn": [{"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096},
             {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
              "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
             {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
              "truncate": False, "attention_factor": 1.25}],
    "longrope": [{"rope_type": "longrope", "original_max_position_embeddings": 4096,
                  "short_factor": [1.0 + 0.05 * i for i in range(32)],
                  "long_factor": [1.0 + 0.5 * i for i in range(32)]},
                 {"rope_type": "longrope", "original_max_position_embeddings": 4096,
                  "attention_factor": 1.1, "factor": 8.0,
                  "short_factor": [1.0] * 32, "long_factor": [2.0] * 32}],
    "llama3": [{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}],
    "proportional": [{"rope_type": "proportional", "partial_rotary_factor": 0.25},
                     {"rope_type": "proportional", "partial_rotary_factor": 0.3, "factor": 2.0},
                     {"rope_type": "proportional"}],
}


def _llama(scaling, **extra):
    d = {"model_type": "llama", "hidden_size": 1024, "num_attention_heads": 16,
         "num_key_value_heads": 4, "max_position_embeddings": 32768, "rope_theta": 500000.0,
         "num_hidden_layers": 2, "rope_scaling": scaling}
    d.update(extra)
    return d


def _rope_type_cases():
    out = []
    for rt in ["default", *ROPE_INIT_FUNCTIONS]:
        for j, s in enumerate(SCALINGS.get(rt, [None])):
            out.append(pytest.param(rt, s, id=f"{rt}-{j}"))
    return out


@pytest.mark.parametrize("rope_type,scaling", _rope_type_cases())
def test_every_rope_type(rope_type, scaling):
    """Each RoPE type of the installed transformers: read by posenc exactly as transformers
    computes it, at a short and a long sequence, or refused with an error naming the type."""
    if scaling is None:
        # a type transformers has and this test has no case for: posenc must refuse it by name
        raw = _llama({"rope_type": rope_type, "factor": 2.0})
        with pytest.raises(Exception, match=rope_type):
            posenc.read_model_config(raw)
        if rope_type in NOT_YET:
            return  # refused by name, as documented (docs/model-configs.md)
        pytest.fail(f"transformers {transformers.__version__} has RoPE type {rope_type!r}: "
                    "posenc refuses it; add it to posenc (and a case here)")
    variants = [_llama(scaling)]
    # A partial rotary dim (Phi: 80-dim heads, 32 rotated); proportional takes Phi's top-level
    # partial_rotary_factor only where its own dict has none (posenc refuses two that differ).
    if rope_type != "longrope" and "partial_rotary_factor" not in scaling:
        variants.append({"model_type": "phi", "hidden_size": 2560, "num_attention_heads": 32,
                         "partial_rotary_factor": 0.4, "max_position_embeddings": 8192,
                         "num_hidden_layers": 2, "rope_scaling": scaling})
    for raw in variants:
        extra = raw["model_type"]
        cfg, text, pc = _compare_rope(raw, f"{rope_type} {extra}")
        # the seq_len-dependent types, past their original length
        fn = ROPE_INIT_FUNCTIONS.get(rope_type)
        if rope_type in ("dynamic", "longrope"):
            for seq in (4096, 5000, 65536):
                inv, att = fn(text, None, seq_len=seq)
                f = posenc.rope_frequencies(pc, seq_len=seq)
                np.testing.assert_allclose(np.asarray(f.inv_freq, np.float64),
                                           inv.double().numpy(), rtol=REL, atol=0)
                assert math.isclose(f.attention_factor, att, rel_tol=REL)


def test_saved_configs_read_the_same():
    """transformers 5 writes a loaded config back with `rope_parameters`: posenc reads the saved
    form as it read the original (frequencies of every layer, windows)."""
    for name in _rope_model_files():
        raw = SHIPPED[name]
        cfg, _ = _hf_config(raw)
        saved = json.loads(cfg.to_json_string())
        a = posenc.read_model_config(raw)
        try:
            b = posenc.read_model_config(saved)
        except Exception as err:  # noqa: BLE001 - the message is the finding
            pytest.fail(f"{name}: posenc cannot read the config transformers saves: {err}")
        assert len(a.layers) == len(b.layers), name
        for i in range(len(a.layers)):
            fa = posenc.rope_frequencies(a, layer=i)
            fb = posenc.rope_frequencies(b, layer=i)
            assert fa.nope == fb.nope, (name, i)
            if not fa.nope:
                np.testing.assert_allclose(fa.inv_freq, fb.inv_freq, rtol=REL, err_msg=name)
                assert math.isclose(fa.attention_factor, fb.attention_factor, rel_tol=REL)
            assert a.layers[i]["sliding_window"] == b.layers[i]["sliding_window"], (name, i)


def test_every_rope_model_type_posenc_reads_is_covered():
    """posenc's list of model types (its error message for an unknown one): every type that reads
    as RoPE is in ROPE_TYPES_READ, so a type added to posenc is compared here too."""
    import re
    with pytest.raises(Exception) as err:
        posenc.read_model_config({"model_type": "no-such-model", "hidden_size": 64,
                                  "num_attention_heads": 4})
    listed = re.search(r"supported: ([^)]*)\)", str(err.value)).group(1).split(", ")
    rope = []
    for mt in listed:
        try:
            if posenc.read_model_config({"model_type": mt}).scheme == "rope":
                rope.append(mt)
        except Exception:  # noqa: BLE001 - types whose defaults alone do not form a config
            if mt in DEFAULTS_REFUSED:
                rope.append(mt)
    assert sorted(rope) == sorted(ROPE_TYPES_READ)


GEMMA4 = {"model_type": "gemma4_text", "num_hidden_layers": 8, "hidden_size": 256,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "global_head_dim": 64, "sliding_window": 16, "vocab_size": 64,
          "vocab_size_per_layer_input": 64, "hidden_size_per_layer_input": 8}


@pytest.mark.parametrize("extra", [
    {},
    {"attention_k_eq_v": True, "num_global_key_value_heads": 1},
    {"rope_parameters": {"full_attention": {"rope_type": "proportional", "rope_theta": 5e5,
                                            "partial_rotary_factor": 0.5, "factor": 4.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}},
    {"layer_types": ["full_attention", "sliding_attention"] * 3 + ["sliding_attention"] * 2},
], ids=["defaults", "k_eq_v", "rope-parameters", "layer-types"])
def test_gemma4_layers_head_dims_and_proportional_rope(extra):
    """Gemma 4: global layers with their own head dim (and key/value heads with
    attention_k_eq_v) and proportional RoPE, sliding layers with default RoPE; the last layer
    always global. posenc's layers against the model's attention modules and rotary module, for
    the config as written, as transformers saves it (per_layer_config), and under a gemma4
    wrapper's text_config."""
    raw = {**GEMMA4, **extra}
    cfg, text, pc = _compare_rope(raw, "gemma4_text")
    _compare_layers(text, pc, "gemma4_text")
    assert pc.layers[-1]["attention"] == "full_attention"
    full = [l for l in pc.layers if l["attention"] == "full_attention"]
    assert full and all(l["head_dim"] == 64 for l in full)
    f = posenc.rope_frequencies(pc, layer=full[0]["index"])
    factor = raw.get("rope_parameters", {}).get("full_attention", {}).get(
        "partial_rotary_factor", 0.25)
    assert len(f.inv_freq) == 32 and np.count_nonzero(f.inv_freq) == int(factor * 64 // 2)
    saved = json.loads(cfg.to_json_string())
    assert "per_layer_config" in saved
    b = posenc.read_model_config(saved)
    assert [l["head_dim"] for l in b.layers] == [l["head_dim"] for l in pc.layers]
    assert [l["heads_kv"] for l in b.layers] == [l["heads_kv"] for l in pc.layers]
    for i in range(len(pc.layers)):
        np.testing.assert_array_equal(posenc.rope_frequencies(b, layer=i).inv_freq,
                                      posenc.rope_frequencies(pc, layer=i).inv_freq)
    wrapped = posenc.read_model_config({"model_type": "gemma4", "text_config": raw})
    assert [l["head_dim"] for l in wrapped.layers] == [l["head_dim"] for l in pc.layers]


@pytest.mark.parametrize("extra,match", [
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"per_layer_config": {"3": {"sliding_window": 4}}}, r"per_layer_config\.3\.sliding_window"),
    ({"per_layer_config": {"9": {"head_dim": 64}}}, "past num_hidden_layers"),
    ({"per_layer_config": {"7": {"num_key_value_heads": 3}}}, "must divide"),
    ({"rope_parameters": {"full_attention": {"rope_type": "proportional",
                                             "partial_rotary_factor": 1.5}}},
     "partial_rotary_factor"),
])
def test_gemma4_refusals_name_the_key(extra, match):
    with pytest.raises(Exception, match=match):
        posenc.read_model_config({**GEMMA4, **extra})


def test_gemma4_proportional_rope_rotates_as_the_model():
    """posenc's RoPE with a Gemma 4 global layer's frequencies rotates q as the model's own
    rotary module and apply_rotary_pos_emb do; the unrotated angle pairs pass through bit for
    bit."""
    cfg, text = _hf_config(GEMMA4)
    pc = posenc.read_model_config(GEMMA4)
    mod = importlib.import_module("transformers.models.gemma4.modeling_gemma4")
    rot = mod.Gemma4TextRotaryEmbedding(config=text)
    layer = next(l["index"] for l in pc.layers if l["attention"] == "full_attention")
    pos = torch.arange(0, 300, 7)[None]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, len(pos[0]), 4, 64, generator=g)
    cos, sin = rot(q, pos, "full_attention")
    want = mod.apply_rotary_pos_emb(q, cos, sin, unsqueeze_dim=2)
    f = posenc.rope_frequencies(pc, layer=layer)
    got = posenc.apply_rope(q.double().numpy(), f, positions=pos[0].numpy())
    np.testing.assert_allclose(got, want.double().numpy(), rtol=0, atol=3e-5)
    rotated = int(0.25 * 64 // 2)
    still = np.r_[rotated:32, 32 + rotated:64]
    np.testing.assert_array_equal(got[..., still], q.double().numpy()[..., still])
