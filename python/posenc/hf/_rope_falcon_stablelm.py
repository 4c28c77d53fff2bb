"""Falcon (RoPE) and StableLM attention on posenc: the model's projections and rotary embedding,
posenc's fused attention.

transformers' Falcon computes its attention inline (its own matmul + softmax, or a direct call of
``torch.nn.functional.scaled_dot_product_attention``), never through ``AttentionInterface``:
``attn_implementation="posenc"`` cannot reach it. StableLM does call the interface; patching it
gives the same attention as ``attn_implementation="posenc"`` with patch()'s handling of requests
the kernel cannot serve (attention weights, attention dropout).

The patched forward computes q, k, v with the module's own projections (StableLM's per-head
q / k layer norms included), rotates them with the model's own ``apply_rotary_pos_emb`` and the
cos / sin the model computed (StableLM's partial rotary dims: the first ``rotary_ndims`` of each
head, the rest passed through), updates the KV cache as the module does, and runs the attention
with the "posenc" attention function (``backend.attention_forward``). The patched model's configs
name the "posenc" mask implementation, so masks arrive as ``PosencMask`` descriptions (padding as
key documents, offsets of the cache) instead of ``[batch, 1, q, k]`` tensors; a 4-D mask tensor
handed to the model is read as the attention function reads it (exact).
"""

import sys

import torch

from . import backend
from ._bias_mask import check_call

FAMILIES = ("falcon-rope", "stablelm")


def mask_implementation():
    """Registers "posenc" with transformers (idempotent); returns the name the configs get."""
    return backend.register()


def _attend(self, query, key, value, attention_mask, scale):
    """query [B, H, Lq, D], key, value [B, Hkv, Lk, D] -> [B, Lq, H * D]."""
    out, _ = backend.attention_forward(self, query, key, value, attention_mask, scaling=scale,
                                       dropout=0.0)
    return out.reshape(out.shape[0], out.shape[1], -1)


def falcon_forward(self, hidden_states, alibi=None, attention_mask=None, position_ids=None,
                   layer_past=None, use_cache=False, output_attentions=False,
                   position_embeddings=None, cache=None, **kwargs):
    """FalconAttention.forward (RoPE models) with posenc's fused attention (posenc.hf.patch)."""
    state = self._posenc_state
    check_call(self, dict(kwargs, output_attentions=output_attentions), state["dropout_check"])
    if alibi is not None:
        raise ValueError("Falcon attention patched by posenc.hf.patch as a RoPE model (config."
                         "alibi false) received an ALiBi tensor")
    if position_embeddings is None:
        raise ValueError("Falcon attention patched by posenc.hf.patch needs the model's rotary "
                         "position_embeddings (cos, sin)")
    if layer_past is None:
        layer_past = cache
    query, key, value = self._split_heads(self.query_key_value(hidden_states))   # [B, L, H, D]
    batch, seq_q = query.shape[:2]
    # The key / value heads the module keeps in its cache: new_decoder_architecture broadcasts
    # its kv heads to every query head; multi_query has one.
    kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
    query = query.transpose(1, 2).reshape(batch, self.num_heads, seq_q, self.head_dim)
    key = key.transpose(1, 2).reshape(batch, kv_heads, seq_q, self.head_dim)
    value = value.transpose(1, 2).reshape(batch, kv_heads, seq_q, self.head_dim)
    cos, sin = position_embeddings
    query, key = state["rotate"](query, key, cos, sin)
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    return self.dense(_attend(self, query, key, value, attention_mask,
                              self.inv_norm_factor)), None


def stablelm_forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                     output_attentions=False, use_cache=False, position_embeddings=None,
                     past_key_values=None, **kwargs):
    """StableLmAttention.forward with posenc's fused attention (posenc.hf.patch)."""
    state = self._posenc_state
    check_call(self, dict(kwargs, output_attentions=output_attentions), state["dropout_check"])
    if position_embeddings is None:
        raise ValueError("StableLM attention patched by posenc.hf.patch needs the model's rotary "
                         "position_embeddings (cos, sin)")
    if cache is None:
        cache = past_key_values
    batch, seq_q = hidden_states.shape[:2]
    d = self.head_dim
    query = self.q_proj(hidden_states).view(batch, seq_q, self.num_heads, d).transpose(1, 2)
    key = self.k_proj(hidden_states).view(batch, seq_q, self.num_key_value_heads, d)
    key = key.transpose(1, 2)
    value = self.v_proj(hidden_states).view(batch, seq_q, self.num_key_value_heads, d)
    value = value.transpose(1, 2)
    if self.qk_layernorm:
        query = self.q_layernorm(query)
        key = self.k_layernorm(key)
    r = self.rotary_ndims            # the first r dims of each head rotate, the rest pass through
    cos, sin = position_embeddings
    q_rot, k_rot = state["rotate"](query[..., :r], key[..., :r], cos, sin)
    query = torch.cat((q_rot, query[..., r:]), dim=-1)
    key = torch.cat((k_rot, key[..., r:]), dim=-1)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    return self.o_proj(_attend(self, query, key, value, attention_mask, self.scaling)), None


def refuse_output_attentions(module, args, kwargs):
    """Forward pre-hook of StableLmModel: its layers never receive output_attentions (transformers
    records the attention modules' outputs instead), so the request is refused here."""
    want = kwargs.get("output_attentions")
    if want is None:
        want = getattr(getattr(module, "config", None), "output_attentions", False)
    if want:
        raise ValueError(f"{type(module).__name__} patched by posenc.hf.patch cannot return "
                         "attention weights (output_attentions=True): the fused kernel never "
                         "forms them; use the unpatched model (posenc.hf.unpatch)")


def install(module, family, dropout_check):
    """Makes module (a RoPE FalconAttention or a StableLmAttention) run the forward above."""
    fn = {"falcon-rope": falcon_forward, "stablelm": stablelm_forward}[family]
    rotate = sys.modules[type(module).__module__].apply_rotary_pos_emb   # the model's own RoPE
    module.__dict__["_posenc_state"] = {"family": family, "rotate": rotate,
                                        "dropout_check": dropout_check}
    module.forward = fn.__get__(module)
