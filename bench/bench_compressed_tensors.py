"""SmolLM2-135M through compressed-tensors: qcore quantizes, ``export_compressed_tensors`` writes, transformers with
the compressed-tensors package loads (``CompressedTensorsConfig(dequantize=True)`` for weight-only schemes, its
default compressed route otherwise), and qcore's ``load_compressed_tensors`` loads; perplexity on the protocol's
first windows for all three, and the largest logit difference on the first window.

    python bench/bench_compressed_tensors.py [--schemes uint4_wo_64,w_int8_a_int8_per_token_dynamic,fp8+kv]
                                             [--windows 4]

(SmolLM2's 576 hidden features take no groups of 128: 576 = 4.5 x 128; groups of 64 divide every Linear.)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default="uint4_wo_64,w_int8_a_int8_per_token_dynamic,fp8+kv")
    ap.add_argument("--windows", type=int, default=4)
    args = ap.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    warnings.simplefilter("ignore")
    import copy
    import transformers
    from qcore.adapters import freeze, preset, quantize_model
    from qcore.adapters.eval import evaluate as E
    from qcore.adapters.io.compressed_tensors import export_compressed_tensors
    from qcore.adapters.io.compressed_tensors import load_compressed_tensors
    from qcore.adapters.eval.models import load_smollm2

    base, tok = load_smollm2()
    ids = E.protocol_token_ids(tok)
    windows = range(args.windows)
    start = E.CALIBRATION_START_WINDOW
    calib = [ids[i * E.SEQ_LEN:(i + 1) * E.SEQ_LEN].reshape(1, -1) for i in range(start, start + 4)]
    first = ids[:E.SEQ_LEN].reshape(1, -1)

    def ppl(m):
        return E.perplexity(m, tok, token_ids=ids, windows=windows, progress=False)

    def logits(m):
        with torch.inference_mode():
            return m(first, use_cache=False).logits.float()

    print(f"SmolLM2-135M fp32, {args.windows} protocol windows of {E.SEQ_LEN} tokens, torch threads "
          f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    print(f"float perplexity {ppl(base):.4f}")
    header = f"{'scheme':34} {'format':16} {'lossless':8} {'qcore':>9} {'ct':>9} {'import':>9} {'max|dlogit| ct':>15}"
    print(header)
    for name in args.schemes.split(","):
        base_name, _, kv = name.partition("+")  # "fp8+kv": with fp8 KV-cache scales
        cfg = preset(base_name, kv_cache="fp8" if kv == "kv" else None)
        m = copy.deepcopy(base)
        quantize_model(m, cfg, calib, progress=False)
        freeze(m)
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            info = export_compressed_tensors(m, os.path.join(d, "ct"))
            t_export = time.perf_counter() - t0
            weight_only = cfg.layer.input is None and cfg.layer.output is None and cfg.kv_cache is None
            kw = {"quantization_config": transformers.CompressedTensorsConfig(dequantize=True)} if weight_only else {}
            ct = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(d, "ct"), dtype=torch.float32,
                                                                   local_files_only=True, **kw).eval()
            back = load_compressed_tensors(os.path.join(d, "ct"))
            ref, lc = logits(m), logits(ct)
            diff = float((lc - ref).abs().max())
            same = torch.equal(logits(back), ref)
            print(f"{name:34} {info.format:16} {str(info.lossless):8} {ppl(m):9.4f} {ppl(ct):9.4f} "
                  f"{ppl(back):9.4f} {diff:15.3g}   (import logits identical: {same}, export {t_export:.1f} s, "
                  f"{info.bytes_on_disk / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
