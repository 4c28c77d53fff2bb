"""Adds a toy scheme to a copy of the repository by editing exactly the files that
docs/architecture.md ("How to add a scheme") lists, builds the command-line tool there and checks
that the scheme works everywhere the registry reaches without further edits: `posenc attention`'s
--scheme and its --toy-slope flag (help, type and range checks, refusal for another scheme), the
fused float32 path and the float64 reference; in Python `posenc.schemes()`, the `toy_slope`
keyword of `posenc.attention` (type and range checks), the torch op's typed `toy_slope` argument
and `posenc.torch.attention`'s forward and backward.

The toy is a bias -slope |pos_q - pos_k| with one slope for every head (the distance-bias kernel
form that ALiBi and T5 use): its results must equal ALiBi's with that slope on every head.

    python3 tests/toy_scheme/check.py [--keep DIR]

Needs cmake, a C++ compiler, NumPy, PyTorch and pybind11 (the interpreter running it must have
them). It builds the library, the CLI and the Python extension, unoptimized (about 3 minutes on 2
cores; ccache is used when present, as the project's build does).
"""

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from safetensors_io import write_safetensors  # noqa: E402

REGISTRY_ROW = """  r.push_back({.name = "toy",
               .title = "toy distance bias",
               .summary = "-slope * |pos_q - pos_k| added to the scores",
               .models = "none (a check of the registry)",
               .doc = "docs/architecture.md",
               .settings = {number("toy_slope", "--toy-slope", T::kFloat, 0.0, std::nullopt, true,
                                   "0.5", "the slope of every head", false,
                                   [](SchemeSettings& s, const SettingValue& v) {
                                     s.toy_slope = real(v);
                                   })},
               .relative = true,
               .bias_map = true});
"""

# (file, anchor regex, replacement with \\g<0> for the anchor): each anchor must occur once.
EDITS = [
    ("include/posenc/attention.h", r'#include "posenc/xl.h"\n',
     '\\g<0>#include "posenc/toy.h"\n'),
    ("include/posenc/attention.h", r"DeBERTa>;", "DeBERTa, Toy>;"),
    ("src/attention/prepared.h", r'#include "schemes/xl_term.h"\n',
     '\\g<0>#include "schemes/toy_term.h"\n'),
    ("src/attention/prepared.h", r"DebertaTerm<T>>;", "DebertaTerm<T>, ToyTerm<T>>;"),
    ("src/schemes.cc", r"\n  return r;\n}\n", "\n" + REGISTRY_ROW.replace("\\", "\\\\") +
     "  return r;\n}\n"),
    ("include/posenc/scheme.h", r"  std::optional<bool> deberta_float64_log;[^\n]*\n",
     "\\g<0>  std::optional<double> toy_slope;  // toy: default 0.5\n"),
]
NEW_FILES = {"include/posenc/toy.h": "toy.h", "src/schemes/toy.cc": "toy.cc",
             "src/schemes/toy_term.h": "toy_term.h"}


PYTHON_CHECK = r"""
import numpy as np
import torch

import posenc
import posenc.torch

toy = next(s for s in posenc.schemes() if s["name"] == "toy")
(slope,) = toy["settings"]
assert (slope["keyword"], slope["type"], slope["min"], slope["min_exclusive"],
        slope["default"]) == ("toy_slope", "float", 0.0, True, "0.5"), slope
rng = np.random.default_rng(3)
q, k, v = (rng.standard_normal(s) for s in ((2, 5, 3, 8), (2, 9, 3, 8), (2, 9, 3, 8)))
got = posenc.attention(q, k, v, "toy", toy_slope=0.375, causal=True)
want = posenc.attention(q, k, v, "alibi", params={"slopes": np.full(3, 0.375)}, causal=True)
assert np.abs(got - want).max() <= 1e-12
for bad, error in ((0.0, ValueError), (float("nan"), ValueError), ("1", TypeError),
                   (True, TypeError)):
    try:
        posenc.attention(q, k, v, "toy", toy_slope=bad)
    except error as e:
        assert "toy_slope" in str(e), e
    else:
        raise AssertionError(f"toy_slope={bad!r} accepted")
try:
    posenc.attention(q, k, v, "alibi", toy_slope=1.0)
except TypeError as e:
    assert "'toy_slope' does not apply to scheme 'alibi'" in str(e), e
else:
    raise AssertionError("toy_slope accepted for alibi")
assert "float? toy_slope=None" in str(torch.ops.posenc.attention.default._schema)
tq, tk, tv = (torch.tensor(x, dtype=torch.float32, requires_grad=True) for x in (q, k, v))
out = posenc.torch.attention(tq, tk, tv, "toy", toy_slope=0.375, causal=True)
dout = rng.standard_normal(out.shape)
out.backward(torch.tensor(dout, dtype=torch.float32))
ref = posenc.attention_grad(q, k, v, dout, "toy", toy_slope=0.375, causal=True)
assert np.abs(out.detach().numpy() - got).max() <= 2e-6
for name, t in (("dq", tq), ("dk", tk), ("dv", tv)):
    assert np.abs(t.grad.numpy() - ref[name]).max() <= 1e-5, name
print("toy scheme: Python keyword, checks, torch op argument and gradients OK")
"""


def documented_files():
    """The files of the table in docs/architecture.md's "How to add a scheme", for `toy`."""
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        text = f.read()
    section = text.split("## How to add a scheme", 1)[1].split("\n## ", 1)[0]
    files = []
    for line in section.splitlines():
        m = re.match(r"\|\s*\d+\s*\|\s*`([^`]+)`", line)
        if m:
            files.append(m.group(1).replace("<scheme>", "toy"))
    return files


def source_files():
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return [p for p in out.splitlines() if os.path.isfile(os.path.join(ROOT, p))]


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def add_toy(copy):
    for path, anchor, repl in EDITS:
        full = os.path.join(copy, path)
        with open(full) as f:
            text = f.read()
        found = len(re.findall(anchor, text))
        assert found == 1, f"{path}: anchor {anchor!r} found {found} times"
        with open(full, "w") as f:
            f.write(re.sub(anchor, repl, text))
    for dest, src in NEW_FILES.items():
        shutil.copyfile(os.path.join(HERE, src), os.path.join(copy, dest))


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1800, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", help="build in this directory and keep it")
    args = ap.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="posenc-toy-scheme-")
    copy = os.path.join(work, "repo")
    if os.path.exists(copy):
        shutil.rmtree(copy)
    files = source_files()
    for p in files:
        os.makedirs(os.path.dirname(os.path.join(copy, p)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, p), os.path.join(copy, p))
    before = {p: digest(os.path.join(copy, p)) for p in files}
    add_toy(copy)

    # 1. The files the toy touched are exactly the documented ones, at most 7.
    touched = sorted(set(NEW_FILES) | {p for p in files
                                       if digest(os.path.join(copy, p)) != before[p]})
    documented = documented_files()
    assert sorted(documented) == touched, f"documented {documented}, touched {touched}"
    assert len(touched) <= 7, touched
    print(f"toy scheme: {len(touched)} files, as documented: {', '.join(touched)}")

    # 2. It builds: the library and the command-line tool.
    build = os.path.join(work, "build")
    # Unoptimized: the check is what compiles and what it computes, not speed (a quarter of the
    # Release build's time).
    pybind11_dir = run([sys.executable, "-m", "pybind11", "--cmakedir"]).stdout.strip()
    cfg = ["cmake", "-S", copy, "-B", build, "-DCMAKE_BUILD_TYPE=Debug",
           "-DCMAKE_CXX_FLAGS_DEBUG=-O0", "-DPOSENC_BUILD_TESTS=OFF", "-DPOSENC_BUILD_PYTHON=ON",
           f"-DPython_EXECUTABLE={sys.executable}", f"-Dpybind11_DIR={pybind11_dir}",
           "-DPOSENC_BUILD_BENCHMARKS=OFF"]
    if shutil.which("ninja"):
        cfg += ["-G", "Ninja"]
    for step in (cfg, ["cmake", "--build", build, "--target", "posenc_python_stage", "-j",
                       str(os.cpu_count() or 2)]):
        r = run(step)
        assert r.returncode == 0, f"{' '.join(step)}:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    cli = os.path.join(build, "cli", "posenc")

    # 3. The CLI knows it from the registry: --scheme, the flag, its help, type and range.
    h = run([cli, "attention", "--help"])
    assert h.returncode == 0 and "toy" in h.stdout and "--toy-slope" in h.stdout, h.stdout
    rng = np.random.default_rng(7)
    batch, seq_q, seq_k, heads, dim = 2, 5, 9, 3, 8
    paths = {}
    for name, shape in (("q", (batch, seq_q, heads, dim)), ("k", (batch, seq_k, heads, dim)),
                        ("v", (batch, seq_k, heads, dim))):
        paths[name] = os.path.join(work, name + ".npy")
        np.save(paths[name], rng.standard_normal(shape).astype(np.float32))
    slope = 0.375
    write_safetensors(os.path.join(work, "slopes.safetensors"),
                      {"slopes": np.full(heads, slope, np.float32)})
    qkv = ["--q", paths["q"], "--k", paths["k"], "--v", paths["v"], "--causal"]

    def attention(*extra):
        out = os.path.join(work, f"out{len(os.listdir(work))}.npy")
        r = run([cli, "attention", *qkv, "--out", out, *extra])
        assert r.returncode == 0, r.stderr
        return np.load(out)

    toy = attention("--scheme", "toy", "--toy-slope", str(slope))
    toy64 = attention("--scheme", "toy", "--toy-slope", str(slope), "--reference",
                      "--out-dtype", "float64")
    alibi64 = attention("--scheme", "alibi", "--params", os.path.join(work, "slopes.safetensors"),
                        "--reference", "--out-dtype", "float64")
    assert np.abs(toy64 - alibi64).max() <= 1e-12, np.abs(toy64 - alibi64).max()
    assert np.abs(toy - toy64).max() <= 2e-6, np.abs(toy - toy64).max()
    default = attention("--scheme", "toy")  # the registry's default slope, 0.5
    assert np.abs(default - toy).max() > 1e-4
    for bad, needle in ((["--scheme", "toy", "--toy-slope", "0"], "--toy-slope must be"),
                        (["--scheme", "toy", "--toy-slope", "x"], "--toy-slope must be"),
                        (["--scheme", "alibi", "--toy-slope", "1"],
                         "--toy-slope does not apply to --scheme alibi"),
                        (["--scheme", "toy", "--max-bias", "1"],
                         "--max-bias does not apply to --scheme toy")):
        r = run([cli, "attention", *qkv, "--out", os.path.join(work, "bad.npy"), *bad])
        assert r.returncode == 2 and needle in r.stderr, (bad, r.returncode, r.stderr)
    print(f"toy scheme: CLI fused vs float64 {np.abs(toy - toy64).max():.2e}, float64 vs ALiBi "
          f"{np.abs(toy64 - alibi64).max():.2e}; flag checks OK")

    # 4. Python: the registry's metadata, the keyword and its checks, the torch op's argument.
    env = dict(os.environ, PYTHONPATH=os.path.join(build, "python", "stage"))
    r = run([sys.executable, "-c", PYTHON_CHECK], env=env, cwd=work)
    assert r.returncode == 0, f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    print(r.stdout.strip())
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
