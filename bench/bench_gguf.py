"""SmolLM2-135M quantized by qcore, exported to GGUF, evaluated in llama.cpp and in qcore on the protocol's 20
windows (bench/results/GGUF.md).

    python bench/bench_gguf.py [--scheme uint4|int4] [--windows 20] [--threads 2] [--json FILE]

Steps: load SmolLM2 (float32, transformers' GGUF loader), quantize every Linear but the (tied) head with groups
of 32 along the input axis and float16 scales (RTN, no calibration): ``uint4`` asymmetric (default; GGUF Q4_1) or
``int4`` symmetric (GGUF Q4_0), then

1. ``qcore``: perplexity of the in-memory quantized model (``adapters.evaluate.perplexity``);
2. ``export_gguf`` (tokenizer fields copied from the shipped GGUF file); the per-tensor report says how many
   weights are lossless (Q4_1 stores ``m = -scale * zero_point`` in float16, which rounds; Q4_0 is lossless);
3. ``qcore from_gguf``: perplexity of the exported file imported back (``adapters.from_gguf``: exactly the
   file's values, as transformers' loader would read them);
4. ``llama.cpp`` (llama-cpp-python): the same token windows through ``Llama.eval`` with ``logits_all``; the
   cross entropy is computed here from its float32 logits, in float64, like ``perplexity``. llama.cpp
   quantizes activations to 8 bits inside its Q4_0 / Q4_1 dot products, the expected difference to 3.

Nothing is asserted; prints a table (and writes ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's qcore, however the script is started


def llama_cpp_perplexity(path: pathlib.Path, ids, spans, threads: int) -> tuple[float, float]:
    """(perplexity, seconds evaluating) of llama.cpp on the token windows ``spans`` of ``ids``."""
    from qcore.adapters.eval.evaluate import perplexity_from_nll
    from qcore.testing.ggml import llama_cpp_nll
    nll, n, seconds = llama_cpp_nll(path, ids, spans, threads=threads)
    return perplexity_from_nll(nll, n), seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scheme", choices=("uint4", "int4"), default="uint4",
                    help="uint4 asymmetric (GGUF Q4_1) or int4 symmetric (GGUF Q4_0)")
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch
    torch.set_num_threads(args.threads)
    import qcore
    import qcore.adapters as A
    from qcore import PerGroup
    from qcore.adapters.eval import evaluate as E
    from qcore.adapters.eval import models
    from qcore.adapters.io.gguf import export_gguf

    model, tok = models.load_smollm2()
    spec = qcore.make_spec(args.scheme, granularity=PerGroup(32, axis=-1), scale_dtype="float16")
    A.quantize_model(model, A.ModelConfig(A.LayerConfig(weight=spec)), progress=False)
    ids = E.protocol_token_ids(tok)
    windows = range(args.windows)
    spans = E.token_windows(ids.numel(), seq_len=E.SEQ_LEN, windows=windows)
    out: dict = {"scheme": f"{args.scheme} {'asymmetric' if args.scheme == 'uint4' else 'symmetric'} g32 float16 "
                           f"scales",
                 "windows": args.windows, "threads": args.threads, "llama_cpp": __import__("llama_cpp").__version__}

    t = time.perf_counter()
    out["qcore_ppl"] = E.perplexity(model, tok, token_ids=ids, windows=windows, progress=False)
    out["qcore_seconds"] = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "smollm2.gguf"
        info = export_gguf(model, path, tokenizer=models.smollm2_path())
        out["gguf_bytes"] = info.bytes_on_disk
        out["gguf_lossless"] = sum(r.exact for r in info.quantized)
        out["gguf_quantized"] = len(info.quantized)
        out["gguf_max_abs_diff"] = max((r.max_abs_diff for r in info.quantized), default=0.0)
        del model
        back = A.from_gguf(path)
        out["import"] = back.qcore_gguf_report.summary()
        t = time.perf_counter()
        out["qcore_from_gguf_ppl"] = E.perplexity(back, tok, token_ids=ids, windows=windows, progress=False)
        out["qcore_from_gguf_seconds"] = time.perf_counter() - t
        del back
        out["llama_cpp_ppl"], out["llama_cpp_seconds"] = llama_cpp_perplexity(path, ids, spans, args.threads)
    out["command"] = "python bench/bench_gguf.py" + ("" if args.scheme == "uint4" else f" --scheme {args.scheme}") + \
        ("" if args.windows == 20 else f" --windows {args.windows}")
    print(f"{out['scheme']}, {args.windows} windows of {E.SEQ_LEN} tokens, {args.threads} threads")
    print(f"GGUF: {out['gguf_lossless']}/{out['gguf_quantized']} weights lossless (max abs diff "
          f"{out['gguf_max_abs_diff']:.3g}), {out['gguf_bytes'] / 1e6:.1f} MB; import: {out['import']}")
    print("| evaluator | ppl | seconds |\n|---|---|---|")
    for k, name in (("qcore", "qcore (in memory)"), ("qcore_from_gguf", "qcore from_gguf(file)"),
                    ("llama_cpp", f"llama.cpp {out['llama_cpp']}")):
        print(f"| {name} | {out[k + '_ppl']:.4f} | {out[k + '_seconds']:.1f} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
