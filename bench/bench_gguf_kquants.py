"""qcore's k-quant mixes against llama.cpp's own quantizer on SmolLM2-135M-Instruct: perplexity measured in
llama.cpp on the protocol's windows, with file sizes (issue 25; bench/results/GGUF.md, bench/results/GGUF_KQUANTS.json).

    python bench/bench_gguf_kquants.py [--mixes Q4_K_M,Q3_K_M,Q2_K]
        [--rows f16,llama,llama_imatrix,rtn,imatrix,gptq,gptq_only]
        [--windows 20] [--calib 32] [--threads 2] [--json FILE] [--md FILE] [--keep DIR] [--imatrix-file F]
    python bench/bench_gguf_kquants.py --from-json A.json,B.json --json C.json --md bench/results/GGUF.md

Both quantizers start from the same numbers: SmolLM2 (qcore's default model, loaded by transformers from the
shipped Q4_1 GGUF) with every weight rounded to float16 (``model.half()``).

- ``f16`` (the ceiling; the file is always written, the row measured when named): ``export_gguf`` of the
  float16 model (every Linear under an exact float16 grid, so the file holds the float16 weights as F16; the
  tied head is not written; tokenizer fields copied from the shipped file, as bench/bench_gguf.py does).
- ``llama.cpp``: ``llama_cpp.llama_model_quantize(F16 file, out, params)`` with
  ``llama_model_quantize_default_params()``, ``ftype`` ``LLAMA_FTYPE_MOSTLY_<mix>``, ``nthread`` 2 (no imatrix).
  ``quantize s`` is that call's wall time. Its ``qcore ppl`` is qcore's evaluation of that file imported with
  ``from_gguf`` (its k-quant / Q5_0 / Q4_0 / Q8_0 tensors as codes: exactly the file's values).
- ``llama_imatrix`` (not in the default rows; needs ``--imatrix-file``): the same call with ``params.imatrix`` set
  to the importance matrix of that file, the values ``llama-quantize`` passes (``in_sum2 / counts`` in float32 per
  tensor name, ``.weight`` included: ``qcore.formats.imatrix.read_imatrix(f).quant_weights()``), so llama.cpp and
  qcore's ``imatrix`` / ``gptq`` rows (which load the same file) quantize with identical statistics. The qcore
  rows of a run that also has this row record ``same_bytes_as_llama_imatrix``.
- qcore rows, each the float32 copy of the float16-rounded weights with one GGUF type per tensor: the type
  llama.cpp's quantizer chose for that tensor (read from llama.cpp's own file of the mix with gguf-py, mapped to
  module names with ``gguf_names``; the tied token embedding / head as one module pair of the embedding's type),
  or ``qcore.adapters.gguf_mix(model, mix).config`` when that exists:

  - ``rtn``: ``quantize_model(model, config)``: llama.cpp's scale search in qcore, no data;
  - ``imatrix``: the same with ``collect_imatrix`` on the calibration windows (``quantize_model(...,
    imatrix=stats)``; where quantize_model has no ``imatrix=`` yet: ``qcore.quantize(w, spec, imatrix=...)`` per
    module, frozen into the module with ``load_frozen_gguf``);
  - ``gptq``: ``algorithms=({"name": "gptq"},)`` on the k-quant specs, with the imatrix too (needs
    ``quantize_model(..., imatrix=)``; skipped otherwise); ``gptq_only`` (not in the default rows): GPTQ without
    the imatrix (its block search weighted by the Hessian's diagonal).

  ``quantize s``: wall time of the quantization (the imatrix collection is timed apart, ``imatrix s``);
  ``qcore ppl``: qcore's own perplexity of the in-memory model (``adapters.eval.evaluate.perplexity``);
  then ``export_gguf`` (every weight written code for code, lossless, checked) and llama.cpp's perplexity of
  that file. ``gap`` = llama.cpp ppl / qcore ppl - 1 (the issue asks for |gap| <= 1%).

Perplexity protocol (shared/reference/anchors.md): pydoc text, non-overlapping 512-token windows 0..N-1 (20);
calibration windows 20..20+C-1 (32), disjoint from them. llama.cpp's perplexity: bench_gguf.llama_cpp_perplexity
(float32 logits of ``Llama.eval``, cross entropy in float64 here). Nothing is asserted; prints a table.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import ctypes
import inspect
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's qcore, however the script is started
sys.path.insert(0, str(ROOT / "bench"))

MIXES = ("Q4_K_M", "Q3_K_M", "Q2_K")
ROWS = ("f16", "llama", "llama_imatrix", "rtn", "imatrix", "gptq", "gptq_only")
DEFAULT_ROWS = ("f16", "llama", "rtn", "imatrix", "gptq")
SECTION = "## Issue 25: k-quant mixes against llama.cpp's quantizer (SmolLM2-135M)"
QUANTIZER = {"f16": "F16 (no quantization)", "llama": "llama.cpp", "llama_imatrix": "llama.cpp + imatrix",
             "rtn": "qcore RTN",
             "imatrix": "qcore + imatrix", "gptq": "qcore + imatrix + GPTQ",
             "gptq_only": "qcore + GPTQ"}


def _loadavg():
    try:
        return tuple(round(v, 2) for v in os.getloadavg())
    except OSError:  # pragma: no cover - not on Linux
        return None


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


@contextlib.contextmanager
def _quiet_fds(log: pathlib.Path):
    """Send the C library's stdout/stderr (llama.cpp prints a line per tensor) to ``log`` meanwhile."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(log, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def llama_imatrix_entries(path) -> tuple:
    """The importance matrix of the imatrix file ``path`` (.gguf or legacy .dat) as llama.cpp's quantizer takes
    it: a ctypes array of ``llama_model_imatrix_data`` (tensor name, float32 values, count; ended by a null name)
    holding exactly the values ``llama-quantize`` computes from the file (``in_sum2 / counts`` in float32, 1 where
    a count is 0). Returns ``(array, keep)``: ``keep`` owns the memory the array points into."""
    import numpy as np
    import llama_cpp
    from qcore.formats.imatrix import read_imatrix

    qw = read_imatrix(path).quant_weights()
    if not qw:
        raise ValueError(f"imatrix file {path} holds no entries")
    names = sorted(qw)
    arrays = [np.ascontiguousarray(qw[n], dtype=np.float32).reshape(-1) for n in names]
    raw = [n.encode() for n in names]
    entries = (llama_cpp.llama_model_imatrix_data * (len(names) + 1))()
    for e, n, a in zip(entries, raw, arrays):
        e.name, e.data, e.size = n, a.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), a.size
    entries[len(names)].name = None  # the terminator
    return entries, (arrays, raw)


def llama_quantize(src: pathlib.Path, dst: pathlib.Path, mix: str, *, nthread: int = 2, imatrix=None) -> float:
    """llama.cpp's quantizer (llama-cpp-python's ``llama_model_quantize``) of the GGUF ``src`` to ``mix``
    (``"Q4_K_M"``, ...) with the default params, and the importance matrix of the imatrix file ``imatrix`` when
    given (``llama_imatrix_entries``); seconds. RuntimeError if it fails."""
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{mix}", None)
    if ftype is None:
        raise ValueError(f"mix must be one of llama.cpp's ftypes (e.g. Q4_K_M), got {mix!r}")
    if imatrix is not None and not pathlib.Path(imatrix).is_file():
        raise ValueError(f"imatrix must be an existing imatrix file, got {imatrix!r}")
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = ftype
    p.nthread = nthread
    if imatrix is not None:
        entries, keep = llama_imatrix_entries(imatrix)
        p.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    t = time.perf_counter()
    with _quiet_fds(dst.with_suffix(".log")):
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src}, {mix}) returned {rc}; see {dst.with_suffix('.log')}")
    return time.perf_counter() - t


def gguf_tensors(path: pathlib.Path) -> dict:
    """``{tensor name: (type name, [in, out] as ggml's ne), bytes}`` of a GGUF file."""
    import gguf
    import numpy as np

    return {t.name: (t.tensor_type.name, [int(v) for v in t.shape], bytes(np.asarray(t.data)))
            for t in gguf.GGUFReader(path).tensors}


def type_summary(tensors: dict) -> dict:
    """Histogram of the matrices' types (norms, F32 vectors, left out), and the 576-wide fallbacks: matrices
    whose rows (ggml's ne[0], the input width) are not a multiple of 256, so no k-quant can hold them."""
    mats = {n: v for n, v in tensors.items() if len(v[1]) == 2 and v[1][1] > 1}
    hist = collections.Counter(v[0] for v in mats.values())
    narrow = collections.Counter(v[0] for v in mats.values() if v[1][0] % 256)
    per_role = collections.defaultdict(collections.Counter)
    for n, v in mats.items():
        per_role[n.split(".")[-2] if n.startswith("blk.") else n.rsplit(".", 1)[0]][v[0]] += 1
    return {"histogram": dict(sorted(hist.items(), key=lambda kv: -kv[1])),
            "not_256_wide": dict(narrow), "by_role": {k: dict(c) for k, c in sorted(per_role.items())}}


def _hist_text(summary: dict) -> str:
    return " ".join(f"{k.lower()}:{v}" for k, v in summary["histogram"].items())


def f16_model(model):
    """A float16 copy of ``model`` under an exact float16 weight grid on every Linear (power-of-two scale: the
    float16 values themselves), which ``export_gguf`` writes as F16 (its tied head not at all)."""
    import qcore
    import qcore.adapters as A

    m = copy.deepcopy(model).half()
    A.quantize_model(m, A.ModelConfig(A.LayerConfig(weight=qcore.make_spec("float16", pow2_scale=True))),
                     progress=False)
    return m


def mix_config(model, mix: str, llama_types: dict | None):
    """The ModelConfig giving each weight llama.cpp's type for ``mix``: ``qcore.adapters.gguf_mix`` when qcore
    has it, else the types of llama.cpp's own file (``llama_types``: GGUF name -> type name). Returns
    ``(config, source)``."""
    import qcore
    import qcore.adapters as A
    from qcore.adapters.io.gguf import gguf_names
    from qcore.formats import gguf as G

    gm = getattr(A, "gguf_mix", None)
    if gm is not None:
        return gm(model, mix).config, "qcore.adapters.gguf_mix"
    if llama_types is None:
        raise ValueError(f"no qcore.adapters.gguf_mix here: the {mix} types come from llama.cpp's file (row llama)")
    by_name, tied = {}, model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for mod, g in gguf_names(model).items():
        kind = llama_types.get(f"{g}.weight")
        if kind is None or kind not in G.GGUF_SPEC_KINDS:
            continue  # F32 norms; a tied head has no tensor of its own (below)
        by_name[mod] = A.LayerConfig(weight=qcore.make_spec(G.GGUF_SPEC_KINDS[kind]))
        if g == "token_embd" and tied:
            head = next(k for k, v in gguf_names(model).items() if v == "output")
            by_name[head] = by_name[mod]  # the head computes with token_embd's values in llama.cpp
    return A.ModelConfig(by_name=by_name, exclude=()), "types of llama.cpp's file"


def _imatrix_kw():
    import qcore.adapters as A

    return "imatrix" in inspect.signature(A.quantize_model).parameters


def _manual_imatrix(model, stats, floats: dict) -> int:
    """Re-quantize every GGUF-spec Linear of ``model`` (quantized, not frozen) from its float weight with the
    importance weights of ``stats`` (``qcore.quantize(w, spec, imatrix=...)``, llama.cpp's weighted search) and
    freeze it to those blocks. ``floats``: module name -> its float weight before quantize_model (which
    fake-quantizes in place). Returns the number of modules re-quantized."""
    import numpy as np
    import qcore
    from qcore.adapters.imatrix import module_quant_weights

    qw = module_quant_weights(model, stats)
    n = 0
    for name, m in model.named_modules():
        spec = getattr(m, "specs", {}).get("weight") if hasattr(m, "specs") else None
        if spec is None or not spec.gguf or name not in qw:
            continue
        w = floats[name]
        q = qcore.quantize(w, spec, imatrix=np.asarray(qw[name], np.float32))
        m.load_frozen_gguf(qcore.packing.pack_gguf_blocks(q), shape=tuple(w.shape), dtype=m.weight.dtype)
        n += 1
    return n


def _imatrix(model, calib, path, meta: dict):
    """``collect_imatrix`` of ``model`` on ``calib`` (timed into ``meta["imatrix_s"]``), or the imatrix file
    ``path`` when it exists (written there after a collection otherwise)."""
    from qcore.adapters.imatrix import collect_imatrix, load_imatrix, save_imatrix

    if path and pathlib.Path(path).exists():
        meta["imatrix_file"] = f"{path} (loaded)"
        return load_imatrix(path)
    t = time.perf_counter()
    stats = collect_imatrix(model, calib, progress=False)
    meta["imatrix_s"] = round(time.perf_counter() - t, 1)
    if path:
        save_imatrix(stats, path, datasets=("pydoc protocol windows 20..",))
        meta["imatrix_file"] = f"{path} (written)"
    return stats


def _bytes_same(a: dict, b: dict) -> tuple[int, int]:
    """How many matrices of ``b`` have the same type and bytes in ``a`` (of those in both)."""
    common = [k for k in b if k in a and len(b[k][1]) == 2 and b[k][1][1] > 1]
    return sum(a[k][0] == b[k][0] and a[k][2] == b[k][2] for k in common), len(common)


def run(args, command: str = "") -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import llama_cpp
    import qcore.adapters as A
    from qcore.adapters.eval import evaluate as E
    from qcore.adapters.eval import models
    from qcore.adapters.io.gguf import export_gguf
    from bench_gguf import llama_cpp_perplexity

    t0 = time.perf_counter()
    meta = dict(python=platform.python_version(), torch=torch.__version__, llama_cpp=llama_cpp.__version__,
                threads=args.threads, cpus=os.cpu_count(), commit=_commit(), windows=args.windows,
                calibration_windows=args.calib, command=command, loadavg_start=_loadavg(), loadavg=[])
    model, tok = models.load_smollm2()
    base = model.half().float()  # the float16-rounded weights, in float32: qcore's starting point
    ids = E.protocol_token_ids(tok)
    windows = range(args.windows)
    spans = E.token_windows(ids.numel(), seq_len=E.SEQ_LEN, windows=windows)
    calib = E.calibration_batches(None, token_ids=ids, n=args.calib)
    meta["load_s"] = round(time.perf_counter() - t0, 1)
    rows: list[dict] = []
    work = pathlib.Path(args.keep) if args.keep else pathlib.Path(tempfile.mkdtemp(prefix="qcore_kquants_"))
    work.mkdir(parents=True, exist_ok=True)

    def qppl(m):
        t = time.perf_counter()
        p = E.perplexity(m, None, token_ids=ids, windows=windows, progress=False)
        return p, time.perf_counter() - t

    def finish(row, path):
        row["file_bytes"] = path.stat().st_size
        row["file_mb"] = round(path.stat().st_size / 1e6, 2)
        row["llama_ppl"], row["llama_eval_s"] = llama_cpp_perplexity(path, ids, spans, args.threads)
        if row.get("qcore_ppl") is not None:
            row["gap_pct"] = 100 * (row["llama_ppl"] / row["qcore_ppl"] - 1)
        row["loadavg"] = _loadavg()
        meta["loadavg"].append(row["loadavg"])
        rows.append(row)
        print(_line(row), flush=True)
        if args.json:  # written after every row: a long run keeps what it measured
            pathlib.Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")

    f16 = work / "smollm2-f16.gguf"
    m = f16_model(base)
    info = export_gguf(m, f16, tokenizer=models.smollm2_path(), overwrite=True)
    del m
    if not info.lossless or set(info.types.values()) - {"F16", "F32"}:
        raise RuntimeError(f"the F16 export is not the float16 weights: {collections.Counter(info.types.values())}")
    print(f"SmolLM2 float16 weights; {args.windows} windows, {args.calib} calibration windows, {args.threads} "
          f"threads; llama-cpp-python {meta['llama_cpp']}; load average {meta['loadavg_start']}", flush=True)
    print(_HEAD, flush=True)
    if "f16" in args.rows:
        row = dict(mix="F16", quantizer="f16", types=type_summary(gguf_tensors(f16)))
        row["qcore_ppl"], row["qcore_eval_s"] = qppl(base)
        finish(row, f16)

    stats = None
    qcore_rows = {"rtn", "imatrix", "gptq", "gptq_only"} & set(args.rows)
    for mix in args.mixes:
        ref = work / f"smollm2-{mix}-llama.gguf"
        ref_tensors = None
        if "llama" in args.rows or qcore_rows or not hasattr(A, "gguf_mix"):  # a few seconds: same_bytes_as_llama
            secs = llama_quantize(f16, ref, mix, nthread=2)
            ref_tensors = gguf_tensors(ref)
        if "llama" in args.rows:
            row = dict(mix=mix, quantizer="llama", quantize_s=secs, types=type_summary(ref_tensors))
            with warnings.catch_warnings():  # the tied Q8_0 token_embd imports as its exact float values
                warnings.simplefilter("ignore")
                back = A.from_gguf(ref)
            row["import"] = back.qcore_gguf_report.summary()
            row["qcore_ppl"], row["qcore_eval_s"] = qppl(back)
            del back
            finish(row, ref)
        refi_tensors = None
        if "llama_imatrix" in args.rows:
            if stats is None:  # the file exists unless this run writes it: collect (and write) it first
                stats = _imatrix(base, calib, args.imatrix_file, meta)
            refi = work / f"smollm2-{mix}-llama_imatrix.gguf"
            secs = llama_quantize(f16, refi, mix, nthread=2, imatrix=args.imatrix_file)
            refi_tensors = gguf_tensors(refi)
            row = dict(mix=mix, quantizer="llama_imatrix", quantize_s=secs, types=type_summary(refi_tensors),
                       imatrix_file=str(args.imatrix_file))
            if ref_tensors is not None:
                row["same_bytes_as_llama"] = _bytes_same(ref_tensors, refi_tensors)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                back = A.from_gguf(refi)
            row["import"] = back.qcore_gguf_report.summary()
            row["qcore_ppl"], row["qcore_eval_s"] = qppl(back)
            del back
            finish(row, refi)
        llama_types = None if ref_tensors is None else {k: v[0] for k, v in ref_tensors.items()}
        config, source = mix_config(base, mix, llama_types)
        meta.setdefault("types_from", {})[mix] = source
        for kind in ("rtn", "imatrix", "gptq", "gptq_only"):
            if kind not in args.rows:
                continue
            row = dict(mix=mix, quantizer=kind)
            kw = {}
            if kind in ("gptq", "gptq_only") and not _imatrix_kw():
                print(f"{mix} {kind}: skipped (this qcore has no GPTQ to GGUF types: quantize_model has no imatrix=)",
                      flush=True)
                continue
            if kind in ("imatrix", "gptq"):
                if stats is None:
                    stats = _imatrix(base, calib, args.imatrix_file, meta)
                if _imatrix_kw():
                    kw["imatrix"] = stats
                    row["imatrix_path"] = "quantize_model(imatrix=)"
            m = copy.deepcopy(base)
            gptq = kind in ("gptq", "gptq_only")
            cfg = config.replace(algorithms=({"name": "gptq"},)) if gptq else config
            data = calib if gptq else None
            floats = {}
            if kind == "imatrix" and not kw:
                floats = {n: mod.weight.detach().float().numpy().copy() for n, mod in m.named_modules()
                          if isinstance(mod, torch.nn.Linear)}
            t = time.perf_counter()
            A.quantize_model(m, cfg, data, progress=False, **kw)
            if kind == "imatrix" and not kw:
                n = _manual_imatrix(m, stats, floats)
                row["imatrix_path"] = f"qcore.quantize(imatrix=) per module ({n} modules)"
            row["quantize_s"] = time.perf_counter() - t
            if kind in ("imatrix", "gptq") and "imatrix_s" in meta:
                row["imatrix_s"] = meta["imatrix_s"]
            row["qcore_ppl"], row["qcore_eval_s"] = qppl(m)
            path = work / f"smollm2-{mix}-{kind}.gguf"
            info = export_gguf(m, path, tokenizer=models.smollm2_path(), overwrite=True)
            del m
            tensors = gguf_tensors(path)
            row["types"] = type_summary(tensors)
            row["lossless"] = info.lossless
            if ref_tensors is not None:
                row["same_bytes_as_llama"] = _bytes_same(ref_tensors, tensors)
            if refi_tensors is not None:
                row["same_bytes_as_llama_imatrix"] = _bytes_same(refi_tensors, tensors)
                if row["same_bytes_as_llama_imatrix"][0] < row["same_bytes_as_llama_imatrix"][1]:
                    row["differing_from_llama_imatrix"] = sorted(
                        k for k in tensors if k in refi_tensors and len(tensors[k][1]) == 2 and tensors[k][1][1] > 1
                        and (tensors[k][0], tensors[k][2]) != (refi_tensors[k][0], refi_tensors[k][2]))
            del tensors
            finish(row, path)
    meta["loadavg_end"] = _loadavg()
    meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
    meta["work_dir"] = str(work) if args.keep else None
    if not args.keep:
        for p in work.iterdir():
            p.unlink()
        work.rmdir()
    return dict(meta=meta, rows=rows)


_HEAD = (f"{'mix':<7} {'quantizer':<22} {'MB':>7} {'quant s':>8} {'qcore ppl':>10} {'llama.cpp':>10} {'gap %':>7}  "
         f"types")


def _f(v, spec):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _line(r) -> str:
    return (f"{r['mix']:<7} {QUANTIZER[r['quantizer']]:<22} {r['file_mb']:>7.2f} {_f(r.get('quantize_s'), '8.1f')} "
            f"{_f(r.get('qcore_ppl'), '10.4f')} {_f(r['llama_ppl'], '10.4f')} {_f(r.get('gap_pct'), '+7.2f')}  "
            f"{_hist_text(r['types'])}")


def _same(r: dict) -> str:
    s, si = r.get("same_bytes_as_llama"), r.get("same_bytes_as_llama_imatrix")
    out = [] if s is None else [f"{s[0]}/{s[1]} matrices"]
    if si is not None:
        out.append(f"{si[0]}/{si[1]} as llama.cpp + imatrix")
    return "; ".join(out) or "-"


def _loads(m: dict) -> str:
    runs = m.get("runs") or [m]
    return "; ".join(f"{'run ' + str(i + 1) + ': ' if len(runs) > 1 else ''}{r.get('loadavg_start')} at the start, "
                     f"{r.get('loadavg_end')} at the end, {r.get('elapsed_s')} s" for i, r in enumerate(runs))


def markdown(res: dict, command: str) -> str:
    m = res["meta"]
    out = [SECTION, "",
           textwrap.fill(f"SmolLM2-135M-Instruct with its weights rounded to float16; llama.cpp's quantizer "
           f"(llama-cpp-python {m['llama_cpp']}, `llama_model_quantize`, default params, nthread 2; row llama.cpp: no imatrix; llama.cpp + imatrix: "
           f"`params.imatrix` from the imatrix file the qcore rows read, the values `llama-quantize` computes) "
           f"from the F16 GGUF of those weights, qcore from the same weights in float32. Perplexity over the "
           f"protocol's windows 0..{m['windows'] - 1} of 512 tokens, in llama.cpp and in qcore (in memory; for "
           f"llama.cpp's files: `from_gguf` of the file); calibration (imatrix, GPTQ) on windows 20.."
           f"{20 + m['calibration_windows'] - 1}. gap = llama.cpp / qcore - 1. Types: the matrices' GGUF types "
           f"(count). {m['cpus']} CPUs, {m['threads']} threads, qcore at commit "
           f"{', '.join(sorted({r.get('commit') or '?' for r in m.get('runs') or [m]}))}; load average "
           + _loads(m) + " (per row in GGUF_KQUANTS.json).", width=118), "",
           "```", command, "```", "",
           "| mix | quantizer | types (histogram) | file MB | quantize s | qcore ppl | llama.cpp ppl | gap | "
           "same bytes as llama.cpp (no imatrix) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        qs = r.get("quantize_s")
        if qs is not None and r.get("imatrix_s") is not None:
            qs_txt = f"{qs:.1f} (+ {r['imatrix_s']:.0f} imatrix)"
        else:
            qs_txt = _f(qs, ".1f")
        out.append(f"| {r['mix']} | {QUANTIZER[r['quantizer']]} | {_hist_text(r['types'])} | {r['file_mb']:.2f} | "
                   f"{qs_txt} | {_f(r.get('qcore_ppl'), '.4f')} | {_f(r['llama_ppl'], '.4f')} | "
                   f"{_f(r.get('gap_pct'), '+.2f')}% | {_same(r)} |")
    out.append("")
    return "\n".join(out)


def write_markdown(path: pathlib.Path, text: str, reading: str = "") -> None:
    """Put ``text`` (+ ``reading``) as the section SECTION of ``path``: replaced where it is, else appended."""
    old = path.read_text() if path.exists() else ""
    body = text + ("\n" + reading.strip() + "\n" if reading.strip() else "")
    i = old.find(SECTION)
    if i < 0:
        new = old.rstrip("\n") + ("\n\n" if old else "") + body
    else:
        j = old.find("\n## ", i + len(SECTION))
        new = old[:i] + body + (old[j + 1:] if j >= 0 else "")
    path.write_text(new)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mixes", default=",".join(MIXES), help=f"llama.cpp mixes (default {','.join(MIXES)})")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                   help=f"rows among {','.join(ROWS)} (default {','.join(DEFAULT_ROWS)})")
    p.add_argument("--windows", type=int, default=20, help="evaluation windows 0..N-1 (protocol: 20)")
    p.add_argument("--calib", type=int, default=32, help="calibration windows from window 20 (default 32)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="write the rows here (after each row)")
    p.add_argument("--md", default=None, help="put the table as the issue-25 section of this markdown file")
    p.add_argument("--reading", default="", help="text appended under the table in --md")
    p.add_argument("--keep", default=None, help="keep the GGUF files in this folder")
    p.add_argument("--imatrix-file", default=None,
                   help="an imatrix file (.gguf / .dat): loaded when it exists, else written after the collection "
                        "(the calibration windows must be the same: --calib)")
    p.add_argument("--from-json", default=None,
                   help="measure nothing: merge the rows of these comma-separated JSON files (a later file's row "
                        "replaces an earlier one of the same mix and quantizer) and write --md / --json")
    args = p.parse_args(argv)
    args.mixes = [m.strip() for m in args.mixes.split(",") if m.strip()]
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    import llama_cpp
    bad = [m for m in args.mixes if not hasattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{m}")]
    if bad or not args.mixes:
        p.error(f"--mixes: unknown {bad or args.mixes}; llama.cpp mixes such as {','.join(MIXES)}")
    if set(args.rows) - set(ROWS) or not args.rows:
        p.error(f"--rows: unknown {sorted(set(args.rows) - set(ROWS)) or args.rows}; known {','.join(ROWS)}")
    if not 1 <= args.windows <= 20:
        p.error(f"--windows must be 1..20 (the evaluation windows), got {args.windows}")
    if not 1 <= args.calib <= 200:
        p.error(f"--calib must be 1..200, got {args.calib}")
    if "llama_imatrix" in args.rows and not args.imatrix_file and not args.from_json:
        p.error("--rows llama_imatrix needs --imatrix-file (loaded when it exists, else written by the collection)")
    return args


def merge_runs(paths: list) -> dict:
    """One result from several runs' JSON files: rows in table order (F16, then per mix in MIXES order, the
    quantizers in ROWS order), a later file's row replacing an earlier one; meta of the first, with each run's
    command, commit, load averages and duration under ``runs``."""
    runs = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    rows = {}
    for r in runs:
        for row in r["rows"]:
            rows[(row["mix"], row["quantizer"])] = row
    order = {m: i for i, m in enumerate(("F16",) + MIXES)}
    keyed = sorted(rows, key=lambda k: (order.get(k[0], len(order)), k[0], ROWS.index(k[1])))
    meta = dict(runs[0]["meta"])
    keys = ("command", "commit", "loadavg_start", "loadavg_end", "elapsed_s", "windows", "calibration_windows")
    meta["runs"] = [run for r in runs for run in r["meta"].get("runs") or [{k: r["meta"].get(k) for k in keys}]]
    if len({(r["windows"], r["calibration_windows"]) for r in meta["runs"]}) > 1:
        raise ValueError(f"--from-json: the runs used different windows: {meta['runs']}")
    return dict(meta=meta, rows=[rows[k] for k in keyed])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = "python bench/bench_gguf_kquants.py " + " ".join(argv)
    if args.from_json:
        res = merge_runs(args.from_json.split(","))
        command = "\n".join(r["command"] or "?" for r in res["meta"]["runs"])
    else:
        res = run(args, command)
        print(f"whole run {res['meta']['elapsed_s']} s, load average {res['meta']['loadavg_end']}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    if args.md:
        write_markdown(pathlib.Path(args.md), markdown(res, command), args.reading)
    return 0


if __name__ == "__main__":
    sys.exit(main())
