"""What a quantized HF checkpoint holds (``qcore inspect DIR``): numpy only, reads config.json and the safetensors
headers (every file is validated: a truncated or corrupted file is an error), never the tensor data."""

from __future__ import annotations

import math
import pathlib
from collections import Counter
from typing import Any, Union

from qcore import get_dtype

from .safetensors_io import CorruptCheckpointError, SafetensorsFile, index_shards, no_safetensors, read_json_object

__all__ = ["inspect_checkpoint", "format_report", "checkpoint_files"]

# weight elements per stored weight element, by layout and element bits (packed formats)
_WEIGHT_SUFFIXES = ("weight", "weight_scale", "weight_zero_point", "weight_scale_2", "weight_shifts")


def _element_bits(name) -> int:
    """Bits per element of a Quark dtype name (Quark's names are qcore aliases; block formats: their element's);
    8 when the name is unknown."""
    try:
        d = get_dtype(name)
    except (ValueError, TypeError):
        return 8
    return getattr(d, "element", d).bits


def checkpoint_files(d: Union[str, pathlib.Path]) -> list[pathlib.Path]:
    """The safetensors files of a checkpoint directory (the index's shards, or every ``*.safetensors``)."""
    d = pathlib.Path(d)
    idx = d / "model.safetensors.index.json"
    if idx.is_file():
        return index_shards(d, idx)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise no_safetensors(d)
    return files


def _weight_count(layout: str, dtype: str, shape: tuple, el_bits: int) -> int:
    n = math.prod(shape)
    if layout in ("int4_channel", "int4_group") or (dtype == "I32" and layout == "?"):
        return n * 8
    if layout in ("mx", "nvfp4", "qcore") or dtype == "U8":
        return n * 8 // max(1, el_bits)
    return n


def _infer_layout(entries: dict, name: str) -> str:
    """The Quark layout of a layer from its tensors' dtypes (checkpoints that do not state their layouts)."""
    w, s = entries.get(f"{name}.weight"), entries.get(f"{name}.weight_scale")
    if w is None:
        return "?"
    if w.dtype == "I32":
        return "int4_group" if s is not None and len(s.shape) == 2 else "int4_channel"
    if w.dtype in ("F8_E4M3", "F8_E5M2"):
        return "fp8"
    if w.dtype in ("I8",) or (w.dtype == "U8" and f"{name}.weight_zero_point" in entries):
        return "int8"
    if w.dtype == "U8" and s is not None:
        return "nvfp4" if s.dtype == "F8_E4M3" else "mx"
    return "?"


def inspect_checkpoint(directory: Union[str, pathlib.Path]) -> dict:
    """A JSON-able description of a checkpoint directory; raises ``ValueError`` (``CorruptCheckpointError``) or
    ``OSError`` for something that is not a complete checkpoint."""
    d = pathlib.Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"{str(d)!r} is not a directory")
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{str(d)!r} has no config.json (not an HF checkpoint directory)")
    cfg = read_json_object(d / "config.json", what="the model config")
    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method") == "compressed-tensors":
        return _inspect_ct(d, cfg, qc)
    own = qc.get("qcore") if isinstance(qc.get("qcore"), dict) else {}
    layouts = own.get("layouts") or {}
    entries: dict[str, Any] = {}
    files = checkpoint_files(d)
    for f in files:
        entries.update(SafetensorsFile(f).entries)
    # quantized layers: modules with a weight_scale (or the layouts the checkpoint states)
    layers = sorted({k.rsplit(".", 1)[0] for k in entries if k.endswith((".weight_scale", ".weight_scale_2"))}
                    | set(layouts))
    gw = (qc.get("global_quant_config") or {}).get("weight")
    gw = gw[0] if isinstance(gw, list) and gw else gw
    el = (gw or {}).get("dtype") if isinstance(gw, dict) else None
    el_bits = _element_bits(el) if el is not None else 8
    per_layout: Counter = Counter()
    q_bytes = q_weights = 0
    for name in layers:
        lay = layouts.get(name) or _infer_layout(entries, name)
        per_layout[lay] += 1
        w = entries.get(f"{name}.weight")
        if w is None:
            raise CorruptCheckpointError(f"layer {name!r}: no {name}.weight tensor")
        q_weights += _weight_count(lay, w.dtype, w.shape, el_bits)
        q_bytes += sum(entries[f"{name}.{s}"].end - entries[f"{name}.{s}"].begin for s in _WEIGHT_SUFFIXES
                       if f"{name}.{s}" in entries)
    dtypes = Counter(e.dtype for e in entries.values())
    total = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
    return {
        "directory": str(d),
        "architecture": (cfg.get("architectures") or [cfg.get("model_type")])[0],
        "quant_method": qc.get("quant_method"),
        "written_by": f"qcore {own.get('qcore_version')}" if own else ("AMD Quark " + str(qc.get("version"))
                                                                       if qc.get("quant_method") == "quark" else None),
        "weight_format": (gw or {}).get("dtype") if isinstance(gw, dict) else None,
        "weight_qscheme": (gw or {}).get("qscheme") if isinstance(gw, dict) else None,
        "group_size": (gw or {}).get("group_size") if isinstance(gw, dict) else None,
        "activations": _role(qc, "input_tensors"),
        "kv_cache": sorted((qc.get("kv_cache_quant_config") or {}).keys()),
        "exclude": qc.get("exclude"),
        "pack_method": (qc.get("export") or {}).get("pack_method"),
        "quantized_layers": len(layers),
        "layers_per_layout": dict(sorted(per_layout.items())),
        "bits_per_weight": round(8 * q_bytes / q_weights, 3) if q_weights else None,
        "tensors": len(entries),
        "tensor_dtypes": dict(sorted(dtypes.items())),
        "files": sorted(f.name for f in d.iterdir() if f.is_file()),
        "safetensors_files": len(files),
        "bytes_on_disk": total,
    }


def _role(qc: dict, key: str):
    v = (qc.get("global_quant_config") or {}).get(key)
    v = v[0] if isinstance(v, list) and v else v
    if not isinstance(v, dict):
        return None
    return f"{v.get('dtype')} {v.get('qscheme')} {'dynamic' if v.get('is_dynamic') else 'static'}"


def format_report(info: dict) -> str:
    rows = [("checkpoint", info["directory"]), ("architecture", str(info["architecture"])),
            ("quant_method", f"{info['quant_method']} (written by {info['written_by']})"),
            ("weights", f"{info['weight_format']} {info['weight_qscheme']}"
                        + (f" g{info['group_size']}" if info["group_size"] else "")),
            ("activations", str(info["activations"] or "float")),
            ("kv cache", ", ".join(info["kv_cache"]) or "float"),
            ("excluded", ", ".join(info["exclude"] or []) or "-"),
            ("quantized layers", f"{info['quantized_layers']} " + (
                "(" + ", ".join(f"{k}: {v}" for k, v in info["layers_per_layout"].items()) + ")")),
            ("bits per weight", f"{info['bits_per_weight']} (quantized layers, scales included)"),
            ("tensors", f"{info['tensors']} (" + ", ".join(f"{k} {v}" for k, v in info["tensor_dtypes"].items())
             + ")"),
            ("files", ", ".join(info["files"])),
            ("size on disk", f"{info['bytes_on_disk'] / 2**20:.2f} MiB")]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(w)}  {v}" for k, v in rows)


_CT_TENSORS = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx")


def _inspect_ct(d: pathlib.Path, cfg: dict, qc: dict) -> dict:
    """``inspect_checkpoint`` of a compressed-tensors checkpoint (``qcore.formats.compressed_tensors``)."""
    import re

    from .compressed_tensors import CTConfig, CTFormat

    ct = CTConfig.from_dict(qc)
    files = checkpoint_files(d)
    entries: dict[str, Any] = {}
    for f in files:
        entries.update(SafetensorsFile(f).entries)
    layers = sorted(k.rsplit(".", 1)[0] for k in entries if k.endswith(".weight_scale"))

    def group_of(name: str) -> str:
        named = [g for g, s in ct.config_groups.items() if any(
            t == name or (t.startswith("re:") and re.match(t[3:], name)) for t in s.targets)]
        return (named or list(ct.config_groups))[0]

    per_format: Counter = Counter()
    q_bytes = q_weights = 0
    for name in layers:
        g = group_of(name)
        fmt = ct.scheme_format(g)
        bits = ct.config_groups[g].weights.num_bits if ct.config_groups[g].weights is not None else 8
        per_format[fmt.value] += 1
        w = entries.get(f"{name}.weight_packed") or entries.get(f"{name}.weight")
        if w is None:
            raise CorruptCheckpointError(f"layer {name!r}: no {name}.weight_packed or {name}.weight tensor")
        n = math.prod(w.shape)
        q_weights += (n * 32 // bits if fmt is CTFormat.PACK_QUANTIZED else
                      n * 2 if fmt is CTFormat.MXFP4_PACK_QUANTIZED else n)
        q_bytes += sum(entries[f"{name}.{s}"].end - entries[f"{name}.{s}"].begin for s in _CT_TENSORS
                       if f"{name}.{s}" in entries)
    first = next(iter(ct.config_groups.values()))
    w0, a0 = first.weights, first.input_activations
    own = ct.qcore if isinstance(ct.qcore, dict) else {}
    total = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
    return {
        "directory": str(d),
        "architecture": (cfg.get("architectures") or [cfg.get("model_type")])[0],
        "quant_method": "compressed-tensors",
        "written_by": f"qcore {own.get('qcore_version')}" if own else f"compressed-tensors {ct.version}",
        "weight_format": None if w0 is None else f"{w0.type.value}{w0.num_bits}" + (
            "" if w0.symmetric else " asymmetric"),
        "weight_qscheme": None if w0 is None else w0.strategy.value,
        "group_size": None if w0 is None or not w0.group_size or w0.group_size < 0 else w0.group_size,
        "activations": None if a0 is None else (f"{a0.type.value}{a0.num_bits} {a0.strategy.value} "
                                                f"{'dynamic' if a0.dynamic else 'static'}"),
        "kv_cache": ["k_scale", "v_scale"] if ct.kv_cache_scheme is not None else [],
        "exclude": list(ct.ignore),
        "pack_method": None,
        "quantized_layers": len(layers),
        "layers_per_layout": dict(sorted(per_format.items())),
        "bits_per_weight": round(8 * q_bytes / q_weights, 3) if q_weights else None,
        "tensors": len(entries),
        "tensor_dtypes": dict(sorted(Counter(e.dtype for e in entries.values()).items())),
        "files": sorted(f.name for f in d.iterdir() if f.is_file()),
        "safetensors_files": len(files),
        "bytes_on_disk": total,
    }
