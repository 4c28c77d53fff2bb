"""Keyword sets of posenc.torch.attention shared by posenc.torch, posenc.torch.flex and
posenc.torch.distributed."""

# Keywords whose values are integer / boolean arrays: they travel to the ops as tensors, each the
# op argument of its name (posenc._ops._MASKS).
MASK_KEYWORDS = ("cu_seqlens_q", "cu_seqlens_k", "query_documents", "key_documents", "prefix",
                 "mask")

# The packed-sequence ones among them.
PACKED_KEYWORDS = ("cu_seqlens_q", "cu_seqlens_k")

# Keywords that decide which keys each query sees (posenc's masks, docs/attention.md): the
# keywords of posenc.torch.flex.mask_mod and block_mask.
VISIBILITY_KEYWORDS = ("causal", "window", "chunk", "query_positions", "key_positions",
                       "query_documents", "key_documents", "prefix", "global_positions", "mask")
