"""Convert a quantized checkpoint between formats: ``convert(src, dst, to=...)`` and ``qcore convert``.

Formats (``FORMATS``):

- ``"hf"``: AMD Quark's HF layout (``export_hf`` / ``from_pretrained``; ``quant_method`` ``"quark"``, or
  ``"qcore"`` for grids Quark has no layout for);
- ``"gguf"``: one GGUF file for llama.cpp (``export_gguf`` / ``from_gguf``); ``dst`` is a ``.gguf`` file or a
  directory (then ``dst/model.gguf``);
- ``"compressed-tensors"``: the layout llm-compressor writes and vLLM reads (``export_compressed_tensors`` /
  ``load_compressed_tensors``);
- ``"onnx"`` (destination only): an ONNX model for onnxruntime (``export_onnx``).

The source format is detected: a ``.gguf`` file (or a directory holding exactly one) is GGUF; a directory with
``config.json`` is read by its ``quantization_config.quant_method`` (``quark`` / ``qcore`` -> hf,
``compressed-tensors``). The source is loaded into qcore's frozen quantized modules **without a float round
trip** (codes and scales as stored), then written by the destination's exporter from those codes.

**What changed is computed from the written file, not assumed.** The destination is written into a staging
place, loaded back there with qcore's own importer in its own dtype, and compared with the source as the source
format defines it (loaded in its own dtype, whatever ``dtype`` the conversion used):

- every tensor, bit for bit (in float32, which holds every float16 / bfloat16 / float32 value): a quantized
  weight by its dequantized values (its grid), every other parameter by its values and its dtype (a narrower
  dtype, e.g. float32 -> float16, is a change even where the values survive), each module's activation
  quantization by its spec and its static scales. ``TensorChange``: the max abs / rel difference and how many
  elements differ;
- every metadata entry: GGUF -> GGUF every key/value of the two files (gguf-py's reader); between checkpoint
  directories ``config.json`` (``quantization_config`` too when both are the same format), ``generation_config.json``
  and every tokenizer file, key by key; between a directory and a GGUF file the model config the two loaders
  build, the model class and the tokenizer (vocabulary, merges, special tokens, chat template, the encoding of
  probe texts). ``MetadataChange``: missing / changed / added. Source entries the destination format has no
  field for (a GGUF file's ``general.license`` in an HF directory, ``generation_config.json`` in a GGUF file)
  are listed as ``not_carried``.

``ConvertInfo.lossless`` is True only when all of that was compared and nothing differs, False when something
is known to differ, None when nothing was compared (``verify=False``; ONNX, which qcore cannot load back: the
exporter's own per-weight report is given). ``strict=True`` always verifies and refuses any difference before the
destination is published (the destination is left as it was).

Writes are atomic (staged beside ``dst``, renamed into place after the verification) and deterministic; nothing
is unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import nn

from qcore import PerChannel, PerGroup, PerTensor
from qcore._fsutil import staged_path
from qcore.formats import gguf as G
from qcore.formats.gguf import check_file
from qcore.formats.safetensors_io import read_json

from ..batches import set_module
from ..io.formats import ExportRequest, Format, FORMATS, detect_format, format_named, gguf_in_dir, option_owner
from ..io.gguf import model_config_of_specs
from ..io.onnx import UnsupportedWeightError
from ..modules import EXPERT_PROJS, QuantExperts, QuantModule
from .common import PYTHON, Names
from .files import JobFiles

__all__ = ["convert", "check_options", "ConvertInfo", "TensorChange", "MetadataChange", "load_quantized",
           "compare_models", "summary_rows", "job_files"]


@dataclass(frozen=True)
class TensorChange:
    """One tensor (HF name) that differs between the source and the destination."""

    name: str
    what: str  # "weight" (quantized weight, dequantized values), "tensor" (float parameter), "activation",
    #            "dequantized" (a quantized source weight the destination holds as float values)
    source: str  # how the source holds it (qcore spec / dtype)
    destination: str  # how the destination holds it
    max_abs_diff: float  # nan: not measured (a dropped activation quantization, an unverified conversion)
    max_rel_diff: float = float("nan")  # max |dst - src| / |src| over the elements that differ (inf where src is 0)
    changed: int = -1  # elements that differ (-1: not measured); 0 with a narrower dtype
    size: int = -1  # elements of the source tensor (-1: not measured)


@dataclass(frozen=True)
class MetadataChange:
    """One metadata entry that differs: ``where`` it lives (``gguf``, ``config.json``, ``tokenizer``, ...), its
    ``key``, ``change`` (``"missing"`` in the destination, ``"changed"``, ``"added"``) and both values as text."""

    where: str
    key: str
    change: str
    source: Optional[str]
    destination: Optional[str]


@dataclass(frozen=True)
class ConvertInfo:
    """What ``convert`` did: formats, paths, size, what was compared and what differs (see the module docstring).

    compared: ``{"tensors": {kind: count}, "metadata": {where: entries}}`` of what was compared (empty when nothing
        was).
    tensors / metadata: the ``TensorChange`` / ``MetadataChange`` of each difference.
    not_carried: source metadata the destination format has no field for (listed, not compared).
    """

    source: str
    source_format: str
    destination: str
    to: str
    bytes_on_disk: int
    quantized: int  # quantized weights in the source
    tensors: tuple = ()  # TensorChange per changed tensor
    verified_by: str = "reload"  # "reload" (dst loaded back and compared), "exporter" (ONNX), "none" (verify=False)
    notes: tuple = ()
    metadata: tuple = ()  # MetadataChange per changed metadata entry
    compared: dict = dataclasses.field(default_factory=dict)
    not_carried: tuple = ()

    @property
    def lossless(self) -> Optional[bool]:
        """True: every tensor and metadata entry compared with dst loaded back, none differs; False: something
        differs; None: not compared (``verify=False``, ONNX) and nothing known to differ."""
        if self.tensors or self.metadata:
            return False
        return True if self.verified_by == "reload" else None

    def to_dict(self) -> dict:
        def num(x: float) -> Optional[float]:
            return None if math.isnan(x) else x
        return {"source": self.source, "source_format": self.source_format, "destination": self.destination,
                "to": self.to, "bytes_on_disk": self.bytes_on_disk, "quantized_weights": self.quantized,
                "lossless": self.lossless, "verified_by": self.verified_by, "compared": self.compared,
                "tensors_changed": len(self.tensors), "metadata_changed": len(self.metadata),
                "notes": list(self.notes),
                "changed": [{"name": t.name, "what": t.what, "source": t.source, "destination": t.destination,
                             "max_abs_diff": num(t.max_abs_diff), "max_rel_diff": num(t.max_rel_diff),
                             "elements_changed": None if t.changed < 0 else t.changed,
                             "elements": None if t.size < 0 else t.size} for t in self.tensors],
                "metadata": [{"where": m.where, "key": m.key, "change": m.change, "source": m.source,
                              "destination": m.destination} for m in self.metadata],
                "not_carried": list(self.not_carried)}


_LOADING_KWARGS = ("is_local", "local_files_only", "gguf_file", "_commit_hash", "cache_dir", "revision")


def _tokenizer(p: pathlib.Path, fmt: Format) -> tuple:
    """``(tokenizer or None, why the source's tokenizer could not be loaded or None)``: a source without a
    tokenizer gives ``(None, None)`` (transformers would make up a one-token one for a directory without tokenizer
    files); one transformers cannot load is never dropped silently."""
    held = fmt.held_tokenizer(p)
    if held is None:
        return None, None
    try:
        tok = fmt.read_tokenizer(p)
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if ", 0 merges" in held and isinstance(e, KeyError):  # a GGUF BPE vocabulary without merges
            why = f"its GGUF reader needs merges (or scores) to build a BPE tokenizer ({why})"
        return None, f"tokenizer dropped: transformers cannot load the source's tokenizer ({held}): {why}"
    for k in _LOADING_KWARGS:  # how it was loaded here, not what it is: not written with it
        tok.init_kwargs.pop(k, None)
    return tok, None


def _source_file(p: pathlib.Path, fmt: Format) -> pathlib.Path:
    """The checkpoint itself: a directory holding one GGUF file stands for that file."""
    return gguf_in_dir(p) if fmt.suffix == ".gguf" and p.is_dir() else p


def _load_quantized(p: pathlib.Path, *, dtype: Optional[torch.dtype]) -> tuple:
    """``(model, tokenizer, format, why the source's tokenizer was dropped or None)``."""
    fmt = detect_format(p)
    p = _source_file(p, fmt)
    model = fmt.load(p, dtype)
    tok, dropped = _tokenizer(p, fmt)
    return model, tok, fmt, dropped


def load_quantized(src: Union[str, pathlib.Path], *, dtype: Optional[torch.dtype] = None) -> tuple:
    """``(model, tokenizer, format)``: a quantized checkpoint of any source format loaded into qcore's frozen
    modules (the tokenizer is None when the checkpoint has none; a UserWarning says why when the checkpoint
    holds one transformers cannot load)."""
    model, tok, fmt, dropped = _load_quantized(pathlib.Path(src), dtype=dtype)
    if dropped:
        warnings.warn(f"load_quantized: {dropped}", UserWarning, stacklevel=2)
    return model, tok, fmt.name


def _size(p: pathlib.Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _gguf_name(path: pathlib.Path) -> Optional[str]:
    """The ``general.name`` of a GGUF file (kept by a GGUF -> GGUF conversion), or None."""
    import gguf
    check_file(path)
    f = gguf.GGUFReader(str(path)).fields.get("general.name")
    if f is None or not f.data:
        return None
    return bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")


def _import_changes(model: nn.Module) -> list:
    """Block-quantized source tensors the importer could not hold as codes (GGUF Q4_1 with float offsets, other
    block types with ``dequantize_other``): their values are kept, their grid is not."""
    rep = getattr(model, "qcore_gguf_report", None)
    if rep is None:
        return []
    return [TensorChange(r.name, "dequantized", r.gguf_type, "float (no qcore grid: " + (r.reason or "?") + ")",
                         float(r.max_abs_diff)) for r in rep.dequantized]


def _gguf_specs_to_float(model: nn.Module, to: str) -> list:
    """A destination other than GGUF has no float block offsets or super-block scales: every module with a GGUF
    weight spec (k-quants, llama.cpp's Q4_1, ... imported as codes) becomes its float module holding the exact
    dequantized weight (in the model's dtype), each one a ``TensorChange`` (``what="dequantized"``; measured by
    the comparison with the source when the conversion is verified), and
    ``model.qcore_config`` describes the modules left quantized."""
    changes, left = [], {}
    for name, m in list(model.named_modules()):
        if not isinstance(m, QuantModule) or "weight" not in m.specs:
            continue
        spec = m.specs["weight"]
        if not spec.gguf:
            left[name] = spec
            continue
        if isinstance(m, QuantExperts):  # fused MoE experts: float experts of the same class
            set_module(model, name, m.to_float().eval())
            changes += [TensorChange(f"{name}.{p}", "dequantized", f"GGUF {m.weight_spec(p).gguf} (float block "
                                     f"offsets)", f"float ({to} has no float offsets or super-block scales)", float("nan"))
                        for p in EXPERT_PROJS]
            continue
        w = m.effective("weight").detach()
        if isinstance(m, nn.Embedding):
            f = nn.Embedding(m.num_embeddings, m.embedding_dim, padding_idx=m.padding_idx, device="meta")
        elif isinstance(m, nn.Linear):
            f = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
            if m.bias is not None:
                f.bias = nn.Parameter(m.bias.detach().clone(), requires_grad=False)
        else:
            raise ValueError(f"convert to {to}: {name!r} ({type(m).__name__}) has a GGUF weight spec "
                             f"({spec.gguf}) that {to} cannot hold")
        f.weight = nn.Parameter(w.clone(), requires_grad=False)
        set_module(model, name, f.eval())
        changes.append(TensorChange(f"{name}.weight", "dequantized", f"GGUF {spec.gguf} (float block offsets)",
                                    f"float ({to} has no float offsets or super-block scales)", float("nan")))
    if changes:
        cfg = model_config_of_specs(model, left)
        # exclude=None (the output head, float here anyway): the spelling that survives the checkpoint's
        # to_dict/from_dict round trip with float Linears listed by name (exclude=() reads back as None, and
        # Quark's exclude list would then come in another order)
        model.qcore_config = None if cfg is None else dataclasses.replace(cfg, exclude=None)
    return changes


def _export(model: nn.Module, tok: Any, src_path: pathlib.Path, src: Format, dst: pathlib.Path, to: Format, *,
            overwrite: bool, tokenizer_pre: Optional[str], progress: bool = False,
            onnx_unsupported: str = "error") -> tuple:
    """Write ``model`` in format ``to`` at ``dst``; ``(path written, notes, exporter report)``."""
    same = to.copies_own_source and src is to  # GGUF -> GGUF: the tokenizer.* fields and the name copied verbatim
    request = ExportRequest(tokenizer=str(src_path) if same else tok, overwrite=overwrite, progress=progress,
                            drop_activations=True, tokenizer_pre=tokenizer_pre, onnx_unsupported=onnx_unsupported,
                            name=_gguf_name(src_path) if same else None, file_ok=True,
                            metadata=str(src_path) if same else None)
    try:
        written = to.write(model, dst, request)
    except UnsupportedWeightError as e:  # name convert's own argument (the command line names its flag)
        raise e.with_option("onnx_unsupported='dequantize'") from None
    notes = list(written.notes)
    if to.copies_own_source and request.tokenizer is None:
        notes.append("no tokenizer in the source: the GGUF file has none (llama.cpp needs one)")
    return written.path, notes, written.info


class _Stages:
    """A tqdm bar over the stages of ``convert`` (nothing when disabled)."""

    def __init__(self, total: int, *, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, desc="convert", leave=False)
        self.started = False

    def next(self, desc: str) -> None:
        if self.bar is None:
            return
        if self.started:
            self.bar.update(1)
        self.started = True
        self.bar.set_description(desc)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _reload(path: pathlib.Path, to: Format) -> nn.Module:
    """The written destination loaded back in its own dtype."""
    with warnings.catch_warnings():  # the tensors a loader warns about are compared and reported here
        warnings.simplefilter("ignore", UserWarning)
        return to.load(path, None)


def _describe_changes(changes: list, info: Any) -> list:
    """Destination descriptions from the exporter's per-tensor report where it has one (GGUF: the block type and
    whether it was written code for code or re-quantized)."""
    reports = {r.name: r for r in getattr(info, "quantized", ()) if hasattr(r, "gguf_type")}
    return [c if c.name not in reports or c.what != "weight" else dataclasses.replace(
        c, destination=f"{reports[c.name].gguf_type} ({reports[c.name].how})") for c in changes]


def _onnx_changes(info: Any, model: nn.Module) -> list:
    """The ONNX exporter's report: weights written dequantized (formats onnxruntime cannot run) or not exactly."""
    mods = dict(model.named_modules())

    def desc(name: str) -> str:
        m = mods.get(name[:-len(".weight")] if name.endswith(".weight") else name)
        return _spec_desc(m.specs["weight"]) if isinstance(m, QuantModule) and "weight" in m.specs else "?"
    return [TensorChange(r.name, "weight", desc(r.name), f"{r.onnx_type} ({r.how})", float(r.max_abs_diff))
            for r in info.quantized if not r.exact or r.how == "dequantized"]


def _a(name: str) -> str:
    """``a`` or ``an`` before a format's name in capitals (an ONNX file, a GGUF file)."""
    return "an" if name[0] in "aeio" else "a"


def _check_dst(dst: pathlib.Path, overwrite: bool, names: Names = PYTHON) -> None:
    """An existing file or non-empty directory at ``dst`` needs ``overwrite`` (an empty directory does not)."""
    if dst.exists() and not overwrite and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"dst {str(dst)!r} exists; pass {names('overwrite')}{'' if names.cli else '=True'} to "
                              f"replace it")


# ---------------------------------------------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------------------------------------------


def _spec_desc(spec) -> str:
    """``uint4 asym group 64 (float32 scales)``-style description of a weight spec."""
    g = spec.granularity
    gran = (f"group {g.size}" if isinstance(g, PerGroup) else "per-channel" if isinstance(g, PerChannel)
            else "per-tensor" if isinstance(g, PerTensor) else type(g).__name__)
    el = spec.name or spec.dtype.name
    asym = "" if spec.symmetric else " asym"
    return f"{el}{asym} {gran} ({spec.scale_dtype.name} scales)"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _effective(model: nn.Module, *, values: bool = True) -> dict:
    """name -> (kind, tensor, description, dtype) for every parameter of the model as it computes: a quantized
    weight dequantized (``dtype``: the dtype it is dequantized to), static activation scales, every float
    parameter. ``values=False``: the same entries with None for every tensor (nothing is dequantized)."""
    out: dict[str, tuple] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        pre = f"{mname}." if mname else ""
        experts = isinstance(m, QuantExperts)
        if isinstance(m, QuantModule):
            spec = m.specs.get("weight")
            dt = _dtype_name(m.weight_dtype) if spec is not None else ""
            if spec is not None and experts:  # fused MoE experts: one weight per projection
                for p in EXPERT_PROJS:
                    out[pre + p] = ("weight", m.effective_proj(p) if values else None, _spec_desc(m.weight_spec(p)),
                                    dt)
            elif spec is not None:
                with torch.no_grad():
                    w = m.effective("weight").detach() if values else None
                out[pre + "weight"] = ("weight", w, _spec_desc(spec), dt)
            for role in ("input", "output"):
                rs = m.specs.get(role)
                tc = getattr(m.qconfig, role, None)
                if rs is None or tc is None:
                    continue
                desc = f"{_spec_desc(rs)} {'dynamic' if tc.dynamic else 'static'}"
                sc = m.scales(role)  # static: the scale, the zero point and a two-level format's tensor scale
                parts = [x for x in (sc.scale, sc.zero_point, sc.tensor_scale) if x is not None]
                t = None if tc.dynamic or sc.scale is None or not values else torch.cat(
                    [x.detach().float().flatten() for x in parts])
                # the 4th entry: the whole spec (rounding, range, ... too), compared as text
                out[f"{pre}{role}_quant"] = ("activation", t, desc, f"{rs!r} dynamic={tc.dynamic}")
        for n, t in m._parameters.items():
            if t is None or (isinstance(m, QuantModule) and n == "weight") or (
                    experts and n in EXPERT_PROJS and "weight" in m.specs):
                continue
            out[pre + n] = ("tensor", t.detach() if values else None, _dtype_name(t.dtype), _dtype_name(t.dtype))
    return out


def _as_float32(model: nn.Module) -> dict:
    """``_effective`` of ``model`` with every value in float32 and each entry's own dtype kept: the model is cast to
    float32 in place (exact for float16 / bfloat16 / float32; a frozen weight then dequantizes in float32, its
    grid's values), so only a model loaded for the comparison goes through here."""
    dtypes = {k: (v[2], v[3]) for k, v in _effective(model, values=False).items()}
    nn.Module.float(model)  # transformers refuses .float() on a quantized model; torch's own cast is what is meant
    return {k: (kind, t, *dtypes[k]) for k, (kind, t, _, _) in _effective(model).items()}


_GGUF_FLOATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _stored_as(entries: dict, model: nn.Module) -> dict:
    """``entries`` (``_effective``-style) with each float tensor of a model imported from GGUF described by the
    type its file stores it in (an F16 tensor is float16 there, whatever dtype it was loaded in)."""
    rep = getattr(model, "qcore_gguf_report", None)
    if rep is None:
        return entries
    stored = {t.name: _GGUF_FLOATS[t.gguf_type] for t in rep.tensors if t.how == "float" and t.gguf_type in
              _GGUF_FLOATS}
    return {k: (v if v[0] != "tensor" or k not in stored else (v[0], v[1], f"{stored[k]} (GGUF)", stored[k]))
            for k, v in entries.items()}


_WIDER = {"float16": ("float32", "float64"), "bfloat16": ("float32", "float64"), "float32": ("float64",)}


def _holds(src: str, dst: str) -> bool:
    """Whether dtype ``dst`` holds every value of dtype ``src`` (the same, or wider)."""
    return src == dst or not src or not dst or dst in _WIDER.get(src, ())


def _diff(a: torch.Tensor, b: torch.Tensor) -> Optional[tuple]:
    """None when ``a`` and ``b`` hold the same values bit for bit (both widened to float32, or float64, which is
    exact), else ``(max abs difference, max rel difference, elements that differ, elements)`` (inf for a shape
    change or a NaN against a number; the relative difference is inf where ``a`` is 0)."""
    if tuple(a.shape) != tuple(b.shape):
        return float("inf"), float("inf"), max(a.numel(), b.numel()), a.numel()
    wide = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    a, b = a.detach().to("cpu", wide), b.detach().to("cpu", wide)
    bits = torch.int64 if wide == torch.float64 else torch.int32
    ne = a.view(bits) != b.view(bits)
    n = int(ne.sum())
    if n == 0:
        return None
    x, y = a[ne].double(), b[ne].double()
    d = torch.nan_to_num((x - y).abs(), nan=float("inf"))
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = torch.where(x == 0, torch.where(d == 0, torch.zeros_like(d), torch.full_like(d, float("inf"))),
                          d / x.abs())
    rel = torch.nan_to_num(rel, nan=float("inf"))
    return float(d.max()), float(rel.max()), n, a.numel()


def _compare(a: dict, b: dict) -> list:
    """``TensorChange`` for each entry of ``_effective``-style dicts ``a`` (source) and ``b`` (destination) that
    differs: present in one only, another kind (a quantized weight held as float: ``"dequantized"``), other
    values, a narrower dtype, another activation spec."""
    changes = []
    for name in sorted(set(a) | set(b)):
        if name not in b or name not in a:
            kind, _, desc, _ = a[name] if name in a else b[name]
            na = float("nan") if kind == "activation" else float("inf")
            changes.append(TensorChange(name, kind, desc if name in a else "absent", "absent" if name in a else desc,
                                        na, na))
            continue
        (ka, ta, da, dta), (kb, tb, db, dtb) = a[name], b[name]
        if ka == "activation" or kb == "activation":
            if ka != kb or da != db or dta != dtb or (ta is None) != (tb is None):
                changes.append(TensorChange(name, ka, da, db, float("nan")))
            elif ta is not None and (d := _diff(ta, tb)) is not None:
                changes.append(TensorChange(name, ka, da, db, *d))
            continue
        d = _diff(ta, tb)
        narrower = not _holds(dta, dtb)
        if d is None and not narrower and ka == kb:
            continue
        what = "dequantized" if (ka, kb) == ("weight", "tensor") else ka
        src = da if ka == "tensor" else f"{da}, {dta}" if narrower else da
        dst = db if kb == "tensor" else f"{db}, {dtb}" if narrower else db
        if d is None:
            d = (0.0, 0.0, 0, ta.numel())
        changes.append(TensorChange(name, what, src, dst, *d))
    return changes


def compare_models(source: nn.Module, destination: nn.Module) -> list:
    """``TensorChange`` for each tensor of ``source`` that differs in ``destination``, as the two models compute
    (see the module docstring: values bit for bit, a narrower dtype, another activation spec or scale; a
    quantized weight held as float values is ``"dequantized"``); tensors only in one of them are reported too
    (``max_abs_diff`` inf). Neither model is changed."""
    return _compare(_effective(source), _effective(destination))


# ---------------------------------------------------------------------------------------------------------------
# metadata
# ---------------------------------------------------------------------------------------------------------------


def _show(v: Any, limit: int = 72) -> Optional[str]:
    """A metadata value as short text (None stays None: absent)."""
    if v is None:
        return None
    if isinstance(v, (list, tuple)) and len(v) > 8:
        return f"[{len(v)} items]"
    if isinstance(v, dict) and len(json.dumps(v, default=str)) > limit:
        return f"{{{len(v)} keys}}"
    t = v if isinstance(v, str) else json.dumps(v, default=str) if isinstance(v, (dict, list)) else repr(v)
    return t if len(t) <= limit else t[:limit - 3] + "..."


def _diff_entries(where: str, a: dict, b: dict, *, equal=None, show=_show) -> list:
    """``MetadataChange`` for each key of ``a`` (source) missing from, changed in or added to ``b``."""
    same = equal or (lambda x, y: x == y)
    out = []
    for k in list(a) + [k for k in b if k not in a]:
        if k not in b:
            out.append(MetadataChange(where, k, "missing", show(a[k]), None))
        elif k not in a:
            out.append(MetadataChange(where, k, "added", None, show(b[k])))
        elif not same(a[k], b[k]):
            out.append(MetadataChange(where, k, "changed", show(a[k]), show(b[k])))
    return out


def _gguf_fields(path: pathlib.Path) -> dict:
    """key -> (value types and bytes as stored, value) of every metadata entry of a GGUF file (gguf-py's reader,
    after ``check_file``; the reader's own ``GGUF.*`` header counts are not entries)."""
    import gguf
    check_file(path)
    out = {}
    for k, f in gguf.GGUFReader(str(path)).fields.items():
        if k.startswith("GGUF."):
            continue
        raw = (tuple(int(t) for t in f.types), b"".join(bytes(np.asarray(p)) for p in f.parts[2:]))
        try:
            v = f.contents()
        except (ValueError, TypeError, IndexError):
            v = "?"
        out[k] = (raw, v)
    return out


_CONFIG_SKIP = ("transformers_version", "dtype", "torch_dtype", "_name_or_path", "_commit_hash")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "merges.txt", "spiece.model")
_GGUF_STRUCTURE = ("general.architecture", "general.quantization_version", "general.file_type",
                   "general.alignment")  # what the model class and the tensors themselves carry


def _dir_entries(d: pathlib.Path, name: str, *, skip: tuple = ()) -> Optional[dict]:
    """The entries of checkpoint file ``d/name``: a JSON object's top-level keys, another file's bytes as one
    entry; None when there is no such file."""
    p = d / name
    if not p.is_file():
        return None
    if name.endswith(".json"):
        v = read_json(p, what=name)
        if isinstance(v, dict):
            return {k: x for k, x in v.items() if k not in skip}
        return {"(the file)": v}
    return {"(the file)": p.read_bytes()}


_CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def _with_chat_template(d: pathlib.Path, entries: Optional[dict]) -> Optional[dict]:
    """``tokenizer_config.json``'s entries with the chat template of ``chat_template.jinja`` / ``.json`` as its
    ``chat_template`` key (transformers saves it in either place: one entry, wherever it is)."""
    jinja, js = d / "chat_template.jinja", d / "chat_template.json"
    if not jinja.is_file() and not js.is_file():
        return entries
    out = dict(entries or {})
    if jinja.is_file():
        out["chat_template"] = jinja.read_text(encoding="utf-8")
    else:
        v = read_json(js, what="chat_template.json")
        out["chat_template"] = v.get("chat_template") if isinstance(v, dict) else v
    return out


def _compare_dirs(src: pathlib.Path, dst: pathlib.Path, same_format: bool) -> tuple:
    """Two checkpoint directories: config.json (its quantization_config when both are one format: another format's
    is another schema, compared through the tensors), generation_config.json, the tokenizer files."""
    changes, compared = [], {}
    files = [("config.json", _CONFIG_SKIP + (() if same_format else ("quantization_config",))),
             ("generation_config.json", ("transformers_version",))] + [(f, ()) for f in _TOKENIZER_FILES
                                                                        if f not in _CHAT_TEMPLATE_FILES]
    for name, skip in files:
        a, b = _dir_entries(src, name, skip=skip), _dir_entries(dst, name, skip=skip)
        if name == "tokenizer_config.json":  # the chat template, wherever transformers saved it
            a, b = _with_chat_template(src, a), _with_chat_template(dst, b)
        if a is None and b is None:
            continue
        compared[name] = len(set(a or {}) | set(b or {}))
        if a is None or b is None:
            changes.append(MetadataChange(name, "(the file)", "added" if a is None else "missing",
                                          None if a is None else f"{len(a)} entries",
                                          None if b is None else f"{len(b)} entries"))
            continue
        changes += _diff_entries(name, a, b)
    return changes, compared, []


def _float32_equal(x: Any, y: Any) -> bool:
    """Equal, or floats equal once rounded to float32: GGUF's metadata floats are float32, and the model computes
    with them in float32 (``rms_norm_eps`` 1e-06 is stored as 9.99999997e-07, the same float32)."""
    if x == y:
        return True
    if isinstance(x, float) and isinstance(y, float):
        return bool(np.float32(x) == np.float32(y))
    if isinstance(x, dict) and isinstance(y, dict) and set(x) == set(y):
        return all(_float32_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y):
        return all(_float32_equal(u, v) for u, v in zip(x, y))
    return False


def _hf_tokenizer_view(tok: Any) -> dict:
    """What a transformers tokenizer tokenizes with, as a GGUF file spells it: the tokens by id, the BPE merges,
    the special token ids, whether a BOS token is added, the chat template."""
    vocab = tok.get_vocab()
    by_id = {i: t for t, i in vocab.items()}
    out: dict = {"tokens": [by_id.get(i) for i in range(max(vocab.values()) + 1)] if vocab else [], "merges": []}
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        out["merges"] = [m if isinstance(m, str) else " ".join(m)
                         for m in json.loads(backend.to_str()).get("model", {}).get("merges", [])]
    for key, attr in _SPECIAL_IDS:
        out[f"{key} id"] = getattr(tok, attr, None)
    out["add_bos_token"] = bool(getattr(tok, "add_bos_token", False))
    tmpl = getattr(tok, "chat_template", None)
    out["chat_template"] = tmpl if isinstance(tmpl, str) else None
    return out


_SPECIAL_IDS = (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unknown", "unk_token_id"),
                ("padding", "pad_token_id"))


def _gguf_tokenizer_view(fields: dict) -> Optional[dict]:
    """``_hf_tokenizer_view`` of a GGUF file's ``tokenizer.*`` entries (None without tokens)."""
    def get(k: str, default: Any = None) -> Any:
        return fields[k][1] if k in fields else default
    if "tokenizer.ggml.tokens" not in fields:
        return None
    out = {"tokens": list(get("tokenizer.ggml.tokens")), "merges": list(get("tokenizer.ggml.merges", []))}
    for key, _ in _SPECIAL_IDS:
        v = get(f"tokenizer.ggml.{key}_token_id")
        out[f"{key} id"] = None if v is None else int(v)
    out["add_bos_token"] = bool(get("tokenizer.ggml.add_bos_token", False))
    out["chat_template"] = get("tokenizer.chat_template")
    return out


def _show_list(a: list, b: list, what: str) -> tuple:
    differ = sum(1 for x, y in zip(a, b) if x != y)
    return f"{len(a)} {what}", f"{len(b)} {what} ({differ} of the first {min(len(a), len(b))} differ)"


def _compare_tokenizer_views(a: Optional[dict], b: Optional[dict], where: str) -> tuple:
    """The tokenizer of a GGUF file against a transformers tokenizer (one side each), entry by entry."""
    if a is None and b is None:
        return [], {}
    if a is None or b is None:
        return [MetadataChange(where, "(the tokenizer)", "added" if a is None else "missing",
                               None if a is None else f"{len(a['tokens'])} tokens",
                               None if b is None else f"{len(b['tokens'])} tokens")], {where: 1}
    out = []
    for k in a:
        if a[k] == b[k]:
            continue
        if k in ("tokens", "merges"):
            out.append(MetadataChange(where, k, "changed", *_show_list(a[k], b[k], k)))
        else:
            out.append(MetadataChange(where, k, "changed", _show(a[k]), _show(b[k])))
    return out, {where: len(a)}


_GGUF_CONFIG = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "(model class)")


def _gguf_config_keys(fields: dict) -> set:
    """The model config keys a GGUF file holds (``fields``: ``_gguf_fields``): what ``from_gguf`` reads from its
    ``{arch}.*`` entries, the special token ids, whether the head is tied, the model class (the architecture)."""
    arch = fields.get("general.architecture", (None, ""))[1]
    try:
        held = set(G.config_from_metadata(arch, {k: v for k, (_, v) in fields.items()}))
    except ValueError:  # a file from_gguf refuses never got this far
        held = set()
    return held | set(_GGUF_CONFIG)


def _default_spelled_out(arch: str, fields: dict, src: dict, key: str, value: Any) -> bool:
    """Whether config ``src``'s None for ``key`` (the config class's default, e.g. GPT-2's ``n_inner``: 4 *
    ``n_embd``) is ``value``: GGUF's metadata of the two spellings is the same."""
    if src.get(key) is not None:
        return False
    experts = f"{arch}.expert_count" in fields
    try:
        return G.metadata(arch, src, experts=experts) == G.metadata(arch, {**src, key: value}, experts=experts)
    except ValueError:
        return False


def _compare_configs(src_model: nn.Module, dst_model: nn.Module, held: set, fields: dict) -> tuple:
    """The model configs the two loaders build, key by key for the ``held`` keys (the ones the GGUF side has a
    field for; ``quantization_config`` is compared through the tensors; a default spelled None on one side and
    as its value on the other is the same entry) and the model class: ``(changes, {"model config": keys
    compared}, source keys not carried: absent from or other in dst, with no GGUF field)``."""
    skip = _CONFIG_SKIP + ("quantization_config", "architectures")
    src_cfg = src_model.config.to_dict()
    a = {k: v for k, v in src_cfg.items() if k not in skip}
    b = {k: v for k, v in dst_model.config.to_dict().items() if k not in skip}
    a["(model class)"], b["(model class)"] = type(src_model).__name__, type(dst_model).__name__
    not_carried = [f"model config {k}" for k in a if k not in held and (k not in b or not _float32_equal(a[k], b[k]))]
    a = {k: v for k, v in a.items() if k in held}
    b = {k: v for k, v in b.items() if k in held}
    arch = fields.get("general.architecture", (None, ""))[1]
    changes = [c for c in _diff_entries("model config", a, b, equal=_float32_equal)
               if not (c.change == "changed" and _default_spelled_out(arch, fields, src_cfg, c.key, b[c.key]))]
    return changes, {"model config": len(set(a) | set(b))}, not_carried


def _compare_metadata(src_fmt: Format, src_file: pathlib.Path, to: Format, written: pathlib.Path,
                      src_model: nn.Module, dst_model: nn.Module, src_tok: Any) -> tuple:
    """``(MetadataChange list, {where: entries compared}, source entries the destination has no field for)``."""
    src_gguf, dst_gguf = src_fmt.suffix == ".gguf", to.suffix == ".gguf"
    if src_gguf and dst_gguf:  # every key/value, by its stored type and bytes
        a, b = _gguf_fields(src_file), _gguf_fields(written)
        return (_diff_entries("gguf", a, b, equal=lambda x, y: x[0] == y[0], show=lambda v: _show(v[1])),
                {"gguf": len(set(a) | set(b))}, [])
    if not src_gguf and not dst_gguf:
        return _compare_dirs(src_file, written, src_fmt is to)
    fields = _gguf_fields(src_file if src_gguf else written)
    changes, compared, config_not_carried = _compare_configs(src_model, dst_model, _gguf_config_keys(fields), fields)
    if src_gguf:  # the GGUF file's tokenizer fields against the tokenizer transformers reads from dst
        src_view = _gguf_tokenizer_view(fields)
        try:
            dst_view = None if to.held_tokenizer(written) is None else _hf_tokenizer_view(to.read_tokenizer(written))
        except (OSError, ValueError, KeyError, TypeError) as e:
            changes.append(MetadataChange("tokenizer", "(the tokenizer)", "changed", "held",
                                          f"unreadable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
            dst_view = src_view
    else:  # the source's tokenizer against the GGUF file's tokenizer fields
        src_view = None if src_tok is None else _hf_tokenizer_view(src_tok)
        dst_view = _gguf_tokenizer_view(fields)
    tch, tcount = _compare_tokenizer_views(src_view, dst_view, "tokenizer")
    changes += tch
    compared.update(tcount)
    if src_gguf:  # GGUF -> directory: descriptive general.* entries have no field in a checkpoint directory
        arch = fields.get("general.architecture", (None, ""))[1]
        return changes, compared, [k for k in fields if k not in _GGUF_STRUCTURE
                                   and not k.startswith(("tokenizer.", f"{arch}."))] + config_not_carried
    return changes, compared, config_not_carried + [f for f in ("generation_config.json",)
                                                    if (src_file / f).is_file()]


# ---------------------------------------------------------------------------------------------------------------
# the options
# ---------------------------------------------------------------------------------------------------------------


def check_options(to: Format, src_format: Format, src_file: pathlib.Path, *, strict: bool, verify: bool,
                  dtype: Optional[torch.dtype], tokenizer_pre: Optional[str], onnx_unsupported: Optional[str],
                  names: Names = PYTHON) -> None:
    """Refuse (ValueError naming the option, before any work) an option that contradicts another or changes nothing
    for this source and destination format: ``strict`` without verification (``strict`` always loads dst back,
    so ``verify=False`` contradicts it, and ONNX cannot be loaded back), ``verify=False`` for ONNX (never loaded
    back), ``dtype`` for ONNX (always float32) or float32 for a GGUF source (loaded in float32 already),
    ``tokenizer_pre`` unless a source tokenizer is converted for GGUF, ``onnx_unsupported`` for another format."""
    no_verify = "--no-verify" if names.cli else "verify=False"
    to_arg = names.arg("to", to.name)
    if to.load is None:
        if strict:
            raise ValueError(f"{names('strict')} loads dst back and compares it, and {to_arg} cannot be loaded back "
                             f"(qcore has no {to.name.upper()} loader): convert without {names('strict')} (the "
                             f"exporter's per-weight report is given)")
        if not verify:
            raise ValueError(f"{no_verify} changes nothing with {to_arg}: it is never loaded back")
    if strict and not verify:
        raise ValueError(f"{names('strict')} with {no_verify}: {names('strict')} always loads dst back and compares "
                         f"every tensor and metadata entry; drop one of them")
    if dtype is not None and to.float32_only:
        if dtype != torch.float32:
            raise ValueError(f"{names.arg('dtype', _dtype_name(dtype))}: {to.name.upper()} exports are float32 "
                             f"models ({to.float32_why})")
        raise ValueError(f"{names.arg('dtype', 'float32')} changes nothing with {to_arg}: it always loads float32")
    if dtype == torch.float32 and src_format.suffix == ".gguf":
        raise ValueError(f"{names.arg('dtype', 'float32')} changes nothing: a GGUF source loads in float32")
    if tokenizer_pre is not None:
        why = None
        if to.suffix != ".gguf":
            why = f"it names llama.cpp's pre-tokenizer of a GGUF destination, not {to_arg}"
        elif to.copies_own_source and src_format is to:
            why = "a GGUF source's tokenizer fields (tokenizer.ggml.pre too) are copied as they are"
        elif src_format.held_tokenizer(src_file) is None:
            why = "the source holds no tokenizer"
        if why:
            raise ValueError(f"{names.arg('tokenizer_pre', tokenizer_pre)} changes nothing: {why}")
    if onnx_unsupported is not None and "onnx_unsupported" not in dict(to.options):
        owner = option_owner("onnx_unsupported").name
        raise ValueError(f"{names.arg('onnx_unsupported', onnx_unsupported)} applies to "
                         f"{names.arg('to', owner)}, not {to_arg}")


# ---------------------------------------------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------------------------------------------


def _all_float32(model: nn.Module) -> bool:
    return all(dt in ("float32", "") for kind, _, _, dt in _effective(model, values=False).values()
               if kind != "activation")


def _merge(known: list, computed: list) -> list:
    """The changes known before writing (GGUF tensors the importer or the destination holds as float values),
    measured where the comparison measured them, then the others the comparison found."""
    by_name = {c.name: c for c in computed}
    out = [c if c.name not in by_name else dataclasses.replace(
        c, max_abs_diff=by_name[c.name].max_abs_diff, max_rel_diff=by_name[c.name].max_rel_diff,
        changed=by_name[c.name].changed, size=by_name[c.name].size) for c in known]
    names = {c.name for c in known}
    return out + [c for c in computed if c.name not in names]


def _refusal(to: Format, changes: list, metadata: list) -> str:
    parts = []
    if changes:
        names = ", ".join(f"{c.name} ({c.source} -> {c.destination})" for c in changes[:8])
        parts.append(f"{len(changes)} tensors change: {names}{' ...' if len(changes) > 8 else ''}")
    if metadata:
        keys = ", ".join(f"{m.where} {m.key} ({m.change})" for m in metadata[:8])
        parts.append(f"{len(metadata)} metadata entries differ: {keys}{' ...' if len(metadata) > 8 else ''}")
    return f"convert to {to.name}: not lossless, {'; '.join(parts)}; dst was not written"


def job_files(src, dst, *, report=None, cli: bool = False) -> JobFiles:
    """What ``convert`` reads (``src``) and writes (``dst``; ``qcore convert --report``: the report, written
    after it), named as the command line (``cli``) or ``convert``'s arguments name them."""
    names = (lambda a: "--report" if a == "report" else a) if cli else (lambda a: a)
    return dataclasses.replace(JobFiles.of(names, reads=[("src", src)], writes=[
        ("dst", dst, "the conversion"), ("report", report, "the report")]), cli=cli)


def convert(src: Union[str, pathlib.Path], dst: Union[str, pathlib.Path], *, to: str, overwrite: bool = False,
            strict: bool = False, dtype: Optional[torch.dtype] = None, tokenizer_pre: Optional[str] = None,
            verify: bool = True, progress: bool = False, onnx_unsupported: Optional[str] = None,
            names: Names = PYTHON) -> ConvertInfo:
    """Convert the quantized checkpoint ``src`` into format ``to`` at ``dst`` (see the module docstring).

    to: one of ``FORMATS`` (aliases: ``quark`` = hf, ``ct`` = compressed-tensors).
    overwrite: replace an existing ``dst`` (else FileExistsError, before any work). A ``dst`` that is, contains or
        lies inside ``src`` is refused either way (ValueError naming both, before anything is read).
    strict: refuse (ValueError listing the changed tensors and metadata entries) a conversion that is not
        lossless; ``dst`` is left as it was. Always verifies: refused with ``verify=False`` and for ONNX.
    dtype: the float dtype the model is loaded and written in (default: the checkpoint's). The comparison is
        with the source in its own dtype, so a narrower dtype is reported as a change of every float tensor.
    tokenizer_pre: llama.cpp's pre-tokenizer name when a transformers tokenizer is converted for GGUF (None: the
        architecture's, ``formats.gguf.Arch.tokenizer_pre``); refused where no tokenizer is converted for GGUF.
    verify: load the destination back and compare every tensor and metadata entry (default; refused for ONNX,
        which is never loaded back: the exporter's report is given).
    progress: show progress bars (one over the stages: load, write, load back and compare, move into place; the
        exporters' bars over tensors / shards where they have them). ``qcore convert`` shows them unless
        ``--no-progress``.
    onnx_unsupported: ``to="onnx"`` only: weights onnxruntime cannot dequantize (fp4, MX6/MX9, NVFP4) are refused
        (``"error"``, the default) or written as dequantized float32 (``"dequantize"``; each one is reported as a
        changed tensor).
    names: how errors name the options (``jobs.common.PYTHON``: the arguments; ``CLI``: ``qcore convert``'s flags).
    """
    if not isinstance(names, Names):
        raise TypeError(f"names must be jobs.common.PYTHON or CLI, got {names!r}")
    to = format_named(to, what=names("to"))
    for k, v in (("overwrite", overwrite), ("strict", strict), ("verify", verify), ("progress", progress)):
        if not isinstance(v, bool):
            raise TypeError(f"{names(k)} must be a bool, got {v!r}")
    if onnx_unsupported is not None and not isinstance(onnx_unsupported, str):
        raise TypeError(f"{names('onnx_unsupported')} must be 'error' or 'dequantize', got {onnx_unsupported!r}")
    if onnx_unsupported not in (None, "error", "dequantize"):
        raise ValueError(f"{names('onnx_unsupported')} must be 'error' or 'dequantize', got {onnx_unsupported!r}")
    if dtype is not None and dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{names('dtype')} must be torch.float32, float16 or bfloat16, got {dtype!r}")
    if tokenizer_pre is not None and (not isinstance(tokenizer_pre, str) or not tokenizer_pre):
        raise TypeError(f"{names('tokenizer_pre')} must be a non-empty str or None, got {tokenizer_pre!r}")
    for k, v in (("src", src), ("dst", dst)):
        if not isinstance(v, (str, os.PathLike)) or not os.fspath(v):
            raise TypeError(f"{k} must be a non-empty path (str or os.PathLike), got {v!r}")
    src_p, dst_p = pathlib.Path(src), pathlib.Path(dst)
    job_files(src, dst).check()  # with overwrite or not: replacing the source would delete it
    src_fmt = detect_format(src_p)
    src_file = _source_file(src_p, src_fmt)
    check_options(to, src_fmt, src_file, strict=strict, verify=verify, dtype=dtype, tokenizer_pre=tokenizer_pre,
                  onnx_unsupported=onnx_unsupported, names=names)
    _check_dst(dst_p, overwrite, names)
    if to.suffix is not None and dst_p.exists() and dst_p.is_dir() and dst_p.suffix == to.suffix:
        raise ValueError(f"dst {str(dst_p)!r} is a directory named like {_a(to.name)} {to.name.upper()} file")
    other = next((f for f in FORMATS.values() if f.suffix and f.suffix == dst_p.suffix and f is not to), None)
    if other is not None:
        raise ValueError(f"dst {str(dst_p)!r} is named like {_a(other.name)} {other.name.upper()} file, but {names.arg('to', to.name)}"
                         f" writes " + (f"a {to.suffix} file or a directory" if to.suffix else "a directory"))

    verifying = verify and to.load is not None
    stages = _Stages(3 + verifying, enabled=progress)
    try:  # the bar is closed before any message: an error starts on its own line
        stages.next(f"convert: loading {src_fmt.name} source")
        model, tok, _, tok_dropped = _load_quantized(src_p, dtype=torch.float32 if to.float32_only else dtype)
        if tokenizer_pre is not None and tok is None:
            raise ValueError(f"{names.arg('tokenizer_pre', tokenizer_pre)} changes nothing: "
                             f"{tok_dropped or 'the source has no tokenizer'}")
        # a GGUF destination of a GGUF source copies the tokenizer fields verbatim; an .onnx file holds none
        carried = (to.copies_own_source and src_fmt is to) or (
            not to.file_holds_tokenizer and dst_p.suffix == to.suffix)
        meta_known = []
        if tok_dropped and not carried:
            if strict:
                raise ValueError(f"convert to {to.name}: not lossless: {tok_dropped}; dst was not written")
            meta_known.append(MetadataChange("tokenizer", "(the tokenizer)", "missing",
                                             src_fmt.held_tokenizer(src_file), "dropped (see the note)"))
        not_carried = ["tokenizer (an .onnx file holds none)"] if (
            not to.file_holds_tokenizer and dst_p.suffix == to.suffix and (tok is not None or tok_dropped)) else []
        known = _import_changes(model)
        # the source as its format defines it: the model as loaded, when nothing was cast (else loaded again)
        ref = _effective(model) if verifying and dtype is None and _all_float32(model) else None
        known += [] if to.gguf_specs else _gguf_specs_to_float(model, to.name)
        nq = sum(1 for m in model.modules() if isinstance(m, QuantModule) and "weight" in m.specs)
        if nq == 0:
            raise ValueError(f"src {str(src_p)!r}: no weight could be loaded onto a qcore grid"
                             + (f" ({len(known)} block-quantized tensors have none, e.g. "
                                f"{known[0].name!r}: {known[0].destination})" if known else "")
                             + "; nothing quantized to convert")

        # written into a private staging place first and verified there: a strict refusal, a failed check or an
        # error leaves dst untouched
        with staged_path(dst_p, recheck=lambda: _check_dst(dst_p, overwrite, names)) as staged:
            stages.next(f"convert: writing {to.name}")
            written, notes, info = _export(model, tok, src_file, src_fmt, staged, to, overwrite=False,
                                           tokenizer_pre=tokenizer_pre, progress=progress,
                                           onnx_unsupported=onnx_unsupported or "error")
            if tok_dropped and not carried:
                notes.insert(0, tok_dropped)
            compared: dict = {}
            metadata = list(meta_known)
            if to.load is None:  # no loader to read it back with (ONNX): the exporter's own report
                changes, how = known + _onnx_changes(info, model), "exporter"
                compared = {"exporter": {"quantized weights": len(info.quantized)}}
            elif verifying:
                stages.next("convert: loading the result back to compare")
                src_model = model if ref is not None else None
                del model  # the written model: the comparison needs the source and the destination only
                try:
                    back = _reload(written, to)
                except (ValueError, OSError) as e:  # named as dst: the staging place is gone when this is read
                    why = str(e).replace(str(staged), str(dst_p)).splitlines()[0]
                    raise ValueError(f"convert to {to.name}: the written {to.name} checkpoint does not load back "
                                     f"with qcore's own loader ({type(e).__name__}: {why}); dst was not "
                                     f"written") from None
                if ref is None:  # the source again, in its own dtype
                    src_model, _, _, _ = _load_quantized(src_p, dtype=None)
                    ref = _as_float32(src_model)
                dst_entries = _stored_as(_as_float32(back), back)
                computed = _describe_changes(_compare(_stored_as(ref, src_model), dst_entries), info)
                changes, how = _merge(known, computed), "reload"
                kinds: dict = {}
                for kind, *_ in ref.values():
                    kinds[kind] = kinds.get(kind, 0) + 1
                meta, mcount, nc = _compare_metadata(src_fmt, src_file, to, written, src_model, back, tok)
                seen = {(m.where, m.key) for m in metadata}
                metadata += [m for m in meta if (m.where, m.key) not in seen]
                not_carried += nc
                compared = {"tensors": kinds, "metadata": mcount}
            else:
                changes, how = known, "none"
            if strict and (changes or metadata):
                raise ValueError(_refusal(to, changes, metadata))
            stages.next("convert: moving into place")
        final = dst_p / written.relative_to(staged) if written != staged else dst_p
    finally:
        stages.close()
    return ConvertInfo(str(src_file), src_fmt.name, str(final), to.name, _size(dst_p), nq, tuple(changes), how,
                       tuple(notes), tuple(metadata), compared, tuple(not_carried))


# ---------------------------------------------------------------------------------------------------------------
# the printed report
# ---------------------------------------------------------------------------------------------------------------


def _verdict(info: ConvertInfo) -> str:
    nt, nm = len(info.tensors), len(info.metadata)
    diff = " and ".join(x for x in (f"{nt} tensors changed" if nt else "",
                                    f"{nm} metadata entries differ" if nm else "") if x)
    if info.verified_by == "reload":
        c = info.compared
        what = (f"{sum(c['tensors'].values())} tensors and {sum(c['metadata'].values())} metadata entries compared "
                f"with dst loaded back")
        nc = len(info.not_carried)
        if nc:  # listed on their own row: never called lossless without saying so
            what += f"; {nc} source entr{'y' if nc == 1 else 'ies'} not carried: {info.to} has no field for them"
        return f"lossless ({what})" if info.lossless else f"{diff} ({what})"
    if info.verified_by == "exporter":
        n = info.compared.get("exporter", {}).get("quantized weights", 0)
        what = (f"dst not loaded back (no {info.to.upper()} loader): the exporter checked the {n} quantized "
                f"weights' codes before writing; float tensors, activations and metadata not compared")
        return f"{diff}; {what}" if diff else what
    return "not verified (--no-verify): nothing compared" + (f"; {diff} (known before writing)" if diff else "")


def _verdict_line(info: ConvertInfo) -> str:
    v = _verdict(info)
    if any(n.startswith("tokenizer dropped") for n in info.notes):
        v += "; tokenizer dropped (see the note)"
    return v


def summary_rows(info: ConvertInfo, *, limit: int = 20) -> list:
    """``(label, text)`` rows of ``qcore convert``'s printed report: source, destination, the result (what was
    compared and what differs), notes, each changed tensor and metadata entry (``limit`` of each), what was not
    carried."""
    rows = [("source", f"{info.source} ({info.source_format}, {info.quantized} quantized weights)"),
            ("destination", f"{info.destination} ({info.to}, {info.bytes_on_disk / 2**20:.2f} MiB)"),
            ("result", _verdict_line(info))]
    if info.verified_by == "reload":
        c = info.compared
        rows.append(("compared", "tensors: " + ", ".join(f"{n} {k}" for k, n in c["tensors"].items())
                     + "; metadata: " + ", ".join(f"{w} {n}" for w, n in c["metadata"].items())))
    rows += [("note", n) for n in info.notes]
    for t in info.tensors[:limit]:
        if math.isnan(t.max_abs_diff):
            diff = "dropped" if t.what == "activation" else "not measured"
        else:
            diff = f"max |diff| {t.max_abs_diff:.3g}"
            if t.changed >= 0:
                diff += f", max rel {t.max_rel_diff:.3g}, {t.changed} of {t.size} elements"
        rows.append((f"  {t.name}", f"{t.what}: {t.source} -> {t.destination}, {diff}"))
    if len(info.tensors) > limit:
        rows.append(("  ...", f"{len(info.tensors) - limit} more tensors (--report FILE.json lists all)"))
    for m in info.metadata[:limit]:
        val = {"missing": f"{m.source} -> absent", "added": f"absent -> {m.destination}",
               "changed": f"{m.source} -> {m.destination}"}[m.change]
        rows.append((f"  {m.where}: {m.key}", f"{m.change}: {val}"))
    if len(info.metadata) > limit:
        rows.append(("  ...", f"{len(info.metadata) - limit} more metadata entries (--report FILE.json lists all)"))
    if info.not_carried:
        shown = ", ".join(info.not_carried[:limit]) + (" ..." if len(info.not_carried) > limit else "")
        rows.append(("not carried", f"{shown} ({info.to} has no field for them)"))
    return rows
