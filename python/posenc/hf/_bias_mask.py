"""Masks for the patched bias-family attention: a compact padding mask instead of [B, 1, L, L].

A patched model's config names the mask implementation ``MASK_IMPL``; transformers' mask helpers
(``create_causal_mask``, ``create_bidirectional_mask``) then return a ``BiasMask``: the 2-D
padding mask of the keys, whether the pattern is causal, and the query offset. The patched
attention turns it into posenc keywords (key documents, positions), O(batch·length). Patterns
other than plain causal / bidirectional (packed sequences, custom mask functions) are kept as
transformers' dense boolean mask inside the BiasMask (exact, one byte per query-key pair).
"""

import torch

MASK_IMPL = "posenc_bias"


class BiasMask:
    """The attention mask a patched layer receives: padding [batch, kv_length] bool (True: a real
    token; None: no padding), causal, q_offset (the first query's position), or dense [batch or 1,
    1, seq_q, seq_k] bool (True: visible) for patterns that are neither."""

    ndim = 2  # not 4: Falcon folds ALiBi into 4-D masks only

    def __init__(self, padding=None, causal=False, q_offset=0, dense=None):
        self.padding = padding
        self.causal = causal
        self.q_offset = q_offset
        self.dense = dense

    dtype = torch.bool

    @property
    def device(self):
        """The device of the mask's tensors (the CPU without any)."""
        t = self.padding if self.padding is not None else self.dense
        return t.device if t is not None else torch.device("cpu")

    def to(self, *args, **kwargs):
        """The mask itself (transformers casts masks; this one is kept as it is)."""
        return self

    def __repr__(self):
        pad = None if self.padding is None else tuple(self.padding.shape)
        return (f"BiasMask(padding={pad}, causal={self.causal}, q_offset={self.q_offset}, "
                f"dense={self.dense is not None})")


def mask_function(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, **kwargs):
    """transformers' AttentionMaskInterface entry for patched models: a BiasMask."""
    from transformers import masking_utils as mu
    if isinstance(attention_mask, BiasMask):
        # Built already (generation with a static cache makes each step's mask before the
        # model's forward): kept as it is, as transformers keeps a 4-D mask it is handed.
        return attention_mask
    if isinstance(q_offset, torch.Tensor):
        q_offset = int(q_offset)
    if isinstance(kv_offset, torch.Tensor):
        kv_offset = int(kv_offset)
    fn = mask_function if mask_function is not None else mu.causal_mask_function
    if fn is mu.causal_mask_function or fn is mu.bidirectional_mask_function:
        padding = None
        if attention_mask is not None:
            # Shorter than the keys (a static cache's free slots): padded with False.
            padding = mu.prepare_padding_mask(attention_mask.to(torch.bool), kv_length,
                                              kv_offset)
            padding = padding[:, kv_offset:kv_offset + kv_length]
            if bool(padding.all()):
                padding = None
        return BiasMask(padding, fn is mu.causal_mask_function, q_offset - kv_offset)
    kwargs.pop("allow_is_causal_skip", None)
    kwargs.pop("allow_is_bidirectional_skip", None)
    kwargs.pop("dtype", None)
    dense = mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                         q_offset=q_offset, kv_offset=kv_offset, mask_function=fn,
                         attention_mask=attention_mask, allow_is_causal_skip=False,
                         allow_is_bidirectional_skip=False, **kwargs)
    return BiasMask(dense=dense)


def register_mask_function():
    """Registers MASK_IMPL with transformers' AttentionMaskInterface (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface
    AttentionMaskInterface.register(MASK_IMPL, mask_function)


def dense_visible(mask, batch, seq_q, seq_k, *, kind, what):
    """A mask tensor from an unpatched path -> bool [batch or 1, seq_q, seq_k] (True: visible).

    kind: "additive" (0 visible, the dtype's minimum hidden; bool: True visible), "masked"
    (bool, True hidden: MPT), "multiplicative" (1 visible: DeBERTa), "additive_bias" (visibility
    only: values above half the minimum count as visible; Falcon folds its ALiBi into the mask).
    """
    t = mask
    if t.dim() == 2:
        t = t[:, None, :]
    if t.dim() == 4:
        if t.shape[1] != 1:
            if not bool((t == t[:, :1]).all()):
                raise ValueError(f"{what}: a per-head attention mask {tuple(mask.shape)} is not "
                                 "supported by posenc.hf.patch (one mask for all heads)")
        t = t[:, 0]
    if t.dim() != 3:
        raise ValueError(f"{what}: attention mask of shape {tuple(mask.shape)}, expected "
                         "[batch, 1, seq_q, seq_k]")
    if kind == "masked":
        vis = ~t.to(torch.bool)
    elif kind == "multiplicative" or t.dtype == torch.bool:
        vis = t.to(torch.bool)
    else:
        low = torch.finfo(t.dtype).min / 2 if t.dtype.is_floating_point else -1
        vis = t > low
        if kind == "additive":
            bad = (t != 0) & vis
            if bool(bad.any()):
                raise ValueError(f"{what}: an additive attention mask with values other than 0 "
                                 "and the dtype's minimum (a bias) cannot be fused by posenc")
    if vis.shape[-2] != seq_q and vis.shape[-2] == 1:
        vis = vis.expand(vis.shape[0], seq_q, vis.shape[-1])
    if vis.shape[-1] != seq_k or vis.shape[-2] != seq_q or vis.shape[0] not in (1, batch):
        raise ValueError(f"{what}: attention mask of shape {tuple(mask.shape)} does not match "
                         f"batch {batch}, {seq_q} queries, {seq_k} keys")
    return vis.contiguous()


def attention_kwargs(mask, batch, seq_q, seq_k, *, causal, kind, what, alibi_positions=False):
    """posenc.torch.attention keywords for a layer's mask.

    mask: a BiasMask, a tensor from an unpatched path (see dense_visible), or None. causal: the
    layer's pattern when the mask says nothing (None). alibi_positions: positions count the real
    tokens only (BLOOM, Falcon: their ALiBi follows the padding mask's cumulative sum).
    """
    kw = {}
    if mask is None:
        kw["causal"] = causal
        return kw
    if isinstance(mask, torch.Tensor):
        kw["mask"] = dense_visible(mask, batch, seq_q, seq_k, kind=kind, what=what)
        kw["allow_fully_masked"] = True
        return kw
    if not isinstance(mask, BiasMask):
        raise TypeError(f"{what}: attention mask of type {type(mask).__name__} is not supported "
                        "by posenc.hf.patch")
    if mask.dense is not None:
        kw["mask"] = dense_visible(mask.dense, batch, seq_q, seq_k, kind="additive", what=what)
        kw["allow_fully_masked"] = True
        return kw
    kw["causal"] = mask.causal
    q_offset = mask.q_offset
    explicit_q = q_offset + seq_q != seq_k
    if mask.padding is not None:
        pad = mask.padding
        if pad.shape[1] != seq_k or pad.shape[0] not in (1, batch):
            raise ValueError(f"{what}: padding mask of shape {tuple(pad.shape)} does not match "
                             f"batch {batch} and {seq_k} keys")
        if pad.shape[0] != batch:
            pad = pad.expand(batch, seq_k)
        kw["key_documents"] = (~pad).to(torch.int32)
        kw["query_documents"] = torch.zeros(batch, seq_q, dtype=torch.int32)
        kw["allow_fully_masked"] = True
        if alibi_positions:
            kpos = (pad.to(torch.int64).cumsum(-1) - 1).clamp_(min=0)
            qidx = torch.arange(seq_q) + q_offset
            if int(qidx[-1]) >= seq_k or q_offset < 0:
                raise ValueError(f"{what}: queries at {q_offset}..{q_offset + seq_q - 1} lie "
                                 f"outside the {seq_k} keys")
            kw["key_positions"] = kpos
            kw["query_positions"] = kpos[:, qidx].contiguous()
            return kw
    if explicit_q:
        kw["query_positions"] = torch.arange(seq_q, dtype=torch.int64) + q_offset
    return kw


def check_call(module, kwargs, training_dropout):
    """Refuses requests the fused kernel cannot serve (attention weights, head masks)."""
    if kwargs.get("output_attentions"):
        raise ValueError(f"{type(module).__name__} patched by posenc.hf.patch cannot return "
                         "attention weights (output_attentions=True): the fused kernel never "
                         "forms them; use the unpatched model (posenc.hf.unpatch)")
    for name in ("head_mask", "layer_head_mask", "cross_attn_head_mask"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{type(module).__name__} patched by posenc.hf.patch: {name} is not "
                             "supported (the fused kernel does not scale attention weights)")
    training_dropout(module)
