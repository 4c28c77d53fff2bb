"""posenc.ref: the float64 reference (posenc::ref), materialized, from the formulas of docs/.

attention / attention_grad / attention_scores take the keywords of posenc.attention and compute
in float64 with float64 parameter tables (float32 inputs are widened exactly); apply_rope,
sinusoidal_table and t5_bucket (log in float64) mirror their float32 counterparts.
"""

from ._posenc import ref as _ref

attention = _ref.attention
attention_grad = _ref.attention_grad
attention_scores = _ref.attention_scores
apply_rope = _ref.apply_rope
sinusoidal_table = _ref.sinusoidal_table
t5_bucket = _ref.t5_bucket

__all__ = ["attention", "attention_grad", "attention_scores", "apply_rope", "sinusoidal_table",
           "t5_bucket"]
