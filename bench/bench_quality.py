"""Model quality of quantization configs: SmolLM2-135M-Instruct perplexity and MiniLM embedding similarity.

    python bench/bench_quality.py [--configs fp32,...] [--windows 20] [--batch-size 1] [--threads 2]
        [--no-minilm] [--no-smollm2] [--md bench/results/QUALITY.md] [--json bench/results/QUALITY.json] [--no-write]

For every config (``quantize_configs`` below: name -> ``quantize(model) -> model``):

- SmolLM2: a fresh deep copy of the fp32 model (loaded once from the GGUF, ``qcore.adapters.eval.models``) is
  quantized (``quant s``: wall time of the call), then its perplexity is measured under the project protocol
  (``qcore.adapters.eval.evaluate``: pydoc text, non-overlapping 512-token windows 0..19; ``ppl s``: wall time);
  the table shows Quark 0.13's figure for the same config where anchors.md has one.
- MiniLM (all-MiniLM-L6-v2): the same callable on a fresh copy of the fp32 encoder; ``cos``: mean cosine of
  mean-pooled sentence embeddings of ``evaluation_sentences()`` against fp32 (1.0 = unchanged).

Calibration data for configs that need it (``CalibrationData``): the protocol's 32 x 512-token SmolLM2
windows 20..51 (never overlapping the evaluation windows) and ``calibration_sentences()`` for MiniLM (disjoint
from the evaluation sentences). Nothing is asserted; the numbers are for people. Peak RSS is the process's
high-water mark so far (``ru_maxrss``), so it only grows down the table. Runs offline (HF_HUB_OFFLINE=1).
On the 2-core development machine the fp32-only run takes about a minute (load ~25 s, perplexity ~30 s).

Threads on a shared machine: the script sets ``OMP_WAIT_POLICY=PASSIVE`` (unless already set) before importing
torch. With OpenMP's default spinning waits, a SmolLM2 window (512 tokens, one forward) took 1.4 s with 2
threads on an idle machine but 4 s with another process busy on one core and 11 s when that process was itself
multi-threaded (1 thread: 2.4-3 s in all three cases); with PASSIVE waits 2 threads cost 2.7 s under contention
and the same 1.4-1.8 s when idle.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import pathlib
import platform
import resource
import subprocess
import sys
import time
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported: see the module docstring

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's qcore, however the script is started

import torch  # noqa: E402

from qcore.adapters.eval import evaluate as E  # noqa: E402
from qcore.adapters.eval import models  # noqa: E402

Quantize = Callable[[torch.nn.Module], "torch.nn.Module | None"]  # None: the config does not apply to that model


@dataclasses.dataclass(frozen=True)
class CalibrationData:
    """What a config may calibrate on. ``lm_batches``: int64 ``[1, 512]`` SmolLM2 token windows 20.. of the
    protocol text; ``sentences``: MiniLM calibration sentences (disjoint from the evaluation ones);
    ``lm_tokenizer`` / ``minilm_tokenizer`` to tokenize them."""

    lm_batches: tuple
    lm_tokenizer: object
    sentences: tuple
    minilm_tokenizer: object


def fp32(model: torch.nn.Module) -> torch.nn.Module:
    """The unquantized baseline."""
    return model


# ======================================================================================================== #
#  PLUG-IN POINT: quantization configs.                                                                     #
#  Add entries name -> quantize(model) -> model. The callable gets a fresh fp32 copy of SmolLM2            #
#  (LlamaForCausalLM) or MiniLM (BertModel) and returns the quantized model (in place or new). Close over  #
#  ``calib`` for calibration-based methods. Names matching a key of E.SMOLLM2_REFERENCE_PPL get Quark's    #
#  figure printed beside them.                                                                              #
# ======================================================================================================== #
def _preset(name: str, calib: CalibrationData, *, algorithms: tuple = (), weight_dtype: str | None = None,
            **kw) -> Quantize:
    """``quantize_model`` with a preset (and ``algorithms``, e.g. ``({"name": "gptq"},)``); calibration on the
    protocol's windows (SmolLM2) or on the calibration sentences (MiniLM) when the preset has static activation
    scales or algorithms. ``weight_dtype``: another integer format for the weights, e.g. ``"uint3"`` with
    ``w_uint4_per_group_asym`` for uint3 per group."""
    from qcore.adapters import preset, quantize_model

    config = preset(name, **kw).replace(algorithms=tuple(algorithms))
    if weight_dtype is not None:
        import qcore
        w = config.layer.weight
        spec = dataclasses.replace(w.spec, dtype=qcore.get_dtype(weight_dtype), name=weight_dtype)
        config = config.replace(layer=dataclasses.replace(config.layer, weight=dataclasses.replace(w, spec=spec)))

    scaling = any(a["name"] in ("awq", "smoothquant", "autosmoothquant", "quarot", "spinquant") for a in algorithms)

    def run(model):
        if getattr(model.config, "model_type", "") == "bert" and scaling:
            return None  # AWQ / SmoothQuant have no built-in scaling map for BERT layers; rotations need RMSNorm
        if getattr(model.config, "model_type", "") == "bert":
            tok = calib.minilm_tokenizer
            s = list(calib.sentences)
            data = [dict(tok(s[i:i + 16], padding=True, return_tensors="pt")) for i in range(0, len(s), 16)]
        else:
            data = list(calib.lm_batches)
        return quantize_model(model, config, data, progress=False)

    return run


def quantize_configs(calib: CalibrationData) -> dict[str, Quantize]:
    from qcore import ScaleMode

    mx = {f"W MXFP4 / A MXFP4 dynamic ({m.value})": _preset("w_mxfp4_a_mxfp4", calib, scale_mode=m)
          for m in (ScaleMode.EVEN, ScaleMode.RCEIL, ScaleMode.FLOOR, ScaleMode.CEIL)}
    mx_wo = {f"W MXFP4 weight-only ({m.value})": _preset("mxfp4_weight_only", calib, scale_mode=m)
             for m in (ScaleMode.EVEN, ScaleMode.RCEIL, ScaleMode.FLOOR)}
    return {
        "fp32": fp32,
        "uint4 weight-only g64 asym RTN": _preset("w_uint4_per_group_asym", calib, group_size=64),
        "W fp8 / A fp8 per-tensor static": _preset("w_fp8_a_fp8", calib),
        "int8 per-channel weight-only": _preset("w_int8_per_channel_sym", calib),
        **mx, **mx_wo,
        "int8 W8A8 per-tensor static (int8)": _preset("int8", calib),
        "int8 W8A8 W per-channel, A per-tensor static": _preset("w_int8_per_channel_a_int8_per_tensor_sym", calib),
        "int8 W8A8 W per-channel, A per-token dynamic": _preset("w_int8_a_int8_per_token_dynamic", calib),
        "fp8 W per-channel, A per-token dynamic (ptpc_fp8)": _preset("ptpc_fp8", calib),
        "W MXFP6 e2m3 / A MXFP6 e2m3 dynamic": _preset("w_mxfp6_e2m3_a_mxfp6_e2m3", calib),
        "nvfp4 (W+A)": _preset("nvfp4", calib),
        "int4 weight-only g128 sym (w_int4_per_group_sym)": _preset("w_int4_per_group_sym", calib),
        **algorithm_configs(calib),
    }


# issue 24: one module per algorithm, bench/quality_<name>.py with ``configs(calib, preset) -> {name: quantize}``
# (``preset`` is ``_preset`` above); a module not there yet is skipped. Their rows run only when named in --configs
# (AutoRound and distillation take from minutes to an hour per row on this CPU).
_ISSUE24 = ("autoround", "gptaq", "qronos", "hqq", "svdquant", "distill")


def _issue24_configs(calib: CalibrationData) -> dict[str, Quantize]:
    import importlib.util

    out: dict = {}
    for name in _ISSUE24:
        path = ROOT / "bench" / f"quality_{name}.py"
        if path.exists():
            spec = importlib.util.spec_from_file_location(f"quality_{name}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            out.update(mod.configs(calib, _preset))
    return out


def algorithm_configs(calib: CalibrationData) -> dict[str, Quantize]:
    """Issue 10: GPTQ, AWQ, SmoothQuant and AutoSmoothQuant against the round-to-nearest rows above."""
    from qcore import ScaleMode

    gptq = ({"name": "gptq"},)
    return {
        "uint4 weight-only g64 asym + GPTQ": _preset("w_uint4_per_group_asym", calib, group_size=64, algorithms=gptq),
        "uint4 weight-only g64 asym + GPTQ (Quark's: static groups)": _preset(
            "w_uint4_per_group_asym", calib, group_size=64,
            algorithms=({"name": "gptq", "static_groups": True, "true_sequential": False},)),
        "W MXFP4 weight-only (even) + GPTQ": _preset("mxfp4_weight_only", calib, scale_mode=ScaleMode.EVEN,
                                                     algorithms=gptq),
        "uint4 weight-only g64 asym + AWQ": _preset("w_uint4_per_group_asym", calib, group_size=64,
                                                    algorithms=({"name": "awq"},)),
        "uint4 weight-only g64 asym + AWQ + GPTQ": _preset("w_uint4_per_group_asym", calib, group_size=64,
                                                           algorithms=({"name": "awq"}, {"name": "gptq"})),
        "int8 W8A8 per-tensor static + SmoothQuant a=0.5": _preset("int8", calib,
                                                                   algorithms=({"name": "smoothquant"},)),
        "int8 W8A8 per-tensor static + SmoothQuant a=0.8": _preset(
            "int8", calib, algorithms=({"name": "smoothquant", "alpha": 0.8},)),
        "int8 W8A8 per-tensor static + AutoSmoothQuant": _preset("int8", calib,
                                                                 algorithms=({"name": "autosmoothquant"},)),
        "int4 weight-only g32 sym RTN": _preset("int4_wo_32", calib),
        "int4 weight-only g32 sym + GPTQ": _preset("int4_wo_32", calib, algorithms=gptq),
        # rotations (issue 11): W+A MXFP4 and W4A4 int (int4 g64 weights, int4 per-token dynamic activations)
        **{f"{label} {name}": _preset(scheme, calib, group_size=gs, algorithms=algos)
           for label, scheme, gs in (("W MXFP4 / A MXFP4 (even)", "w_mxfp4_a_mxfp4", None),
                                     ("W4A4 int g64 / per-token", "w_int4_a_int4_per_token_dynamic", 64))
           for name, algos in (("RTN", ()), ("+ GPTQ", gptq), ("+ QuaRot", ({"name": "quarot"},)),
                               ("+ QuaRot + GPTQ", ({"name": "quarot"},) + gptq),
                               ("+ SpinQuant(40) + GPTQ", ({"name": "spinquant", "steps": 40},) + gptq))},
    }


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _loadavg():
    try:
        return tuple(round(v, 2) for v in os.getloadavg())
    except OSError:  # pragma: no cover - not on Linux
        return None


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    text = E.pydoc_text()
    meta = dict(python=platform.python_version(), torch=torch.__version__, threads=torch.get_num_threads(),
                cpus=os.cpu_count(), commit=_commit(), loadavg_start=_loadavg(), windows=args.windows,
                batch_size=args.batch_size, text_is_protocol=E.text_sha256(text) == E.PYDOC_TEXT_SHA256)
    rows: dict[str, dict] = {}

    lm = lm_tok = ids = enc = enc_tok = None
    t0 = time.perf_counter()
    if args.smollm2:
        lm, lm_tok = models.load_smollm2()
        meta["smollm2_load_s"] = round(time.perf_counter() - t0, 2)
        ids = E.protocol_token_ids(lm_tok, text=text)
        meta["smollm2_tokens"] = ids.numel()
    if args.minilm:
        t1 = time.perf_counter()
        enc, enc_tok = models.load_minilm()
        meta["minilm_load_s"] = round(time.perf_counter() - t1, 2)
        eval_sents = E.evaluation_sentences()
        ref = E.sentence_embeddings(enc, enc_tok, eval_sents)
    meta["rss_after_load_mb"] = round(_rss_mb())
    calib = CalibrationData(
        lm_batches=tuple(E.calibration_batches(None, token_ids=ids)) if ids is not None else (),
        lm_tokenizer=lm_tok, sentences=tuple(E.calibration_sentences()), minilm_tokenizer=enc_tok)

    base = quantize_configs(calib)
    configs = {**base, **_issue24_configs(calib)}
    wanted = args.configs.split(",") if args.configs else list(base)
    unknown = [c for c in wanted if c not in configs]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {', '.join(configs)}")

    print(f"qcore bench_quality: torch {meta['torch']}, {meta['threads']} threads, {meta['cpus']} CPUs, python "
          f"{meta['python']}, load average {meta['loadavg_start']}")
    if args.smollm2:
        print(f"SmolLM2 loaded in {meta['smollm2_load_s']} s, {meta['smollm2_tokens']} protocol tokens "
              f"(text is the protocol's: {meta['text_is_protocol']}); windows 0..{args.windows - 1} of 512")
    for name in wanted:
        quantize = configs[name]
        row: dict = {}
        if args.smollm2:
            model = copy.deepcopy(lm)
            t1 = time.perf_counter()
            model = quantize(model)
            row["quantize_s"] = round(time.perf_counter() - t1, 3)
            t1 = time.perf_counter()
            row["ppl"] = E.perplexity(model, None, token_ids=ids, windows=range(args.windows),
                                      batch_size=args.batch_size, progress=not args.no_progress)
            row["ppl_eval_s"] = round(time.perf_counter() - t1, 2)
            row["quark_ppl"] = E.SMOLLM2_REFERENCE_PPL.get(name) if args.windows == 20 else None
            del model
        if args.minilm:
            model = copy.deepcopy(enc)
            t1 = time.perf_counter()
            model = quantize(model)
            if model is not None:  # None: the config does not apply to a BERT encoder (Llama-only scaling maps)
                row["minilm_quantize_s"] = round(time.perf_counter() - t1, 3)
                row["minilm_cos"] = E.embedding_similarity(model, enc_tok, eval_sents, reference_embeddings=ref)
            del model
        row["peak_rss_mb"] = round(_rss_mb())
        rows[name] = row
        print(_line(name, row), flush=True)
    meta["loadavg_end"] = _loadavg()
    meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return dict(meta=meta, results=rows)


_HEAD = f"{'config':<34} {'quant s':>8} {'ppl':>9} {'quark':>8} {'ppl s':>7} {'cos':>8} {'rss MB':>7}"


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _line(name, r) -> str:
    return (f"{name:<34} {_fmt(r.get('quantize_s'), '8.2f')} {_fmt(r.get('ppl'), '9.4f')} "
            f"{_fmt(r.get('quark_ppl'), '8.3f')} {_fmt(r.get('ppl_eval_s'), '7.1f')} "
            f"{_fmt(r.get('minilm_cos'), '8.5f')} {_fmt(r.get('peak_rss_mb'), '7d')}")


def write_markdown(res: dict, path: pathlib.Path, argv: list[str]) -> None:
    m = res["meta"]
    lines = [
        "# Quality results: SmolLM2 perplexity and MiniLM similarity (bench/bench_quality.py)", "",
        f"Machine: {m['cpus']} CPUs, torch {m['torch']} ({m['threads']} threads), Python {m['python']}, qcore at "
        f"commit {m['commit']}; load average {m['loadavg_start']} -> {m['loadavg_end']}. Protocol text: "
        f"{'yes' if m['text_is_protocol'] else 'NO (other Python: figures not comparable)'}. "
        f"Perplexity over windows 0..{m['windows'] - 1} of 512 tokens, batch size {m['batch_size']}. "
        "Columns: quant s = wall time of quantize(model) on SmolLM2; ppl / quark = ours / Quark 0.13 (anchors.md); "
        "ppl s = perplexity wall time; cos = MiniLM mean cosine vs fp32 on evaluation_sentences(); rss MB = "
        "process peak so far. Raw numbers: QUALITY.json.", "",
        "```", "python bench/bench_quality.py " + " ".join(argv), "```", "",
        "```", _HEAD, "-" * len(_HEAD), *(_line(k, r) for k, r in res["results"].items()), "```", "",
    ]
    path.write_text("\n".join(lines))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="", help="comma-separated config names (default: all but the rows of bench/quality_<name>.py, which run "
                   "only when named)")
    p.add_argument("--windows", type=int, default=20, help="evaluation windows 0..N-1 (protocol: 20)")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward pass (default 1)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--no-minilm", dest="minilm", action="store_false", help="skip MiniLM")
    p.add_argument("--no-smollm2", dest="smollm2", action="store_false", help="skip SmolLM2")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar during perplexity")
    p.add_argument("--md", default=str(ROOT / "bench" / "results" / "QUALITY.md"), help="markdown output")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "QUALITY.json"), help="JSON output")
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    if not 1 <= args.windows <= 20:
        p.error(f"--windows must be 1..20 (the evaluation windows), got {args.windows}")
    if not (args.minilm or args.smollm2):
        p.error("nothing to do: both --no-minilm and --no-smollm2")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    res = run(args)
    print(f"whole run {res['meta']['elapsed_s']} s, load average {res['meta']['loadavg_end']}")
    if not args.no_write:
        pathlib.Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
        write_markdown(res, pathlib.Path(args.md), argv)
        print(f"wrote {args.md}, {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
