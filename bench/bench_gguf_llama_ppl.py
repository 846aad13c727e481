"""The perplexity llama.cpp computes for qcore's GGUF exports, and qcore's prediction of it (issue 33, part 4;
bench/results/GGUF_LLAMA_PPL.md / .json).

    python bench/bench_gguf_llama_ppl.py [--families llama,qwen2,...] [--types Q4_1,Q4_K,...] [--steps 60]
        [--windows 16] [--seq 128] [--parts] [--outliers ALPHA] [--smollm2] [--threads 1] [--json FILE] [--md FILE]

For each family llama.cpp runs (tests/adapters/gguf_kit.py ``WIDE_FAMILIES``: 256-wide rows, two layers, the tiny
tokenizer's 128 tokens), a model trained ``--steps`` AdamW steps on the protocol text in the tiny tokenizer's ids
(``trained_family``; its perplexity far below the vocabulary, a trained model's activations), then per GGUF type:

- ``Q4_1``: ``preset("uint4_wo_64")`` (the issue's uint4 g64; its float32 scales have no Q4_1 block, so
  ``export_gguf`` requantizes the dequantized weight into Q4_1 with ggml's quantizer), ``Q4_0`` (int4 symmetric
  g32, float16 scales: written code for code), ``Q8_0`` (int8 symmetric g32, float16 scales), ``Q4_K``
  (``make_spec("q4_k")``: llama.cpp's quantizer in qcore); every Linear and the fused experts, the head and the
  embedding float (F32 in the file);
- four perplexities on the same windows (``--windows`` non-overlapping windows of ``--seq`` tokens from token 0):
  ``memory`` (qcore, the quantized model in memory), ``file`` (qcore, ``from_gguf`` of the written file),
  ``predicted`` (``qcore.adapters.eval.llama_cpp.llama_cpp_perplexity``: the file as llama.cpp computes it),
  ``llama.cpp`` (llama-cpp-python ``Llama.eval``, logits_all, n_ctx = seq, ``--threads``; float64 cross entropy of
  its float32 logits); ``--parts`` adds the prediction with one part of ``LlamaCppNumerics`` at a time
  (``acts``: activation rounding only; ``acts+offsets``; ``kv``: the F16 KV cache only).

``--outliers ALPHA``: the trained models get outlier activation channels (``gguf_kit.with_outliers``: the same
float function, every 32nd channel after the norms ALPHA times larger, as real LLMs' activations have them).
``--smollm2``: also the embedded SmolLM2-135M (its own llama.cpp Q4_1 file, then qcore's exports of its weights;
``--smollm2-windows`` windows of 512 tokens).

Relative differences: ``file/mem`` = file / memory - 1, ``llama/file`` = llama.cpp / file - 1 (what the prediction
must explain), ``pred err`` = predicted / llama.cpp - 1 (the issue's bound: 1%). Nothing is asserted
(tests/adapters/eval/test_llama_cpp_ppl.py asserts the bound per family).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = pathlib.Path(__file__).resolve().parents[1]
TYPES = ("Q4_1", "Q4_0", "Q8_0", "Q4_K")


def _kit():
    """tests/adapters/gguf_kit.py (the tiny tokenizer, the trained tiny models), loaded by path."""
    spec = importlib.util.spec_from_file_location("gguf_kit", ROOT / "tests" / "adapters" / "gguf_kit.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def config_of(kind: str):
    import qcore
    from qcore import PerGroup
    from qcore.adapters.config import LayerConfig, ModelConfig
    from qcore.adapters.presets import preset
    if kind == "Q4_1":
        return preset("uint4_wo_64")
    spec = {"Q4_0": lambda: qcore.make_spec("int4", granularity=PerGroup(32, axis=-1), scale_dtype="float16"),
            "Q8_0": lambda: qcore.make_spec("int8", granularity=PerGroup(32, axis=-1), scale_dtype="float16"),
            "Q4_K": lambda: qcore.make_spec("q4_k")}[kind]()
    return ModelConfig(LayerConfig(weight=spec))


def llama_cpp_ppl(path, ids, spans, threads: int) -> float:
    """llama.cpp's perplexity of ``path`` on the windows ``spans`` of ``ids`` (``qcore.testing.ggml.llama_cpp_nll``,
    as bench_gguf)."""
    from qcore.algorithms.metrics import perplexity_from_nll
    from qcore.testing.ggml import llama_cpp_nll
    nll, n, _ = llama_cpp_nll(path, ids, spans, threads=threads)
    return perplexity_from_nll(nll, n)


def measure(fam: str, kinds, *, kit, ids, steps: int, seq: int, windows: int, threads: int, parts: bool,
            work: pathlib.Path, outliers: float = 0.0) -> list:
    import torch
    from qcore.adapters import quantize_model
    from qcore.adapters.eval import evaluate as E
    from qcore.adapters.eval.llama_cpp import LlamaCppNumerics, llama_cpp_perplexity
    from qcore.adapters.io.gguf import export_gguf, from_gguf
    from qcore.algorithms.metrics import token_windows
    t0 = time.perf_counter()
    base = kit.trained_family(fam, steps=steps, ids=ids)
    if outliers:
        kit.with_outliers(base, fam, alpha=outliers)
    train_s = time.perf_counter() - t0
    wins = range(windows)
    spans = token_windows(ids.numel(), seq_len=seq, windows=wins)
    ev = dict(token_ids=ids, seq_len=seq, windows=wins, progress=False)
    tok = kit.tiny_tokenizer()
    row0 = dict(family=fam, steps=steps, outliers=outliers, train_s=round(train_s, 1), float=E.perplexity(base, None, **ev))
    rows = []
    for kind in kinds:
        m = copy.deepcopy(base)
        quantize_model(m, config_of(kind), None, progress=False)
        path = work / f"{fam}_{kind}.gguf"
        info = export_gguf(m, path, tokenizer=tok)
        r = dict(row0, type=kind, lossless=info.lossless, file_types=sorted(set(info.types.values())))
        r["memory"] = E.perplexity(m, None, **ev)
        del m
        r["file"] = E.perplexity(from_gguf(path), None, **ev)
        t = time.perf_counter()
        r["predicted"] = llama_cpp_perplexity(path, None, **ev)
        r["predict_s"] = round(time.perf_counter() - t, 1)
        if parts:
            for name, num in (("acts", LlamaCppNumerics(offsets=False, kv_cache=False)),
                              ("acts+offsets", LlamaCppNumerics(kv_cache=False)),
                              ("kv", LlamaCppNumerics(activations=False, offsets=False))):
                r[f"predicted[{name}]"] = llama_cpp_perplexity(path, None, numerics=num, **ev)
        t = time.perf_counter()
        r["llama.cpp"] = llama_cpp_ppl(path, ids, spans, threads)
        r["llama_s"] = round(time.perf_counter() - t, 1)
        r["file/mem"] = r["file"] / r["memory"] - 1
        r["llama/file"] = r["llama.cpp"] / r["file"] - 1
        r["pred err"] = r["predicted"] / r["llama.cpp"] - 1
        print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
        rows.append(r)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


def measure_smollm2(kinds, *, windows: int, seq: int, threads: int, work: pathlib.Path) -> list:
    """The embedded SmolLM2-135M (a real Llama): its own GGUF file (llama.cpp's Q4_1, type ``file``), then qcore's
    exports of its weights per type (576-wide rows: no k-quant; ``Q4_K`` is skipped)."""
    import torch
    from qcore.adapters import quantize_model
    from qcore.adapters.eval import evaluate as E
    from qcore.adapters.eval import models as M
    from qcore.adapters.eval.llama_cpp import llama_cpp_perplexity
    from qcore.adapters.io.gguf import export_gguf, from_gguf
    from qcore.algorithms.metrics import token_windows
    base, tok = M.load_smollm2()
    ids = E.protocol_token_ids(tok)
    wins = range(windows)
    spans = token_windows(ids.numel(), seq_len=seq, windows=wins)
    ev = dict(token_ids=ids, seq_len=seq, windows=wins, progress=False)
    row0 = dict(family="smollm2 (real)", steps=0, outliers=0.0, float=E.perplexity(base, None, **ev))
    rows = []
    for kind in ["own"] + [k for k in kinds if k != "Q4_K"]:
        if kind == "own":  # llama.cpp's own Q4_1 file of these weights
            path = M.smollm2_path()
            r = dict(row0, type="Q4_1 (llama.cpp's file)", lossless=True)
            r["memory"] = r["file"] = E.perplexity(from_gguf(path), None, **ev)
        else:
            m = copy.deepcopy(base)
            quantize_model(m, config_of(kind), None, progress=False)
            path = work / f"smollm2_{kind}.gguf"
            info = export_gguf(m, path, tokenizer=M.smollm2_path())
            r = dict(row0, type=kind, lossless=info.lossless)
            r["memory"] = E.perplexity(m, None, **ev)
            del m
            r["file"] = E.perplexity(from_gguf(path), None, **ev)
        t = time.perf_counter()
        r["predicted"] = llama_cpp_perplexity(path, None, **ev)
        r["predict_s"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        r["llama.cpp"] = llama_cpp_ppl(path, ids, spans, threads)
        r["llama_s"] = round(time.perf_counter() - t, 1)
        r["file/mem"] = r["file"] / r["memory"] - 1
        r["llama/file"] = r["llama.cpp"] / r["file"] - 1
        r["pred err"] = r["predicted"] / r["llama.cpp"] - 1
        print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
        rows.append(r)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


def _pct(v) -> str:
    return f"{100 * v:+.3f}%"


def markdown(rows: list, meta: dict) -> str:
    parts = sorted({k for r in rows for k in r if k.startswith("predicted[")}, key=lambda k: (len(k), k))
    head = ["family", "type", "float", "memory", "file", "predicted", *parts, "llama.cpp", "file/mem", "llama/file",
            "pred err"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["family"], r["type"]] + [f"{r[k]:.4f}" if k in r else "-" for k in (
            "float", "memory", "file", "predicted", *parts, "llama.cpp")]
        cells += [_pct(r["file/mem"]), _pct(r["llama/file"]), _pct(r["pred err"])]
        lines.append("| " + " | ".join(cells) + " |")
    worst = max(rows, key=lambda r: abs(r["pred err"])) if rows else None
    return "\n".join([
        f"`{meta['command']}` at commit {meta['commit']}; {meta['machine']}; load average {meta['load']} at the "
        f"start; {meta['seconds']:.0f} s.", "",
        *lines, "",
        (f"Largest |pred err|: {_pct(worst['pred err'])} ({worst['family']} {worst['type']}); largest |llama/file|: "
         f"{_pct(max(abs(r['llama/file']) for r in rows))}." if worst else ""), ""])


def main() -> int:
    kit_families = list(_kit().WIDE_FAMILIES)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(kit_families))
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--outliers", type=float, default=0.0)
    ap.add_argument("--smollm2", action="store_true", help="also the embedded SmolLM2-135M (--smollm2-windows of "
                    "512 tokens)")
    ap.add_argument("--smollm2-windows", type=int, default=4)
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "GGUF_LLAMA_PPL.json"))
    ap.add_argument("--md", default=str(ROOT / "bench" / "results" / "GGUF_LLAMA_PPL.md"))
    a = ap.parse_args()
    import torch
    torch.set_num_threads(a.threads)
    kit = _kit()
    fams, kinds = [f for f in a.families.split(",") if f], a.types.split(",")
    bad = [f for f in fams if f not in kit.WIDE_FAMILIES] + [k for k in kinds if k not in TYPES]
    if bad:
        ap.error(f"unknown families / types: {bad}")
    load = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    ids = kit.text_ids()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for fam in fams:
            rows += measure(fam, kinds, kit=kit, ids=ids, steps=a.steps, seq=a.seq, windows=a.windows,
                            threads=a.threads, parts=a.parts, work=pathlib.Path(d),
                            outliers=a.outliers)
        if a.smollm2:
            rows += measure_smollm2(kinds, windows=a.smollm2_windows, seq=512, threads=a.threads,
                                    work=pathlib.Path(d))
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    meta = dict(command="python bench/bench_gguf_llama_ppl.py " + " ".join(sys.argv[1:]), commit=commit,
                machine=f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}", load=load,
                seconds=time.perf_counter() - t0)
    try:
        import llama_cpp
        meta["llama_cpp"] = llama_cpp.__version__
    except ImportError:
        pass
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    md = markdown(rows, meta)
    if a.md:
        pathlib.Path(a.md).write_text("# qcore's prediction of llama.cpp's perplexity of GGUF exports\n\n" + md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
