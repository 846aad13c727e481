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

**What changed is measured, not assumed.** After writing, the destination is loaded back with qcore's own
importer (every format but ONNX) and each tensor of the model is compared with the source: a quantized weight by
its dequantized values, every other parameter by value, and each module's activation quantization (spec and
static scales). ``ConvertInfo.tensors`` has one ``TensorChange`` per tensor that is not bit-identical (weights
re-quantized onto another grid, scales rounded to another dtype, activation quantization the destination cannot
hold) with its max abs difference, and ``lossless`` says whether there is none. For ONNX the exporter's own
per-tensor report is used. ``strict=True`` refuses a conversion that is not lossless before the destination is
replaced (the destination is left as it was).

Writes are atomic (each exporter stages and renames into place) and deterministic; nothing is unpickled.
"""

from __future__ import annotations

import dataclasses
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
from qcore.formats.gguf import check_file

from ..batches import set_module
from ..io.formats import ExportRequest, Format, detect_format, format_named, gguf_in_dir, option_owner
from ..io.gguf import model_config_of_specs
from ..io.onnx import UnsupportedWeightError
from ..modules import EXPERT_PROJS, QuantExperts, QuantModule
from .common import PYTHON, Names
from .files import JobFiles

__all__ = ["convert", "ConvertInfo", "TensorChange", "load_quantized", "compare_models", "job_files"]


@dataclass(frozen=True)
class TensorChange:
    """One tensor (HF name) whose values differ between the source and the destination."""

    name: str
    what: str  # "weight" (quantized weight, dequantized values), "tensor" (float parameter), "activation"
    source: str  # how the source holds it (qcore spec name / dtype)
    destination: str  # how the destination holds it
    max_abs_diff: float  # nan for a dropped activation quantization


@dataclass(frozen=True)
class ConvertInfo:
    """What ``convert`` did: formats, paths, size and the tensors that changed (empty: lossless)."""

    source: str
    source_format: str
    destination: str
    to: str
    bytes_on_disk: int
    quantized: int  # quantized weights in the source
    tensors: tuple = ()  # TensorChange per changed tensor
    verified_by: str = "reload"  # "reload" (destination loaded back and compared) or "exporter" (ONNX)
    notes: tuple = ()

    @property
    def lossless(self) -> bool:
        return not self.tensors

    def to_dict(self) -> dict:
        return {"source": self.source, "source_format": self.source_format, "destination": self.destination,
                "to": self.to, "bytes_on_disk": self.bytes_on_disk, "quantized_weights": self.quantized,
                "lossless": self.lossless, "verified_by": self.verified_by, "notes": list(self.notes),
                "changed": [{"name": t.name, "what": t.what, "source": t.source, "destination": t.destination,
                             "max_abs_diff": None if np.isnan(t.max_abs_diff) else t.max_abs_diff}
                            for t in self.tensors]}


def _tokenizer(p: pathlib.Path, fmt: Format) -> tuple:
    """``(tokenizer or None, why the source's tokenizer could not be loaded or None)``: a source without a
    tokenizer gives ``(None, None)``; one transformers cannot load is never dropped silently."""
    try:
        return fmt.read_tokenizer(p), None
    except (OSError, ValueError, KeyError, TypeError) as e:
        held = fmt.held_tokenizer(p)
        if held is None:
            return None, None
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if ", 0 merges" in held and isinstance(e, KeyError):  # a GGUF BPE vocabulary without merges
            why = f"its GGUF reader needs merges (or scores) to build a BPE tokenizer ({why})"
        return None, f"tokenizer dropped: transformers cannot load the source's tokenizer ({held}): {why}"


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


def _spec_desc(spec) -> str:
    """``uint4 asym group 64 (float32 scales)``-style description of a weight spec."""
    g = spec.granularity
    gran = (f"group {g.size}" if isinstance(g, PerGroup) else "per-channel" if isinstance(g, PerChannel)
            else "per-tensor" if isinstance(g, PerTensor) else type(g).__name__)
    el = spec.name or spec.dtype.name
    asym = "" if spec.symmetric else " asym"
    return f"{el}{asym} {gran} ({spec.scale_dtype.name} scales)"


def _effective(model: nn.Module) -> dict:
    """name -> (kind, tensor, description) for every parameter of the model as it computes: a quantized weight
    dequantized, static activation scales, every float parameter."""
    out: dict[str, tuple] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        pre = f"{mname}." if mname else ""
        experts = isinstance(m, QuantExperts)
        if isinstance(m, QuantModule):
            spec = m.specs.get("weight")
            if spec is not None and experts:  # fused MoE experts: one weight per projection
                for p in EXPERT_PROJS:
                    out[pre + p] = ("weight", m.effective_proj(p), _spec_desc(m.weight_spec(p)))
            elif spec is not None:
                with torch.no_grad():
                    w = m.effective("weight")
                out[pre + "weight"] = ("weight", w.detach(), _spec_desc(spec))
            for role in ("input", "output"):
                rs = m.specs.get(role)
                tc = getattr(m.qconfig, role, None)
                if rs is None or tc is None:
                    continue
                desc = f"{rs.name or rs.dtype.name} {'dynamic' if tc.dynamic else 'static'}"
                sc = m.scales(role).scale
                out[f"{pre}{role}_quant"] = ("activation", None if tc.dynamic or sc is None else sc.detach(), desc)
        for n, t in m._parameters.items():
            if t is None or (isinstance(m, QuantModule) and n == "weight") or (
                    experts and n in EXPERT_PROJS and "weight" in m.specs):
                continue
            out[pre + n] = ("tensor", t.detach(), str(t.dtype).replace("torch.", ""))
    return out


def _diff(a: torch.Tensor, b: torch.Tensor) -> Optional[float]:
    """None when bit-identical in value (float32), else the max abs difference (inf for a shape change)."""
    if tuple(a.shape) != tuple(b.shape):
        return float("inf")
    a32, b32 = a.float().cpu(), b.float().cpu()
    if torch.equal(a32, b32):
        return None
    d = (a32 - b32).abs()
    return float(torch.nan_to_num(d, nan=float("inf")).max())


def compare_models(source: nn.Module, destination: nn.Module) -> list:
    """``TensorChange`` for each tensor of ``source`` whose value differs in ``destination`` (see the module
    docstring); tensors only in one of them are reported too (``max_abs_diff`` inf)."""
    a, b = _effective(source), _effective(destination)
    changes = []
    for name in sorted(set(a) | set(b)):
        if name not in b:
            kind, _, desc = a[name]
            changes.append(TensorChange(name, kind, desc, "absent", float("nan") if kind == "activation"
                                        else float("inf")))
            continue
        if name not in a:
            kind, _, desc = b[name]
            changes.append(TensorChange(name, kind, "absent", desc, float("nan") if kind == "activation"
                                        else float("inf")))
            continue
        (ka, ta, da), (_, tb, db) = a[name], b[name]
        if ka == "activation":
            if da != db or (ta is None) != (tb is None):
                changes.append(TensorChange(name, ka, da, db, float("nan")))
            elif ta is not None and _diff(ta, tb) is not None:
                changes.append(TensorChange(name, ka, da, db, _diff(ta, tb)))
            continue
        d = _diff(ta, tb)
        if d is not None:
            changes.append(TensorChange(name, ka, da, db, d))
    return changes


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
    dequantized weight (in the model's dtype), each one a ``TensorChange`` (``what="dequantized"``), and
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
                                     f"offsets)", f"float ({to} has no float offsets or super-block scales)", 0.0)
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
                                    f"float ({to} has no float offsets or super-block scales)", 0.0))
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
                            name=_gguf_name(src_path) if same else None, file_ok=True)
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


def _reload(path: pathlib.Path, to: Format, dtype: torch.dtype) -> nn.Module:
    with warnings.catch_warnings():  # the tensors a loader warns about are compared and reported here
        warnings.simplefilter("ignore", UserWarning)
        return to.load(path, dtype)


def _describe_changes(changes: list, info: Any) -> list:
    """Destination descriptions from the exporter's per-tensor report where it has one (GGUF: the block type and
    whether it was written code for code or re-quantized)."""
    reports = {r.name: r for r in getattr(info, "quantized", ()) if hasattr(r, "gguf_type")}
    out = []
    for c in changes:
        r = reports.get(c.name)
        out.append(c if r is None else TensorChange(c.name, c.what, c.source, f"{r.gguf_type} ({r.how})",
                                                    c.max_abs_diff))
    return out


def _onnx_changes(info: Any, model: nn.Module) -> list:
    """The ONNX exporter's report: weights written dequantized (formats onnxruntime cannot run) or not exactly."""
    mods = dict(model.named_modules())

    def desc(name: str) -> str:
        m = mods.get(name[:-len(".weight")] if name.endswith(".weight") else name)
        return _spec_desc(m.specs["weight"]) if isinstance(m, QuantModule) and "weight" in m.specs else "?"
    return [TensorChange(r.name, "weight", desc(r.name), f"{r.onnx_type} ({r.how})", float(r.max_abs_diff))
            for r in info.quantized if not r.exact or r.how == "dequantized"]


def _check_dst(dst: pathlib.Path, overwrite: bool, names: Names = PYTHON) -> None:
    """An existing file or non-empty directory at ``dst`` needs ``overwrite`` (an empty directory does not)."""
    if dst.exists() and not overwrite and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"dst {str(dst)!r} exists; pass {names('overwrite')}{'' if names.cli else '=True'} to "
                              f"replace it")


def _model_dtype(model: nn.Module) -> torch.dtype:
    for m in model.modules():
        if isinstance(m, QuantModule) and m.frozen:
            return m.weight_dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def job_files(src, dst, *, report=None, cli: bool = False) -> JobFiles:
    """What ``convert`` reads (``src``) and writes (``dst``; ``qcore convert --report``: the report, written
    after it), named as the command line (``cli``) or ``convert``'s arguments name them."""
    names = (lambda a: "--report" if a == "report" else a) if cli else (lambda a: a)
    return dataclasses.replace(JobFiles.of(names, reads=[("src", src)], writes=[
        ("dst", dst, "the conversion"), ("report", report, "the report")]), cli=cli)


def convert(src: Union[str, pathlib.Path], dst: Union[str, pathlib.Path], *, to: str, overwrite: bool = False,
            strict: bool = False, dtype: Optional[torch.dtype] = None, tokenizer_pre: Optional[str] = None,
            verify: bool = True, progress: bool = False, onnx_unsupported: str = "error",
            names: Names = PYTHON) -> ConvertInfo:
    """Convert the quantized checkpoint ``src`` into format ``to`` at ``dst`` (see the module docstring).

    to: one of ``FORMATS`` (aliases: ``quark`` = hf, ``ct`` = compressed-tensors).
    overwrite: replace an existing ``dst`` (else FileExistsError, before any work). A ``dst`` that is, contains or
        lies inside ``src`` is refused either way (ValueError naming both, before anything is read).
    strict: refuse (ValueError listing the changed tensors) a conversion that is not lossless; ``dst`` is left as
        it was.
    dtype: the float dtype the model is loaded in (default: the checkpoint's).
    tokenizer_pre: llama.cpp's pre-tokenizer name when a transformers tokenizer is converted for GGUF (None: the
        architecture's, ``formats.gguf.Arch.tokenizer_pre``).
    verify: load the destination back and compare every tensor (default; ONNX: the exporter's report).
    progress: show progress bars (one over the stages: load, write, load back and compare, move into place; the
        exporters' bars over tensors / shards where they have them). ``qcore convert`` shows them unless
        ``--no-progress``.
    onnx_unsupported: ``to="onnx"``: weights onnxruntime cannot dequantize (fp4, MX6/MX9, NVFP4) are refused
        (``"error"``, default) or written as dequantized float32 (``"dequantize"``; each one is reported as a
        changed tensor, so ``strict`` refuses it).
    names: how errors name the options (``qcore convert``: its flags).
    """
    to = format_named(to, what="to")
    for k, v in (("overwrite", overwrite), ("strict", strict), ("verify", verify), ("progress", progress)):
        if not isinstance(v, bool):
            raise TypeError(f"{k} must be a bool, got {v!r}")
    if not isinstance(onnx_unsupported, str):
        raise TypeError(f"onnx_unsupported must be 'error' or 'dequantize', got {onnx_unsupported!r}")
    if onnx_unsupported not in ("error", "dequantize"):
        raise ValueError(f"onnx_unsupported must be 'error' or 'dequantize', got {onnx_unsupported!r}")
    if onnx_unsupported != "error" and "onnx_unsupported" not in dict(to.options):
        owner = option_owner("onnx_unsupported").name
        raise ValueError(f"onnx_unsupported={onnx_unsupported!r} applies to to={owner!r}, not to={to.name!r}")
    if dtype is not None and dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32, float16 or bfloat16, got {dtype!r}")
    for k, v in (("src", src), ("dst", dst)):
        if not isinstance(v, (str, os.PathLike)) or not os.fspath(v):
            raise TypeError(f"{k} must be a non-empty path (str or os.PathLike), got {v!r}")
    src_p, dst_p = pathlib.Path(src), pathlib.Path(dst)
    job_files(src, dst).check()  # with overwrite or not: replacing the source would delete it
    src_fmt = detect_format(src_p)
    _check_dst(dst_p, overwrite, names)
    if to.suffix is not None and dst_p.exists() and dst_p.is_dir() and dst_p.suffix == to.suffix:
        raise ValueError(f"dst {str(dst_p)!r} is a directory named like a {to.name.upper()} file")

    if to.float32_only and dtype not in (None, torch.float32):
        raise ValueError(f"dtype {dtype}: ONNX exports are float32 models (onnxruntime's quantized ops need "
                         f"float32 activations)")
    stages = _Stages(3 + (verify and to.load is not None), enabled=progress)
    try:  # the bar is closed before any message: an error starts on its own line
        stages.next(f"convert: loading {src_fmt.name} source")
        model, tok, _, tok_dropped = _load_quantized(src_p, dtype=torch.float32 if to.float32_only else dtype)
        src_p = _source_file(src_p, src_fmt)
        # a GGUF destination of a GGUF source copies the tokenizer fields verbatim; an .onnx file holds none
        carried = (to.copies_own_source and src_fmt is to) or (
            not to.file_holds_tokenizer and dst_p.suffix == to.suffix)
        if tok_dropped and not carried:
            if strict:
                raise ValueError(f"convert to {to.name}: not lossless: {tok_dropped}; dst was not written")
            tok_note = tok_dropped
        else:
            tok_note = None
        imported = _import_changes(model) + ([] if to.gguf_specs else _gguf_specs_to_float(model, to.name))
        nq = sum(1 for m in model.modules() if isinstance(m, QuantModule) and "weight" in m.specs)
        if nq == 0:
            raise ValueError(f"src {str(src_p)!r}: no weight could be loaded onto a qcore grid"
                             + (f" ({len(imported)} block-quantized tensors have none, e.g. "
                                f"{imported[0].name!r}: {imported[0].destination})" if imported else "")
                             + "; nothing quantized to convert")
        load_dtype = _model_dtype(model)

        # write into a private staging place first: strict refusals and failed checks leave dst untouched
        with staged_path(dst_p, recheck=lambda: _check_dst(dst_p, overwrite, names)) as staged:
            stages.next(f"convert: writing {to.name}")
            written, notes, info = _export(model, tok, src_p, src_fmt, staged, to, overwrite=False,
                                           tokenizer_pre=tokenizer_pre, progress=progress,
                                           onnx_unsupported=onnx_unsupported)
            if tok_note:
                notes.insert(0, tok_note)
            if to.load is None:  # no loader to read it back with (ONNX): the exporter's own report
                changes, how = imported + _onnx_changes(info, model), "exporter"
            elif verify:
                stages.next("convert: loading the result back to compare")
                back = _reload(written, to, load_dtype)
                changes, how = imported + _describe_changes(compare_models(model, back), info), "reload"
            else:
                changes, how = imported, "none"
            if strict and changes:
                names = ", ".join(f"{c.name} ({c.source} -> {c.destination})" for c in changes[:8])
                raise ValueError(f"convert to {to.name}: not lossless, {len(changes)} tensors change: {names}"
                                 f"{' ...' if len(changes) > 8 else ''}; dst was not written")
            stages.next("convert: moving into place")
        final = dst_p / written.relative_to(staged) if written != staged else dst_p
    finally:
        stages.close()
    return ConvertInfo(str(src_p), src_fmt.name, str(final), to.name, _size(dst_p), nq, tuple(changes), how,
                       tuple(notes))
