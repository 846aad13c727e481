"""Fake-quantize speed on CPU: a 4096x4096 float32 torch tensor, as a ratio to ``x.clone()`` timed in the same run.

    python bench/bench_fake_quantize.py [--size 4096] [--repeat 7] [--numpy] [--formats mxfp4,int4_g128]

Rows: qcore eager (torch), qcore ``compile=True`` (torch.compile, first call's compile time reported
separately), and where they exist torchao 0.18's MX QDQ (to_mx + to_dtype) and ml_dtypes' cast round trip
(numpy), each checked for bit-identity with qcore's numpy oracle semantics where they share them. The goal
is every format within 3x of clone with compile=True. Timings are medians; this machine is noisy,
so only ratios measured in the same run mean anything. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import qcore

FORMATS = {
    # name: (spec or format name, overrides, torchao element, ml_dtypes element)
    "mxfp4": ("mxfp4", {}, "fp4", None),
    "mxfp6_e2m3": ("mxfp6_e2m3", {}, "fp6_e2m3", None),
    "mxfp8_e4m3": ("mxfp8_e4m3", {}, "fp8_e4m3", None),
    "mxint8": ("mxint8", {}, None, None),
    "mx9": ("mx9", {}, None, None),
    "mx6": ("mx6", {}, None, None),
    "bfp16": ("bfp16", {}, None, None),
    "fp8_e4m3_tensor": ("float8_e4m3fn", {}, None, "float8_e4m3fn"),
    "int4_g128": ("int4", {"granularity": qcore.PerGroup(128)}, None, None),
}


def timeit(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired(fn, ref, repeat):
    """Median time of ``fn`` and of ``ref``, measured alternately so both see the same machine state
    (allocator, page cache, other load): the ratio is what this benchmark reports."""
    fn()
    ref()
    a, b = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        ref()
        t2 = time.perf_counter()
        a.append(t1 - t0)
        b.append(t2 - t1)
    return statistics.median(a), statistics.median(b)


def torchao_qdq(torch, elem):
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    except Exception:  # torchao absent or broken
        return None
    dt = {"fp4": getattr(torch, "float4_e2m1fn_x2", None), "fp8_e4m3": torch.float8_e4m3fn,
          "fp6_e2m3": "fp6_e2m3"}.get(elem)
    if dt is None:
        return None

    def run(x):
        s, d = to_mx(x, dt, 32)
        return to_dtype(d, s, dt, 32, torch.float32)

    return run


def ml_dtypes_qdq(elem):
    try:
        import ml_dtypes
    except ImportError:
        return None
    t = getattr(ml_dtypes, elem)
    maxv = float(ml_dtypes.finfo(t).max)

    def run(x):
        scale = np.float32(np.abs(x).max() / maxv)
        return (x / scale).astype(t).astype(np.float32) * scale

    return run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--numpy", action="store_true", help="also time the numpy oracle (slow)")
    p.add_argument("--formats", default=",".join(FORMATS))
    args = p.parse_args(argv)

    import torch

    torch.manual_seed(0)
    x = torch.randn(args.size, args.size)
    xn = x.numpy()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, x {tuple(x.shape)} float32 "
          f"({x.numel() * 4 / 2**20:.0f} MiB), median of {args.repeat}")
    header = f"{'format':<16} {'clone ms':>8} {'eager':>7} {'compiled':>8} {'compile s':>9} {'torchao':>8} " \
             f"{'ml_dtypes':>9} {'numpy':>7}  bit-identical"
    print(header)
    print("-" * len(header))
    for name in args.formats.split(","):
        fmt, kw, ao, mld = FORMATS[name]
        spec = qcore.make_spec(fmt, **kw)
        t0 = time.perf_counter()
        yc = qcore.fake_quantize(x, spec, compile=True)
        ctime = time.perf_counter() - t0
        comp, clone = paired(lambda: qcore.fake_quantize(x, spec, compile=True), lambda: x.clone(), args.repeat)
        eager = paired(lambda: qcore.fake_quantize(x, spec), lambda: x.clone(), max(2, args.repeat // 3))
        eager = eager[0] / eager[1] * clone
        ye = qcore.fake_quantize(x, spec)
        same = torch.equal(yc.view(torch.int32), ye.view(torch.int32))
        cells = [f"{clone * 1e3:8.1f}", f"{eager / clone:6.1f}x", f"{comp / clone:7.2f}x", f"{ctime:9.1f}"]
        ref = torchao_qdq(torch, ao) if ao else None
        if ref is not None:
            try:
                cells.append(f"{timeit(lambda: ref(x), max(2, args.repeat // 3)) / clone:7.1f}x")
            except Exception as exc:  # a torchao version without this path
                cells.append(f"{'err':>8}")
                print(f"  torchao {ao}: {type(exc).__name__}: {exc}")
        else:
            cells.append(f"{'-':>8}")
        mref = ml_dtypes_qdq(mld) if mld else None
        cells.append(f"{timeit(lambda: mref(xn), 2) / clone:8.1f}x" if mref else f"{'-':>9}")
        if args.numpy:
            cells.append(f"{timeit(lambda: qcore.fake_quantize(xn, spec), 1) / clone:6.1f}x")
            same = same and np.array_equal(qcore.fake_quantize(xn, spec).view(np.uint32),
                                           ye.numpy().view(np.uint32))
        else:
            cells.append(f"{'-':>7}")
        print(f"{name:<16} " + " ".join(cells) + f"  {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
