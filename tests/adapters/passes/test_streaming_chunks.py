"""The slice-at-a-time encoding of streaming / export (issue 23, memory at 13B widths) writes the bytes the
whole-tensor path writes: int4 packing by slices of rows in uint32 (``quark_layout._pack_int4_rows``) against
``qcore.packing.pack_int4_int32``, ``io.common.weight_parts`` by slices of rows against the whole weight, and
``quantize_checkpoint`` with tiny slices against the landed whole-tensor path (thresholds set out of reach)."""

import pathlib
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import stream_worker  # noqa: E402

import qcore  # noqa: E402
import qcore.adapters as A  # noqa: E402
from qcore.adapters.io import common, quark_hf  # noqa: E402
from qcore.adapters.jobs.checkpoint import quantize_checkpoint  # noqa: E402
from qcore.formats import quark_layout as L  # noqa: E402

BATCHES = [torch.randint(0, stream_worker.VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
           for _ in range(2)]
HUGE = 1 << 62


@pytest.mark.parametrize("dtype,lo,hi", [(np.uint8, 0, 16), (np.int8, -8, 8), (np.int8, -8, 16),
                                         (np.int64, 0, 16)])
@pytest.mark.parametrize("order", ["order", "reorder"])
def test_pack_int4_rows_equals_pack_int4_int32(dtype, lo, hi, order, monkeypatch):
    rng = np.random.default_rng(0)
    monkeypatch.setattr(L, "_PACK_ROWS_ELEMENTS", 100)  # several slices, one of them short
    for shape in [(37, 64), (5, 21), (64, 37)]:  # 21, 37: not whole words (the pack_int4_int32 fallback)
        c = rng.integers(lo, hi, shape).astype(dtype)
        for view in (c, c.T):  # a transposed view (the int4_group layout packs codes.T)
            got = L._pack_int4_rows(view, order)
            want = qcore.packing.pack_int4_int32(np.ascontiguousarray(view), order=order, axis=-1)
            assert got.dtype == want.dtype == np.int32 and np.array_equal(got, want)


def test_pack_int4_rows_refuses_out_of_range_codes(monkeypatch):
    monkeypatch.setattr(L, "_PACK_ROWS_ELEMENTS", 64)
    c = np.zeros((16, 32), np.uint8)
    c[9, 3] = 16  # past uint4: the fast path hands it to pack_int4_int32, which refuses it
    with pytest.raises(ValueError):
        L._pack_int4_rows(c, "reorder")
    with pytest.raises(ValueError):
        qcore.packing.pack_int4_int32(c, order="reorder", axis=-1)


def _configs():
    return {"uint4_g16_asym": A.preset("w_uint4_per_group_asym", group_size=16),
            "int8_channel": A.preset("w_int8_per_channel_sym"),
            "int4_wo_32": A.preset("int4_wo_32"),
            "ptpc_fp8": A.preset("ptpc_fp8"),
            "mxfp4_weight_only": A.preset("mxfp4_weight_only"),
            "nvfp4": A.preset("nvfp4"),  # a tensor scale: never by rows (the whole-weight path)
            "mx9": A.preset("mx9"),  # micro-exponent shifts: never by rows
            "uint4_wo_64": A.preset("uint4_wo_64")}


def _parts(w, big: bool, monkeypatch):
    monkeypatch.setattr(common, "_PARTS_ROWS_ELEMENTS", HUGE if big else 200)
    return common.weight_parts(w)


@pytest.mark.parametrize("name", list(_configs()))
def test_weight_parts_by_rows_equals_whole_weight(name, monkeypatch):
    cfg = _configs()[name]
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 48).to(torch.bfloat16)
    m = torch.nn.Sequential(lin)
    plan = A.quantizer.plan_model(m, cfg)[0]
    w = A.modules.wrap(lin, plan.config, name="0")
    w.commit()
    (a, sa), (b, sb) = _parts(w, False, monkeypatch), _parts(w, True, monkeypatch)
    assert sa == sb
    for f in ("codes", "scales", "zero_points", "shifts", "tensor_scale"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y, equal_nan=True), f
    layout = quark_hf.module_layout(w)
    ea = L.encode_weight(a, w.specs["weight"], layout=layout)
    eb = L.encode_weight(b, w.specs["weight"], layout=layout)
    assert ea.keys() == eb.keys() and all(np.array_equal(ea[k][1], eb[k][1]) for k in ea)


def test_weight_parts_by_rows_still_refuses_a_weight_off_its_grid(monkeypatch):
    lin = torch.nn.Linear(128, 48)
    cfg = A.preset("w_uint4_per_group_asym", group_size=16)
    w = A.modules.wrap(lin, A.quantizer.plan_model(torch.nn.Sequential(lin), cfg)[0].config, name="0")
    w.commit()
    off = w.effective("weight", canonical=True).clone()
    off[40, 5] += 1e-3  # off the grid, in a later slice of rows
    monkeypatch.setattr(w, "effective", lambda role, canonical=False: off)
    monkeypatch.setattr(common, "_PARTS_ROWS_ELEMENTS", 200)
    assert common._row_chunks(off, w.specs["weight"],
                              {"scale": w.weight_scale, "zero_point": w.weight_zero_point}) > 0
    for n in (200, HUGE):  # by rows and whole: the same refusal
        monkeypatch.setattr(common, "_PARTS_ROWS_ELEMENTS", n)
        with pytest.raises(RuntimeError, match="not on its quantization grid"):
            common.weight_parts(w)


@pytest.mark.parametrize("cfg_name,dtype", [("uint4_wo_64", torch.bfloat16), ("uint4_g16_asym", torch.float32),
                                            ("int4_wo_32", torch.float32), ("ptpc_fp8", torch.bfloat16)])
def test_quantize_checkpoint_by_slices_equals_the_whole_tensor_path(cfg_name, dtype, tmp_path, monkeypatch):
    src = tmp_path / "src"
    stream_worker.write_llama(src, hidden=64, intermediate=128, layers=2, dtype=dtype)
    cfg = _configs()[cfg_name]
    for tag, small in (("whole", False), ("slices", True)):
        monkeypatch.setattr(common, "_PARTS_ROWS_ELEMENTS", 256 if small else HUGE)
        monkeypatch.setattr(L, "_PACK_ROWS_ELEMENTS", 128 if small else HUGE)
        monkeypatch.setattr(L, "_pack_int4_slice", L._pack_int4_slice if small else
                            (lambda c, order: qcore.packing.pack_int4_int32(c, order=order, axis=-1)))
        quantize_checkpoint(src, tmp_path / tag, cfg, BATCHES, max_shard_size="60KB", progress=False)
    names = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "slices").iterdir())
    for f in names:
        assert (tmp_path / "whole" / f).read_bytes() == (tmp_path / "slices" / f).read_bytes(), f
