"""The python examples in docs/*.md run as written (each file in one namespace, blocks in order)."""

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
FILES = ["adapters.md", "algorithms.md", "rotations.md", "gguf.md", "onnx.md", "kernels.md", "convert.md",
         "compressed_tensors.md", "distributed.md"]


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
