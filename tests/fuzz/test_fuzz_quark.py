"""Fuzzing qcore's Quark / qcore HF checkpoint loader (``qcore.adapters.from_pretrained``) with mutations of real
exports (int8 per-channel: Quark's ``int8`` layout; asymmetric uint4 groups of 32: ``int4_group``; the int8
export in shards with its index): config.json (every quantization_config field by type, the model's
hyperparameters), the stored tensors (scales set to inf / 0 / negative / subnormal / huge, codes and zero points
to their extremes, dtypes, shapes, names, removals, extra tensors), the index (weight_map entries pointing at
missing shards or tensors) and the shards themselves.

A checkpoint qcore loads must give the logits of the independent model (ckpt_kit.independent_model: transformers'
float model of the same config.json with the stored float tensors and each quantized weight dequantized by numpy
from the stored codes, scales and zero points), bit for bit; anything else is a one-line ValueError naming the
file (config.json, the shard) or the checkpoint, and the field or tensor."""

import json
import pathlib
import tempfile

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from ckpt_kit import (Case, Unreadable, config_edit, copy_checkpoint, dequantize_quark, independent_model,  # noqa: E402
                      logits, same_logits, tensor_edit)
from fuzz_kit import attempt, check_refusal, counts, fuzz, json_edit, record  # noqa: E402

import qcore.adapters as A  # noqa: E402


def _deq(t, layer, qc):
    qc = qc if isinstance(qc, dict) else {}
    wcfg = ((qc.get("global_quant_config") or {}).get("weight") or {}) if isinstance(qc.get("global_quant_config"),
                                                                                     dict) else {}
    pack = (qc.get("export") or {}).get("pack_method", "reorder") if isinstance(qc.get("export"), dict) else "reorder"
    return dequantize_quark(t, layer, wcfg if isinstance(wcfg, dict) else {}, pack)


def _size(d: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir())


def check_case(src: pathlib.Path, case: Case, batch, target: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        d = copy_checkpoint(src, pathlib.Path(tmp) / src.name)
        case.apply(d)
        out = attempt(lambda: A.from_pretrained(d), watch=[tmp], size=_size(d))
        record(target, out)
        try:
            ind, why = independent_model(d, _deq), ""
        except Unreadable as e:
            ind, why = None, str(e)
        if out.ok:
            assert ind is not None, f"qcore loaded a checkpoint the independent reader cannot read: {why}"
            got = logits(out.value, batch)
            assert same_logits(got, logits(ind, batch)), "qcore's logits differ from the independent model's"
            assert not case.finite or bool(torch.isfinite(got).all()), "qcore loaded a checkpoint whose model " \
                                                                       "computes NaN or Inf"
            return "accepted"
        check_refusal(out.error, files=[*case.files, str(d)], fields=case.fields)
        return "refused"


@pytest.mark.parametrize("fixture", ["quark_int8", "quark_uint4"])
def test_unchanged_exports_load_as_the_independent_model(request, fixture, batches):
    src = request.getfixturevalue(fixture)
    assert check_case(src, Case("unchanged", lambda d: None, ()), batches[0], "quark (unchanged)") == "accepted"


@pytest.mark.parametrize("n", counts(40, 600))
@pytest.mark.parametrize("fixture", ["quark_int8", "quark_uint4"])
def test_fuzz_quark_checkpoint(request, fixture, batches, n):
    src = request.getfixturevalue(fixture)

    @fuzz(n)
    @given(st.one_of(config_edit(src), tensor_edit(src)))
    def run(case):
        check_case(src, case, batches[0], "quark checkpoint")

    run()


@st.composite
def _index_edit(draw, d: pathlib.Path):
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(idx["weight_map"].values()))
    kind = draw(st.sampled_from(["index", "index", "remove_shard", "extra_shard"]))
    if kind == "index":
        e = draw(json_edit(idx, vocabulary=shards + ["missing.safetensors", "../model.safetensors", "/etc/passwd",
                                                     "model.safetensors.index.json", "config.json"]))

        def apply(dst):
            (dst / "model.safetensors.index.json").write_text(e.text)
        return Case(f"index {e!r}", apply, ("model.safetensors.index.json",),
                    e.fields if e.op not in ("truncate", "raw") else ())
    shard = draw(st.sampled_from(shards))
    if kind == "remove_shard":
        return Case(f"{shard} removed", lambda dst: (dst / shard).unlink(), (shard, "model.safetensors.index.json"))

    def extra(dst):
        (dst / "model-extra.safetensors").write_bytes((dst / shard).read_bytes())
    return Case(f"a copy of {shard} beside the shards", extra, ("model-extra.safetensors",))


@pytest.mark.parametrize("n", counts(30, 400))
def test_fuzz_sharded_checkpoint(quark_sharded, batches, n):
    @fuzz(n)
    @given(st.one_of(_index_edit(quark_sharded), tensor_edit(quark_sharded)))
    def run(case):
        check_case(quark_sharded, case, batches[0], "quark sharded checkpoint")

    run()
