"""Shared cases of the Python tests: random attention problems for every scheme, expressed both
as posenc keywords and as keywords of the independent PyTorch reference (reference.py)."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

# test_half.py compares the half-precision functions bit for bit with the float32 functions on
# widened inputs. On a processor with AVX512_BF16, decoding with a bf16 query and cache would
# take the vdpbf16ps scores (another summation order, within the same bound of the float64
# oracle; tests/test_bf16_dot.cc checks it): the Python tests run the widening kernel.
os.environ.setdefault("POSENC_BF16_DOT", "0")

def maxerr(a, b):
    """max |a - b| in float64."""
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def tol32(ref, naive):
    """The float32 tolerance: 2 max |naive32 - ref64| + 2e-6 max(1, |ref|)."""
    return 2 * maxerr(naive, ref) + 2e-6 * max(1.0, float(np.max(np.abs(ref))))


SCHEMES = ("none", "rope", "alibi", "t5", "shaw", "xl", "deberta")


class Case:
    """One problem: q, k, v (float64), named parameter tables, posenc keywords, reference
    keywords."""

    def __init__(self, scheme, seed, *, batch=2, seq_q=5, seq_k=7, heads_q=4, heads_kv=2, dim=8,
                 causal=False, variant=0, positions=False, sinks=False, chunk=None):
        import posenc
        rng = np.random.default_rng(seed)
        self.scheme, self.causal = scheme, causal
        self.q = rng.standard_normal((batch, seq_q, heads_q, dim))
        self.k = rng.standard_normal((batch, seq_k, heads_kv, dim))
        self.v = rng.standard_normal((batch, seq_k, heads_kv, dim))
        self.params = {}
        self.kw = {"causal": causal}
        self.ref_kw = {"causal": causal}
        if positions:
            # Left padding in row 0, a gap in row 1 (packed / non-contiguous ids); queries last.
            pk = np.stack([np.arange(seq_k) + 3, np.concatenate([np.arange(3), np.arange(seq_k - 3) + 9])])
            pq = pk[:, seq_k - seq_q:][:batch]
            pk = pk[:batch]
            self.kw.update(query_positions=pq, key_positions=pk)
            self.ref_kw.update(query_positions=pq, key_positions=pk)
        if scheme == "rope":
            rotary = dim if variant % 2 == 0 else dim // 2
            style = "half" if variant < 2 else "interleaved"
            self.kw.update(base=500.0, rotary_dim=rotary, style=style)
            f = posenc.rope_frequencies(dim, rotary_dim=rotary, base=500.0)
            self.ref_kw.update(rope_inv_freq=_t(f.inv_freq), rope_style=style)
        elif scheme == "alibi":
            if variant == 1:
                self.params["slopes"] = rng.uniform(0.05, 0.5, heads_q)
            else:
                self.kw["max_bias"] = 4.0
                self.ref_kw["max_bias"] = 4.0
        elif scheme == "t5":
            self.params["relative_attention_bias"] = rng.standard_normal((16, heads_q))
            self.kw["max_distance"] = 20
            self.ref_kw["max_distance"] = 20
        elif scheme == "shaw":
            kk = 2
            shape = (2 * kk + 1, heads_q, dim) if variant == 1 else (2 * kk + 1, dim)
            self.params["rel_k"] = 0.5 * rng.standard_normal(shape)
            self.params["rel_v"] = 0.5 * rng.standard_normal(shape)
        elif scheme == "xl":
            self.params["r_w_bias"] = 0.5 * rng.standard_normal((heads_q, dim))
            self.params["r_r_bias"] = 0.5 * rng.standard_normal((heads_q, dim))
            self.params["r_net"] = 0.3 * rng.standard_normal((heads_q * dim, 10))
        elif scheme == "deberta":
            mrp, pb = (16, 4) if variant == 1 else (4, 0)
            span = pb if pb > 0 else mrp
            self.params["pos_key"] = 0.5 * rng.standard_normal((2 * span, heads_q, dim))
            self.params["pos_query"] = 0.5 * rng.standard_normal((2 * span, heads_q, dim))
            p2c = "paper" if variant == 2 else "model"
            self.kw.update(max_relative_positions=mrp, position_buckets=pb, deberta_p2c=p2c)
            self.ref_kw.update(max_relative_positions=mrp, position_buckets=pb, deberta_p2c=p2c)
        if sinks:  # attention sinks (gpt-oss): one logit per query head
            self.params["sinks"] = 1.5 * rng.standard_normal(heads_q)
        if chunk is not None:  # chunked local attention (Llama 4)
            self.kw["chunk"] = chunk
            self.ref_kw["chunk"] = chunk

    def posenc_kwargs(self, dtype=np.float64):
        kw = dict(self.kw)
        if self.params:
            kw["params"] = {n: np.asarray(p, dtype=dtype) for n, p in self.params.items()}
        return kw

    def inputs(self, dtype):
        return [np.ascontiguousarray(x, dtype=dtype) for x in (self.q, self.k, self.v)]

    def reference(self, dtype="float64", requires_grad=False):
        """(out, tensors) of the PyTorch reference in `dtype`; tensors: q, k, v and the tables."""
        import torch
        import reference
        td = getattr(torch, dtype)
        q, k, v = (torch.tensor(x, dtype=td, requires_grad=requires_grad)
                   for x in (self.q, self.k, self.v))
        params = {n: torch.tensor(p, dtype=td, requires_grad=requires_grad)
                  for n, p in self.params.items()}
        kw = dict(self.ref_kw)
        if "rope_inv_freq" in kw:
            kw["rope_inv_freq"] = kw["rope_inv_freq"].to(td)
        out = reference.attention(q, k, v, self.scheme, params, **kw)
        return out, (q, k, v, params)

    def reference_grads(self, dout_seed):
        """Backpropagates a random dout (standard normal, seeded) through the float64 and the
        float32 PyTorch references: (dout, ref, naive, ref_grads, naive_grads), the outputs as
        tensors and the gradients as {"dq", "dk", "dv", "d<table>": tensor}."""
        import torch
        ref, (q, k, v, tables) = self.reference("float64", requires_grad=True)
        naive, (q32, k32, v32, tables32) = self.reference("float32", requires_grad=True)
        dout = np.random.default_rng(dout_seed).standard_normal(ref.shape)
        (ref * torch.from_numpy(dout)).sum().backward()
        (naive * torch.from_numpy(dout).float()).sum().backward()
        ref_grads = {"dq": q.grad, "dk": k.grad, "dv": v.grad}
        ref_grads.update({"d" + n: t.grad for n, t in tables.items()})
        naive_grads = {"dq": q32.grad, "dk": k32.grad, "dv": v32.grad}
        naive_grads.update({"d" + n: t.grad for n, t in tables32.items()})
        return dout, ref, naive, ref_grads, naive_grads


def _t(a):
    import torch
    return torch.from_numpy(np.asarray(a))


def load_config(name, **overrides):
    """A config.json of tests/configs as a dict, with keys overridden (in text_config when the
    config has one)."""
    import json
    path = os.path.join(os.path.dirname(__file__), "..", "configs", name)
    with open(path) as f:
        cfg = json.load(f)
    cfg.get("text_config", cfg).update(overrides)
    return cfg


def variants(scheme):
    return {"rope": 4, "alibi": 2, "shaw": 2, "deberta": 3}.get(scheme, 1)


@pytest.fixture
def cli():
    path = os.environ.get("POSENC_CLI")
    if not path or not os.path.exists(path):
        pytest.skip("POSENC_CLI (the posenc binary) not set")
    return path


@pytest.fixture
def configs_dir():
    d = os.environ.get("POSENC_TEST_CONFIGS_DIR",
                       os.path.join(os.path.dirname(__file__), "..", "configs"))
    return os.path.abspath(d)
