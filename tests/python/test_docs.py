"""The Python code blocks of docs/python.md run as written."""

import contextlib
import io
import os
import re

import pytest

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "python.md")


def blocks():
    with open(DOC) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def test_numpy_quick_start_runs(tmp_path, monkeypatch):
    code = blocks()[0]
    os.symlink(os.path.abspath(os.path.join(os.path.dirname(DOC), "..", "tests")),
               tmp_path / "tests")
    monkeypatch.chdir(tmp_path)
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, "docs/python.md (quick start)", "exec"), {})
    assert (tmp_path / "pe.png").exists() and (tmp_path / "posenc-demo" / "index.html").exists()


def block_starting(text):
    found = [b for b in blocks() if b.startswith(text)]
    assert len(found) == 1, text
    return found[0]


def test_layer_walk_example_runs(monkeypatch):
    code = block_starting("import posenc\ncfg = posenc.read_model_config")
    monkeypatch.chdir(os.path.abspath(os.path.join(os.path.dirname(DOC), "..")))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/python.md (layer walk)", "exec"), {})
    lines = out.getvalue().splitlines()
    assert len(lines) == 48
    assert lines[0] == "0 128 None"
    assert lines[3] == "3 NoPE {'floor_scale': 8192.0, 'attn_scale': 0.1}"


def test_pytorch_decoder_example_trains():
    pytest.importorskip("torch")
    code = block_starting("import torch, posenc.torch as pt")
    assert len(code.strip().splitlines()) <= 32
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/python.md (decoder layer)", "exec"), {})
    lines = out.getvalue().split("\n")
    losses = {l.split()[0]: float(l.split()[-1]) for l in lines if "loss" in l}
    assert set(losses) == {"alibi", "t5"}
    assert all(0 < x < 1.0 for x in losses.values()), losses  # from ~1.3 at the start


def test_compile_and_export_example_runs():
    torch = pytest.importorskip("torch")
    code = block_starting("import torch\nimport posenc.torch as pt\n\nclass Block")
    scope = {}
    exec(compile(code, "docs/python.md (torch.compile)", "exec"), scope)
    names = {str(n.target) for n in scope["exported"].graph.nodes if n.op == "call_function"}
    assert any("posenc.attention" in n for n in names), names
    ids = torch.randint(0, 100, (3, 20))
    assert torch.allclose(scope["compiled"](ids), scope["model"](ids), atol=1e-5)


def test_packed_sequences_example_runs():
    code = block_starting("import numpy as np\nimport posenc\nrng = np.random.default_rng(0)\ncu =")
    scope = {}
    exec(compile(code, "docs/python.md (packed sequences)", "exec"), scope)
    assert scope["out"].shape == (13, 4, 16) and scope["masked"].shape == (1, 13, 4, 16)


@pytest.mark.parametrize("page", ["sinusoidal", "learned", "rope", "alibi", "t5", "shaw",
                                  "transformer-xl", "deberta"])
def test_scheme_pages_python_sections_run(page, monkeypatch):
    root = os.path.abspath(os.path.join(os.path.dirname(DOC), ".."))
    with open(os.path.join(root, "docs", f"{page}.md")) as f:
        text = f.read()
    section = text.split("## Python\n", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"```python\n(.*?)```", section, re.S)
    assert code
    monkeypatch.chdir(root)
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code[0], f"docs/{page}.md", "exec"), {})


def test_readme_fits_on_a_page_and_no_heading_is_dated():
    """README.md is read top to bottom (at most 200 lines); docs/ headings carry no dates (the
    software as it is; provenance goes in the text)."""
    import glob
    import re
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    with open(os.path.join(root, "README.md")) as f:
        readme = f.read().splitlines()
    assert len(readme) <= 200, len(readme)
    dated = re.compile(r"^#+ .*\b(19|20)\d\d-\d\d(-\d\d)?\b")
    for path in [os.path.join(root, "README.md")] + glob.glob(
            os.path.join(root, "docs", "**", "*.md"), recursive=True):
        with open(path) as f:
            for n, line in enumerate(f, 1):
                assert not dated.match(line), f"{path}:{n}: {line.strip()}"


def test_table_head_axes_come_from_the_registry():
    """The head axis of every parameter table the testing and distributed modules slice, read
    as the registry declares them, as docs/attention.md lists them."""
    from posenc._tables import TABLE_HEAD_AXIS
    assert TABLE_HEAD_AXIS == {"slopes": 0, "relative_attention_bias": 1, "r_w_bias": 0,
                               "r_r_bias": 0, "pos_key": 1, "pos_query": 1, "sinks": 0}
