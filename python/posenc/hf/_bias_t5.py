"""T5 / mT5 attention on posenc: the stack's layer-0 bucket table inside the fused kernel."""

import torch

from .. import torch as pt
from ._bias_mask import attention_kwargs, check_call


def forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None,
            cache=None, past_key_values=None, **kwargs):
    """T5Attention.forward with posenc's fused attention (installed by posenc.hf.patch).

    Self-attention adds the stack's bucketed bias (the layer-0 table relative_attention_bias,
    bidirectional in the encoder, causal buckets in the decoder) inside the kernel; cross-attention
    has no bias. Scores are not scaled (T5). Returns (output, None, None): no bias tensor to share.
    """
    from transformers.cache_utils import EncoderDecoderCache

    state = self._posenc_state
    check_call(self, kwargs, state["dropout_check"])
    if position_bias is not None:
        raise ValueError("T5 attention patched by posenc.hf.patch: an explicit position_bias "
                         "tensor is not supported (posenc computes the bias inside the kernel)")
    if cache is None:
        cache = past_key_values
    batch, seq_q = hidden_states.shape[:2]
    d = self.key_value_proj_dim
    past_seen = cache.get_seq_length(self.layer_idx) if cache is not None else 0
    if isinstance(past_seen, torch.Tensor):
        past_seen = int(past_seen)
    is_cross = key_value_states is not None
    query = self.q(hidden_states).view(batch, seq_q, -1, d)

    is_updated = False
    curr_cache = cache
    if isinstance(cache, EncoderDecoderCache):
        is_updated = cache.is_updated.get(self.layer_idx)
        curr_cache = cache.cross_attention_cache if is_cross else cache.self_attention_cache
    current = key_value_states if is_cross else hidden_states
    if is_cross and cache is not None and is_updated:
        key = curr_cache.layers[self.layer_idx].keys
        value = curr_cache.layers[self.layer_idx].values
    else:
        kv_shape = (*current.shape[:-1], -1, d)
        key = self.k(current).view(kv_shape).transpose(1, 2)
        value = self.v(current).view(kv_shape).transpose(1, 2)
        if cache is not None:
            key, value = curr_cache.update(key, value, self.layer_idx, kwargs=kwargs)
            if is_cross and isinstance(cache, EncoderDecoderCache):
                cache.is_updated[self.layer_idx] = True
    seq_k = key.shape[-2]
    kw = attention_kwargs(mask, batch, seq_q, seq_k, causal=self.is_decoder and not is_cross,
                          kind="additive", what=f"T5 layer {self.layer_idx}")
    if (not is_cross and "mask" not in kw and "query_positions" not in kw
            and past_seen + seq_q != seq_k):
        kw["query_positions"] = torch.arange(seq_q, dtype=torch.int64) + past_seen
    owner = state["owner"]
    if is_cross or owner is None:
        out = pt.attention(query, key.transpose(1, 2), value.transpose(1, 2), "none", scale=1.0,
                           **kw)
    else:
        table = owner.relative_attention_bias.weight
        out = pt.attention(query, key.transpose(1, 2), value.transpose(1, 2), "t5",
                           params={"relative_attention_bias": table}, scale=1.0,
                           max_distance=owner.relative_attention_max_distance,
                           bidirectional=not owner.is_decoder, **kw)
    out = out.reshape(batch, seq_q, -1)
    return self.o(out), None, None


def install(module, owner, dropout_check):
    """Makes module (a T5Attention) run forward() above; owner holds the stack's table."""
    module.__dict__["_posenc_state"] = {"owner": owner, "dropout_check": dropout_check}
    module.forward = forward.__get__(module)
