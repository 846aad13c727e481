"""Speed and memory of the checkpoint exporter and loader on SmolLM2-135M, against transformers' own float
save / load measured in the same run.

    python bench/bench_export.py [--scheme uint4_wo_64] [--threads 2] [--json FILE]

Each measurement runs in its own process (peak RSS is per process), after the model is loaded and quantized:

- export: ``export_hf`` of the frozen model vs ``save_pretrained`` of the float model (wall time, peak RSS growth
  over the loaded model, bytes on disk);
- reload: ``qcore.adapters.from_pretrained`` of the export vs ``AutoModelForCausalLM.from_pretrained`` of the
  float save (wall time, peak RSS).

Prints a table with the ratios; nothing is asserted. Export writes one tensor at a time, so its RSS growth
should stay near the largest tensor, not the model.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(task: str, scheme: str, directory: str, threads: int) -> dict:
    import torch
    torch.set_num_threads(threads)
    import qcore.adapters as A
    from qcore.adapters.eval import models
    from transformers import AutoModelForCausalLM
    out: dict = {"task": task}
    if task in ("export", "save"):
        model, tok = models.load_smollm2()
        if task == "export":
            A.quantize_model(model, A.preset(scheme), progress=False)
            A.freeze(model)
        base = _rss()
        t = time.perf_counter()
        if task == "export":
            A.export_hf(model, directory, tokenizer=tok)
        else:
            model.save_pretrained(directory)
            tok.save_pretrained(directory)
        out.update(seconds=time.perf_counter() - t, rss_growth=_rss() - base,
                   bytes_on_disk=sum(f.stat().st_size for f in pathlib.Path(directory).iterdir()))
    else:
        base = _rss()
        t = time.perf_counter()
        m = A.from_pretrained(directory) if task == "load" else \
            AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        out.update(seconds=time.perf_counter() - t, rss_growth=_rss() - base, model_bytes=A.model_bytes(m))
    return out


def run(task: str, scheme: str, directory: str, threads: int) -> dict:
    p = subprocess.run([sys.executable, __file__, "--child", task, "--scheme", scheme, "--dir", directory,
                        "--threads", str(threads)], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])))
    if p.returncode != 0:
        raise SystemExit(f"{task} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scheme", default="uint4_wo_64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.scheme, args.dir, args.threads)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        q, f = str(pathlib.Path(tmp, "q")), str(pathlib.Path(tmp, "f"))
        r = {k: run(k, args.scheme, d, args.threads) for k, d in (("export", q), ("save", f), ("load", q),
                                                                   ("float_load", f))}
    mib = 2 ** 20
    rows = [("write: qcore export_hf (frozen) vs save_pretrained (float)", r["export"], r["save"]),
            ("read: qcore from_pretrained vs AutoModel (float)", r["load"], r["float_load"])]
    print(f"SmolLM2-135M, scheme {args.scheme}, {args.threads} threads, load average {os.getloadavg()[0]:.2f}")
    print(f"{'':58s} {'qcore s':>8s} {'float s':>8s} {'ratio':>6s} {'qcore RSS+':>10s} {'float RSS+':>10s}")
    for name, a, b in rows:
        print(f"{name:58s} {a['seconds']:8.2f} {b['seconds']:8.2f} {a['seconds'] / b['seconds']:6.2f} "
              f"{a['rss_growth'] / mib:9.0f}M {b['rss_growth'] / mib:9.0f}M")
    print(f"on disk: {r['export']['bytes_on_disk'] / mib:.1f} MiB vs {r['save']['bytes_on_disk'] / mib:.1f} MiB "
          f"({r['export']['bytes_on_disk'] / r['save']['bytes_on_disk']:.3f}x); reloaded model bytes "
          f"{r['load']['model_bytes'] / mib:.1f} MiB vs {r['float_load']['model_bytes'] / mib:.1f} MiB")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(dict(scheme=args.scheme, threads=args.threads, **r), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
