"""Speed and memory of qcore's default path (fake_quantize / quantize / dequantize), torch CPU and numpy.

    python bench/bench_fake_quantize.py [--size 4096] [--repeat 5] [--formats mxfp4,int4_g128,...]
        [--numpy | --no-numpy] [--no-compile] [--threads N] [--small] [--json FILE]
    python bench/bench_fake_quantize.py --core [--repeat 9]      # issue 23's core leftovers only (a few minutes)
    python bench/bench_fake_quantize.py --core --threads 1 --cpu-time   # the same on a loaded machine

``--core``: the rows issue 23 names (MX9/MX6/MX4/bfp16 fake_quantize on torch and numpy, 4096x4096 float32, over
clone/copy; ``fake_quantize`` on a 576-element column with given scale and zero point over the plain torch
expression), no compile, no memory columns; it ends with the "core targets" table (new ratio, the landed ratio
quoted from bench/results/RESULTS.md, the target) and writes it to bench/results/CORE_LEFTOVERS.md and .json (``--md`` /
``--json`` to change). The small rows include one whose parameters change at every call (two alternating sets),
so ``qcore._given``'s memo of checked values never hits: the cost of the checks themselves.

Prints one table per backend (rows: formats) and a table of small-tensor cases, then a summary of the targets.
Nothing here asserts a time: the numbers are for people to read. On the 2-core development machine a default
run takes about 5 minutes with a warm inductor cache and about 11 with a cold one (``compile=True`` of a
float-element format then compiles for 33-45 s); ``--no-compile`` takes about 4. Results: bench/results/RESULTS.md.

Timing. Every figure is a ratio of two medians measured in the same run, the two functions called alternately
(``paired``: fn, ref, fn, ref, ...) so both see the same machine state (allocator, caches, other people's load).
This machine is shared and has 2 cores; absolute times drift, ratios much less. Columns (torch table):

- ``clone ms``: median of ``x.clone()`` (numpy: ``x.copy()``), the unit of the ``x`` columns.
- ``fake x``: ``qcore.fake_quantize(x, spec)`` (default path: eager, no flags) / clone, paired with clone.
- ``q/fake``, ``dq/fake``: ``quantize(x, spec)`` and ``dequantize(q)``, each paired with ``fake_quantize``.
- ``comp x``: ``fake_quantize(x, spec, compile=True)`` after three warm-up calls / clone, paired with clone
  (3 pairs); ``comp s``: wall time of the first compiled call in this process (dynamo trace + inductor compile,
  or a load from inductor's on-disk cache where an earlier run compiled the same graph: the header says whether
  that cache directory existed). ``eager!`` marks a spec whose compiled call fell back to eager (qcore warned).
- ``ao x``: torchao 0.18's quantize-dequantize over the row's ``clone ms`` (MX: ``to_mx`` + ``to_dtype``;
  NVFP4: ``NVFP4Tensor.to_nvfp4``, which calls ``nvfp4_quantize``, with the per-tensor scale
  ``per_tensor_amax_to_scale(amax)``, then ``.dequantize``); ``ao/fake``: torchao's time over qcore's default,
  measured as a pair (> 1: qcore faster; the target is >= 10).
- numpy table: ``copy ms`` (``x.copy()``), and ``mld x`` / ``mld/fake`` as above for an ml_dtypes round trip:
  per-tensor and per-channel fp8 are ``(x / s).astype(float8_e4m3fn).astype(float32) * s`` with
  ``s = amax / 448``; MX formats compute the OCP E8M0 block scale with numpy and clip before ``astype``
  (ml_dtypes' fn formats turn overflow into NaN); NVFP4 follows torchao's two-level arithmetic with ml_dtypes
  casts. These baselines are the obvious way to write the round trip with ml_dtypes, not references
  (JSON ``ref_same_bits`` says whether they happen to give qcore's bits).

Memory (``mem x``): peak memory during one call beyond what was live before it, minus the result's own bytes,
as a multiple of the float32 input's bytes (also for ``dequantize``, whose input is the QTensor); the column is
the largest of fake_quantize / quantize / dequantize (JSON has each).

- numpy: ``tracemalloc`` in this process (numpy reports its data buffers to it): ``reset_peak``, call, peak
  minus the traced bytes before the call.
- torch CPU: torch 2.13 has no CPU allocator statistics (``memory_stats`` exists for CUDA/XPU/MTIA only; a
  peak summed from ``torch.profiler``'s memory events is not dependable), so the figure is the kernel's resident-set
  high-water mark, measured in a fresh subprocess started with ``MALLOC_MMAP_THRESHOLD_=131072``: a fixed
  threshold turns off glibc's dynamic one, so every buffer of 128 KiB or more is its own mmap, returned to the
  kernel on free, and RSS follows live large buffers instead of a heap that keeps freed memory. Per call: one
  warm-up call (lazy imports, thread pools), then ``echo 5 > /proc/self/clear_refs`` (Linux: resets VmHWM to
  the current RSS), read VmRSS, call, read VmHWM. The subprocess also measures two calibration cases printed
  under the table (``x.clone()``: expected 0.0x; ``(x * 2 + 1).abs()``: one temporary, expected 1.0x) and the
  numpy calls again by RSS (``mem x (RSS)``) as a cross-check of the two methods. Allocations below 128 KiB
  stay in glibc's heap and are not seen; at 4096x4096 they are far below the 0.01x the table prints.
  ``compile=True`` calls are not measured.

Bit-identical (``bits``): on the full input, the torch default result equals numpy's default result bit for bit
(``t~n``), ``dequantize(quantize(x))`` equals ``fake_quantize(x)`` on each backend (``q``), and the compiled
result equals the default one (``c``); on the 512x512 top-left slice, both backends' default results equal the
generic oracle ``qcore.quantize._fake_quantize_pure`` on numpy (``o``). ``qcore.cast``'s default path calls the
fast cast kernel too, so the oracle runs with ``qcore._inplace.cast_ok`` patched (in this process, for that call
only) to refuse every format: the oracle is then the generic code alone. ``yes`` = all checks pass, else the
failing ones are named.

Small tensors (``--small``, also part of the default run): GPTQ-style column updates, ``w`` of shape (576, 1)
with a given scale and zero point (per-tensor, (1, 1); per-row, ``PerChannel(0)``, (576, 1)), uint4
asymmetric, against the plain expression ``(clamp(round(w / s) + z, 0, 15) - z) * s`` (torch and numpy); and
MXFP4 of a 512x576 activation against torchao's MX quantize-dequantize. Times are per call, from loops long
enough (a few ms) to time.

The ``--threads`` flag sets ``torch.set_num_threads`` (default: torch's own choice, printed). On a loaded
2-core machine torch's two OpenMP threads can wait for each other in every one of the many small operations
of the slab-wise path; compare with ``--threads 1`` before reading much into a slow torch row.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc
import warnings
from unittest import mock

import numpy as np

import qcore
from qcore import PerChannel, PerGroup

# name: (format, make_spec overrides, torchao reference, ml_dtypes reference)
FORMATS = {
    "mxfp4": ("mxfp4", {}, ("mx", "fp4"), ("mx", "float4_e2m1fn", 32)),
    "mxfp6_e2m3": ("mxfp6_e2m3", {}, ("mx", "fp6_e2m3"), ("mx", "float6_e2m3fn", 32)),
    "mxfp6_e3m2": ("mxfp6_e3m2", {}, ("mx", "fp6_e3m2"), ("mx", "float6_e3m2fn", 32)),
    "mxfp8_e4m3": ("mxfp8_e4m3", {}, ("mx", "fp8_e4m3"), ("mx", "float8_e4m3fn", 32)),
    "mxfp8_e5m2": ("mxfp8_e5m2", {}, ("mx", "fp8_e5m2"), ("mx", "float8_e5m2", 32)),
    "mxint8": ("mxint8", {}, None, None),
    "mx9": ("mx9", {}, None, None),
    "mx6": ("mx6", {}, None, None),
    "mx4": ("mx4", {}, None, None),
    "bfp16": ("bfp16", {}, None, None),
    "nvfp4": ("nvfp4", {}, ("nvfp4",), ("nvfp4",)),
    "fp8_e4m3_tensor": ("float8_e4m3fn", {}, None, ("tensor", "float8_e4m3fn")),
    "fp8_e4m3_channel": ("float8_e4m3fn", {"axis": 0}, None, ("channel", "float8_e4m3fn")),
    "int8_channel": ("int8", {"axis": 0}, None, None),
    "int4_g128": ("int4", {"granularity": PerGroup(128)}, None, None),
    "uint4_asym_g128": ("uint4", {"granularity": PerGroup(128)}, None, None),
}

TARGETS = dict(torch_fake_x=3.0, torchao_speedup=10.0, numpy_fake_x=8.0, q_over_fake=1.5, dq_over_fake=1.5,
               small_over_plain=2.0, small_torchao_speedup=3.0, mem_x=2.0)

# Issue 23 ("Core leftovers"): targets and the landed figures they improve on. The landed figures are quoted from
# bench/results/RESULTS.md (run of 2026-11-23, qcore at commit b384243, the idle 2-core development VM, torch 2 threads;
# the fake_quantizer rows from its "fake_quantizer" section).
CORE_FORMATS = "mx9,mx6,mx4,bfp16"
CORE_TARGETS = {"torch": 3.0, "numpy": 8.0, "small": 3.0}
CORE_LANDED_SOURCE = "bench/results/RESULTS.md (2026-11-23, b384243, idle, 2 threads)"
CORE_LANDED = {
    ("torch", "mx9"): 3.84, ("torch", "mx6"): 3.40, ("torch", "mx4"): 3.79, ("torch", "bfp16"): 4.53,
    ("numpy", "mx9"): 8.38, ("numpy", "mx6"): 6.82, ("numpy", "mx4"): 6.87, ("numpy", "bfp16"): 12.19,
    ("torch", "gptq col, per-tensor s,z (576,1)"): 15.95, ("torch", "gptq col, per-row s,z (576,1)"): 17.39,
    ("numpy", "gptq col, per-tensor s,z (576,1)"): 10.56, ("numpy", "gptq col, per-row s,z (576,1)"): 14.71,
    ("torch", "fake_quantizer, per-tensor s,z (576,1)"): 2.79, ("torch", "fake_quantizer, per-row s,z (576,1)"): 2.76,
}
# which rows carry an issue-23 target (the others are shown for context)
CORE_TARGETED = {("torch", f) for f in CORE_FORMATS.split(",")} | {("numpy", "mx9"), ("numpy", "bfp16")} | {
    ("torch", "gptq col, per-tensor s,z (576,1)"), ("torch", "gptq col, per-row s,z (576,1)")}

MEM_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
# The clock of every timed pair: wall time (default), or with --cpu-time this thread's CPU time
# (time.thread_time: under load it leaves out the time the process waits for a core; needs --threads 1, since
# it does not count torch's other threads).
CLOCK = [time.perf_counter]
ORACLE_SLICE = 512


# ---------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------
def paired(fn, ref, repeat, inner=1, samples=None):
    """Median time per call of ``fn`` and of ``ref``, measured alternately (``inner`` calls per sample) so both
    see the same machine state (allocator, caches, other load): their ratio is what this benchmark reports.
    ``samples``: a dict that receives every sample (ms) under "fn" and "ref" (kept in the JSON)."""
    fn()
    ref()
    a, b = [], []
    clock = CLOCK[0]
    for _ in range(repeat):
        t0 = clock()
        for _ in range(inner):
            fn()
        t1 = clock()
        for _ in range(inner):
            ref()
        t2 = clock()
        a.append((t1 - t0) / inner)
        b.append((t2 - t1) / inner)
    if samples is not None:
        samples.update(fn=[round(v * 1e3, 3) for v in a], ref=[round(v * 1e3, 3) for v in b])
    return statistics.median(a), statistics.median(b)


def inner_loops(fn, target_s=0.005):
    """Calls per sample so that one sample of ``fn`` lasts about ``target_s`` (for microsecond-scale calls)."""
    fn()
    t0 = CLOCK[0]()
    fn()
    dt = max(CLOCK[0]() - t0, 1e-7)
    return max(1, min(10000, int(target_s / dt)))


def loadavg():
    try:
        return tuple(round(v, 2) for v in os.getloadavg())
    except OSError:  # pragma: no cover - not on Linux
        return None


# ---------------------------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------------------------
def torchao_qdq(torch, ref):
    """torchao 0.18's quantize-dequantize for ``ref`` (a FORMATS entry), or None (no such path / no torchao)."""
    if ref is None:
        return None
    try:
        if ref[0] == "nvfp4":
            from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

            def run(x):
                g = per_tensor_amax_to_scale(torch.amax(torch.abs(x)))
                return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=g).dequantize(torch.float32)

            return run
        from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    except Exception:  # noqa: BLE001 - torchao absent or broken: no reference column
        return None
    dt = {"fp4": getattr(torch, "float4_e2m1fn_x2", None), "fp6_e2m3": DTYPE_FP6_E2M3, "fp6_e3m2": DTYPE_FP6_E3M2,
          "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[ref[1]]
    if dt is None:
        return None

    def run(x):
        s, d = to_mx(x, dt, 32)
        return to_dtype(d, s, dt, 32, torch.float32)

    return run


def ml_dtypes_qdq(ref):
    """An ml_dtypes cast round trip with numpy scales for ``ref`` (a FORMATS entry), or None."""
    if ref is None:
        return None
    try:
        import ml_dtypes
    except ImportError:
        return None
    f32 = np.float32
    if ref[0] == "nvfp4":
        e4m3, e2m1 = ml_dtypes.float8_e4m3fn, ml_dtypes.float4_e2m1fn

        def run(x):
            g = f32(np.max(np.abs(x)) / f32(448.0 * 6.0))
            xb = x.reshape(-1, 16)
            bs = np.abs(xb).max(axis=1, keepdims=True) / f32(6.0) / g
            bs = np.clip(bs, f32(2.0**-9), f32(448.0)).astype(e4m3).astype(f32)
            y = np.clip(xb * ((f32(1.0) / g) / bs), -6, 6).astype(e2m1).astype(f32) * (g * bs)
            return y.reshape(x.shape)

        return run
    t = getattr(ml_dtypes, ref[1])
    maxv = f32(ml_dtypes.finfo(t).max)
    if ref[0] == "tensor":
        def run(x):
            s = f32(np.max(np.abs(x)) / maxv)
            return (x / s).astype(t).astype(f32) * s

        return run
    if ref[0] == "channel":
        def run(x):
            s = np.max(np.abs(x), axis=1, keepdims=True) / maxv
            return (x / s).astype(t).astype(f32) * s

        return run
    emax = int(np.floor(np.log2(float(maxv))))
    bsz = ref[2]

    def run(x):
        xb = x.reshape(-1, bsz)
        amax = np.maximum(np.abs(xb).max(axis=1, keepdims=True), f32(2.0**-126))
        s = np.exp2(np.clip(np.floor(np.log2(amax)) - emax, -127, 127)).astype(f32)
        return (np.clip(xb / s, -maxv, maxv).astype(t).astype(f32) * s).reshape(x.shape)

    return run


# ---------------------------------------------------------------------------------------------------------------
# Bits and bytes
# ---------------------------------------------------------------------------------------------------------------
def as_numpy(a):
    return a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)


def same_bits(a, b) -> bool:
    a, b = as_numpy(a), as_numpy(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == np.float32:
        an, bn = np.isnan(a), np.isnan(b)  # NaN sign/payload unspecified (qcore._fast docstring)
        return bool(np.array_equal(an, bn) and np.array_equal(a.view(np.uint32)[~an], b.view(np.uint32)[~bn]))
    return bool(np.array_equal(a, b))


def nbytes(v) -> int:
    if v is None:
        return 0
    if isinstance(v, qcore.QTensor):
        return sum(nbytes(p) for p in (v.codes, v.scales, v.zero_points, v.subblock_shifts, v.tensor_scale))
    if hasattr(v, "element_size"):
        return v.numel() * v.element_size()
    return np.asarray(v).nbytes


def oracle(xs, spec):
    """The generic path alone (``_fake_quantize_pure`` with the fast cast kernel refused), numpy."""
    qmod = importlib.import_module("qcore.quantize")
    inplace = importlib.import_module("qcore._inplace")
    with mock.patch.object(inplace, "cast_ok", lambda *a, **k: False):
        return qmod._fake_quantize_pure(xs, None, None, None, None, spec=spec)


def spec_of(name):
    fmt, kw = FORMATS[name][:2]
    return qcore.make_spec(fmt, **kw)


# ---------------------------------------------------------------------------------------------------------------
# Memory (subprocess worker for RSS; tracemalloc in process for numpy)
# ---------------------------------------------------------------------------------------------------------------
def _status_kib():
    d = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                d[k] = int(v.split()[0])
    return d


def rss_extra(fn, unit):
    """Peak RSS growth during ``fn()`` beyond its result's bytes, in units of ``unit`` bytes (see docstring)."""
    out = fn()
    del out
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib()["VmRSS"]
    out = fn()
    peak = _status_kib()["VmHWM"]
    return ((peak - base) * 1024 - nbytes(out)) / unit


def tracemalloc_extra(fn, unit):
    out = fn()
    del out
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        cur = tracemalloc.get_traced_memory()[0]
        out = fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return (peak - cur - nbytes(out)) / unit


def op_calls(x, spec):
    q = qcore.quantize(x, spec)
    return {"fake": lambda: qcore.fake_quantize(x, spec), "quantize": lambda: qcore.quantize(x, spec),
            "dequantize": lambda: qcore.dequantize(q)}


def memory_worker(args):
    """Runs in a subprocess with MEM_ENV set; prints one JSON line."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.size, args.size)
    unit = x.numel() * 4
    res = {"calibration": {"clone": rss_extra(lambda: x.clone(), unit),
                           "(x*2+1).abs()": rss_extra(lambda: (x * 2 + 1).abs(), unit)}, "torch": {}, "numpy": {}}
    xn = x.numpy().copy()
    for name in args.formats.split(","):
        spec = spec_of(name)
        res["torch"][name] = {k: rss_extra(f, unit) for k, f in op_calls(x, spec).items()}
        if args.numpy:
            res["numpy"][name] = {k: rss_extra(f, unit) for k, f in op_calls(xn, spec).items()}
        gc.collect()
    print(json.dumps(res))


def run_memory_subprocess(args):
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-worker", "--size", str(args.size),
           "--formats", args.formats, "--numpy" if args.numpy else "--no-numpy"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = dict(os.environ, **MEM_ENV)
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        return json.loads(p.stdout.strip().splitlines()[-1])
    except Exception as exc:  # noqa: BLE001 - report, don't die: memory is one column of many
        err = getattr(locals().get("p"), "stderr", "") or ""
        print(f"memory subprocess failed: {type(exc).__name__}: {exc} {err[-2000:]}", file=sys.stderr)
        return None


# ---------------------------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------------------------
def time_default_path(x, spec, ref, ref_name, rep, r):
    """The default call against ``ref`` (clone/copy), and quantize and dequantize against it; fills ``r`` with
    ``{ref_name}_ms``, ``fake_ms``, ``fake_x``, ``quantize_ms``, ``q_over_fake``, ``dequantize_ms``,
    ``dq_over_fake``; returns (the QTensor, the fake_quantize call, the reference's median time)."""
    fake = lambda: qcore.fake_quantize(x, spec)  # noqa: E731
    r["samples_ms"] = {}
    t_fake, t_ref = paired(fake, ref, rep, samples=r["samples_ms"])
    r.update({f"{ref_name}_ms": t_ref * 1e3, "fake_ms": t_fake * 1e3, "fake_x": t_fake / t_ref})
    q = qcore.quantize(x, spec)
    t_q, t_f = paired(lambda: qcore.quantize(x, spec), fake, rep)
    r.update(quantize_ms=t_q * 1e3, q_over_fake=t_q / t_f)
    t_dq, t_f = paired(lambda: qcore.dequantize(q), fake, rep)
    r.update(dequantize_ms=t_dq * 1e3, dq_over_fake=t_dq / t_f)
    return q, fake, t_ref


def torch_row(name, x, args, torch):
    spec = spec_of(name)
    rep = args.repeat
    r = {"format": name}
    q, fake, t_clone = time_default_path(x, spec, lambda: x.clone(), "clone", rep, r)
    y = fake()
    bits = {"t~n": same_bits(y, qcore.fake_quantize(x.numpy(), spec)), "q": same_bits(qcore.dequantize(q), y)}
    del q
    xs = x[:ORACLE_SLICE, :ORACLE_SLICE].contiguous()
    bits["o"] = same_bits(qcore.fake_quantize(xs, spec), oracle(xs.numpy(), spec))
    if not args.no_compile:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            yc = qcore.fake_quantize(x, spec, compile=True)
            r["compile_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            qcore.fake_quantize(x, spec, compile=True)
            r["compiled_second_call_s"] = time.perf_counter() - t0
            qcore.fake_quantize(x, spec, compile=True)
            comp = lambda: qcore.fake_quantize(x, spec, compile=True)  # noqa: E731
            t_c, t_cl = paired(comp, lambda: x.clone(), min(3, rep))
        fell_back = [str(w.message) for w in caught if str(w.message).startswith("qcore: torch.compile")]
        r.update(compiled_ms=t_c * 1e3, compiled_x=t_c / t_cl, compile_fell_back=fell_back)
        bits["c"] = same_bits(yc, y)
        del yc
    ao = torchao_qdq(torch, FORMATS[name][2])
    if ao is not None:
        try:
            t_ao, t_f = paired(lambda: ao(x), fake, max(3, rep // 2 + 1))
            r.update(torchao_ms=t_ao * 1e3, torchao_over_fake=t_ao / t_f, torchao_x=t_ao / t_clone,
                     ref_same_bits=same_bits(ao(x), y))
        except Exception as exc:  # noqa: BLE001 - a torchao version without this path
            r["torchao_error"] = f"{type(exc).__name__}: {exc}"
    r["bits"] = bits
    r["bit_identical"] = all(v for v in bits.values() if v is not None)
    return r, y


def numpy_row(name, xn, args):
    spec = spec_of(name)
    rep = args.repeat
    r = {"format": name}
    q, fake, t_copy = time_default_path(xn, spec, lambda: xn.copy(), "copy", rep, r)
    y = fake()
    bits = {"q": same_bits(qcore.dequantize(q), y)}
    xs = np.ascontiguousarray(xn[:ORACLE_SLICE, :ORACLE_SLICE])
    bits["o"] = same_bits(qcore.fake_quantize(xs, spec), oracle(xs, spec))
    mld = ml_dtypes_qdq(FORMATS[name][3])
    if mld is not None:
        with np.errstate(all="ignore"):
            t_m, t_f = paired(lambda: mld(xn), fake, max(3, rep // 2 + 1))
            r.update(ml_dtypes_ms=t_m * 1e3, ml_dtypes_over_fake=t_m / t_f, ml_dtypes_x=t_m / t_copy,
                     ref_same_bits=same_bits(mld(xn), y))
    unit = xn.nbytes
    r["mem_tracemalloc"] = {k: tracemalloc_extra(f, unit) for k, f in op_calls(xn, spec).items()}
    r["bits"] = bits
    r["bit_identical"] = all(bits.values())
    return r, y


def _small_row(case: str, backend: str, t_a: float, t_b: float, same: bool) -> dict:
    """One row of the small-tensor table: qcore's time against the plain expression on the same backend."""
    return {"case": case, "backend": backend, "qcore_us": t_a * 1e6, "ref": f"plain {backend} expression",
            "ref_us": t_b * 1e6, "qcore_over_ref": t_a / t_b, "target": f"<= {TARGETS['small_over_plain']}",
            "same_bits": same}


def small_rows(args, torch, with_numpy):
    rows = []
    rep = max(7, args.repeat)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(576, 1, generator=g)
    lo, hi = float(w.min()), float(w.max())
    s_t = torch.tensor([[(hi - lo) / 15.0]], dtype=torch.float32)
    z_t = torch.tensor([[float(round(-lo / float(s_t)))]], dtype=torch.float32)
    s_r = (w.abs() + 0.1) / 7.5
    z_r = torch.full((576, 1), 8.0)
    cases = [("gptq col, per-tensor s,z (576,1)", qcore.make_spec("uint4"), s_t, z_t),
             ("gptq col, per-row s,z (576,1)", qcore.make_spec("uint4", granularity=PerChannel(0)), s_r, z_r)]
    for label, spec, s, z in cases:
        def qc(w=w, spec=spec, s=s, z=z):
            return qcore.fake_quantize(w, spec, scale=s, zero_point=z)

        def plain(w=w, s=s, z=z):
            return (torch.clamp(torch.round(w / s) + z, 0, 15) - z) * s

        n = inner_loops(qc)
        t_a, t_b = paired(qc, plain, rep, n)
        rows.append(_small_row(label, "torch", t_a, t_b, same_bits(qc(), plain())))
        # New parameter values at every call (two sets, alternating): qcore._given's memo of checked values never
        # hits, so this row pays the checks themselves (the plain expression alternates the same way).
        s2, z2 = s * 1.25, torch.clamp(z + 1, 0, 15)
        sets = [(s, z), (s2, z2)]
        turn = [0]

        def qc_fresh(w=w, spec=spec, sets=sets, turn=turn):
            turn[0] ^= 1
            sv, zv = sets[turn[0]]
            return qcore.fake_quantize(w, spec, scale=sv, zero_point=zv)

        def plain_fresh(w=w, sets=sets, turn=turn):
            sv, zv = sets[turn[0]]
            return (torch.clamp(torch.round(w / sv) + zv, 0, 15) - zv) * sv

        t_a, t_b = paired(qc_fresh, plain_fresh, rep, n)
        same = all(same_bits(qcore.fake_quantize(w, spec, scale=sv, zero_point=zv),
                             (torch.clamp(torch.round(w / sv) + zv, 0, 15) - zv) * sv) for sv, zv in sets)
        rows.append(_small_row(label.replace("(576,1)", "new values each call (576,1)"), "torch", t_a, t_b, same))
        # The same step with the parameters validated once (qcore.fake_quantizer), as a GPTQ loop would use it.
        fq = qcore.fake_quantizer(spec, shape=tuple(w.shape), scale=s, zero_point=z, like=w)
        t_a, t_b = paired(lambda fq=fq, w=w: fq(w), plain, rep, n)
        rows.append(_small_row(label.replace("gptq col", "fake_quantizer"), "torch", t_a, t_b,
                               same_bits(fq(w), plain())))
        if with_numpy:
            wn, sn, zn = w.numpy(), s.numpy(), z.numpy()

            def qn(wn=wn, spec=spec, sn=sn, zn=zn):
                return qcore.fake_quantize(wn, spec, scale=sn, zero_point=zn)

            def pn(wn=wn, sn=sn, zn=zn):
                return (np.clip(np.rint(wn / sn) + zn, 0, 15) - zn) * sn

            n = inner_loops(qn)
            t_a, t_b = paired(qn, pn, rep, n)
            rows.append(_small_row(label, "numpy", t_a, t_b, same_bits(qn(), pn())))
    if getattr(args, "core", False):
        return rows
    a = torch.randn(512, 576, generator=g)
    spec = qcore.make_spec("mxfp4")
    qc = lambda: qcore.fake_quantize(a, spec)  # noqa: E731
    ao = torchao_qdq(torch, FORMATS["mxfp4"][2])
    if ao is not None:
        n = inner_loops(qc)
        t_a, t_b = paired(qc, lambda: ao(a), rep, n)
        rows.append({"case": "mxfp4 activation (512,576)", "backend": "torch", "qcore_us": t_a * 1e6,
                     "ref": "torchao to_mx+to_dtype", "ref_us": t_b * 1e6, "qcore_over_ref": t_a / t_b,
                     "target": f"<= {1 / TARGETS['small_torchao_speedup']:.2f} (3x faster)",
                     "same_bits": same_bits(qc(), ao(a))})
    t_a, t_b = paired(qc, lambda: a.clone(), rep, inner_loops(qc))
    rows.append({"case": "mxfp4 activation (512,576)", "backend": "torch", "qcore_us": t_a * 1e6,
                 "ref": "a.clone()", "ref_us": t_b * 1e6, "qcore_over_ref": t_a / t_b, "target": "-",
                 "same_bits": None})
    if with_numpy:
        an = a.numpy()
        qn = lambda: qcore.fake_quantize(an, spec)  # noqa: E731
        mld = ml_dtypes_qdq(FORMATS["mxfp4"][3])
        if mld is not None:
            with np.errstate(all="ignore"):
                t_a, t_b = paired(qn, lambda: mld(an), rep, inner_loops(qn))
                rows.append({"case": "mxfp4 activation (512,576)", "backend": "numpy", "qcore_us": t_a * 1e6,
                             "ref": "ml_dtypes MX round trip", "ref_us": t_b * 1e6, "qcore_over_ref": t_a / t_b,
                             "target": "-", "same_bits": same_bits(qn(), mld(an))})
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------------------------
def _f(v, fmt, width):
    return f"{'-':>{width}}" if v is None else f"{v:{width}{fmt}}"


def bits_cell(r):
    bad = [k for k, v in r["bits"].items() if v is False]
    return "yes" if not bad else "NO: " + ",".join(bad)


def print_torch_table(rows, mem, compile_on):
    hdr = (f"{'format':<17} {'clone ms':>8} {'fake x':>7} {'q/fake':>6} {'dq/fake':>7} {'comp x':>7} {'comp s':>6} "
           f"{'ao x':>6} {'ao/fake':>7} {'mem x':>6}  bits")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        m = (mem or {}).get("torch", {}).get(r["format"])
        r["mem_rss"] = m
        mx = max(m.values()) if m else None
        comp = r.get("compiled_x")
        cs = r.get("compile_s")
        ccell = f"{'eager!':>7}" if r.get("compile_fell_back") else _f(comp, ".2f", 7)
        print(f"{r['format']:<17} {r['clone_ms']:8.2f} {r['fake_x']:7.2f} {r['q_over_fake']:6.2f} "
              f"{r['dq_over_fake']:7.2f} {ccell if compile_on else _f(None, '', 7)} {_f(cs, '.1f', 6)} "
              f"{_f(r.get('torchao_x'), '.1f', 6)} {_f(r.get('torchao_over_fake'), '.1f', 7)} {_f(mx, '.2f', 6)}"
              f"  {bits_cell(r)}")


def print_numpy_table(rows, mem):
    hdr = (f"{'format':<17} {'copy ms':>8} {'fake x':>7} {'q/fake':>6} {'dq/fake':>7} {'mld x':>6} {'mld/fake':>8} "
           f"{'mem x':>6} {'mem x (RSS)':>11}  bits")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        m = (mem or {}).get("numpy", {}).get(r["format"])
        r["mem_rss"] = m
        mt = max(r["mem_tracemalloc"].values())
        mr = max(m.values()) if m else None
        print(f"{r['format']:<17} {r['copy_ms']:8.2f} {r['fake_x']:7.2f} {r['q_over_fake']:6.2f} "
              f"{r['dq_over_fake']:7.2f} {_f(r.get('ml_dtypes_x'), '.1f', 6)} "
              f"{_f(r.get('ml_dtypes_over_fake'), '.2f', 8)} {mt:6.2f} {_f(mr, '.2f', 11)}  {bits_cell(r)}")


def print_small(rows):
    hdr = f"{'case':<34} {'backend':<7} {'qcore us':>9} {'ref us':>9} {'qcore/ref':>9}  {'same bits':<9} reference"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        sb = "-" if r["same_bits"] is None else ("yes" if r["same_bits"] else "no")
        print(f"{r['case']:<34} {r['backend']:<7} {r['qcore_us']:9.1f} {r['ref_us']:9.1f} {r['qcore_over_ref']:9.2f}"
              f"  {sb:<9} {r['ref']} (target {r['target']})")


def reference_outliers(rows, key, label):
    """Rows whose reference time (clone/copy) is off the table's median by 2x or more: a fresh 64 MiB buffer
    costs ~10 ms when it happens to get transparent huge pages and ~40-50 ms with 4 KiB page faults, so that
    row's ``x`` columns mislead; its absolute ``fake ms`` (in the JSON and the note) does not."""
    if len(rows) < 3:
        return []
    med = statistics.median(r[key] for r in rows)
    notes = [f"note: {r['format']}: {label} took {r[key]:.1f} ms against the table's median {med:.1f} ms, so its "
             f"'fake x' misleads; its fake_quantize took {r['fake_ms']:.1f} ms"
             for r in rows if not med / 2 < r[key] < med * 2]
    for n in notes:
        print(n)
    return notes


def summary(res):
    """One line per target: met everywhere, or where not (with the figure)."""
    T = TARGETS
    lines = []

    def check(label, items, ok):
        miss = [f"{k} {v:.2f}" for k, v in items if v is not None and not ok(v)]
        n = sum(v is not None for _, v in items)
        if n:
            lines.append(f"{label}: {'met' if not miss else 'NOT met'} ({n - len(miss)}/{n})"
                         + (f"; misses: {', '.join(miss)}" if miss else ""))

    tr, nr = res.get("torch", []), res.get("numpy", [])
    check(f"torch fake <= {T['torch_fake_x']}x clone", [(r["format"], r["fake_x"]) for r in tr],
          lambda v: v <= T["torch_fake_x"])
    check(f"torch: torchao / fake >= {T['torchao_speedup']}", [(r["format"], r.get("torchao_over_fake")) for r in tr],
          lambda v: v >= T["torchao_speedup"])
    check(f"numpy fake <= {T['numpy_fake_x']}x copy", [(r["format"], r["fake_x"]) for r in nr],
          lambda v: v <= T["numpy_fake_x"])
    check("numpy: ml_dtypes round trip / fake > 1", [(r["format"], r.get("ml_dtypes_over_fake")) for r in nr],
          lambda v: v > 1)
    for b, rows in (("torch", tr), ("numpy", nr)):
        check(f"{b} quantize/fake <= {T['q_over_fake']}", [(r["format"], r["q_over_fake"]) for r in rows],
              lambda v: v <= T["q_over_fake"])
        check(f"{b} dequantize/fake <= {T['dq_over_fake']}", [(r["format"], r["dq_over_fake"]) for r in rows],
              lambda v: v <= T["dq_over_fake"])
        key = "mem_rss" if b == "torch" else "mem_tracemalloc"
        check(f"{b} peak extra memory <= {T['mem_x']}x input (max of fake/quantize/dequantize)",
              [(r["format"], max(r[key].values()) if r.get(key) else None) for r in rows],
              lambda v: v <= T["mem_x"])
        check(f"{b} bit-identical", [(r["format"], 1.0 if r["bit_identical"] else 0.0) for r in rows],
              lambda v: v == 1.0)
    sm = res.get("small", [])
    check(f"small: qcore / plain expression <= {T['small_over_plain']}",
          [(f"{r['case']} [{r['backend']}]", r["qcore_over_ref"]) for r in sm if r["ref"].startswith("plain")],
          lambda v: v <= T["small_over_plain"])
    check(f"small: torchao / qcore >= {T['small_torchao_speedup']} (mxfp4 512x576)",
          [(r["case"], 1 / r["qcore_over_ref"]) for r in sm if r["ref"].startswith("torchao")],
          lambda v: v >= T["small_torchao_speedup"])
    return lines


def core_rows(res):
    """Issue 23's rows: (backend, case, reference, reference time, new time, ratio, landed ratio, target, met)."""
    out = []
    for backend, ref in (("torch", "clone"), ("numpy", "copy")):
        for r in res.get(backend, []):
            key = (backend, r["format"])
            if key not in CORE_LANDED:
                continue
            tgt = CORE_TARGETS[backend] if key in CORE_TARGETED else None
            n = res["meta"]["size"]
            out.append({"backend": backend, "case": f"fake_quantize {r['format']} {n}x{n}", "ref": f"x.{ref}()",
                        "ref_ms": r[f"{ref}_ms"], "new_ms": r["fake_ms"], "ratio": r["fake_x"],
                        "landed": CORE_LANDED[key], "target": tgt,
                        "met": None if tgt is None else r["fake_x"] <= tgt, "same_bits": r["bit_identical"]})
    for r in res.get("small", []):
        if not r["ref"].startswith("plain"):
            continue
        key = (r["backend"], r["case"])
        fresh = "new values" in r["case"]
        tgt = CORE_TARGETS["small"] if (key in CORE_TARGETED or (fresh and r["backend"] == "torch")) else None
        out.append({"backend": r["backend"], "case": r["case"], "ref": r["ref"], "ref_ms": r["ref_us"] / 1e3,
                    "new_ms": r["qcore_us"] / 1e3, "ratio": r["qcore_over_ref"], "landed": CORE_LANDED.get(key),
                    "target": tgt, "met": None if tgt is None else r["qcore_over_ref"] <= tgt,
                    "same_bits": r["same_bits"]})
    return out


def core_markdown(res, args):
    m = res["meta"]
    lines = [
        "# Issue 23, core leftovers: bench/bench_fake_quantize.py",
        "",
        f"Command: `{m['command']}`. Date {m['date'][:19]}. Machine: {m['nproc']} CPUs ({m['machine']}), torch "
        f"threads {m['torch_threads']}, clock: {m.get('clock', 'wall time')}, load average {m['loadavg_start']} at "
        f"start, {m.get('loadavg_end')} at end (1, 5, 15 min). Versions: {', '.join(f'{k} {v}' for k, v in m['versions'].items())}.",
        "",
        f"Ratios are medians of {m['repeat']} (large) / >= 7 (small) alternating pairs measured in this run against the "
        "reference in the same process (x.clone() / x.copy(); the plain expression "
        "`(clamp(round(w / s) + z, 0, 15) - z) * s` for the 576-element column). Landed: the same ratio in "
        f"{CORE_LANDED_SOURCE}. 'same bits': qcore's output equals the reference path's bit for bit (large rows: "
        "torch = numpy = the generic oracle on a 512x512 slice, and dequantize(quantize) = fake_quantize; small rows: "
        "= the plain expression).",
        "",
        "| backend | case | reference | ref ms | new ms | new ratio | landed ratio | target | met | same bits |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in res["core"]:
        def f(v, fmt):
            return "-" if v is None else format(v, fmt)
        met = "-" if r["met"] is None else ("yes" if r["met"] else "**no**")
        sb = "-" if r["same_bits"] is None else ("yes" if r["same_bits"] else "**NO**")
        lines.append(f"| {r['backend']} | {r['case']} | {r['ref']} | {f(r['ref_ms'], '.3f')} | {f(r['new_ms'], '.3f')} "
                     f"| {r['ratio']:.2f}x | {f(r['landed'], '.2f')}{'x' if r['landed'] else ''} "
                     f"| {'<= ' + format(r['target'], '.1f') + 'x' if r['target'] else '-'} | {met} | {sb} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4096, help="x is size x size float32 (default 4096)")
    p.add_argument("--repeat", type=int, default=5, help="pairs per timing (default 5)")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, from: {', '.join(FORMATS)}")
    p.add_argument("--numpy", dest="numpy", action="store_true", default=True, help="numpy table (default)")
    p.add_argument("--no-numpy", dest="numpy", action="store_false", help="skip the numpy table")
    p.add_argument("--no-compile", action="store_true", help="skip compile=True (slow: seconds to a minute a format)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--small", action="store_true", help="only the small-tensor rows")
    p.add_argument("--no-memory", action="store_true", help="skip the memory measurements")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--core", action="store_true",
                   help=f"issue 23's core leftovers only ({CORE_FORMATS}, the small rows; no compile, no memory), "
                        "ending with the core targets table, written to --md / --json (default "
                        "bench/results/CORE_LEFTOVERS.md / .json)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with this thread's CPU time instead of wall time (for a loaded machine; needs "
                        "--threads 1)")
    p.add_argument("--md", metavar="FILE", help="write the core targets table as markdown (default with --core: "
                                                "bench/results/CORE_LEFTOVERS.md)")
    p.add_argument("--memory-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.core:
        if "--formats" not in (argv if argv is not None else sys.argv[1:]):
            args.formats = CORE_FORMATS
        args.no_compile = args.no_memory = True
        here = os.path.dirname(os.path.abspath(__file__))
        args.md = args.md or os.path.join(here, "results", "CORE_LEFTOVERS.md")
        args.json = args.json or os.path.join(here, "results", "CORE_LEFTOVERS.json")
    if args.cpu_time and args.threads != 1:
        p.error("--cpu-time needs --threads 1 (the thread CPU time does not count torch's other threads)")
    unknown = [f for f in args.formats.split(",") if f not in FORMATS]
    if unknown:
        p.error(f"unknown format(s) {', '.join(unknown)}; known: {', '.join(FORMATS)}")
    if args.size < 128 or args.size % 128:
        p.error(f"--size must be a positive multiple of 128 (the int4/uint4 groups), got {args.size}")
    return args


def main(argv=None):
    args = parse(argv)
    CLOCK[0] = time.thread_time if args.cpu_time else time.perf_counter
    if args.memory_worker:
        return memory_worker(args)
    t_start = time.perf_counter()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    versions = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
                "qcore": qcore.__version__}
    for mod in ("torchao", "ml_dtypes"):
        try:
            versions[mod] = importlib.import_module(mod).__version__
        except Exception:  # noqa: BLE001
            versions[mod] = None
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        "/tmp", f"torchinductor_{os.environ.get('USER') or 'root'}")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.relpath(os.path.abspath(sys.argv[0]), repo)  # as the repository names it, not this machine
    meta = {"command": " ".join([os.path.basename(sys.executable), script] + sys.argv[1:]),
            "date": str(datetime.datetime.now()),
            "versions": versions, "torch_threads": torch.get_num_threads(), "nproc": os.cpu_count(),
            "machine": platform.machine(), "processor": platform.processor(), "size": args.size,
            "repeat": args.repeat, "loadavg_start": loadavg(), "inductor_cache_existed": os.path.isdir(cache),
            "clock": "thread CPU time" if args.cpu_time else "wall time"}
    print(f"qcore {versions['qcore']}, torch {versions['torch']}, numpy {versions['numpy']}, torchao "
          f"{versions['torchao']}, ml_dtypes {versions['ml_dtypes']}, python {versions['python']}")
    print(f"machine: {meta['nproc']} CPUs ({meta['machine']}), torch threads {meta['torch_threads']}, "
          f"load average {meta['loadavg_start']} (1, 5, 15 min), clock: {meta['clock']}")
    print(f"x: {args.size}x{args.size} float32 ({args.size * args.size * 4 / 2**20:.0f} MiB), medians of "
          f"{args.repeat} alternating pairs; inductor cache {cache} "
          f"{'existed' if meta['inductor_cache_existed'] else 'did not exist'} at start")
    res = {"meta": meta}
    if not args.small:
        torch.manual_seed(0)
        x = torch.randn(args.size, args.size)
        xn = x.numpy()
        names = args.formats.split(",")
        mem = None if args.no_memory else run_memory_subprocess(args)
        res["memory_calibration"] = mem and mem.get("calibration")
        if args.numpy:
            print("\nnumpy arrays (fake x = multiple of x.copy(); target <= 8x and faster than ml_dtypes)")
            rows = []
            for name in names:
                r, _ = numpy_row(name, xn, args)
                rows.append(r)
                if len(rows) == 1:
                    print_numpy_table([], None)
                print_numpy_table_row(r, mem)
            res["numpy"] = rows
            meta["reference_outliers_numpy"] = reference_outliers(rows, "copy_ms", "x.copy()")
            print(f"load average {loadavg()}")
        print("\ntorch CPU tensors (fake x = multiple of x.clone(); targets <= 3x clone, >= 10x faster than torchao)")
        rows = []
        for name in names:
            r, y = torch_row(name, x, args, torch)
            rows.append(r)
            if len(rows) == 1:
                print_torch_table([], None, not args.no_compile)
            print_torch_table_row(r, mem, not args.no_compile)
            del y
        res["torch"] = rows
        meta["reference_outliers_torch"] = reference_outliers(rows, "clone_ms", "x.clone()")
        if mem:
            c = mem["calibration"]
            print(f"memory method check (RSS high-water, fresh subprocess): x.clone() extra {c['clone']:.2f}x "
                  f"(expect 0.00), (x*2+1).abs() extra {c['(x*2+1).abs()']:.2f}x (expect 1.00)")
        print(f"load average {loadavg()}")
    print("\nsmall tensors (time per call; qcore/ref < 1: qcore faster)")
    res["small"] = small_rows(args, torch, args.numpy)
    print_small(res["small"])
    meta["loadavg_end"] = loadavg()
    meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    print(f"load average {meta['loadavg_end']}; whole run {meta['elapsed_s']:.0f} s")
    res["summary"] = summary(res)
    print("\ntargets")
    for line in res["summary"]:
        print("  " + line)
    res["core"] = core_rows(res)
    md = core_markdown(res, args)
    print("\ncore targets (issue 23)\n" + md)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return res


def print_torch_table_row(r, mem, compile_on):
    with contextlib.redirect_stdout(_Tail()) as t:
        print_torch_table([r], mem, compile_on)
    print(t.last(), flush=True)


def print_numpy_table_row(r, mem):
    with contextlib.redirect_stdout(_Tail()) as t:
        print_numpy_table([r], mem)
    print(t.last(), flush=True)


class _Tail:
    """Collects printed text; ``last()`` is its last line (prints one table row at a time, as rows finish)."""

    def __init__(self):
        self.parts = []

    def write(self, s):
        self.parts.append(s)

    def flush(self):
        pass

    def last(self):
        return "".join(self.parts).rstrip("\n").splitlines()[-1]


if __name__ == "__main__":
    main()
