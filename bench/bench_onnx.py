"""ONNX export of SmolLM2-135M: perplexity and speed in onnxruntime (CPU) against the quantized torch model it
was exported from, on the evaluation protocol (src/qcore/adapters/eval/evaluate.py: 512-token windows of pydoc_data.topics).

    python bench/bench_onnx.py [--scheme uint4_wo_64] [--formats qdq,matmulnbits] [--windows 20] [--threads 2]
                               [--json FILE]

For each weight format: export time and file size; perplexity over the first ``--windows`` protocol windows
and the wall time of those forwards, for torch (the in-memory qcore model) and onnxruntime (exact session:
``qcore.formats.onnx.EXACT_SESSION_CONFIG``; and onnxruntime's default session, which fuses QDQ into its own
int8 kernels). Nothing is asserted; the relative perplexity difference is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _nll(logits, ids) -> float:
    import numpy as np
    x = logits[0, :-1].astype(np.float64)
    m = x.max(-1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(x - m).sum(-1)))
    return float((lse - x[np.arange(x.shape[0]), ids[1:]]).sum())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scheme", default="uint4_wo_64")
    p.add_argument("--formats", default="qdq,matmulnbits")
    p.add_argument("--windows", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--default-session", action="store_true", help="also run onnxruntime's default session")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import torch
    torch.set_num_threads(a.threads)
    import qcore.adapters as A
    from qcore.adapters.eval import evaluate as E
    from qcore.adapters.eval import models
    from qcore.adapters.io.onnx import decoder_logits, export_onnx
    from qcore.formats.onnx import ort_session

    model, tok = models.load_smollm2()
    A.quantize_model(model, A.preset(a.scheme), progress=False)
    ids = E.protocol_token_ids(tok)
    spans = [(w * E.SEQ_LEN, (w + 1) * E.SEQ_LEN) for w in range(a.windows)]
    n_pred = len(spans) * (E.SEQ_LEN - 1)

    t = time.perf_counter()
    nll = 0.0
    with torch.inference_mode():
        for s0, s1 in spans:
            x = ids[s0:s1][None]
            nll += _nll(model(input_ids=x, use_cache=False).logits.float().numpy(), x[0].numpy())
    res: dict = {"scheme": a.scheme, "windows": a.windows, "threads": a.threads,
                 "torch": {"ppl": math.exp(nll / n_pred), "seconds": time.perf_counter() - t}}
    print(f"torch  {a.scheme}: ppl {res['torch']['ppl']:.4f}  {res['torch']['seconds']:.1f} s")
    with tempfile.TemporaryDirectory() as d:
        for fmt in a.formats.split(","):
            path = pathlib.Path(d) / f"{fmt}.onnx"
            t = time.perf_counter()
            info = export_onnx(model, path, weight_format=fmt)
            r = {"export_seconds": time.perf_counter() - t, "bytes": info.bytes_on_disk,
                 "hows": sorted({q.how for q in info.quantized})}
            for label, exact in (("exact", True),) + ((("default", False),) if a.default_session else ()):
                sess = ort_session(path, exact=exact, threads=a.threads)
                t = time.perf_counter()
                nll = 0.0
                for s0, s1 in spans:
                    x = ids[s0:s1][None].numpy()
                    nll += _nll(decoder_logits(sess, x), x[0])
                ppl = math.exp(nll / n_pred)
                r[label] = {"ppl": ppl, "seconds": time.perf_counter() - t,
                            "rel_diff": ppl / res["torch"]["ppl"] - 1}
                print(f"ort    {fmt} ({label} session): ppl {ppl:.4f} ({r[label]['rel_diff']:+.2e} vs torch)  "
                      f"{r[label]['seconds']:.1f} s; file {info.bytes_on_disk / 1e6:.1f} MB, export "
                      f"{r['export_seconds']:.1f} s")
                del sess
            res[fmt] = r
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    main()
