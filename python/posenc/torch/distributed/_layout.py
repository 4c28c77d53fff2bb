"""Sequence layouts: which global rows of the sequence each rank holds (contiguous: one chunk;
zigzag: chunks r and 2N-1-r), and shard / unshard / shard_indices by them."""

import numpy as np
import torch


STRATEGIES = ("ring", "all_to_all")
LAYOUTS = ("contiguous", "zigzag")


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout: '{layout}' (contiguous or zigzag)")


def _check_world(rank, world_size):
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size: {world_size!r} (an int >= 1)")
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ValueError(f"rank: {rank!r} (an int in [0, world_size = {world_size}))")


def _chunk_bounds(length, parts):
    """Start offsets of torch.tensor_split(range(length), parts): parts + 1 values."""
    base, extra = divmod(length, parts)
    bounds = [0]
    for c in range(parts):
        bounds.append(bounds[-1] + base + (1 if c < extra else 0))
    return bounds


def _segments(length, rank, world_size, layout):
    """The global ranges [start, end) rank `rank` holds, in its shard's order."""
    if layout == "contiguous":
        b = _chunk_bounds(length, world_size)
        return [(b[rank], b[rank + 1])]
    b = _chunk_bounds(length, 2 * world_size)
    c = 2 * world_size - 1 - rank
    return [(b[rank], b[rank + 1]), (b[c], b[c + 1])]


def _shard_len(length, rank, world_size, layout):
    return sum(e - s for s, e in _segments(length, rank, world_size, layout))


def shard_indices(length, rank, world_size, layout="contiguous"):
    """The global indices (int64 tensor) of the sequence positions rank `rank` holds in a
    sequence of `length` split over `world_size` ranks with `layout`."""
    _check_layout(layout)
    _check_world(rank, world_size)
    if length < 0:
        raise ValueError(f"length: {length} (>= 0)")
    return torch.cat([torch.arange(s, e, dtype=torch.int64)
                      for s, e in _segments(int(length), rank, world_size, layout)])


def shard(x, rank, world_size, layout="contiguous", *, dim=1):
    """Rank `rank`'s shard of x along `dim` (1: the sequence of [batch, seq, heads, head_dim]).

    contiguous: chunk `rank` of torch.tensor_split(x, world_size, dim); zigzag: chunks `rank` and
    2*world_size-1-rank of torch.tensor_split(x, 2*world_size, dim), concatenated. Works on any
    tensor (positions [seq] with dim=0, document ids [batch, seq] with dim=1); the contiguous
    shard is a view, the zigzag one a new tensor."""
    _check_layout(layout)
    _check_world(rank, world_size)
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(np.asarray(x))
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim: {dim} is outside a tensor of {x.dim()} dimensions")
    if layout == "contiguous":
        return torch.tensor_split(x, world_size, dim)[rank]
    parts = torch.tensor_split(x, 2 * world_size, dim)
    return torch.cat([parts[rank], parts[2 * world_size - 1 - rank]], dim)


def unshard(shards, layout="contiguous", *, dim=1):
    """The whole tensor from the shards of every rank, in rank order (the inverse of
    ``shard``). A shard whose length does not match the layout raises ValueError."""
    _check_layout(layout)
    shards = list(shards)
    if not shards:
        raise ValueError("shards: an empty list (one shard per rank)")
    shards = [s if isinstance(s, torch.Tensor) else torch.as_tensor(np.asarray(s))
              for s in shards]
    n = len(shards)
    length = sum(int(s.shape[dim]) for s in shards)
    for r, s in enumerate(shards):
        want = _shard_len(length, r, n, layout)
        if s.shape[dim] != want:
            raise ValueError(f"shards[{r}]: {s.shape[dim]} rows along dim {dim}; the {layout} "
                             f"layout of {length} rows over {n} ranks gives rank {r} {want}")
    if layout == "contiguous":
        return torch.cat(shards, dim)
    pieces = [None] * (2 * n)
    for r, s in enumerate(shards):
        (a0, a1), (b0, b1) = _segments(length, r, n, layout)
        pieces[r] = s.narrow(dim, 0, a1 - a0)
        pieces[2 * n - 1 - r] = s.narrow(dim, a1 - a0, b1 - b0)
    return torch.cat(pieces, dim)
