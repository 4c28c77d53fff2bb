"""Communication between the ranks: the statistics of comm_stats(), point-to-point transfers
(counted, waited on with a timeout), the pairwise all-to-all, and the agreement that makes an
error on one rank raise on every rank."""

import time

import torch
import torch.distributed as dist


# ---- statistics ---------------------------------------------------------------------------------

_STATS_KEYS = ("calls", "bytes_sent", "bytes_received", "messages_sent", "messages_received",
               "compute_s", "comm_wait_s", "blocks_computed", "blocks_skipped",
               "visible_pairs")
_STATS = dict.fromkeys(_STATS_KEYS, 0)


def comm_stats():
    """What context_parallel_attention did in this process since the last reset (a dict):
    calls (forward and backward passes), bytes_sent / bytes_received and messages_sent /
    messages_received (point-to-point payloads of the ring and the all-to-all; the small
    agreement collectives are not counted), compute_s (time in posenc kernels and merges),
    comm_wait_s (time blocked waiting for transfers: communication not hidden behind compute),
    blocks_computed / blocks_skipped (kernel calls of the ring, and blocks a mask hid entirely),
    visible_pairs (query-key pairs the computed blocks could see: the work, per head and batch
    row; an upper bound where masks other than causal / window / chunk apply)."""
    return dict(_STATS)


def reset_comm_stats():
    """Sets every counter of comm_stats() to zero."""
    for key in _STATS_KEYS:
        _STATS[key] = 0


class _Timer:
    def __init__(self, key):
        self.key = key

    def __enter__(self):
        self.t = time.perf_counter()

    def __exit__(self, *exc):
        _STATS[self.key] += time.perf_counter() - self.t


# ---- communication ------------------------------------------------------------------------------

def _comm_device(group):
    """Where the group's transfers and collectives take their tensors: the current CUDA device
    for NCCL, which moves CUDA tensors only; the CPU for gloo, whose point-to-point transfers
    take CPU tensors only."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Staged:
    """A receive into a staging buffer on the group's device, copied into its destination
    (on the data's device) when waited on."""

    def __init__(self, work, staged, dst):
        self.work, self.staged, self.dst = work, staged, dst

    def wait(self, timeout=None):
        if timeout is None:
            self.work.wait()
        else:
            self.work.wait(timeout)
        self.dst.copy_(self.staged)


class _Comm:
    """Point-to-point transfers within a group, counted, waited on with a timeout. Tensors on
    another device than the group's (CUDA shards over gloo) travel through a copy on the group's
    device."""

    def __init__(self, group, timeout):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout = timeout
        self.globals = [dist.get_global_rank(group, r) if group is not None else r
                        for r in range(self.world)]
        self.works = []
        self.keep = []  # staged copies of sends in flight
        self.device = _comm_device(group) if self.rank >= 0 else torch.device("cpu")

    def send(self, t, to, tag):
        if t.numel() == 0:
            return
        if t.device != self.device:
            t = t.to(self.device)  # kept alive by the list below until the send completes
            self.keep.append(t)
        self.works.append(dist.isend(t, self.globals[to], group=self.group, tag=tag))
        _STATS["bytes_sent"] += t.numel() * t.element_size()
        _STATS["messages_sent"] += 1

    def recv(self, t, frm, tag):
        if t.numel() == 0:
            return None
        if t.device != self.device:
            staged = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            w = _Staged(dist.irecv(staged, self.globals[frm], group=self.group, tag=tag),
                        staged, t)
        else:
            w = dist.irecv(t, self.globals[frm], group=self.group, tag=tag)
        _STATS["bytes_received"] += t.numel() * t.element_size()
        _STATS["messages_received"] += 1
        return w

    def wait(self, works):
        with _Timer("comm_wait_s"):
            for w in works:
                if w is None:
                    continue
                if self.timeout is None:
                    w.wait()
                else:
                    w.wait(self.timeout)

    def flush(self):
        """Waits for every send posted so far."""
        works, self.works = self.works, []
        self.wait(works)
        self.keep = []


def _prev(c):
    return (c.rank - 1) % c.world


def _next(c):
    return (c.rank + 1) % c.world


_TAG_KV, _TAG_DKV, _TAG_A2A = 1 << 16, 2 << 16, 3 << 16


def _all_to_all(c, sends, recv_numels, dtype, tag):
    """sends[r]: the flat tensor for rank r (own rank: kept); returns the flat tensors received
    from each rank (point-to-point, so the sizes may differ), on the device of sends."""
    out = [None] * c.world
    waits = []
    for step in range(1, c.world):  # pairwise order: every rank talks to rank +- step
        to, frm = (c.rank + step) % c.world, (c.rank - step) % c.world
        buf = torch.empty(recv_numels[frm], dtype=dtype, device=sends[c.rank].device)
        waits.append(c.recv(buf, frm, tag))
        c.send(sends[to], to, tag)
        out[frm] = buf
    out[c.rank] = sends[c.rank]
    c.wait(waits)
    c.flush()
    return out


# ---- agreement between ranks --------------------------------------------------------------------

def _raise_agreed(c, errors, local=None):
    """errors: the gathered (rank, type name, message) of the ranks that failed."""
    first = errors[0]
    others = ", ".join(str(e[0]) for e in errors[1:])
    msg = (f"context_parallel_attention: rank {first[0]} of {c.world} failed: {first[2]}"
           + (f" (ranks {others} failed too)" if others else ""))
    cls = {"ValueError": ValueError, "TypeError": TypeError,
           "NotImplementedError": NotImplementedError}.get(first[1], RuntimeError)
    raise cls(msg) from local


def _agree(c, error, extra=None):
    """Every rank learns whether any failed; raises the same error on all of them if so. extra:
    a float tensor summed over the ranks in the same collective (returned)."""
    flag = torch.tensor([1.0 if error is not None else 0.0], dtype=torch.float64,
                        device=c.device)
    buf = flag if extra is None else torch.cat([flag, extra.reshape(-1).double().to(c.device)])
    if c.world > 1:
        dist.all_reduce(buf, group=c.group)
    if buf[0].item() > 0:
        local = None if error is None else (c.rank, _error_name(error), str(error))
        gathered = [None] * c.world
        if c.world > 1:
            dist.all_gather_object(gathered, local, group=c.group)
        else:
            gathered = [local]
        failed = [g for g in gathered if g is not None]
        if error is not None and c.world == 1:
            raise error
        _raise_agreed(c, failed, error)
    return None if extra is None else buf[1:].view(extra.shape).to(extra.device, extra.dtype)


def _error_name(e):
    for cls in (NotImplementedError, TypeError, ValueError):
        if isinstance(e, cls):
            return cls.__name__
    return "RuntimeError"
