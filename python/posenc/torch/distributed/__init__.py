"""posenc.torch.distributed: context-parallel attention over torch.distributed, for every scheme.

The sequence dimension (dim 1 of ``[batch, seq, heads, head_dim]``) is split across the ranks of
a process group, and ``context_parallel_attention`` gives each rank its shard of the exact
attention over the whole sequence, forward and backward:

- ``strategy="ring"``: each rank keeps its queries; the key/value shards travel around the ring
  (``isend`` / ``irecv``, the next transfer overlapped with the current block's kernel), every
  block is an ordinary posenc attention call with the block's *global* query and key positions,
  and the partial results are merged exactly through their per-row log-sum-exp
  (``attention_merge``). Under a causal mask (or a window, or chunks) blocks that no query can
  see are skipped. The backward is the ring backward (FlashAttention-2's recomputation from the
  global ``out`` and ``lse``): ``dq`` stays, ``dk`` / ``dv`` travel with their shard back to it.
- ``strategy="all_to_all"`` (DeepSpeed-Ulysses): an all-to-all turns sequence shards into head
  shards, each rank runs full-sequence attention on ``heads_q / world_size`` heads (per-head
  tables sliced to them), and another all-to-all turns the output back.

Layouts (``shard`` / ``unshard``): ``contiguous``, rank r holds chunk r of
``torch.tensor_split(x, N, dim=1)``; ``zigzag``, the sequence cut into 2N chunks and rank r
holding chunks r and 2N-1-r, so causal work is even. Positions, document ids and dense masks are
given whole (the global sequence's) and sharded by the same rule inside; every scheme (RoPE,
ALiBi, T5, Shaw, Transformer-XL, DeBERTa) therefore sees global distances.

Gradients: q, k, v get their shard's gradients; learned tables (``params``) get the gradient of
the global attention, summed over the ranks (``reduce_grads=True``, the default) or, with
``reduce_grads=False``, this rank's share (the shares of all ranks sum to it: reduce them with the
model's other gradients).

Devices: CPU shards run posenc's CPU kernels, CUDA shards its Triton kernels (partial results
merged on the device); NCCL moves CUDA tensors directly, gloo through a copy in host memory.

Errors: the ranks exchange shapes and a fingerprint of their arguments before any work, and
agree on success after it, so a mismatched shard, different options or tables on one rank, or an
error raised on one rank (bad input in its shard) raises on every rank, naming the rank; a dead
or hung peer ends in the process group's timeout (or ``timeout=``), never a hang.

``comm_stats()`` returns the bytes and messages this process sent and received and the time
spent computing and waiting on communication; ``cost_model(...)`` gives the same counts and the
per-rank work without running anything (docs/distributed.md).

Modules: _attention (context_parallel_attention, ContextParallel, the autograd Function), _plan
(the ranks' agreement on the call; positions, masks, options, skippable blocks), _ring and
_ulysses (the two strategies, forward and backward), _comm (transfers, statistics, agreement),
_layout (shard, unshard, shard_indices), _cost (cost_model).
"""

from ._attention import ContextParallel, context_parallel_attention
from ._comm import comm_stats, reset_comm_stats
from ._cost import cost_model
from ._layout import LAYOUTS, STRATEGIES, shard, shard_indices, unshard

__all__ = ["context_parallel_attention", "ContextParallel", "shard", "unshard", "shard_indices",
           "comm_stats", "reset_comm_stats", "cost_model", "STRATEGIES", "LAYOUTS"]
