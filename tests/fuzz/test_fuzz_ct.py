"""Fuzzing qcore's compressed-tensors loader (``qcore.adapters.io.compressed_tensors.load_compressed_tensors``:
the config parse ``qcore.formats.compressed_tensors.CTConfig`` and the packed tensors' checks) with mutations of
a real export (pack-quantized asymmetric int4 in groups of 32, as compressed-tensors / vLLM read it):
config.json (every quantization_config field by type: config_groups and their QuantizationArgs, ignore,
format, the qcore block; the model's hyperparameters) and the stored tensors (weight_packed words,
weight_scale set to inf / 0 / negative / subnormal / huge, weight_zero_point words, weight_shape; dtypes,
shapes, names, removals, extra tensors).

A checkpoint qcore loads must give the logits of the independent model (transformers' float model of the same
config.json with each quantized Linear's weight unpacked and dequantized by the numpy below from the stored
words, scales and zero points, as compressed-tensors' pack_to_int32 lays them out), bit for bit; anything else
is a one-line ValueError naming the file and the field or tensor. (The target matching of config_groups is
another part's; these mutations keep to the fields' types and values.)"""

import pathlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from ckpt_kit import (Case, Unreadable, config_edit, copy_checkpoint, independent_model, logits,  # noqa: E402
                      same_logits, tensor_edit)
from fuzz_kit import attempt, check_refusal, counts, fuzz, record  # noqa: E402

from qcore.adapters.io.compressed_tensors import load_compressed_tensors  # noqa: E402


def _unpack4(words: np.ndarray, n: int, dim: int) -> np.ndarray:
    """int32 words packing 8 unsigned 4-bit values each (value i of a word at bits 4i) along ``dim`` -> the
    signed codes (value - 8), ``n`` of them along ``dim``."""
    w = (words.astype(np.int64) & 0xFFFFFFFF)
    v = np.stack([(w >> (4 * i)) & 0xF for i in range(8)], axis=dim + 1)  # [.., words, 8, ..]
    shape = list(words.shape)
    shape[dim] *= 8
    v = v.reshape(shape) if dim == 1 else np.moveaxis(v, 1, 1).reshape(shape)
    v = np.take(v, np.arange(n), axis=dim)
    return v - 8


def dequantize_ct(t: dict, layer: str, qc) -> np.ndarray:
    if not isinstance(qc, dict):
        raise Unreadable("no quantization_config")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise Unreadable("config_groups")
    args = next(iter(groups.values())).get("weights")
    if not (isinstance(args, dict) and args.get("num_bits") == 4 and args.get("type") == "int"
            and args.get("strategy") in ("group", None) and args.get("symmetric") is False):
        # (compressed-tensors' QuantizationArgs infers strategy "group" from a group_size when strategy is null)
        raise Unreadable(f"weights args {args}")
    g = args.get("group_size")
    shape = tuple(int(x) for x in t[f"{layer}.weight_shape"].reshape(-1))
    if len(shape) != 2 or not isinstance(g, int) or g < 1 or shape[1] % g:
        raise Unreadable(f"shape {shape}, group {g}")
    out, cols = shape
    q = _unpack4(t[f"{layer}.weight_packed"], cols, 1)
    s = t[f"{layer}.weight_scale"].astype(np.float32)
    zw = t[f"{layer}.weight_zero_point"]
    z = np.stack([(zw.astype(np.int64) & 0xFFFFFFFF) >> (4 * i) & 0xF for i in range(8)], axis=1)  # [w, 8, ng]
    z = z.reshape(-1, zw.shape[1])[:out] - 8
    if q.shape != (out, cols) or s.shape != (out, cols // g) or z.shape != s.shape:
        raise Unreadable(f"{layer}: {q.shape} {s.shape} {z.shape}")
    with np.errstate(all="ignore"):
        return (q - np.repeat(z, g, axis=1)).astype(np.float32) * np.repeat(s, g, axis=1)


def check_case(src: pathlib.Path, case: Case, batch, target: str) -> str:
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        d = copy_checkpoint(src, pathlib.Path(tmp) / src.name)
        case.apply(d)
        out = attempt(lambda: load_compressed_tensors(d), watch=[tmp], size=sum(p.stat().st_size
                                                                                for p in d.iterdir()))
        record(target, out)
        try:
            ind, why = independent_model(d, dequantize_ct), ""
        except Unreadable as e:
            ind, why = None, str(e)
        if out.ok:
            assert ind is not None, f"qcore loaded a checkpoint the independent reader cannot read: {why}"
            got = logits(out.value, batch)
            assert same_logits(got, logits(ind, batch)), "qcore's logits differ from the independent model's"
            assert not case.finite or bool(torch.isfinite(got).all()), "qcore's model computes NaN or Inf"
            return "accepted"
        check_refusal(out.error, files=[*case.files, str(d)], fields=case.fields)
        return "refused"


def test_the_unchanged_export_loads_as_the_independent_model(ct_uint4, batches):
    assert check_case(ct_uint4, Case("unchanged", lambda d: None, ()), batches[0], "ct (unchanged)") == "accepted"


@pytest.mark.parametrize("n", counts(40, 600))
def test_fuzz_compressed_tensors_checkpoint(ct_uint4, batches, n):
    @fuzz(n)
    @given(st.one_of(config_edit(ct_uint4), tensor_edit(ct_uint4)))
    def run(case):
        check_case(ct_uint4, case, batches[0], "compressed-tensors checkpoint")

    run()
