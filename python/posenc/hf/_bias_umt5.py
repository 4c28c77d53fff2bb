"""UMT5 attention on posenc: each layer's own bucket table inside the fused kernel.

UMT5 is T5 with a relative_attention_bias table in every self-attention layer (encoder and
decoder) instead of one per stack, and an attention forward that takes (hidden_states,
encoder_hidden_states, cache, attention_mask). The computation is T5's (_bias_t5.forward: the
same buckets, no score scaling, the same caches and masks); this module adapts the call.
"""

from . import _bias_t5


def forward(self, hidden_states, encoder_hidden_states=None, cache=None, attention_mask=None,
            past_key_values=None, **kwargs):
    """UMT5Attention.forward with posenc's fused attention (installed by posenc.hf.patch).

    Self-attention adds the layer's own bucketed bias (bidirectional in the encoder, causal
    buckets in the decoder) inside the kernel; cross-attention has no bias. Returns (output,
    None): the attention weights are never formed.
    """
    if "position_bias" in kwargs:
        raise ValueError("UMT5 attention patched by posenc.hf.patch: an explicit position_bias "
                         "is not supported (posenc computes the bias inside the kernel)")
    if cache is None:
        cache = past_key_values
    out, _, _ = _bias_t5.forward(self, hidden_states, mask=attention_mask,
                                 key_value_states=encoder_hidden_states, cache=cache, **kwargs)
    return out, None


def install(module, dropout_check):
    """Makes module (a UMT5Attention) run forward() above with its own table (none in
    cross-attention)."""
    owner = module if module.has_relative_attention_bias else None
    module.__dict__["_posenc_state"] = {"owner": owner, "dropout_check": dropout_check}
    module.forward = forward.__get__(module)
