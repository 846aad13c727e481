"""Larger than the machine, shown: quantize a synthetic 13B-shaped Llama checkpoint with ``quantize_checkpoint``.

    python bench/bench_scale.py                       # 13B shapes on CPU (~26 GB under /tmp), writes bench/results/SCALE.md/.json
    python bench/bench_scale.py --gpu-quick           # the same on one GPU, within ~6 minutes (no distributed part)
    python bench/bench_scale.py --layers 4 --hidden 1024 --intermediate 2816 --heads 16 --vocab 4096   # small

1. writes a random Llama checkpoint (``--hidden 5120 --layers 40 --intermediate 13824 --heads 40 --vocab 32000``,
   bf16; each weight read cyclically from a random offset of one block of 2**24 N(0, 0.02) values drawn with a
   fixed seed; norms 1) into ``--dir``, tensor by tensor (our own safetensors writer: no tensor in memory),
   in shards of about ``--shard-gb`` GB: the weights outside the layers in one shard, the first ``--gptq-layers``
   layers in the next, the others after;
2. (a) ``quantize_checkpoint`` uint4 g128 round-to-nearest of the whole checkpoint, in a fresh process: wall time
   and peak resident memory (``VmHWM`` of the process, imports included);
3. (b) GPTQ (uint4 g128, the default GPTQConfig) on the first ``--gptq-layers`` layers (a variant directory: its
   config.json says that many layers, its index lists the shards holding them, linked, not copied): wall time,
   peak memory, per layer the step time (read, GPTQ, replay, pack), the GPTQ solves (Cholesky + column loop, per
   Linear group), the layer forwards (the Hessian forward and the replay: the float-forward reference of this
   bench), and a projection to every layer;
4. (c) the same GPTQ with ``torch.distributed`` over ``--world`` processes (gloo on CPU, nccl with a GPU each):
   data-parallel (Hessians all-reduced) and layer-parallel (``Distributed(layer_parallel=True)``), with the
   per-layer speed-up against (b) and the Amdahl prediction from (b)'s measured shares;
5. deletes everything it wrote under ``--dir`` (also on an error or Ctrl-C / SIGTERM; ``--keep`` keeps it).

Calibration: ``--calib N`` sequences of ``--seq-len`` synthetic token ids (default 4 x 512; ids uniform over the
vocabulary, seed 1); ranks take ``batches[rank::world]``. Threads: each GPTQ process (single or rank) uses
``--threads-per-process`` threads (default: cores // world), so that a rank has what the single process had (the
analogue of one GPU per rank); RTN uses ``--threads`` (default: all cores).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
HERE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(ROOT / "src"))  # qcore from this checkout (also when not installed)
GiB = 1024 ** 3


def shown_path(p) -> str:
    """``p`` as a record shows it: relative to the repository where it lies inside it, ``~/...`` under the home
    folder, else as given (a record names no absolute path of the machine it was written on)."""
    s = str(p)
    if not os.path.isabs(s):
        return s
    full = pathlib.Path(s).resolve()
    if full.is_relative_to(ROOT):
        return os.path.relpath(full, ROOT)
    home = pathlib.Path.home().resolve()
    return "~/" + os.path.relpath(full, home) if full.is_relative_to(home) else s


# ---------------------------------------------------------------------------------------------------------------
# the synthetic checkpoint
# ---------------------------------------------------------------------------------------------------------------


def llama_config(a):
    import transformers
    return transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                                    num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                    num_key_value_heads=a.kv_heads or a.heads, max_position_embeddings=4096,
                                    tie_word_embeddings=False, dtype="bfloat16")


def _shapes(cfg) -> list[tuple[str, tuple]]:
    """The model's state-dict names and shapes (a meta model: no memory)."""
    import torch
    import transformers
    with torch.device("meta"):
        m = transformers.LlamaForCausalLM(cfg)
    return [(k, tuple(t.shape)) for k, t in m.state_dict().items() if not k.endswith("rotary_emb.inv_freq")
            and t.dtype != torch.int64]


BASE = 16_777_259  # elements of the random block the weights are cut from (a prime: no alignment with rows)


def _base(seed: int):
    """``BASE`` N(0, 0.02) bf16 values (fixed seed), as bytes."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.empty(BASE, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=g).view(torch.uint8).numpy()


def _write_safetensors(path: pathlib.Path, items: list[tuple[str, tuple]], seed: int, start: int, base) -> int:
    """A bf16 safetensors file of ``items`` (name, shape), written tensor by tensor: norms 1; every other tensor
    the random block ``base`` read cyclically from an offset drawn per tensor (``seed``, running index from
    ``start``): random-looking weights at the disk's speed, no tensor ever in memory."""
    import torch
    header, off = {}, 0
    for k, s in items:
        n = 2
        for d in s:
            n *= d
        header[k] = {"dtype": "BF16", "shape": list(s), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt"}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for i, (k, s) in enumerate(items):
            if "norm" in k:
                f.write(torch.ones(s, dtype=torch.bfloat16).reshape(-1).view(torch.uint8).numpy())
                continue
            g = torch.Generator().manual_seed(seed * 1_000_003 + start + i)
            pos = 2 * int(torch.randint(0, BASE, (1,), generator=g))
            left = 2 * _numel(s)
            while left:
                n = min(left, base.size - pos)
                f.write(base[pos:pos + n])
                left -= n
                pos = 0
    return off


def write_checkpoint(a, d: pathlib.Path) -> dict:
    """config.json + sharded safetensors + index in ``d``; the GPTQ variant (first ``gptq_layers`` layers) in
    ``d/variant``. Returns sizes and timings."""
    t0 = time.perf_counter()
    d.mkdir(parents=True, exist_ok=True)
    cfg = llama_config(a)
    cfg.save_pretrained(d)
    shapes = _shapes(cfg)
    layer_of = {k: int(k.split(".")[2]) for k, _ in shapes if k.startswith("model.layers.")}
    outer = [(k, s) for k, s in shapes if k not in layer_of]
    per_layer = sum(2 * _numel(s) for k, s in shapes if layer_of.get(k) == 0)
    per_shard = max(1, int(a.shard_gb * 1e9 // per_layer))
    groups, i = [], 0
    k0 = min(a.gptq_layers, a.layers)
    for b in sorted({a.dist_layers, k0} - {0}):  # the variants' layers: shards of their own
        groups.append(list(range(i, b)))
        i = b
    while i < a.layers:
        groups.append(list(range(i, min(a.layers, i + per_shard))))
        i += per_shard
    n_files = 1 + len(groups)
    names = [f"model-{j + 1:05d}-of-{n_files:05d}.safetensors" for j in range(n_files)]
    weight_map, total, idx = {}, 0, 0
    base = _base(a.seed)
    parts = [outer] + [[(k, s) for k, s in shapes if layer_of.get(k, -1) in set(g)] for g in groups]
    for name, items in zip(names, parts):
        total += _write_safetensors(d / name, items, a.seed, idx, base)
        idx += len(items)
        weight_map.update({k: name for k, _ in items})
        print(f"  wrote {name}: {len(items)} tensors, total {total / 1e9:.1f} GB", flush=True)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": weight_map}, indent=1))
    # the GPTQ variants: the first k layers (a model of k layers whose shards hold exactly its tensors)
    for k in sorted({a.dist_layers, k0} - {0}):
        v = d / f"variant-{k}"
        v.mkdir()
        vcfg = llama_config(a)
        vcfg.num_hidden_layers = k
        vcfg.save_pretrained(v)
        vmap = {n: f for n, f in weight_map.items() if n not in layer_of or layer_of[n] < k}
        for f in sorted(set(vmap.values())):
            os.symlink(d / f, v / f)
        (v / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0},
                                                                    "weight_map": vmap}))
    return {"bytes": total, "files": n_files, "layers_per_shard": per_shard, "seconds": time.perf_counter() - t0}


def _numel(s) -> int:
    n = 1
    for d in s:
        n *= d
    return n


# ---------------------------------------------------------------------------------------------------------------
# the measured children (fresh processes: their own peak memory)
# ---------------------------------------------------------------------------------------------------------------


def _status(key: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _batches(a):
    import torch
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, a.vocab, (1, a.seq_len), generator=g) for _ in range(a.calib)]


def _instrument(rec: dict):
    """Time, per decoder layer: the step (first read of its tensors to its memory release), the GPTQ solves
    (``gptq``, with the weight shape), the layer forwards (Hessian capture, and replay)."""
    import qcore.adapters.passes.gptq as seq  # GPTQ's binding: where gptq() and the Hessian forwards are looked up
    import qcore.adapters.passes.streaming as st
    layers = rec.setdefault("layers", [])
    cur: dict = {}

    import torch
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # GPU work timed to its end
    real_load, real_release, real_gptq = st.load_tensors, st._release_memory, seq.gptq
    real_fwd_seq, real_fwd_st = seq.forward_layer, st.forward_layer

    def load(root, prefix, *args, **kw):
        if prefix and prefix.rstrip(".").rsplit(".", 1)[-1].isdigit() and not cur:
            cur.update(start=time.perf_counter(), solves=[], hessian_fwd=0.0, replay_fwd=0.0)
        return real_load(root, prefix, *args, **kw)

    def release():
        real_release()
        sync()
        if cur:
            cur["step"] = time.perf_counter() - cur.pop("start")
            layers.append(dict(cur))
            cur.clear()

    def gptq(w, *args, **kw):
        sync()
        t = time.perf_counter()
        out = real_gptq(w, *args, **kw)
        sync()
        if cur:
            cur["solves"].append([list(w.shape), time.perf_counter() - t])
        return out

    def fwd(key, real):
        def f(*args, **kw):
            sync()
            t = time.perf_counter()
            out = real(*args, **kw)
            sync()
            if cur:
                cur[key] += time.perf_counter() - t
            return out
        return f

    st.load_tensors, st._release_memory, seq.gptq = load, release, gptq
    seq.forward_layer = fwd("hessian_fwd", real_fwd_seq)
    st.forward_layer = fwd("replay_fwd", real_fwd_st)


def child(a) -> None:
    """One measured run (``--child rtn|gptq|rank``); writes its JSON record to ``--record``."""
    import torch
    rec: dict = {}
    threads = a.threads if a.child == "rtn" else a.threads_per_process
    torch.set_num_threads(threads)
    rec["threads"] = threads
    from qcore.adapters import preset
    from qcore.adapters.jobs.checkpoint import quantize_checkpoint
    cfg = preset("uint4_wo_128")
    data = None
    dist_obj = None
    device = a.device
    if a.child in ("gptq", "rank"):
        cfg = cfg.replace(algorithms=({"name": "gptq"},))
        data = _batches(a)
        _instrument(rec)
    if a.child == "rank":
        import torch.distributed as dist
        from datetime import timedelta
        from qcore.adapters.distributed import Distributed
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(a.rank)
            device = f"cuda:{a.rank}"
        dist.init_process_group(backend, init_method=f"file://{a.init}", rank=a.rank, world_size=a.world,
                                timeout=timedelta(seconds=3600))
        dist_obj = Distributed(layer_parallel=a.layer_parallel)
        data = data[a.rank::a.world]
    rec["rss_after_imports"] = _status("VmRSS")
    t0 = time.perf_counter()
    quantize_checkpoint(a.src, a.dst, cfg, data, device=device, progress=False, overwrite=True,
                        distributed=dist_obj)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        rec["cuda_peak_alloc"] = torch.cuda.max_memory_allocated()
    rec["seconds"] = time.perf_counter() - t0
    rec["peak_rss"] = _status("VmHWM")
    if dist_obj is not None:
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()
    pathlib.Path(a.record).write_text(json.dumps(rec))


_PROCS: list = []


def _spawn(a, mode: str, src, dst, record, extra=()) -> subprocess.Popen:
    args = [sys.executable, str(HERE), "--child", mode, "--src", str(src), "--dst", str(dst), "--record",
            str(record), "--device", a.device, "--threads", str(a.threads),
            "--threads-per-process", str(a.threads_per_process), "--vocab", str(a.vocab), "--calib", str(a.calib),
            "--seq-len", str(a.seq_len), *extra]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen(args, env=env)
    _PROCS.append(p)
    return p


def _wait(procs, what: str) -> None:
    """Wait for every process; one that fails stops the others (a rank left waiting in a collective)."""
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.5)
    for p in procs:
        p.wait()
    bad = [p.returncode for p in procs if p.returncode != 0]
    if bad:
        raise RuntimeError(f"{what}: a child process failed (exit codes {[p.returncode for p in procs]})")


def run_one(a, mode, src, dst, work) -> dict:
    rec = work / f"{mode}.json"
    _wait([_spawn(a, mode, src, dst, rec)], mode)
    shutil.rmtree(dst, ignore_errors=True)
    return json.loads(rec.read_text())


def run_ranks(a, src, dst, work, layer_parallel: bool) -> list[dict]:
    tag = "lp" if layer_parallel else "dp"
    init = work / f"init-{tag}"
    procs = [_spawn(a, "rank", src, dst, work / f"rank{r}-{tag}.json",
                    ["--rank", str(r), "--world", str(a.world), "--init", str(init)]
                    + (["--layer-parallel"] if layer_parallel else [])) for r in range(a.world)]
    _wait(procs, f"distributed ({tag})")
    shutil.rmtree(dst, ignore_errors=True)
    return [json.loads((work / f"rank{r}-{tag}.json").read_text()) for r in range(a.world)]


# ---------------------------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------------------------


def per_layer(rec: dict) -> dict:
    ls = rec.get("layers", [])
    n = max(1, len(ls))
    step = sum(x["step"] for x in ls) / n
    solve = sum(t for x in ls for _, t in x["solves"]) / n
    hfwd = sum(x["hessian_fwd"] for x in ls) / n
    rfwd = sum(x["replay_fwd"] for x in ls) / n
    replayed = [x["replay_fwd"] for x in ls if x["replay_fwd"] > 0]  # the last layer is not replayed
    # the float-forward reference: one layer's forward over the calibration tokens (the replay; with one layer
    # only, the forward capturing the Hessians, which also accumulates x^T x)
    ref = sum(replayed) / len(replayed) if replayed else hfwd
    return {"n": len(ls), "step": step, "solve": solve, "hessian_fwd": hfwd, "replay_fwd": rfwd,
            "forward_ref": ref, "forward_ref_kind": "replay" if replayed else "hessian capture",
            "other": step - solve - hfwd - rfwd, "solves": ls[0]["solves"] if ls else []}


def amdahl(pl: dict, world: int) -> dict:
    """Predicted per-layer step with ``world`` ranks, from one process's measured shares: the forwards split by
    the batches (data-parallel), the solves not (data-parallel) or by group onto the ranks (layer-parallel:
    ``owners`` of the measured solve times; the largest load counts), the rest (reading, packing) not."""
    from qcore.adapters.distributed import owners
    fwd = pl["hessian_fwd"] + pl["replay_fwd"]
    times = [t for _, t in pl["solves"]]
    load = [0.0] * world
    for t, r in zip(times, owners(times, world)):
        load[r] += t
    solve_lp = max(load) * (pl["solve"] / sum(times) if times and sum(times) else 1.0)
    dp = pl["other"] + pl["solve"] + fwd / world
    lp = pl["other"] + solve_lp + fwd / world
    return {"dp_step": dp, "lp_step": lp, "dp_speedup": pl["step"] / dp, "lp_speedup": pl["step"] / lp}


def _gb(x) -> str:
    return f"{x / GiB:.2f}"


def report(a, res: dict) -> str:
    m = res["meta"]
    lines = ["# Larger than the machine: a synthetic 13B-shaped Llama through `quantize_checkpoint`", "",
             f"Machine: {m['machine']}; load average before / after: {m['load_before']} / {m['load_after']}; "
             f"RTN threads {a.threads}, GPTQ threads per process {a.threads_per_process}; device {a.device}; "
             f"torch {m['torch']}.", "",
             f"Checkpoint: hidden {a.hidden}, {a.layers} layers, intermediate {a.intermediate}, {a.heads} heads, "
             f"vocab {a.vocab}, bf16: {res['checkpoint']['bytes'] / 1e9:.1f} GB in {res['checkpoint']['files']} "
             f"shards ({res['checkpoint']['layers_per_shard']} layers each), written in "
             f"{res['checkpoint']['seconds']:.0f} s; machine RAM {m['ram_gib']:.1f} GiB. Calibration: {a.calib} "
             f"sequences x {a.seq_len} synthetic token ids. Command: `{m['command']}`", ""]
    if "rtn" in res:
        r = res["rtn"]
        lines += ["## (a) uint4 g128 round-to-nearest, every layer", "",
                  "| what | value | target |", "|---|---|---|",
                  f"| wall time | {r['seconds']:.1f} s | measured |",
                  f"| peak RSS (VmHWM, imports included) | {_gb(r['peak_rss'])} GiB | <= 3 GiB |",
                  f"| RSS after imports | {_gb(r['rss_after_imports'])} GiB | |",
                  f"| checkpoint / peak RSS | {res['checkpoint']['bytes'] / max(1, r['peak_rss']):.1f}x | > 1 |", "",
                  "Where this memory and time go, by phase, and the landed code against this one on the same "
                  "checkpoint: bench/results/SCALE_PHASES.md (`python bench/bench_stream_phases.py --old-python ...`).", ""]
    if "gptq" in res:
        g, pl = res["gptq"], res["gptq_per_layer"]
        proj = res["gptq_projection"]
        lines += [f"## (b) GPTQ uint4 g128 on the first {pl['n']} layers (one process)", "",
                  "| per layer | seconds | share |", "|---|---|---|"]
        for k, label in (("step", "step (read, Hessians, solves, replay, pack)"),
                         ("solve", "GPTQ solves (Cholesky + column loop)"),
                         ("hessian_fwd", "layer forwards capturing the Hessians"),
                         ("replay_fwd", "layer forward, replay (none after the last layer)"),
                         ("other", "the rest (read, pack, spill)")):
            lines.append(f"| {label} | {pl[k]:.1f} | {pl[k] / pl['step']:.0%} |")
        lines += ["", "Solves of layer 0 (weight shape: seconds): "
                  + ", ".join(f"{s[0]}x{s[1]}: {t:.1f}" for s, t in pl["solves"]) + ".", "",
                  f"Wall {g['seconds']:.0f} s, peak RSS {_gb(g['peak_rss'])} GiB. Float-forward reference (one "
                  f"layer over the calibration tokens, the {pl['forward_ref_kind']} forward): "
                  f"{pl['forward_ref']:.1f} s; GPTQ step / forward {pl['step'] / max(1e-9, pl['forward_ref']):.1f}x. "
                  f"Projection to {a.layers} layers: wall + "
                  f"({a.layers} - {pl['n']}) x step = {proj / 60:.0f} min ({proj / 3600:.1f} h).", ""]
    if "dist" in res:
        lines += [f"## (c) the same GPTQ over {a.world} processes, on the first {a.dist_layers} layer(s) ({'nccl' if a.device == 'cuda' else 'gloo'})", "",
                  "| run | per-layer step (s) | speed-up vs (b) | Amdahl prediction | peak RSS per rank (GiB) | wall (s) |",
                  "|---|---|---|---|---|---|"]
        for tag, label in (("dp", "data-parallel (Hessians all-reduced)"),
                           ("lp", "data- + layer-parallel (`Distributed(layer_parallel=True)`)")):
            d = res["dist"].get(tag)
            if d is None:
                continue
            lines.append(f"| {label} | {d['step']:.1f} | {d['speedup']:.2f}x | {d['predicted']:.2f}x | "
                         f"{', '.join(_gb(x) for x in d['peak_rss'])} | {d['seconds']:.0f} |")
        lines += ["", "Prediction (Amdahl, from (b)'s shares): the forwards split by batches over the ranks; "
                  "data-parallel runs every solve on every rank; layer-parallel gives each rank its groups' solves "
                  "(the largest rank load counts); reading and packing are not split.", ""]
        cores = os.cpu_count() or 1
        loads = [float(m[k].split()[0]) for k in ("load_before", "load_after") if m.get(k)]
        if a.device == "cpu" and loads and max(loads) > cores:
            lines += [f"The machine was oversubscribed (load average up to {max(loads):.1f} on {cores} cores): the "
                      f"{a.world} processes of (c) competed with other work for the cores, so the measured speed-ups "
                      f"are not the algorithm's (the per-solve times of each rank, in the JSON, show by how much "
                      f"each solve slowed down). On an idle machine with a core (or GPU) per rank, the prediction is "
                      f"the expectation.", ""]
    if res.get("notes"):
        lines += ["Notes: " + " ".join(res["notes"]), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="where the checkpoint and outputs go (default: a new folder "
                    "under the system temporary directory); removed at the end")
    ap.add_argument("--keep", action="store_true", help="keep the files (default: delete them)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--gpu-quick", action="store_true", help="one GPU within ~6 minutes: --device cuda, the 13B "
                    "shapes, RTN of every layer and GPTQ of 2 layers, no distributed part (unless there are "
                    "--world GPUs)")
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--intermediate", type=int, default=13824)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--kv-heads", type=int, default=0, help="default: --heads")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-gb", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calib", type=int, default=4, help="calibration sequences")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--gptq-layers", type=int, default=2, help="layers of the GPTQ runs (b) and (c); 0: skip")
    ap.add_argument("--dist-layers", type=int, default=-1, help="layers of the distributed runs (c) (default: "
                    "--gptq-layers); their per-layer step is compared with (b)'s")
    ap.add_argument("--world", type=int, default=2, help="processes of (c); 0 or 1: skip")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: rtn, gptq, dp, lp")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--threads-per-process", type=int, default=0, help="default: max(1, threads // world)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "SCALE"), help="writes OUT.md and OUT.json")
    ap.add_argument("--report-only", metavar="JSON", help="rewrite OUT.md from a JSON this script wrote (no run)")
    # the children
    ap.add_argument("--child", choices=["rtn", "gptq", "rank"], help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    ap.add_argument("--dst", help=argparse.SUPPRESS)
    ap.add_argument("--record", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--init", help=argparse.SUPPRESS)
    ap.add_argument("--layer-parallel", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.gpu_quick:
        a.device = "cuda"
    for k in ("hidden", "layers", "intermediate", "heads", "vocab", "calib", "seq_len", "threads"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1, got {getattr(a, k)}")
    if a.gptq_layers < 0 or a.gptq_layers > a.layers:
        ap.error(f"--gptq-layers must be in 0..--layers ({a.layers}), got {a.gptq_layers}")
    if a.dist_layers < 0:
        a.dist_layers = a.gptq_layers
    if a.dist_layers > a.layers or (a.gptq_layers and a.dist_layers == 0):
        ap.error(f"--dist-layers must be in 1..--layers ({a.layers}), got {a.dist_layers}")
    if a.hidden % a.heads:
        ap.error(f"--hidden ({a.hidden}) must be a multiple of --heads ({a.heads})")
    if a.shard_gb <= 0:
        ap.error(f"--shard-gb must be > 0, got {a.shard_gb}")
    skips = {s for s in a.skip.split(",") if s}
    if skips - {"rtn", "gptq", "dp", "lp"}:
        ap.error(f"--skip: unknown part(s) {sorted(skips - {'rtn', 'gptq', 'dp', 'lp'})}")
    a.skips = skips
    if a.threads_per_process < 1:
        a.threads_per_process = max(1, a.threads // max(1, a.world))
    return a


def _machine() -> str:
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    s = f"{cpu}, {os.cpu_count()} cores"
    if torch.cuda.is_available():
        s += f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return s


def _available() -> int:
    """MemAvailable (bytes; 0 if unknown)."""
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _ram_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    except (ValueError, OSError):
        return float("nan")


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    a = parse(argv)
    if a.child:
        child(a)
        return 0
    if a.report_only:
        res = json.loads(pathlib.Path(a.report_only).read_text())
        for k, v in res["args"].items():  # the run's options, for the table's header
            setattr(a, k, v)
        if "gptq" in res:
            res["gptq_per_layer"] = per_layer(res["gptq"])
            pred = amdahl(res["gptq_per_layer"], max(2, a.world))
            for tag, d in res.get("dist", {}).items():
                d["step"] = max(per_layer(r)["step"] for r in d["ranks"])
                d["speedup"] = res["gptq_per_layer"]["step"] / d["step"]
                d["predicted"] = pred[f"{tag}_speedup"]
        text = report(a, res)
        pathlib.Path(a.out).with_suffix(".md").write_text(text + "\n")
        print(text)
        return 0
    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench_scale: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    made = a.dir is None
    root = pathlib.Path(tempfile.mkdtemp(prefix="qcore-scale-") if made else a.dir)
    if not made:
        root.mkdir(parents=True, exist_ok=True)
        root = pathlib.Path(tempfile.mkdtemp(prefix="qcore-scale-", dir=root))  # ours to delete, whole
    res: dict = {"meta": {"machine": _machine(), "load_before": "%.2f %.2f %.2f" % os.getloadavg(),
                          "torch": torch.__version__, "ram_gib": _ram_gib(), "python": platform.python_version(),
                          "command": "python bench/bench_scale.py " + " ".join(
                              shown_path(x) for x in (argv if argv is not None else sys.argv[1:]))},
                 "args": {k: shown_path(v) if k in ("dir", "out") and v else v for k, v in vars(a).items()
                          if k not in ("skips",) and not k.startswith("child")},
                 "notes": []}
    src, work = root / "src", root / "work"
    failed = None
    try:
        work.mkdir()
        print(f"writing the checkpoint into {src} ...", flush=True)
        res["checkpoint"] = write_checkpoint(a, src)
        if "rtn" not in a.skips:
            print("(a) round-to-nearest, every layer ...", flush=True)
            res["rtn"] = run_one(a, "rtn", src, root / "out", work)
            print(f"    {res['rtn']['seconds']:.0f} s, peak RSS {_gb(res['rtn']['peak_rss'])} GiB", flush=True)
        if a.gptq_layers and "gptq" not in a.skips:
            print(f"(b) GPTQ, the first {a.gptq_layers} layers ...", flush=True)
            res["gptq"] = run_one(a, "gptq", src / f"variant-{a.gptq_layers}", root / "out", work)
            pl = res["gptq_per_layer"] = per_layer(res["gptq"])
            res["gptq_projection"] = res["gptq"]["seconds"] + (a.layers - pl["n"]) * pl["step"]
            print(f"    {res['gptq']['seconds']:.0f} s, per layer {pl['step']:.1f} s", flush=True)
            gpus = torch.cuda.device_count() if a.device == "cuda" else 0
            need = a.world * res["gptq"]["peak_rss"] * 1.1
            if a.world >= 2 and a.device == "cpu" and _available() < need:
                res["notes"].append(f"(c) skipped: {a.world} processes need about {_gb(need)} GiB (each as (b)), "
                                    f"{_gb(_available())} GiB available (a shared machine: run (c) at smaller shapes "
                                    f"or where the memory is).")
            elif a.world >= 2 and (a.device == "cpu" or gpus >= a.world):
                pred = amdahl(pl, a.world)
                res["dist"] = {}
                for tag, lp in (("dp", False), ("lp", True)):
                    if tag in a.skips:
                        continue
                    print(f"(c) GPTQ over {a.world} processes, {tag} ...", flush=True)
                    recs = run_ranks(a, src / f"variant-{a.dist_layers}", root / "out", work, lp)
                    steps = [per_layer(r)["step"] for r in recs]
                    step = max(steps)
                    res["dist"][tag] = {"step": step, "speedup": pl["step"] / step,
                                        "predicted": pred[f"{tag}_speedup"],
                                        "peak_rss": [r["peak_rss"] for r in recs],
                                        "seconds": max(r["seconds"] for r in recs), "ranks": recs}
                    print(f"    per layer {step:.1f} s: {pl['step'] / step:.2f}x (predicted "
                          f"{pred[f'{tag}_speedup']:.2f}x)", flush=True)
            elif a.world >= 2:
                res["notes"].append(f"(c) skipped: {gpus} GPU(s), {a.world} needed (one per rank).")
    except (KeyboardInterrupt, RuntimeError) as e:  # the parts measured so far are still reported
        failed = e
        res["notes"].append(f"stopped early ({type(e).__name__}: {e}); the parts above were measured.")
    finally:
        for p in _PROCS:
            if p.poll() is None:
                p.kill()
                p.wait()
        if a.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
            print(f"removed {root}", flush=True)
    res["meta"]["load_after"] = "%.2f %.2f %.2f" % os.getloadavg()
    if "checkpoint" not in res:
        print(f"bench_scale: stopped while writing the checkpoint ({failed!r}); nothing measured", file=sys.stderr)
        return 1
    text = report(a, res)
    print(text)
    out = pathlib.Path(a.out)
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0 if failed is None else 1


if __name__ == "__main__":
    sys.exit(main())
