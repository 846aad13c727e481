"""What a quantized HF checkpoint holds (``qcore inspect DIR``): numpy only, reads config.json and the safetensors
headers (every file is validated: a truncated or corrupted file is an error), never the tensor data."""

from __future__ import annotations

import math
import pathlib
import re
from collections import Counter
from typing import Any, Mapping, Optional, Union

from qcore import get_dtype

from .compressed_tensors import CTConfig, CTFormat
from .gguf import check_file
from .quark_layout import expected_weight, weight_layout
from .safetensors_io import (DTYPE_BYTES, CorruptCheckpointError, SafetensorsFile, index_shards, no_safetensors,
                             read_json_object)

__all__ = ["inspect_checkpoint", "inspect_path", "format_report", "checkpoint_files", "stored_bits_per_weight",
           "layout_bits_per_weight"]

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


def stored_bits_per_weight(tensors: Mapping[str, tuple], n_weights: int) -> float:
    """Bits per weight element of one layer as stored: every tensor of its weight (codes, scales, zero points,
    MX shared shifts, the two-level tensor scale; ``{name: (safetensors dtype, shape)}``, e.g.
    ``quark_layout.expected_weight``'s or a checkpoint header's) in bits, over ``n_weights``. The one count
    ``qcore inspect`` (from a checkpoint's headers) and ``qcore schemes`` (from the layout an export writes) use."""
    if isinstance(n_weights, bool) or not isinstance(n_weights, int) or n_weights < 1:
        raise ValueError(f"n_weights must be a positive int, got {n_weights!r}")
    bits = 0
    for name, (dtype, shape) in tensors.items():
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"tensor {name!r}: unknown safetensors dtype {dtype!r}")
        bits += 8 * DTYPE_BYTES[dtype] * math.prod(shape)
    return bits / n_weights


def layout_bits_per_weight(spec, shape: tuple, *, module: str = "Linear") -> tuple[str, float]:
    """``(layout, bits per weight)`` of a weight of canonical ``shape`` quantized by ``spec`` as an HF export
    stores it (``quark_layout.weight_layout`` / ``expected_weight``, counted by ``stored_bits_per_weight``)."""
    layout = weight_layout(spec, tuple(shape), module=module)
    return layout, stored_bits_per_weight(expected_weight(spec, tuple(shape), layout=layout), math.prod(shape))


# layouts whose weight element count follows from the stored tensors alone (MX blocks of 32, NVFP4 of 16)
def _weight_count(layout: str, entries: dict, name: str, el_bits: Optional[int]) -> Optional[int]:
    w = entries[f"{name}.weight"]
    n = math.prod(w.shape)
    if layout in ("int8", "fp8"):
        return n
    if layout in ("int4_channel", "int4_group"):
        return n * 8
    sc = entries.get(f"{name}.weight_scale")
    if layout == "mx" and sc is not None:
        return math.prod(sc.shape) * 32
    if layout == "nvfp4" and sc is not None:
        return math.prod(sc.shape) * 16
    if el_bits is None:
        return None
    return n * 8 * DTYPE_BYTES.get(w.dtype, 1) // el_bits  # the qcore layout: codes packed row by row


def _match(pattern: str, name: str) -> bool:
    import fnmatch
    import re
    parts = name.split(".")
    for i in range(len(parts), 0, -1):  # the pattern may name the module or a parent (a block)
        n = ".".join(parts[:i])
        if (re.fullmatch(pattern[3:], n) is not None) if pattern.startswith("re:") else fnmatch.fnmatchcase(
                n, pattern):
            return True
    return False


def _qcore_weight_dtype(own_config: Any, name: str, *, module_type: Optional[str] = None) -> Optional[str]:
    """The weight element format of module ``name`` by qcore's own config (``quantization_config["qcore"]
    ["config"]``, a ``ModelConfig`` dict): its ``by_name`` pattern, else its ``module_type``'s ``by_type`` entry
    when the type is known (fused experts: ``"Experts"``), else the default layer (or, when the ``by_type``
    entries agree with it, theirs; ``"Experts"`` does not count: ``inspect_checkpoint`` tells a fused experts
    module by its per-expert tensors and passes its type); None when it cannot be told without the module's type."""
    if not isinstance(own_config, dict):
        return None

    def wdtype(lc):
        w = (lc or {}).get("weight") if isinstance(lc, dict) else None
        spec = w.get("spec") if isinstance(w, dict) else None
        return (spec.get("name") or spec.get("dtype")) if isinstance(spec, dict) else None

    for pat, lc in (own_config.get("by_name") or {}).items():
        if _match(pat, name):
            return wdtype(lc)
    by_type = own_config.get("by_type") or {}
    if module_type is not None and isinstance(by_type, dict):
        if module_type in by_type:
            return wdtype(by_type[module_type])
        return wdtype(own_config.get("layer"))
    cands = {wdtype(own_config.get("layer"))} | {wdtype(v) for k, v in by_type.items() if k != "Experts"}
    cands.discard(None)
    bits = {_element_bits(c) for c in cands}
    return next(iter(cands)) if len(bits) == 1 else None


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
    if not isinstance(qc, dict):
        raise ValueError(f"{str(d / 'config.json')!r}: quantization_config must be a JSON object, got "
                         f"{type(qc).__name__}")
    if qc.get("quant_method") == "compressed-tensors":
        return _inspect_ct(d, cfg, qc)
    own = qc.get("qcore") if isinstance(qc.get("qcore"), dict) else {}
    layouts = own.get("layouts") or {}
    entries: dict[str, Any] = {}
    files = checkpoint_files(d)
    for f in files:
        entries.update(SafetensorsFile(f).entries)
    # quantized layers: modules with a weight_scale (or the layouts the checkpoint states); a fused experts module
    # (no weight of its own) is one layer made of the per-expert Linears stored for it
    experts = {name: _expert_linears(entries, name) for name in layouts if f"{name}.weight" not in entries}
    experts = {k: v for k, v in experts.items() if v}
    in_experts = {lin for v in experts.values() for lin in v}
    layers = sorted(({k.rsplit(".", 1)[0] for k in entries if k.endswith((".weight_scale", ".weight_scale_2"))}
                     - in_experts) | set(layouts))
    gw = (qc.get("global_quant_config") or {}).get("weight")
    gw = gw[0] if isinstance(gw, list) and gw else gw
    own_config = own.get("config")
    per_layout: Counter = Counter()
    per_layer: dict[str, dict] = {}
    for name in layers:
        lay = layouts.get(name) or _infer_layout(entries, name)
        per_layout[lay] += 1
        if name in experts:
            per_layer[name] = _experts_layer(cfg, entries, name, experts[name], lay, own_config, qc)
            continue
        w = entries.get(f"{name}.weight")
        if w is None:
            raise CorruptCheckpointError(f"layer {name!r}: no {name}.weight tensor")
        fmt = _qcore_weight_dtype(own_config, name) if own_config is not None else _quark_weight_dtype(qc, name)
        n = _weight_count(lay, entries, name, None if fmt is None else _element_bits(fmt))
        tensors = {s: (entries[f"{name}.{s}"].dtype, tuple(entries[f"{name}.{s}"].shape)) for s in _WEIGHT_SUFFIXES
                   if f"{name}.{s}" in entries}
        per_layer[name] = {"layout": lay, "format": fmt, "weights": n,
                           "bytes": sum(entries[f"{name}.{s}"].end - entries[f"{name}.{s}"].begin for s in tensors),
                           "tensors": {s: f"{d} {list(sh)}" for s, (d, sh) in tensors.items()},
                           "bits_per_weight": None if n is None else round(stored_bits_per_weight(tensors, n), 4)}
    counted = [v for v in per_layer.values() if v["weights"] is not None]
    q_weights = sum(v["weights"] for v in counted)
    q_bytes = sum(v["bytes"] for v in counted)
    formats = Counter(v["format"] or "?" for v in per_layer.values())
    dtypes = Counter(e.dtype for e in entries.values())
    total = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
    return {
        "directory": str(d),
        "architecture": (cfg.get("architectures") or [cfg.get("model_type")])[0],
        "quant_method": qc.get("quant_method"),
        "written_by": f"qcore {own.get('qcore_version')}" if own else ("AMD Quark " + str(qc.get("version"))
                                                                       if qc.get("quant_method") == "quark" else None),
        "weight_format": (gw or {}).get("dtype") if isinstance(gw, dict) else None,
        "layers_per_format": dict(sorted(formats.items())),
        "weight_qscheme": (gw or {}).get("qscheme") if isinstance(gw, dict) else None,
        "group_size": (gw or {}).get("group_size") if isinstance(gw, dict) else None,
        "activations": _role(qc, "input_tensors"),
        "kv_cache": sorted((qc.get("kv_cache_quant_config") or {}).keys()),
        "exclude": qc.get("exclude"),
        "pack_method": (qc.get("export") or {}).get("pack_method"),
        "quantized_layers": len(layers),
        "layers_per_layout": dict(sorted(per_layout.items())),
        "bits_per_weight": round(8 * q_bytes / q_weights, 3) if q_weights else None,
        "layers": per_layer,
        "tensors": len(entries),
        "tensor_dtypes": dict(sorted(dtypes.items())),
        "files": sorted(f.name for f in d.iterdir() if f.is_file()),
        "safetensors_files": len(files),
        "bytes_on_disk": total,
    }


_EXPERT_TENSOR = re.compile(r"(?P<prefix>.+)\.(?P<e>\d+)\.(?P<proj>[^.]+)\.weight")


def _expert_linears(entries: Mapping[str, Any], name: str) -> dict[str, tuple[int, str]]:
    """``{per-expert Linear: (expert, projection)}`` stored for the fused experts module ``name`` (e.g.
    ``model.layers.0.mlp.experts``): ``<name>.<e>.<proj>`` (Qwen2/3-MoE, qcore's own names) or, as
    ``save_pretrained`` names Mixtral's, the same under a sibling of ``name``'s parent
    (``model.layers.0.block_sparse_moe.experts.<e>.w1``). Empty when none is stored."""
    parent, _, leaf = name.rpartition(".")
    block = parent.rpartition(".")[0]
    by_prefix: dict[str, dict[str, tuple[int, str]]] = {}
    for k in entries:
        m = _EXPERT_TENSOR.fullmatch(k)
        if m is None:
            continue
        p = m["prefix"]
        if p != name:
            head, _, last = p.rpartition(".")
            if last != leaf or not head or head.rpartition(".")[0] != block or "." in head[len(block) + 1:] or (
                    block and not head.startswith(block + ".")):
                continue
        by_prefix.setdefault(p, {})[k[:-len(".weight")]] = (int(m["e"]), m["proj"])
    if name in by_prefix:
        return by_prefix[name]
    if len(by_prefix) > 1:
        raise CorruptCheckpointError(f"fused experts {name!r}: per-expert tensors under several names "
                                     f"({sorted(by_prefix)}); expected one")
    return next(iter(by_prefix.values()), {})


def _config_dims(cfg: dict) -> tuple[Optional[int], Optional[int]]:
    """``(hidden size, expert intermediate size)`` by config.json (its ``text_config`` for a multimodal model)."""
    c = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    h = c.get("hidden_size")
    i = c.get("moe_intermediate_size", c.get("intermediate_size"))
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (h, i))
    return (h, i) if ok else (None, None)


def _experts_layer(cfg: dict, entries: dict, name: str, linears: dict, lay: str, own_config: Any,
                   qc: dict) -> dict:
    """``inspect_checkpoint``'s row of a fused experts module stored as per-expert Linears: its format (by the
    ``"Experts"`` type), its bytes (every tensor of every per-expert weight) and its bits per weight over the
    float weight count ``E * (2 I H + H I)`` (E experts of hidden size H and intermediate size I, config.json)."""
    by_expert: dict[int, set] = {}
    for e, proj in linears.values():
        by_expert.setdefault(e, set()).add(proj)
    n_exp = len(by_expert)
    projs = {frozenset(p) for p in by_expert.values()}
    if len(projs) != 1 or len(next(iter(projs))) != 3 or sorted(by_expert) != list(range(n_exp)):
        found = dict(sorted((e, sorted(p)) for e, p in by_expert.items()))
        raise CorruptCheckpointError(f"fused experts {name!r}: expected experts 0..E-1 with the same 3 projections "
                                     f"each (gate, up, down), found {found}")
    c = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    want = c.get("num_local_experts", c.get("num_experts"))
    if isinstance(want, int) and not isinstance(want, bool) and want != n_exp:
        raise CorruptCheckpointError(f"fused experts {name!r}: {n_exp} experts stored, config.json says {want}")
    fmt = (_qcore_weight_dtype(own_config, name, module_type="Experts") if own_config is not None
           else _quark_weight_dtype(qc, name))
    h, i = _config_dims(cfg)
    if h is not None:
        n = n_exp * 3 * i * h
    else:  # no dims in config.json: the per-expert Linears' own counts
        counts = [_weight_count(lay, entries, lin, None if fmt is None else _element_bits(fmt)) for lin in linears]
        n = None if None in counts else sum(counts)
    tensors = {f"{lin}.{s}": (entries[f"{lin}.{s}"].dtype, tuple(entries[f"{lin}.{s}"].shape))
               for lin in sorted(linears) for s in _WEIGHT_SUFFIXES if f"{lin}.{s}" in entries}
    stored = next(iter(linears)).rsplit(".", 2)[0]
    summary: dict[str, Counter] = {}
    for lin in sorted(linears):
        for s in _WEIGHT_SUFFIXES:
            if f"{lin}.{s}" in tensors:
                dt, sh = tensors[f"{lin}.{s}"]
                summary.setdefault(f"<e>.{linears[lin][1]}.{s}", Counter())[f"{dt} {list(sh)}"] += 1
    return {"layout": lay, "format": fmt, "weights": n, "experts": n_exp, "stored_as": stored,
            "bytes": sum(entries[k].end - entries[k].begin for k in tensors),
            "tensors": {k: ", ".join(f"{t} x{c}" for t, c in v.items()) for k, v in summary.items()},
            "bits_per_weight": None if n is None else round(stored_bits_per_weight(tensors, n), 4)}


def _quark_weight_dtype(qc: dict, name: str) -> Optional[str]:
    """The weight dtype of module ``name`` by a Quark config: its ``layer_quant_config`` pattern, else the global
    one (``layer_type_quant_config`` needs the module's type: None when it disagrees with the global)."""
    def wd(spec):
        w = (spec or {}).get("weight") if isinstance(spec, dict) else None
        w = w[0] if isinstance(w, list) and w else w
        return w.get("dtype") if isinstance(w, dict) else None

    for pat, spec in (qc.get("layer_quant_config") or {}).items():
        if _match(pat, name):
            return wd(spec)
    g = wd(qc.get("global_quant_config"))
    types = {wd(v) for v in (qc.get("layer_type_quant_config") or {}).values()}
    return g if not types or types == {g} else None


def _role(qc: dict, key: str):
    v = (qc.get("global_quant_config") or {}).get(key)
    v = v[0] if isinstance(v, list) and v else v
    if not isinstance(v, dict):
        return None
    return f"{v.get('dtype')} {v.get('qscheme')} {'dynamic' if v.get('is_dynamic') else 'static'}"


def _bits_by_group(per_layer: dict, key: str) -> dict:
    """Bits per weight of the layers grouped by ``key`` (their format or layout), summed over the group."""
    acc: dict = {}
    for v in per_layer.values():
        if v["weights"] is None:
            continue
        k = v[key] or "?"
        b, n = acc.get(k, (0, 0))
        acc[k] = (b + v["bytes"], n + v["weights"])
    return {k: round(8 * b / n, 3) for k, (b, n) in sorted(acc.items())}


def format_report(info: dict, *, layers: bool = False) -> str:
    """The text ``qcore inspect`` prints (``layers``: one row per quantized layer too)."""
    if info.get("kind") in ("gguf", "onnx"):
        return _format_other(info, layers=layers)
    per_layer = info.get("layers") or {}
    by_fmt = _bits_by_group(per_layer, "format")
    rows = [("checkpoint", info["directory"]), ("architecture", str(info["architecture"])),
            ("quant_method", f"{info['quant_method']} (written by {info['written_by']})"),
            ("weights", f"{info['weight_format']} {info['weight_qscheme']}"
                        + (f" g{info['group_size']}" if info["group_size"] else "") + " (the global config)"),
            ("activations", str(info["activations"] or "float")),
            ("kv cache", ", ".join(info["kv_cache"]) or "float"),
            ("excluded", ", ".join(info["exclude"] or []) or "-"),
            ("quantized layers", f"{info['quantized_layers']} " + (
                "(" + ", ".join(f"{k}: {v}" for k, v in info["layers_per_layout"].items()) + ")")),
            ("layer formats", ", ".join(f"{k}: {v} layers, {by_fmt.get(k, '?')} bits/weight"
                                        for k, v in (info.get("layers_per_format") or {}).items()) or "-"),
            ("bits per weight", f"{info['bits_per_weight']} (quantized layers, each in its own format; scales, "
                                f"zero points and shared exponents included)"),
            ("tensors", f"{info['tensors']} (" + ", ".join(f"{k} {v}" for k, v in info["tensor_dtypes"].items())
             + ")"),
            ("files", ", ".join(info["files"])),
            ("size on disk", f"{info['bytes_on_disk'] / 2**20:.2f} MiB")]
    if layers:
        rows += [(f"  {n}", f"{v['format'] or '?'} {v['layout']}: {v['bits_per_weight']} bits/weight "
                            f"({v['weights']} weights, {v['bytes']} bytes"
                            + (f"; {v['experts']} experts stored as {v['stored_as']}.<e>" if "experts" in v else "")
                            + ": " + ", ".join(
                                f"{k} {t}" for k, t in v["tensors"].items()) + ")") for n, v in per_layer.items()]
    return _rows(rows)


def _rows(rows) -> str:
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(w)}  {v}" for k, v in rows)


_CT_TENSORS = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx")


def _inspect_ct(d: pathlib.Path, cfg: dict, qc: dict) -> dict:
    """``inspect_checkpoint`` of a compressed-tensors checkpoint (``qcore.formats.compressed_tensors``)."""
    import re


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
    formats: Counter = Counter()
    per_layer: dict[str, dict] = {}
    for name in layers:
        g = group_of(name)
        fmt = ct.scheme_format(g)
        wa = ct.config_groups[g].weights
        bits = wa.num_bits if wa is not None else 8
        per_format[fmt.value] += 1
        w = entries.get(f"{name}.weight_packed") or entries.get(f"{name}.weight")
        if w is None:
            raise CorruptCheckpointError(f"layer {name!r}: no {name}.weight_packed or {name}.weight tensor")
        n = math.prod(w.shape)
        n = (n * 32 // bits if fmt is CTFormat.PACK_QUANTIZED else n * 2 if fmt is CTFormat.MXFP4_PACK_QUANTIZED
             else n)
        tensors = {s: (entries[f"{name}.{s}"].dtype, tuple(entries[f"{name}.{s}"].shape)) for s in _CT_TENSORS
                   if f"{name}.{s}" in entries}
        fname = None if wa is None else f"{wa.type.value}{wa.num_bits}"
        formats[fname or "?"] += 1
        per_layer[name] = {"layout": fmt.value, "format": fname, "weights": n,
                           "bytes": sum(entries[f"{name}.{s}"].end - entries[f"{name}.{s}"].begin for s in tensors),
                           "tensors": {s: f"{d} {list(sh)}" for s, (d, sh) in tensors.items()},
                           "bits_per_weight": round(stored_bits_per_weight(tensors, n), 4)}
    q_weights = sum(v["weights"] for v in per_layer.values())
    q_bytes = sum(v["bytes"] for v in per_layer.values())
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
        "layers_per_format": dict(sorted(formats.items())),
        "layers": per_layer,
        "tensors": len(entries),
        "tensor_dtypes": dict(sorted(Counter(e.dtype for e in entries.values()).items())),
        "files": sorted(f.name for f in d.iterdir() if f.is_file()),
        "safetensors_files": len(files),
        "bytes_on_disk": total,
    }


# ---------------------------------------------------------------------------------------------------------------
# GGUF files and ONNX exports (``qcore inspect FILE.gguf`` / ``qcore inspect DIR`` holding model.onnx)
# ---------------------------------------------------------------------------------------------------------------


def inspect_path(path: Union[str, pathlib.Path]) -> dict:
    """``qcore inspect PATH``: a ``.gguf`` file, an ONNX export (a ``.onnx`` file or a directory holding one and
    no safetensors) or an HF checkpoint directory (``inspect_checkpoint``)."""
    p = pathlib.Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return inspect_gguf(p)
    if p.is_file() and p.suffix == ".onnx":
        return inspect_onnx(p)
    if p.is_dir() and not any(p.glob("*.safetensors")) and any(p.glob("*.onnx")):
        return inspect_onnx(p)
    if p.is_file():
        raise ValueError(f"{str(p)!r}: not a .gguf or .onnx file, nor a checkpoint directory")
    try:
        return inspect_checkpoint(p)
    except (AttributeError, TypeError, KeyError, IndexError) as e:  # a config field of an unexpected type
        raise ValueError(f"{str(p / 'config.json')!r}: a quantization_config field is not what the format "
                         f"expects ({type(e).__name__}: {e})") from None


def _layer_of(tensor: str) -> str:
    return tensor[:-len(".weight")] if tensor.endswith(".weight") else tensor


def inspect_gguf(path: Union[str, pathlib.Path]) -> dict:
    """Tensor types and bits per weight of a GGUF file (the ``gguf`` package's reader; header and tensor infos
    only). A quantized tensor's bits per weight is its block type's: bytes per block x 8 / weights per block
    (Q4_0: 18 x 8 / 32 = 4.5), checked against the bytes the file gives the tensor."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{str(p)!r} is not a file")
    try:
        import gguf
    except ModuleNotFoundError:
        raise ModuleNotFoundError("qcore inspect of a GGUF file needs the gguf package (pip install gguf)") from None
    check_file(p)  # a truncated or corrupted file: the error names the file and the tensor
    try:
        r = gguf.GGUFReader(str(p))
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise ValueError(f"{str(p)!r}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    types: Counter = Counter()
    per_layer: dict[str, dict] = {}
    q_bits = q_n = 0
    for t in r.tensors:
        tname = gguf.GGMLQuantizationType(int(t.tensor_type)).name
        types[tname] += 1
        n = int(t.n_elements)
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t.tensor_type))]
        if n % block or n // block * size != int(t.n_bytes):
            raise ValueError(f"{str(p)!r}: tensor {t.name!r} ({tname}, {n} elements) holds {int(t.n_bytes)} bytes; "
                             f"its block type needs {-(-n // block) * size}")
        bpw = 8 * size / block
        per_layer[_layer_of(t.name)] = {"type": tname, "shape": [int(x) for x in t.shape[::-1]], "weights": n,
                                        "bytes": int(t.n_bytes), "bits_per_weight": round(bpw, 4)}
        if tname not in ("F32", "F16", "BF16", "F64"):
            q_bits += 8 * int(t.n_bytes)
            q_n += n
    arch = r.get_field("general.architecture")
    arch = bytes(arch.parts[arch.data[0]]).decode("utf-8", "replace") if arch is not None else None
    return {"kind": "gguf", "path": str(p), "architecture": arch, "tensors": len(r.tensors),
            "tensor_types": dict(sorted(types.items())),
            "quantized_tensors": sum(v for k, v in types.items() if k not in ("F32", "F16", "BF16", "F64")),
            "bits_per_weight": round(q_bits / q_n, 3) if q_n else None, "layers": per_layer,
            "bytes_on_disk": p.stat().st_size}


_ONNX_BITS = {"FLOAT": 32, "FLOAT16": 16, "BFLOAT16": 16, "DOUBLE": 64, "INT64": 64, "UINT64": 64, "INT32": 32,
              "UINT32": 32, "INT16": 16, "UINT16": 16, "INT8": 8, "UINT8": 8, "BOOL": 8, "FLOAT8E4M3FN": 8,
              "FLOAT8E4M3FNUZ": 8, "FLOAT8E5M2": 8, "FLOAT8E5M2FNUZ": 8, "FLOAT8E8M0": 8, "INT4": 4, "UINT4": 4,
              "FLOAT4E2M1": 4, "INT2": 2, "UINT2": 2}


def inspect_onnx(path: Union[str, pathlib.Path]) -> dict:
    """Initializers of an ONNX export (``model.onnx`` in a directory, or the file): per tensor its dtype, shape
    and quantized form; per quantized weight its bits per weight: codes + scales + zero points (packed as ONNX
    stores them: 4-bit types two per byte), over the weight's elements. Quantized forms: ``DequantizeLinear``
    (QDQ; per tensor, axis or block) and ``MatMulNBits`` (com.microsoft). Needs the onnx package."""
    p = pathlib.Path(path)
    f = p
    if p.is_dir():
        files = sorted(p.glob("*.onnx"))
        if len(files) != 1:
            raise ValueError(f"{str(p)!r}: expected one .onnx file, found {[x.name for x in files]}")
        f = files[0]
    try:
        import onnx
    except ModuleNotFoundError:
        raise ModuleNotFoundError("qcore inspect of an ONNX export needs the onnx package (pip install onnx)") from None
    try:
        model = onnx.load(str(f), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError and friends: one line naming the file
        raise ValueError(f"{str(f)!r}: not a readable ONNX model ({type(e).__name__}: {e})") from None
    inits = {}
    for t in model.graph.initializer:  # what sizes are computed from, checked first (one line naming the tensor)
        if t.name in inits:
            raise ValueError(f"{str(f)!r}: initializer {t.name!r} appears twice")
        if t.data_type not in onnx.TensorProto.DataType.values():
            raise ValueError(f"{str(f)!r}: initializer {t.name!r} has data_type {t.data_type}, not an ONNX type")
        if any(d < 0 for d in t.dims):
            raise ValueError(f"{str(f)!r}: initializer {t.name!r} has dims {list(t.dims)}; expected sizes >= 0")
        inits[t.name] = t

    def dtype(t) -> str:
        return onnx.TensorProto.DataType.Name(t.data_type)

    def nbytes(t) -> int:
        bits = _ONNX_BITS.get(dtype(t))
        if bits is None:
            raise ValueError(f"{str(f)!r}: initializer {t.name!r} has dtype {dtype(t)}, which qcore inspect does "
                             f"not size")
        return -(-math.prod(t.dims) * bits // 8)

    def attributes(node) -> dict:
        out = {}
        label = node.name or (node.output[0] if node.output else node.op_type)
        for a in node.attribute:
            if a.name in out:
                raise ValueError(f"{str(f)!r}: node {label!r} has attribute {a.name!r} twice")
            try:
                out[a.name] = onnx.helper.get_attribute_value(a)
            except Exception as e:  # an attribute of no known type
                raise ValueError(f"{str(f)!r}: node {label!r}: attribute {a.name!r} is unreadable ({e})") from None
        for k in ("K", "N", "bits", "block_size", "axis"):
            v = out.get(k)
            if v is not None and (not isinstance(v, int) or (k != "axis" and v < 1)):
                raise ValueError(f"{str(f)!r}: node {label!r}: attribute {k} is {v!r}; expected a "
                                 f"{'' if k == 'axis' else 'positive '}int")
        if node.op_type == "MatMulNBits" and ("K" not in out or "N" not in out):
            raise ValueError(f"{str(f)!r}: node {label!r}: MatMulNBits needs the attributes K and N")
        return out

    form: dict[str, str] = {}
    weights: dict[str, dict] = {}
    for node in model.graph.node:
        ins = list(node.input)
        if node.op_type == "DequantizeLinear" and ins and ins[0] in inits:
            attrs = attributes(node)
            x = inits[ins[0]]
            how = "qdq " + (f"block {attrs['block_size']}" if attrs.get("block_size") else
                            "per tensor" if len(ins) > 1 and ins[1] in inits and not inits[ins[1]].dims else
                            f"axis {attrs.get('axis', 1)}")
            parts = [n for n in ins[:3] if n in inits]
            weights[ins[0]] = {"form": how, "dtype": dtype(x), "weights": math.prod(x.dims), "parts": parts}
        elif node.op_type == "MatMulNBits" and len(ins) > 1 and ins[1] in inits:
            attrs = attributes(node)
            parts = [n for n in ins[1:4] if n in inits]
            weights[ins[1]] = {"form": f"MatMulNBits {attrs.get('bits', 4)}-bit block {attrs.get('block_size')}",
                               "dtype": dtype(inits[ins[1]]), "weights": int(attrs["K"]) * int(attrs["N"]),
                               "parts": parts}
        else:
            continue
    for w in weights.values():
        for n in w["parts"]:
            form[n] = w["form"]
    per_layer = {}
    for name, w in weights.items():
        if w["weights"] < 1:
            raise ValueError(f"{str(f)!r}: quantized weight {name!r} has {w['weights']} elements")
        b = sum(nbytes(inits[n]) for n in w["parts"])
        per_layer[name] = {"form": w["form"], "dtype": w["dtype"], "weights": w["weights"], "bytes": b,
                           "tensors": {n: f"{dtype(inits[n])} {list(inits[n].dims)}" for n in w["parts"]},
                           "bits_per_weight": round(8 * b / w["weights"], 4)}
    tensors = {n: {"dtype": dtype(t), "shape": list(t.dims), "form": form.get(n, "float" if dtype(t) in (
        "FLOAT", "FLOAT16", "BFLOAT16", "DOUBLE") else "plain")} for n, t in inits.items()}
    dtypes = Counter(dtype(t) for t in inits.values())
    q_b = sum(v["bytes"] for v in per_layer.values())
    q_n = sum(v["weights"] for v in per_layer.values())
    d = f.parent
    return {"kind": "onnx", "path": str(f), "opset": {o.domain or "ai.onnx": o.version for o in model.opset_import},
            "initializers": len(inits), "tensor_dtypes": dict(sorted(dtypes.items())),
            "quantized_weights": len(per_layer),
            "forms": dict(sorted(Counter(v["form"] for v in per_layer.values()).items())),
            "bits_per_weight": round(8 * q_b / q_n, 3) if q_n else None, "layers": per_layer, "tensors": tensors,
            "bytes_on_disk": sum(x.stat().st_size for x in d.iterdir() if x.is_file()) if p.is_dir()
            else f.stat().st_size}


def _format_other(info: dict, *, layers: bool) -> str:
    if info["kind"] == "gguf":
        rows = [("gguf file", info["path"]), ("architecture", str(info["architecture"])),
                ("tensors", f"{info['tensors']} (" + ", ".join(f"{k} {v}" for k, v in info["tensor_types"].items())
                 + ")"),
                ("bits per weight", f"{info['bits_per_weight']} (quantized tensors, by their block types)"),
                ("size on disk", f"{info['bytes_on_disk'] / 2**20:.2f} MiB")]
        if layers:
            rows += [(f"  {n}", f"{v['type']} {v['shape']}: {v['bits_per_weight']} bits/weight")
                     for n, v in info["layers"].items()]
        return _rows(rows)
    rows = [("onnx model", info["path"]), ("opset", ", ".join(f"{k} {v}" for k, v in info["opset"].items())),
            ("initializers", f"{info['initializers']} (" + ", ".join(f"{k} {v}" for k, v in
                                                                     info["tensor_dtypes"].items()) + ")"),
            ("quantized weights", f"{info['quantized_weights']} (" + ", ".join(
                f"{k}: {v}" for k, v in info["forms"].items()) + ")"),
            ("bits per weight", f"{info['bits_per_weight']} (quantized weights: codes, scales and zero points)"),
            ("size on disk", f"{info['bytes_on_disk'] / 2**20:.2f} MiB")]
    if layers:
        rows += [(f"  {n}", f"{v['form']} {v['dtype']}: {v['bits_per_weight']} bits/weight ("
                            + ", ".join(f"{k} {t}" for k, t in v["tensors"].items()) + ")")
                 for n, v in info["layers"].items()]
    return _rows(rows)
