"""posenc.hf.patch: fused positional attention for the bias families of transformers.

``patch(model)`` replaces, in place, the attention of T5 / mT5 (encoder and decoder
self-attention with the stack's layer-0 bucket table, cross-attention), UMT5 (a table in every
layer), BLOOM, MPT and Falcon-RW (ALiBi with the model's slopes) and DeBERTa v1/v2/v3 (c2p and
p2c from the model's relative embeddings and projections) by posenc's fused kernels, so the
``[batch, heads, L, L]`` bias (and the ``[batch, 1, L, L]`` mask) is never built. Forward and
backward; gradients reach the model's own tables. See docs/hf.md.
"""

import copy
import warnings

from . import _bias_alibi, _bias_deberta, _bias_deberta_v1, _bias_mask, _bias_t5, _bias_umt5
from . import _bias_longt5, _rope_falcon_stablelm

__all__ = ["patch", "unpatch", "SUPPORTED_MODEL_TYPES"]

# model_type -> family.
SUPPORTED_MODEL_TYPES = {"t5": "t5", "mt5": "t5", "bloom": "bloom", "mpt": "mpt",
                         "falcon": "falcon", "deberta-v2": "deberta", "umt5": "umt5",
                         "deberta": "deberta-v1", "stablelm": "stablelm", "longt5": "longt5"}
_ATTENTION_CLASSES = {"T5Attention": "t5", "MT5Attention": "t5", "UMT5Attention": "umt5",
                      "BloomAttention": "bloom",
                      "MptAttention": "mpt", "FalconAttention": "falcon",
                      "DisentangledSelfAttention": "deberta", "StableLmAttention": "stablelm",
                      "LongT5Attention": "longt5", "LongT5LocalAttention": "longt5",
                      "LongT5TransientGlobalAttention": "longt5"}
_DROPOUT_POLICIES = ("warn", "error", "ignore")


def _family_of(module):
    """The family of an attention module class we patch, or None."""
    name = type(module).__name__
    fam = _ATTENTION_CLASSES.get(name)
    if fam == "deberta":  # v1 and v2 have different attention classes of that name
        return {"modeling_deberta_v2": "deberta", "modeling_deberta": "deberta-v1"}.get(
            type(module).__module__.split(".")[-1])
    if fam == "umt5" and type(module).__module__.split(".")[-1] != "modeling_umt5":
        return None
    if fam == "longt5" and type(module).__module__.split(".")[-1] != "modeling_longt5":
        return None
    if fam == "stablelm" and type(module).__module__.split(".")[-1] != "modeling_stablelm":
        return None
    if fam == "falcon" and not getattr(getattr(module, "config", None), "alibi", False):
        return "falcon-rope"
    if fam == "t5" and type(module).__module__.split(".")[-1] not in ("modeling_t5",
                                                                        "modeling_mt5"):
        return None
    return fam


def _dropout_probability(module, family):
    if family in ("t5", "umt5", "longt5"):
        return float(module.dropout)
    if family == "bloom" or family == "falcon":
        return float(module.attention_dropout.p)
    if family == "mpt":
        return float(module.attn_dropout_p or 0.0)
    if family == "stablelm":
        return float(module.attention_dropout)
    if family == "falcon-rope":
        return 0.0  # transformers' RoPE Falcon applies no attention dropout (eager nor sdpa)
    return float(module.dropout.p)


def _make_dropout_check(policy, family, model_name):
    """A check run by every patched forward: attention-probability dropout cannot be fused."""
    warned = []

    def check(module):
        if not module.training:
            return
        p = _dropout_probability(module, family)
        if p <= 0.0 or policy == "ignore":
            return
        msg = (f"{model_name} patched by posenc.hf.patch: attention dropout p={p} in training "
               "mode cannot be fused (posenc never forms the attention weights)")
        if policy == "error":
            raise ValueError(msg + "; set the config's attention dropout to 0, call model.eval(),"
                             " or patch(model, attention_dropout='ignore')")
        if not warned:
            warned.append(True)
            warnings.warn(msg + "; it is skipped (patch(model, attention_dropout='ignore') "
                          "silences this)", RuntimeWarning, stacklevel=3)
    return check


def _configs(model):
    """Every distinct config object of model's modules (T5's stacks hold copies)."""
    seen = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            seen[id(cfg)] = cfg
    return list(seen.values())


def _own_configs(model):
    """Gives the model's modules their own copies of the config objects they hold, so that the
    attention implementation patch sets changes nothing outside the model: models built from one
    config object share it (from_config does not copy), and a model built from it later would
    inherit the setting. unpatch puts the original objects back."""
    if "_posenc_configs" in model.__dict__:
        return
    copies, held = {}, []
    for m in model.modules():
        cfg = m.__dict__.get("config")
        if cfg is None or not hasattr(cfg, "_attn_implementation"):
            continue
        if id(cfg) not in copies:
            copies[id(cfg)] = copy.deepcopy(cfg)
        held.append((m, cfg))
        m.__dict__["config"] = copies[id(cfg)]
    model.__dict__["_posenc_configs"] = held


def patch(model, *, attention_dropout="warn"):
    """Runs the attention of a transformers T5 / mT5, BLOOM, MPT, Falcon-RW (ALiBi) or
    DeBERTa-v2/v3 model (and of RoPE Falcon and StableLM) on posenc's fused kernels, in place;
    returns the model.

    The model's own weights are used: T5's ``relative_attention_bias`` table of layer 0 of each
    stack (shared by the stack's layers, as transformers shares its bias), the ALiBi slopes the
    model's code computes (BLOOM, MPT, Falcon), DeBERTa's ``rel_embeddings`` with their
    normalisation and the layer's position projections (``share_att_key`` or
    ``pos_key_proj`` / ``pos_query_proj``), its ``position_buckets``, ``max_relative_positions``
    and scale. No ``[batch, heads, L, L]`` bias and no ``[batch, 1, L, L]`` mask are built: padding
    masks travel as key document ids (O(batch·L)). Forward and backward (gradients reach every
    weight, the tables included); generation with the KV cache works.

    Padding: real tokens are exact; outputs at padded query positions are not defined (the
    unpatched model also gives arbitrary values there). Requests the fused kernel cannot serve
    raise ValueError: ``output_attentions=True``, head masks, explicit ``position_bias`` /
    ``relative_pos`` tensors. attention_dropout: what to do when a module in training mode has
    attention-probability dropout (which cannot be fused): "warn" (default: skip it, warn once),
    "error" (ValueError) or "ignore". Model types: t5, mt5, umt5 (every self-attention layer
    with its own table), bloom, mpt, falcon (with ``alibi=True``), deberta-v2 (DeBERTa-v3 too),
    deberta (v1: ``in_proj`` with ``q_bias`` / ``v_bias``, ``pos_proj`` / ``pos_q_proj``, clipped
    distances; ``talking_head`` raises TypeError), falcon with RoPE (``alibi=False``; Falcon's
    attention never calls transformers' attention interface) and stablelm (partial rotary, q / k
    layer norms): the model's own projections and rotation, posenc's attention with the "posenc"
    masks (``posenc.hf.register()``, called by patch), longt5 (local and transient-global
    encoders: a window of ``local_radius``, the global blocks' side keys merged by log-sum-exp;
    the decoder as T5). Other models raise TypeError; other RoPE models use
    the attention backend instead (``posenc.hf.register()``, ``attn_implementation="posenc"``).
    ``posenc.hf.unpatch(model)`` restores the original attention.
    """
    try:
        import torch.nn as nn
    except ImportError as e:  # pragma: no cover
        raise ImportError("posenc.hf.patch needs PyTorch") from e
    if not isinstance(model, nn.Module):
        raise TypeError(f"posenc.hf.patch: a transformers model (torch.nn.Module), got "
                        f"{type(model).__name__}")
    if attention_dropout not in _DROPOUT_POLICIES:
        raise ValueError(f"attention_dropout: '{attention_dropout}' "
                         f"({', '.join(_DROPOUT_POLICIES)})")
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    name = f"{type(model).__name__} ({model_type})" if model_type else type(model).__name__
    found = [(m, _family_of(m)) for m in model.modules()]
    found = [(m, f) for m, f in found if f is not None]
    if not found:
        raise TypeError(f"posenc.hf.patch: {name} has no attention posenc can patch; supported "
                        f"model types: {', '.join(SUPPORTED_MODEL_TYPES)} (RoPE models: "
                        "posenc.hf.register() and attn_implementation='posenc')")
    families = {f for _, f in found}
    for m, f in found:
        option = _bias_deberta_v1.unsupported(m) if f == "deberta-v1" else None
        if option is not None:
            raise TypeError(f"posenc.hf.patch: {name}: the configuration option {option}=True "
                            "(DeBERTa's talking heads mix the heads' scores before the softmax "
                            "and its probabilities after it) cannot be fused; use the unpatched "
                            "model")
    if "t5" in families:
        _patch_t5(model, attention_dropout, name)
    if families & {"bloom", "mpt", "falcon"}:
        _patch_alibi(model, attention_dropout, name)
    if "deberta" in families:
        _patch_deberta(model, attention_dropout, name)
    if "umt5" in families:
        _patch_umt5(model, attention_dropout, name)
    if "deberta-v1" in families:
        _patch_deberta_v1(model, attention_dropout, name)
    if "longt5" in families:
        _bias_longt5.install_model(
            model, lambda: _make_dropout_check(attention_dropout, "longt5", name))
    mask_impl = None
    if families & {"t5", "umt5", "longt5", "bloom", "mpt", "falcon"}:
        _bias_mask.register_mask_function()
        mask_impl = _bias_mask.MASK_IMPL
    if families & set(_rope_falcon_stablelm.FAMILIES):
        _patch_rope(model, families, attention_dropout, name)
        mask_impl = _rope_falcon_stablelm.mask_implementation()
    if mask_impl is not None:
        _own_configs(model)
        previous = model.__dict__.setdefault("_posenc_previous_attn", {})
        for c in _configs(model):
            previous.setdefault(id(c), (c, c._attn_implementation))
            c._attn_implementation = mask_impl
    model.__dict__["_posenc_patched"] = True
    return model


def _patch_t5(model, policy, name):
    for stack in model.modules():
        blocks = getattr(stack, "block", None)
        if blocks is None or type(stack).__name__ not in ("T5Stack", "MT5Stack"):
            continue
        attns = [m for m in stack.modules() if _family_of(m) == "t5"]
        selfs = [blk.layer[0].SelfAttention for blk in blocks]
        owner = next((a for a in selfs if a.has_relative_attention_bias), None)
        check = _make_dropout_check(policy, "t5", name)
        for a in attns:
            own = owner
            if a.has_relative_attention_bias:
                own = a
            _bias_t5.install(a, own, check)
    for a in model.modules():  # attention modules outside a stack (used alone)
        if _family_of(a) == "t5" and "_posenc_state" not in a.__dict__:
            _bias_t5.install(a, a if a.has_relative_attention_bias else None,
                             _make_dropout_check(policy, "t5", name))


def _patch_alibi(model, policy, name):
    bases = {"BloomModel": "bloom", "MptModel": "mpt", "FalconModel": "falcon"}
    for base in model.modules():
        family = bases.get(type(base).__name__)
        if family is None:
            continue
        attns = [m for m in base.modules() if _family_of(m) == family]
        if not attns:
            continue
        heads = getattr(attns[0], "num_heads", None) or attns[0].n_heads
        slopes = _bias_alibi.model_slopes(family, base, heads)
        if family == "mpt":
            bias_max = getattr(getattr(base.config, "attn_config", None), "alibi_bias_max", 8)
            if bias_max not in (None, 8):
                warnings.warn(f"{name}: config alibi_bias_max={bias_max}, but transformers' MPT "
                              "computes its slopes with 8; posenc.hf.patch follows transformers",
                              RuntimeWarning, stacklevel=3)
        check = _make_dropout_check(policy, family, name)
        for a in attns:
            _bias_alibi.install(a, family, slopes, check)
        if family == "mpt":  # MptBlock does not pass output_attentions on to its attention
            for blk in base.modules():
                if type(blk).__name__ == "MptBlock" and "_posenc_hook" not in blk.__dict__:
                    blk.__dict__["_posenc_hook"] = blk.register_forward_pre_hook(
                        _refuse_output_attentions, with_kwargs=True)
    left = [type(m).__name__ for m in model.modules()
            if _family_of(m) in ("bloom", "mpt", "falcon") and "_posenc_state" not in m.__dict__]
    if left:
        raise TypeError(f"posenc.hf.patch: {name}: {left[0]} outside its base model "
                        "(BloomModel / MptModel / FalconModel): the slopes are unknown")


def _refuse_output_attentions(module, args, kwargs):
    if kwargs.get("output_attentions"):
        raise ValueError(f"{type(module).__name__} patched by posenc.hf.patch cannot return "
                         "attention weights (output_attentions=True): the fused kernel never "
                         "forms them; use the unpatched model (posenc.hf.unpatch)")


def _patch_deberta(model, policy, name):
    check = _make_dropout_check(policy, "deberta", name)
    for m in model.modules():
        if _family_of(m) == "deberta":
            _bias_deberta.install(m, check)
        elif type(m).__name__ == "DebertaV2Encoder":
            _bias_deberta.install_encoder(m)


def _patch_umt5(model, policy, name):
    check = _make_dropout_check(policy, "umt5", name)
    for m in model.modules():
        if _family_of(m) == "umt5":
            _bias_umt5.install(m, check)  # every self-attention layer holds its own table


def _patch_deberta_v1(model, policy, name):
    check = _make_dropout_check(policy, "deberta-v1", name)
    for m in model.modules():
        if _family_of(m) == "deberta-v1":
            _bias_deberta_v1.install(m, check)
        elif (type(m).__name__ == "DebertaEncoder"
              and type(m).__module__.split(".")[-1] == "modeling_deberta"):
            _bias_deberta_v1.install_encoder(m)


def _patch_rope(model, families, policy, name):
    """RoPE Falcon and StableLM: the model's rotation, posenc's attention."""
    for family in set(_rope_falcon_stablelm.FAMILIES) & families:
        check = _make_dropout_check(policy, family, name)
        for m in model.modules():
            if _family_of(m) == family:
                _rope_falcon_stablelm.install(m, family, check)
    for m in model.modules():  # StableLM's layers are not told of output_attentions
        if type(m).__name__ == "StableLmModel" and "_posenc_hook" not in m.__dict__:
            m.__dict__["_posenc_hook"] = m.register_forward_pre_hook(
                _rope_falcon_stablelm.refuse_output_attentions, with_kwargs=True)


def unpatch(model):
    """Restores the attention posenc.hf.patch replaced (and the configs' attention
    implementation); returns the model."""
    for m in model.modules():
        hook = m.__dict__.pop("_posenc_hook", None)
        if hook is not None:
            hook.remove()
        if "_posenc_state" in m.__dict__:
            del m.__dict__["_posenc_state"]
            m.__dict__.pop("forward", None)
        if type(m).__name__ in ("DebertaEncoder", "DebertaV2Encoder"):
            m.__dict__.pop("get_attention_mask", None)
            m.__dict__.pop("get_rel_pos", None)
    for c, prev in model.__dict__.pop("_posenc_previous_attn", {}).values():
        c._attn_implementation = prev
    for m, cfg in model.__dict__.pop("_posenc_configs", []):
        m.__dict__["config"] = cfg  # the very objects the model held before patch
    model.__dict__.pop("_posenc_patched", None)
    return model
