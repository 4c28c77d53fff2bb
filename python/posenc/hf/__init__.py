"""posenc.hf: Hugging Face transformers models on posenc's fused attention.

``register()`` adds the attention implementation "posenc" to transformers' ``AttentionInterface``
(the RoPE families: ``attn_implementation="posenc"``); ``patch(model)`` replaces the attention of
the bias families (T5, BLOOM / MPT / Falcon-RW ALiBi, DeBERTa-v2/v3) by posenc's fused schemes,
using the model's own weights. See docs/hf.md.
"""

from .backend import register  # noqa: F401
from .patch import patch, unpatch  # noqa: F401

__all__ = ["register", "patch", "unpatch"]
