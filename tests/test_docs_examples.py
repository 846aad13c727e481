"""The python examples in docs/*.md run as written (each file in one namespace, blocks in order)."""

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
FILES = ["quickstart.md", "adapters.md", "algorithms.md", "rotations.md", "gguf.md", "onnx.md", "kernels.md",
         "convert.md", "compressed_tensors.md", "distributed.md", "export.md", "kernel_testing.md"]


@pytest.mark.parametrize("name", FILES)
def test_doc_examples_run(name):
    text = (DOCS / name).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, f"{name} has no python example"
    if any("import torch" in b for b in blocks):
        pytest.importorskip("torch")
    if any("onnxruntime" in b or "ort_session" in b for b in blocks):
        pytest.importorskip("onnxruntime")
    if any("qcore.adapters.triton" in b for b in blocks):
        pytest.importorskip("triton")  # kernels.md: Triton's CPU interpreter when there is no GPU
    ns: dict = {}
    for block in blocks:
        exec(compile(block, name, "exec"), ns)


def test_every_doc_with_a_python_example_is_run():
    """A doc's python examples are run here: none is left out of FILES (docs/README.md promises it)."""
    with_python = {p.name for p in DOCS.glob("*.md") if "```python\n" in p.read_text()}
    assert with_python <= set(FILES), sorted(with_python - set(FILES))

