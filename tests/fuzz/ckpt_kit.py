"""What the HF-checkpoint fuzz targets share (Quark / qcore and compressed-tensors checkpoints): copying a
checkpoint folder with one change (config.json, a tensor of a safetensors file, a shard, the index), the
mutations of tensors, and the independent model: transformers' float model built from the (mutated)
config.json, every float tensor as stored and every quantized Linear's weight dequantized by the numpy in this
file from the stored codes, scales and zero points (the layouts as their formats document them), read with the
safetensors library."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import torch
import transformers
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from fuzz_kit import FLOAT_VALUES, json_edit

_INTS = {np.dtype(np.int8): (-128, 127), np.dtype(np.uint8): (0, 255), np.dtype(np.int32): (-2 ** 31, 2 ** 31 - 1),
         np.dtype(np.int64): (-2 ** 63, 2 ** 63 - 1)}
_RETYPE = [np.float32, np.float16, np.float64, np.int8, np.uint8, np.int32, np.int64]


class Case:
    """One checkpoint mutation: ``apply(directory)`` changes a copy; ``what`` (shown in failure reports),
    ``files`` (names an error may use for the file) and ``fields`` (for the field or tensor; empty: any);
    ``finite``: a load must compute finite logits (the unchanged checkpoint does; False where the change writes
    NaN or Inf into a float weight, which a float checkpoint may hold)."""

    def __init__(self, what: str, apply, files: tuple, fields: tuple = (), finite: bool = True):
        self.what, self.apply, self.files, self.fields, self.finite = what, apply, files, fields, finite

    def __repr__(self) -> str:
        return f"Case({self.what})"


def copy_checkpoint(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


def shard_of(d: pathlib.Path, key: str) -> pathlib.Path:
    idx = d / "model.safetensors.index.json"
    if idx.is_file():
        return d / json.loads(idx.read_text())["weight_map"][key]
    return d / "model.safetensors"


def tensor_names(d: pathlib.Path) -> list:
    idx = d / "model.safetensors.index.json"
    if idx.is_file():
        return sorted(json.loads(idx.read_text())["weight_map"])
    return sorted(load_file(d / "model.safetensors"))


@st.composite
def config_edit(draw, d: pathlib.Path, *, quant_share: float = 0.75) -> Case:
    """A JSON edit of config.json: inside quantization_config (``quant_share`` of the time) or anywhere else
    (the model's hyperparameters)."""
    cfg = json.loads((d / "config.json").read_text())
    under = ("quantization_config",) if draw(st.floats(0, 1)) < quant_share else ()
    e = draw(json_edit(cfg, under=under, vocabulary=["int8", "uint4", "int4", "fp8_e4m3", "per_group", "per_channel",
                                                     "per_tensor", "reorder", "order", "quark", "qcore",
                                                     "float32", "bfloat16", "float16", "llama", "gpt2"]))

    def apply(dst):
        (dst / "config.json").write_text(e.text)
    fields = e.fields if e.op not in ("truncate", "raw") and e.fields else ()
    if fields and e.path[0] != "quantization_config":  # a hyperparameter: the tensor it then disagrees with
        fields += ("tensor '",)
    return Case(f"config.json {e!r}", apply, ("config.json",), fields)


@st.composite
def tensor_edit(draw, d: pathlib.Path, *, keys=None) -> Case:
    """A change of one stored tensor: some of its values (scales to inf / 0 / negative / subnormal / huge, codes
    and zero points to their dtype's extremes), its dtype, its shape, its name, its removal, or an extra
    tensor."""
    names = keys or tensor_names(d)
    key = draw(st.sampled_from(names))
    op = draw(st.sampled_from(["values", "values", "values", "dtype", "shape", "drop", "rename", "extra"]))
    if op == "values":
        n_set = draw(st.integers(1, 3))
        picks = [(draw(st.integers(0, 2 ** 20)), draw(st.sampled_from(FLOAT_VALUES)), draw(st.integers(0, 2 ** 64)))
                 for _ in range(n_set)]
        what = f"{n_set} value(s) of {key} set"
    elif op == "dtype":
        new = draw(st.sampled_from(_RETYPE))
        what = f"{key} stored as {np.dtype(new).name}"
    elif op == "shape":
        how = draw(st.sampled_from(["flat", "unsqueeze", "transpose", "half"]))
        what = f"{key} reshaped ({how})"
    elif op == "rename":
        other = draw(st.sampled_from(names))
        other = other if other != key else key + "_renamed"
        what = f"{key} renamed" + (f" (swapped with {other})" if other != key + "_renamed" else "")
    else:
        what = {"drop": f"{key} removed", "extra": "an extra tensor beside " + key}[op]

    def apply(dst):
        f = shard_of(dst, key)
        t = load_file(f)
        if op == "values":
            a = t[key].copy()
            flat = a.reshape(-1)
            for i, fv, iv in picks:
                if flat.size == 0:
                    break
                i %= flat.size
                if a.dtype.kind == "f":
                    flat[i] = fv
                else:
                    lo, hi = _INTS[a.dtype]
                    flat[i] = [lo, hi, 0, -1 if lo < 0 else 1, lo + iv % (hi - lo + 1)][iv % 5]
            t[key] = a
        elif op == "dtype":
            with np.errstate(all="ignore"):
                t[key] = t[key].astype(new)
        elif op == "shape":
            a = t[key]
            if how == "flat":
                t[key] = a.reshape(-1)
            elif how == "unsqueeze":
                t[key] = a[None]
            elif how == "transpose" and a.ndim == 2:
                t[key] = np.ascontiguousarray(a.T)
            else:
                t[key] = np.ascontiguousarray(a.reshape(-1)[: max(1, a.size // 2)])
        elif op == "drop":
            del t[key]
        elif op == "rename":
            if other in t:
                t[key], t[other] = t[other], t[key]
            else:
                t[key + "_renamed"] = t.pop(key)
                _reindex(dst, key, key + "_renamed")
        else:
            t["model.qcore_fuzz_extra"] = np.zeros(4, np.float32)
            _reindex(dst, None, "model.qcore_fuzz_extra", f.name)
        save_file(t, str(f), metadata={"format": "pt"})
    fields = ("model.qcore_fuzz_extra",) if op == "extra" else (key, other) if op == "rename" else (key,)
    if "." in key:  # "layer 'model.layers.0.mlp.up_proj': weight_scale holds ..." names it too
        fields += (tuple(key.rsplit(".", 1)),)
    scale = any(key.endswith(s) for s in ("_scale", "_scale_2"))
    # NaN / Inf written into a float weight, or a huge but representable scale (weights near float32's largest:
    # a float checkpoint may hold those too), may compute NaN; the independent model must then compute it too
    wild = op == "values" and (not scale or any(abs(fv) > 1e4 for _, fv, _ in picks))
    return Case(what, apply, (f"{shard_of(d, key).name}",), fields, finite=not wild)


def _reindex(d: pathlib.Path, old, new, file=None) -> None:
    idx = d / "model.safetensors.index.json"
    if not idx.is_file():
        return
    j = json.loads(idx.read_text())
    wm = j["weight_map"]
    if old is not None:
        wm[new] = wm.pop(old)
    else:
        wm[new] = file
    idx.write_text(json.dumps(j, indent=2))


# ---------------------------------------------------------------------------------------------------------------
# the independent model
# ---------------------------------------------------------------------------------------------------------------


class Unreadable(Exception):
    """The independent reader cannot read the checkpoint (qcore must then have refused it)."""


def stored_tensors(d: pathlib.Path) -> dict:
    idx = d / "model.safetensors.index.json"
    files = sorted(set(json.loads(idx.read_text())["weight_map"].values())) if idx.is_file() else \
        sorted(p.name for p in d.glob("*.safetensors"))
    out: dict = {}
    for name in files:
        for k, v in load_file(d / name).items():
            if k in out:
                raise Unreadable(f"{k} stored twice")
            out[k] = v
    return out


def _nibbles(words: np.ndarray, order: str, signed: bool) -> np.ndarray:
    """int32 words [r, c] -> 4-bit values [r, 8c]: slot i holds element [0,2,4,6,1,3,5,7][i] ("reorder") or
    element i ("order"); two's complement when ``signed``."""
    w = words.astype(np.int64) & 0xFFFFFFFF
    slots = np.stack([(w >> (4 * i)) & 0xF for i in range(8)], axis=-1)  # [r, c, 8]
    perm = (0, 2, 4, 6, 1, 3, 5, 7) if order == "reorder" else tuple(range(8))
    out = np.empty_like(slots)
    for i, e in enumerate(perm):
        out[..., e] = slots[..., i]
    out = out.reshape(words.shape[0], -1)
    return np.where(out > 7, out - 16, out) if signed else out


def dequantize_quark(t: dict, layer: str, wcfg: dict, pack_method: str) -> np.ndarray:
    """float32 [out, in] of one Quark-layout layer (tensor table in qcore/formats/quark_layout.py, as amd-quark
    writes them): (codes - zero point) * scale."""
    w, s = t[f"{layer}.weight"], t[f"{layer}.weight_scale"].astype(np.float32)
    z = t.get(f"{layer}.weight_zero_point")
    dtype, qscheme = wcfg.get("dtype"), wcfg.get("qscheme")
    if w.dtype in (np.int8, np.uint8) and w.ndim == 2:
        zf = np.zeros(s.shape, np.float32) if z is None else z.astype(np.float32)
        if s.ndim == 0:
            return (w.astype(np.float32) - zf) * s
        return (w.astype(np.float32) - zf[:, None]) * s[:, None]
    if w.dtype == np.int32 and dtype in ("int4", "uint4"):
        signed = dtype == "int4"
        if qscheme == "per_group":
            codes = _nibbles(w, pack_method, signed).T.astype(np.float32)  # [out, in]
            zz = _nibbles(z, pack_method, signed).T.astype(np.float32)  # [out, ngroups]
            g = codes.shape[1] // s.shape[0]
            return (codes - np.repeat(zz, g, axis=1)) * np.repeat(s.T, g, axis=1)
        codes = _nibbles(w, pack_method, signed).astype(np.float32)
        zz = _nibbles(z[None], pack_method, signed).reshape(-1).astype(np.float32)
        return (codes - zz[:, None]) * s[:, None]
    raise Unreadable(f"{layer}: {w.dtype} {w.shape} with config {wcfg}")


def independent_model(d: pathlib.Path, dequantize) -> torch.nn.Module:
    """``_independent_model``; ``Unreadable`` for whatever it cannot read."""
    try:
        return _independent_model(d, dequantize)
    except Unreadable:
        raise
    except (Exception, RecursionError) as e:
        raise Unreadable(f"{type(e).__name__}: {e}") from None


def _independent_model(d: pathlib.Path, dequantize) -> torch.nn.Module:
    """transformers' model of the (mutated) config.json with the stored tensors; ``dequantize(tensors, layer,
    quantization_config)`` gives each quantized layer's float weight (layers: those with a ``weight_scale``)."""
    cfg = json.loads((d / "config.json").read_text())
    if not isinstance(cfg, dict):
        raise Unreadable("config.json is not an object")
    qc = cfg.pop("quantization_config", None)
    try:
        hf = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        model = transformers.AutoModelForCausalLM.from_config(hf).eval()
    except Exception as e:  # whatever transformers refuses, the independent reader cannot read
        raise Unreadable(f"transformers: {type(e).__name__}: {e}") from None
    t = stored_tensors(d)
    state = {}
    for k, v in model.state_dict().items():
        layer = k[:-len(".weight")]
        try:
            if k.endswith(".weight") and f"{layer}.weight_scale" in t:  # Quark's weight, compressed-tensors' packed
                a = dequantize(t, layer, qc)
            elif k in t:
                a = t[k]
            elif k == "lm_head.weight" and getattr(hf, "tie_word_embeddings", False):
                continue
            else:
                raise Unreadable(f"{k} is missing")
            a = np.asarray(a)
            if a.shape != tuple(v.shape) or a.dtype.kind != "f":
                raise Unreadable(f"{k}: {a.dtype} {a.shape}, the model's {tuple(v.shape)}")
        except (KeyError, ValueError, IndexError, TypeError, AttributeError) as e:
            raise Unreadable(f"{k}: {type(e).__name__}: {e}") from None
        state[k] = torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(v.dtype)
    used = set(state) | {f"{k[:-len('.weight')]}.{s}" for k in state
                         for s in ("weight_scale", "weight_zero_point", "weight_packed", "weight_shape")}
    left = sorted(set(t) - used)
    if left:
        raise Unreadable(f"tensors the model does not have: {left[:3]}")
    model.load_state_dict(state, strict=False)
    if getattr(hf, "tie_word_embeddings", False):
        model.tie_weights()
    return model


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(batch).logits.float()


def same_logits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN equal to NaN."""
    if a.shape != b.shape:
        return False
    na, nb = torch.isnan(a), torch.isnan(b)
    return bool(torch.equal(na, nb) and torch.equal(torch.where(na, 0, a), torch.where(nb, 0, b)))
