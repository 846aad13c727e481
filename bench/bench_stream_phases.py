"""Where streaming RTN's memory and time go, per phase, new code against the landed one on the same checkpoint;
and the peak of GPTQ's Hessian work on one ``n``-wide Hessian (issue 23, "Larger than the machine").

    python bench/bench_stream_phases.py --old-python ../landed/.venv/bin/python          # 13B widths, 4 layers
    python bench/bench_stream_phases.py --hidden 2560 --intermediate 6912 --layers 3 --gptq-n 3000   # small

1. writes a synthetic bf16 Llama checkpoint with ``bench_scale.write_checkpoint`` (default: the 13B widths,
   hidden 5120, intermediate 13824, vocab 32000, ``--layers 4``: 3.2 GB under ``--dir``);
2. runs ``quantize_checkpoint`` uint4 g128 round-to-nearest in a fresh process per implementation (this
   checkout's, and with ``--old-python`` the interpreter of another checkout, e.g. the landed code's venv), one
   thread, sampling the resident memory every 2 ms and labelling it by phase: ``load`` (the layer's tensors read),
   ``commit`` (round-to-nearest into the weights), ``weight_parts`` (codes for the checkpoint), ``encode`` (packing
   to the layout), ``spill`` (the layer's records written: weight_parts + encode), the rest unlabelled; RSS at each
   layer's start (it settles after ~3 layers); the outputs' bytes compared;
3. runs ``gptq()`` on an ``--gptq-n``-wide Hessian (32 weight rows: the Hessian work dominates) in each
   implementation: the peak above the caller's state, in float64 ``[n, n]`` copies; results compared;
4. writes ``--out``.md/.json and deletes the checkpoint (``--keep`` keeps it).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parents[1]
GiB = 1024 ** 3

_CHILD = r'''
import sys, time, threading, os, json, collections
import torch
torch.set_num_threads(1)
mode, a, b, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
PAGE = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE
def hwm():
    for l in open("/proc/self/status"):
        if l.startswith("VmHWM"):
            return int(l.split()[1]) * 1024
phase = ["other"]; peak = collections.defaultdict(int); tm = collections.defaultdict(float); stop = [False]
def sampler():
    while not stop[0]:
        r = rss(); p = phase[-1]
        if r > peak[p]: peak[p] = r
        time.sleep(0.002)
threading.Thread(target=sampler, daemon=True).start()
def labelled(real, label):
    def f(*x, **k):
        phase.append(label); t = time.perf_counter()
        try:
            return real(*x, **k)
        finally:
            tm[label] += time.perf_counter() - t; peak[label] = max(peak[label], rss()); phase.pop()
    return f
res = {}
if mode == "rtn":
    import qcore.adapters.passes.streaming as st
    try:  # the job and its pass apart (issue 32): the reads go through load_tensors in both
        import qcore.adapters.jobs.checkpoint as job
        readers, run = [(st, "load_tensors"), (job, "load_tensors")], job.quantize_checkpoint
    except ImportError:  # a landed checkout before issue 32
        readers, run = [(st, "_load")], st.quantize_checkpoint
    import qcore.adapters.io.quark_hf as qh  # module_records looks weight_parts (io.common's) up here
    import qcore.adapters.modules as M
    import qcore.formats.quark_layout as L
    import qcore.adapters.passes.runner as R
    from qcore.adapters import preset
    starts = []
    real_load = getattr(*readers[0])
    def load(root, prefix, *x, **k):
        if prefix and prefix.rstrip(".").rsplit(".", 1)[-1].isdigit():
            starts.append(rss())
        return real_load(root, prefix, *x, **k)
    for mod, name in readers:
        setattr(mod, name, labelled(load, "load"))
    qh.weight_parts = labelled(qh.weight_parts, "weight_parts")
    L.encode_weight = labelled(L.encode_weight, "encode")
    base = getattr(M, "QuantModule", None) or M._QuantMixin  # the base's name before issue 32
    base.commit = labelled(base.commit, "commit")
    R.Spill.add = labelled(R.Spill.add, "spill")
    res["rss_after_imports"] = rss()
    t0 = time.perf_counter()
    run(a, b, preset("uint4_wo_128"), None, progress=False, overwrite=True)
    res["seconds"] = time.perf_counter() - t0
    res["layer_start_rss"] = starts
else:
    from qcore.algorithms.gptq import gptq, HessianStats, update_hessian
    from qcore.adapters import preset
    torch.set_num_threads(2)
    n = int(a)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * n, n, generator=g) * torch.rand(n, generator=g)
    stats = update_hessian(HessianStats.empty(n, like=x), x)
    del x
    w = torch.randn(32, n, generator=g) * 0.02
    import gc; gc.collect()
    base = rss(); phase.append("gptq")
    t0 = time.perf_counter()
    r = gptq(w, stats, preset("uint4_wo_128").layer.weight.spec)
    res["seconds"] = time.perf_counter() - t0
    res["above_caller"] = peak["gptq"] - base
    res["copies"] = res["above_caller"] / (n * n * 8)
    torch.save({"codes": r.qtensor.codes, "scales": r.qtensor.scales, "zp": r.qtensor.zero_points,
                "weight": r.weight, "damp": r.damp, "loss": r.loss}, b)
stop[0] = True
res["peak_rss"] = hwm()
res["phases"] = {k: {"peak": peak[k], "seconds": tm[k]} for k in sorted(set(peak) | set(tm))}
pathlib = __import__("pathlib"); pathlib.Path(out).write_text(json.dumps(res))
'''


def _run_child(python, mode, a, b, record) -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)  # each interpreter imports its own checkout's qcore
    subprocess.run([python, "-c", _CHILD, mode, str(a), str(b), str(record)], check=True, env=env,
                   cwd=str(pathlib.Path(record).parent))  # not a checkout: its src/qcore/ would shadow the install
    return json.loads(pathlib.Path(record).read_text())


def _same_dir(x: pathlib.Path, y: pathlib.Path) -> bool:
    fx, fy = sorted(p.name for p in x.iterdir()), sorted(p.name for p in y.iterdir())
    return fx == fy and all((x / f).read_bytes() == (y / f).read_bytes() for f in fx)


def _same_gptq(x, y) -> bool:
    import torch
    a, b = torch.load(x), torch.load(y)
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def report(a, res) -> str:
    g = lambda v: f"{v / GiB:.2f}"  # noqa: E731
    impls = list(res["rtn"])
    lines = ["# Streaming RTN and GPTQ's Hessian: memory and time by phase (new vs landed, same run)", "",
             f"Machine: {res['machine']}; load average at start {res['load'][0]:.1f}, at end "
             f"{res['load'][1]:.1f}; one thread (RTN), two (GPTQ). Script: `python bench/bench_stream_phases.py "
             f"{' '.join(res['argv'])}`.", "",
             f"Checkpoint: synthetic Llama, hidden {a.hidden}, intermediate {a.intermediate}, {a.layers} layers, "
             f"vocab {a.vocab}, bf16: {res['checkpoint_bytes'] / 1e9:.2f} GB. RTN = `quantize_checkpoint` uint4 "
             f"g128. Target (issue 23): peak RSS <= 3 GiB for the 13B-shaped model (a 40-layer run peaks where "
             f"these do: RSS at each layer's start settles after ~3 layers). Old figure (bench/results/SCALE.md, the first "
             f"round's run of the landed code at 13B shapes): 3.53 GiB.", "",
             "| RTN | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
    lines.append("| peak RSS (VmHWM) | " + " | ".join(g(res["rtn"][i]["peak_rss"]) + " GiB" for i in impls) + " |")
    lines.append("| total seconds | " + " | ".join(f"{res['rtn'][i]['seconds']:.1f}" for i in impls) + " |")
    lines.append("| RSS at each layer's start (GiB) | " + " | ".join(
        ", ".join(g(v) for v in res["rtn"][i]["layer_start_rss"]) for i in impls) + " |")
    for ph in ("load", "commit", "weight_parts", "encode", "spill"):
        lines.append(f"| {ph}: peak GiB / seconds | " + " | ".join(
            f"{g(res['rtn'][i]['phases'].get(ph, {}).get('peak', 0))} / "
            f"{res['rtn'][i]['phases'].get(ph, {}).get('seconds', 0):.2f}" for i in impls) + " |")
    if len(impls) == 2:
        o, n = (res["rtn"][impls[1]], res["rtn"][impls[0]])
        lines += ["", f"new / old: peak {n['peak_rss'] / o['peak_rss']:.2f}x, time {n['seconds'] / o['seconds']:.2f}x; "
                      f"outputs byte-identical: **{res['rtn_same']}**. (`spill` holds `weight_parts` and `encode`: "
                      f"the records are encoded as they are written.)"]
    if res.get("gptq"):
        lines += ["", f"## GPTQ on one {a.gptq_n}-wide Hessian (32 weight rows; the caller's float64 sum excluded)",
                  "", "| | " + " | ".join(res["gptq"]) + " |", "|---|" + "---|" * len(res["gptq"])]
        lines.append("| peak above the caller (GiB) | " + " | ".join(g(r["above_caller"]) for r in res["gptq"].values())
                     + " |")
        lines.append("| in float64 [n, n] copies | " + " | ".join(f"{r['copies']:.2f}" for r in res["gptq"].values())
                     + " |")
        lines.append("| seconds | " + " | ".join(f"{r['seconds']:.1f}" for r in res["gptq"].values()) + " |")
        if "gptq_same" in res:
            lines += ["", f"Results identical (codes, scales, zero points, weight, damping, loss): "
                          f"**{res['gptq_same']}**. At 13824 (13B's down_proj) a copy is 1.42 GiB."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--intermediate", type=int, default=13824)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--gptq-n", type=int, default=6912, help="Hessian width of the GPTQ part (0: skip)")
    ap.add_argument("--old-python", default=None, help="interpreter of the landed checkout (compared side by side)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "SCALE_PHASES"))
    a = ap.parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    import bench_scale as bs
    work = pathlib.Path(a.dir) if a.dir else pathlib.Path(tempfile.mkdtemp(prefix="qcore-phases-"))
    impls = {"new (this checkout)": sys.executable}
    if a.old_python:
        impls["old (--old-python)"] = a.old_python
    res = {"argv": [bs.shown_path(x) for x in (argv if argv is not None else sys.argv[1:])], "machine": bs._machine(), "rtn": {}, "gptq": {}}
    res["load"] = [os.getloadavg()[0]]
    try:
        src = work / "ckpt"
        ba = bs.parse(["--hidden", str(a.hidden), "--intermediate", str(a.intermediate), "--layers", str(a.layers),
                       "--heads", str(max(1, a.hidden // 128)), "--vocab", str(a.vocab), "--gptq-layers", "0",
                       "--dist-layers", "0"])
        res["checkpoint_bytes"] = bs.write_checkpoint(ba, src)["bytes"]
        outs = {}
        for k, (tag, py) in enumerate(impls.items()):
            outs[tag] = work / f"out{k}"
            res["rtn"][tag] = _run_child(py, "rtn", src, outs[tag], work / f"rtn{k}.json")
            print(tag, "RTN peak", res["rtn"][tag]["peak_rss"] / GiB, "GiB", res["rtn"][tag]["seconds"], "s",
                  flush=True)
        if len(outs) == 2:
            res["rtn_same"] = _same_dir(*outs.values())
        for o in outs.values():
            shutil.rmtree(o, ignore_errors=True)
        shutil.rmtree(src, ignore_errors=True)
        if a.gptq_n:
            for k, (tag, py) in enumerate(impls.items()):
                res["gptq"][tag] = _run_child(py, "gptq", a.gptq_n, work / f"g{k}.pt", work / f"g{k}.json")
                print(tag, "GPTQ", res["gptq"][tag]["copies"], "copies", flush=True)
            if len(impls) == 2:
                res["gptq_same"] = _same_gptq(work / "g0.pt", work / "g1.pt")
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    res["load"].append(os.getloadavg()[0])
    text = report(a, res)
    pathlib.Path(a.out + ".md").write_text(text)
    pathlib.Path(a.out + ".json").write_text(json.dumps(res, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
