"""What a work directory costs (issue 23, "Long runs survive interruption"): GPTQ through ``quantize_model`` on a
random Llama without and with ``work_dir=``, a run interrupted after half its layers and resumed, and the disk the
work directory holds; every result compared byte for byte with the uninterrupted run.

    python bench/bench_work_dir.py          # hidden 512, 8 layers, 4 x 256 tokens; writes bench/results/WORK_DIR.md/.json
    python bench/bench_work_dir.py --hidden 256 --layers 4 --tokens 128 --out /tmp/wd

Reference measured in the same run: one float forward of the model over the calibration batches. Timings are
medians of ``--repeat`` runs; nothing is asserted but the byte equality.
"""

import argparse
import json
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402
import transformers  # noqa: E402

import qcore.adapters as A  # noqa: E402
from qcore.adapters.passes import checkpointing as K  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def model(hidden: int, layers: int):
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                   num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=1024)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _bytes(d: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def _state(m) -> dict:
    return {k: v.clone() for k, v in m.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per calibration batch")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "WORK_DIR"), help="writes OUT.md and OUT.json")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 1024, (1, a.tokens), generator=g) for _ in range(a.batches)]
    cfg = A.preset("uint4_wo_64").replace(algorithms=({"name": "gptq"},))
    base = model(a.hidden, a.layers)
    weights = sum(p.numel() * p.element_size() for p in base.parameters())
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="qcore-wd-"))
    times: dict = {k: [] for k in ("float", "plain", "work_dir", "resumed")}
    equal = True
    disk = 0
    A.quantize_model(model(64, 1), cfg, [d[:, :16] for d in data[:1]], progress=False)  # warm-up (first calls)
    try:
        for r in range(a.repeat):
            m = model(a.hidden, a.layers)
            t = time.perf_counter()
            with torch.no_grad():
                for b in data:
                    m(b)
            times["float"].append(time.perf_counter() - t)

            t = time.perf_counter()
            A.quantize_model(m, cfg, data, progress=False)
            times["plain"].append(time.perf_counter() - t)
            ref = _state(m)
            del m

            w = tmp / f"w{r}"
            m = model(a.hidden, a.layers)
            t = time.perf_counter()
            A.quantize_model(m, cfg, data, progress=False, work_dir=w)
            times["work_dir"].append(time.perf_counter() - t)
            equal &= _same(ref, _state(m))
            disk = _bytes(w)
            del m

            # interrupted after half the layers, then resumed: the resumed call's time
            w2 = tmp / f"i{r}"
            real = K.WorkDir.save_layer
            half = a.layers // 2 - 1

            def save_layer(self, i, *args, real=real, half=half):
                real(self, i, *args)
                if i == half:
                    raise KeyboardInterrupt
            K.WorkDir.save_layer = save_layer
            try:
                A.quantize_model(model(a.hidden, a.layers), cfg, data, progress=False, work_dir=w2)
            except KeyboardInterrupt:
                pass
            finally:
                K.WorkDir.save_layer = real
            m = model(a.hidden, a.layers)
            t = time.perf_counter()
            A.quantize_model(m, cfg, data, progress=False, work_dir=w2, resume=True)
            times["resumed"].append(time.perf_counter() - t)
            equal &= _same(ref, _state(m))
            del m
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "load_average_1min": load, "hidden": a.hidden,
            "layers": a.layers, "tokens": a.tokens * a.batches, "weights_bytes": weights, "repeat": a.repeat}
    rows = [
        ("float forward over the calibration tokens (reference)", med["float"], 1.0, "-", "-"),
        ("GPTQ, no work dir", med["plain"], med["plain"] / med["float"], "landed path (same code)", "-"),
        ("GPTQ, work_dir= (saves after each layer)", med["work_dir"], med["work_dir"] / med["float"],
         f"{med['work_dir'] / med['plain']:.2f}x the run without", "<= 1.10x the run without"),
        (f"GPTQ resumed after {a.layers // 2} of {a.layers} layers", med["resumed"], med["resumed"] / med["float"],
         f"{med['resumed'] / med['plain']:.2f}x the whole run", "about half the run"),
    ]
    lines = ["# Work directory cost (bench/bench_work_dir.py)", "",
             f"machine: {meta['machine']}, {meta['cpus']} CPUs, torch threads {meta['torch_threads']}, load average "
             f"{load:.1f} (1 min) at the end; random Llama hidden {a.hidden}, {a.layers} layers, "
             f"{weights / 1e6:.0f} MB float32 weights; GPTQ uint4 g64 on {a.batches} x {a.tokens} tokens; "
             f"median of {a.repeat}", "",
             "| what | seconds | / float forward | vs | target |", "|---|---|---|---|---|"]
    lines += [f"| {w} | {s:.2f} | {r:.1f} | {v} | {t} |" for w, s, r, v, t in rows]
    lines += ["", f"work directory on disk after the run: {disk / 1e6:.1f} MB ({disk / weights:.2f} x the float "
              f"weights: every layer's state and GPTQ's codes and scales, plus two layer inputs)",
              f"byte-identical to the uninterrupted run (with work_dir, and resumed): {equal}",
              "old figure: none (the landed code has no work directory); command: `python bench/bench_work_dir.py`"]
    text = "\n".join(lines) + "\n"
    print(text)
    out = pathlib.Path(a.out)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "seconds": med, "disk_bytes": disk,
                                                    "byte_identical": equal}, indent=1) + "\n")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
