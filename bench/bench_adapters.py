"""Speed and memory of the torch adapters on SmolLM2-135M, with the float model measured in the same run.

    python bench/bench_adapters.py [--threads 2] [--windows 20] [--no-write]

- RTN wall time: ``quantize_model`` of weight-only / dynamic presets on a fresh copy of the fp32 model
  (Quark 0.13: 0.6 s warm, 6 s cold for uint4 g64, anchors.md).
- Evaluation cost: perplexity wall time (the protocol's windows) of the fp32 model and of the fake-quantized
  MXFP4 W+A (dynamic) model, alternated, and their ratio (target <= 1.5x).
- Memory, each in its own process: the peak RSS of quantize + one 512-token forward after the model is loaded,
  float vs fake-quantized (target <= 1.3x); ``model_bytes`` (parameters + buffers) float, fake-quantized and frozen; ``state_dict`` bytes of a
  frozen uint4 g64 model vs float32 (target ~1/7 on the quantized layers).

Writes bench/results/ADAPTERS.md and bench/results/ADAPTERS.json. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import platform
import resource
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

RTN_PRESETS = [("uint4 g64 asym (w_uint4_per_group_asym, group_size=64)", "w_uint4_per_group_asym", {"group_size": 64}),
               ("int8 per-channel (w_int8_per_channel_sym)", "w_int8_per_channel_sym", {}),
               ("MXFP4 W+A dynamic (w_mxfp4_a_mxfp4)", "w_mxfp4_a_mxfp4", {}),
               ("fp8 per-channel W + per-token A (ptpc_fp8)", "ptpc_fp8", {})]


def _state_bytes(sd, keys=None) -> int:
    return sum(v.numel() * v.element_size() for k, v in sd.items() if keys is None or k in keys)


def _status_mb(key: str) -> float:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _child(mode: str, threads: int) -> None:
    """Memory of: load; then (the high-water mark reset) quantize and one forward of a 512-token window.
    Prints JSON: the process peak, the resident size after load, and the peak after load (Linux /proc)."""
    torch.set_num_threads(threads)
    from qcore.adapters import preset, quantize_model
    from qcore.adapters.eval import evaluate as E
    from qcore.adapters.eval import models
    model, tok = models.load_smollm2()
    ids = E.calibration_batches(tok, n=1)[0]
    import gc
    gc.collect()
    rss_loaded = _status_mb("VmRSS")
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (the peak) to the current RSS
    if mode != "float":
        quantize_model(model, preset(mode), progress=False)
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False)
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "rss_after_load_mb": rss_loaded, "peak_after_load_mb": _status_mb("VmHWM")}))


def _peak(mode: str, threads: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--threads", str(threads)], capture_output=True,
                         text=True, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--child", default=None)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    if a.child:
        return _child(a.child, a.threads)
    torch.set_num_threads(a.threads)
    import transformers
    transformers.logging.set_verbosity_error()
    from qcore.adapters import freeze, model_bytes, preset, quantize_model, quantized_modules
    from qcore.adapters.eval import evaluate as E
    from qcore.adapters.eval import models

    res: dict = {"machine": f"{os.cpu_count()} CPUs, torch {torch.__version__} ({a.threads} threads), "
                            f"Python {platform.python_version()}", "load_before": os.getloadavg()}
    base, tok = models.load_smollm2()
    ids = E.protocol_token_ids(tok)

    rows = []
    for label, name, kw in RTN_PRESETS:
        m = copy.deepcopy(base)
        t = time.perf_counter()
        quantize_model(m, preset(name, **kw), progress=False)
        rows.append({"config": label, "seconds": time.perf_counter() - t})
        del m
    res["rtn"] = rows

    q = quantize_model(copy.deepcopy(base), preset("w_mxfp4_a_mxfp4"), progress=False)
    windows = range(0, a.windows)
    times: dict = {"fp32": [], "mxfp4": []}
    ppl = {}
    for rep in range(2):  # alternate, so that load changes hit both
        for key, model in (("fp32", base), ("mxfp4", q)):
            t = time.perf_counter()
            ppl[key] = E.perplexity(model, tok, token_ids=ids, windows=windows, progress=False)
            times[key].append(time.perf_counter() - t)
    ev = {k: min(v) for k, v in times.items()}
    res["eval"] = {"windows": a.windows, "fp32_s": ev["fp32"], "mxfp4_wa_s": ev["mxfp4"],
                   "ratio": ev["mxfp4"] / ev["fp32"], "ppl": ppl}
    del q

    mem = {"float": _peak("float", a.threads), "w_mxfp4_a_mxfp4": _peak("w_mxfp4_a_mxfp4", a.threads),
           "w_uint4_per_group_asym": _peak("w_uint4_per_group_asym", a.threads)}
    for k in ("w_mxfp4_a_mxfp4", "w_uint4_per_group_asym"):
        mem[k]["ratio"] = mem[k]["peak_after_load_mb"] / mem["float"]["peak_after_load_mb"]
    res["peak_rss"] = mem

    m = quantize_model(copy.deepcopy(base), preset("w_uint4_per_group_asym", group_size=64), progress=False)
    fb = model_bytes(base)
    fq = model_bytes(m)
    qnames = {f"{n}.weight" for n in quantized_modules(m)}
    sd_float = base.state_dict()
    freeze(m)
    sd_frozen = m.state_dict()
    qkeys_frozen = {k for k in sd_frozen if any(k.startswith(n + ".") for n in quantized_modules(m))}
    res["bytes"] = {
        "model_bytes_float": fb, "model_bytes_fake_quant": fq, "model_bytes_frozen": model_bytes(m),
        "state_dict_float32": _state_bytes(sd_float), "state_dict_frozen": _state_bytes(sd_frozen),
        "quantized_layers_float32": _state_bytes(sd_float, qnames),
        "quantized_layers_frozen": _state_bytes(sd_frozen, qkeys_frozen - {k.replace('.weight', '.bias') for k in qnames}),
    }
    b = res["bytes"]
    b["ratio_whole"] = b["state_dict_frozen"] / b["state_dict_float32"]
    b["ratio_quantized_layers"] = b["quantized_layers_frozen"] / b["quantized_layers_float32"]
    res["load_after"] = os.getloadavg()

    lines = ["# Torch adapters: speed and memory on SmolLM2-135M (bench/bench_adapters.py)", "",
             f"Machine: {res['machine']}; load average {res['load_before']} -> {res['load_after']}.", "",
             "```", f"python bench/bench_adapters.py --threads {a.threads} --windows {a.windows}", "```", "",
             "| RTN quantize_model (fresh copy of the fp32 model) | wall s |", "|---|---|"]
    lines += [f"| {r['config']} | {r['seconds']:.2f} |" for r in rows]
    e = res["eval"]
    lines += ["", f"Perplexity evaluation ({e['windows']} windows of 512, best of 2 alternated runs): fp32 "
              f"{e['fp32_s']:.1f} s (ppl {e['ppl']['fp32']:.3f}), fake-quantized MXFP4 W+A dynamic "
              f"{e['mxfp4_wa_s']:.1f} s (ppl {e['ppl']['mxfp4']:.3f}): **{e['ratio']:.2f}x** the float evaluation.",
              "", "Memory, one process each: load the model (RSS after load), reset the peak, then quantize and run one "
              "512-token forward (peak after load; the float row only runs the forward). The process peak "
              "includes transformers' GGUF loading, which dominates it.", "",
              "| process | RSS after load MB | peak after load MB | ratio to float | process peak MB |",
              "|---|---|---|---|---|"]
    for k, v in mem.items():
        lines.append(f"| {k} | {v['rss_after_load_mb']:.0f} | {v['peak_after_load_mb']:.0f} | "
                     f"{v.get('ratio', 1.0):.2f} | {v['peak_rss_mb']:.0f} |")
    lines += ["", "| bytes | float32 | fake-quantized | frozen (uint4 g64, packed) | frozen / float |", "|---|---|---|---|---|",
              f"| model_bytes (params + buffers) | {b['model_bytes_float']:,} | {b['model_bytes_fake_quant']:,} | "
              f"{b['model_bytes_frozen']:,} | {b['model_bytes_frozen'] / b['model_bytes_float']:.3f} |",
              f"| state_dict, whole model | {b['state_dict_float32']:,} | | {b['state_dict_frozen']:,} | "
              f"{b['ratio_whole']:.3f} (1/{1 / b['ratio_whole']:.1f}) |",
              f"| state_dict, the quantized Linear weights | {b['quantized_layers_float32']:,} | | "
              f"{b['quantized_layers_frozen']:,} | {b['ratio_quantized_layers']:.3f} "
              f"(1/{1 / b['ratio_quantized_layers']:.1f}) |", "",
              "The whole-model ratio includes the float embedding table (tied to the excluded lm_head) and norms."]
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_write:
        (ROOT / "bench" / "results" / "ADAPTERS.md").write_text(text)
        (ROOT / "bench" / "results" / "ADAPTERS.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
