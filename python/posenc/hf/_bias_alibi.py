"""BLOOM, MPT and Falcon-RW (ALiBi) attention on posenc, with the slopes the model computes.

Each model writes ALiBi in its own form: BLOOM and Falcon add ``m_h·pos_k`` (key positions
counted over the real tokens of the padding mask), MPT adds ``m_h·(k − (L_k − 1))`` by index.
Under a causal mask both differ from posenc's ``−m_h·(pos_q − pos_k)`` by a constant per query
row, which softmax removes: outputs agree. Falcon adds the bias before its ``1/sqrt(D)`` scale
(its slopes are divided by ``sqrt(D)`` here) and rounds the slopes to bfloat16.
"""

import math
import sys

import torch

from .. import torch as pt
from ._bias_mask import attention_kwargs, check_call


def model_slopes(family, base_model, heads):
    """The slopes [heads] (float32) the model's own code computes for its bias."""
    mod = sys.modules[type(base_model).__module__]
    ones = torch.ones(1, 2, dtype=torch.int64)
    if family == "bloom":
        alibi = mod.build_alibi_tensor(ones, heads, torch.float32)      # [H, 1, 2]: 0, m
        return alibi[:, 0, 1].float().clone()
    if family == "falcon":
        alibi = mod.build_alibi_tensor(ones, heads, torch.float32)      # bf16-rounded m
        return alibi[:, 0, 1].float().clone()
    # MPT: the model's forward calls build_mpt_alibi_tensor(heads, max_seq_len) without the
    # config's alibi_bias_max (so 8): follow it.
    alibi = base_model.build_mpt_alibi_tensor(heads, 2, device=torch.device("cpu"))  # [H,1,2]
    return (-alibi[:, 0, 0]).float().clone()


def _attend(self, query, key, value, attention_mask, *, scale, kind, alibi_positions):
    """posenc ALiBi attention: query [B, Lq, H, D], key, value [B, Lk, Hkv, D] -> [B, Lq, H, D]."""
    batch, seq_q = query.shape[:2]
    seq_k = key.shape[1]
    state = self._posenc_state
    kw = attention_kwargs(attention_mask, batch, seq_q, seq_k, causal=True, kind=kind,
                          what=f"{state['family']} layer {self.layer_idx}",
                          alibi_positions=alibi_positions)
    return pt.attention(query, key, value, "alibi", params={"slopes": state["slopes"]},
                        scale=scale, **kw)


def bloom_forward(self, hidden_states, residual, alibi=None, attention_mask=None, layer_past=None,
                  use_cache=False, output_attentions=False, cache=None, **kwargs):
    """BloomAttention.forward with posenc's fused ALiBi attention (posenc.hf.patch)."""
    from transformers.models.bloom.modeling_bloom import dropout_add
    state = self._posenc_state
    check_call(self, dict(kwargs, output_attentions=output_attentions), state["dropout_check"])
    if layer_past is None:
        layer_past = cache
    batch, seq_q = hidden_states.shape[:2]
    fused = self.query_key_value(hidden_states)
    query, key, value = self._reshape(fused)                    # [B, H, L, D] views
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    out = _attend(self, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                  attention_mask, scale=self.inv_norm_factor, kind="additive",
                  alibi_positions=True)
    context = out.reshape(batch, seq_q, self.hidden_size)
    if self.pretraining_tp > 1 and self.slow_but_exact:
        slices = self.hidden_size / self.pretraining_tp
        output = torch.zeros_like(context)
        for i in range(self.pretraining_tp):
            lo, hi = int(i * slices), int((i + 1) * slices)
            output = output + torch.nn.functional.linear(context[:, :, lo:hi],
                                                         self.dense.weight[:, lo:hi])
    else:
        output = self.dense(context)
    output = dropout_add(output, residual, self.hidden_dropout, self.training)
    return output, None


def mpt_forward(self, hidden_states, position_bias=None, cache=None, attention_mask=None,
                past_key_values=None, **kwargs):
    """MptAttention.forward with posenc's fused ALiBi attention (posenc.hf.patch)."""
    state = self._posenc_state
    check_call(self, kwargs, state["dropout_check"])
    if cache is None:
        cache = past_key_values
    batch, seq_q = hidden_states.shape[:2]
    mixed = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    query, key, value = mixed.chunk(3, dim=2)
    query = query.reshape(batch, seq_q, self.n_heads, self.head_dim)
    key = key.reshape(batch, seq_q, self.n_heads, self.head_dim).transpose(1, 2)
    value = value.reshape(batch, seq_q, self.n_heads, self.head_dim).transpose(1, 2)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    out = _attend(self, query, key.transpose(1, 2), value.transpose(1, 2), attention_mask,
                  scale=self.softmax_scale, kind="masked", alibi_positions=False)
    return self.out_proj(out.reshape(batch, seq_q, -1)), None


def falcon_forward(self, hidden_states, alibi=None, attention_mask=None, position_ids=None,
                   layer_past=None, use_cache=False, output_attentions=False,
                   position_embeddings=None, cache=None, **kwargs):
    """FalconAttention.forward (ALiBi models) with posenc's fused attention (posenc.hf.patch)."""
    state = self._posenc_state
    check_call(self, dict(kwargs, output_attentions=output_attentions), state["dropout_check"])
    if alibi is None:
        raise ValueError("Falcon attention patched by posenc.hf.patch received no ALiBi tensor: "
                         "only ALiBi Falcon models (Falcon-RW, config.alibi=True) are patched")
    if layer_past is None:
        layer_past = cache
    fused = self.query_key_value(hidden_states)
    kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
    query, key, value = self._split_heads(fused)                # [B, L, H, D]
    batch, seq_q = query.shape[:2]
    key = key.transpose(1, 2).reshape(batch, kv_heads, seq_q, self.head_dim)
    value = value.transpose(1, 2).reshape(batch, kv_heads, seq_q, self.head_dim)
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    out = _attend(self, query, key.transpose(1, 2), value.transpose(1, 2), attention_mask,
                  scale=self.inv_norm_factor, kind="additive_bias", alibi_positions=True)
    return self.dense(out.reshape(batch, seq_q, self.num_heads * self.head_dim)), None


def install(module, family, slopes, dropout_check):
    """Makes module run the family's forward above with the given slopes [heads]."""
    fn = {"bloom": bloom_forward, "mpt": mpt_forward, "falcon": falcon_forward}[family]
    slopes = slopes.double()   # the model's float32 values; converted to q's dtype per call
    if family == "falcon":
        slopes = slopes / math.sqrt(module.head_dim)   # Falcon scales the bias with the scores
    module.__dict__["_posenc_state"] = {"family": family, "slopes": slopes,
                                        "dropout_check": dropout_check}
    module.forward = fn.__get__(module)
