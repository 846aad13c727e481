"""bench/bench_gguf_kquants.py's ``llama_imatrix`` row on a tiny Llama (issue 25): llama.cpp's quantizer given the
importance matrix of an imatrix file (``llama_quantize(..., imatrix=path)``, through ``params.imatrix``) writes the
same bytes, tensor for tensor, as qcore's mix quantized with that file (``quantize_model(..., imatrix=
load_imatrix(path))``), and other bytes than without the imatrix. A few seconds."""

import importlib.util
import pathlib

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
pytest.importorskip("llama_cpp")

from qcore.adapters import quantize_model  # noqa: E402
from qcore.adapters.imatrix import collect_imatrix, load_imatrix, save_imatrix  # noqa: E402
from qcore.adapters.io.gguf import export_gguf, from_gguf  # noqa: E402
from test_gguf_mixes import _float_gguf, tiny  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gguf_client


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gguf_kquants_under_test",
                                                  ROOT / "bench" / "bench_gguf_kquants.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tensors(path):
    return {t.name: (t.tensor_type.name, bytes(np.asarray(t.data))) for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q2_K"])
def test_llama_cpp_with_the_imatrix_file_writes_qcores_bytes(tmp_path, mix):
    B = _bench()
    src = _float_gguf(tiny("llama", layers=4), tmp_path / "f.gguf")
    model = from_gguf(src)
    data = [torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    imf = tmp_path / "imatrix.gguf"
    save_imatrix(collect_imatrix(model, data, progress=False), imf)

    B.llama_quantize(src, tmp_path / "plain.gguf", mix, nthread=1)
    B.llama_quantize(src, tmp_path / "theirs.gguf", mix, nthread=1, imatrix=imf)
    quantize_model(model, "gguf_" + mix.lower(), progress=False, imatrix=load_imatrix(imf))
    assert export_gguf(model, tmp_path / "ours.gguf", tokenizer=src).lossless

    theirs, ours, plain = (_tensors(tmp_path / f"{n}.gguf") for n in ("theirs", "ours", "plain"))
    assert ours == theirs, [k for k in theirs if ours.get(k) != theirs[k]][:5]
    changed = [k for k in theirs if theirs[k] != plain[k]]
    assert len(changed) > len(theirs) // 3, changed  # the imatrix reached llama.cpp's searches
    same = B._bytes_same(B.gguf_tensors(tmp_path / "theirs.gguf"), B.gguf_tensors(tmp_path / "ours.gguf"))
    assert same[0] == same[1] >= 4 * 7 + 2, same  # every matrix: 4 layers x 7, token_embd, output (untied)


def test_llama_quantize_refuses_a_missing_imatrix_file(tmp_path):
    B = _bench()
    with pytest.raises(ValueError, match="imatrix must be an existing imatrix file"):
        B.llama_quantize(tmp_path / "f.gguf", tmp_path / "q.gguf", "Q4_K_M", imatrix=tmp_path / "none.gguf")
    assert not (tmp_path / "q.gguf").exists()
