"""GPU benchmark of qcore's Triton kernels (qcore.adapters.triton): bandwidth-bound quantization and the fused
4-bit matmul at batch 1.

    python bench/bench_kernels.py [--size 8192] [--repeat 50] [--json FILE]
    python bench/bench_kernels.py --interpret      # CPU smoke run of the script itself (tiny, times meaningless)

On a GPU (CUDA or ROCm) it measures:

1. the memory bandwidth: ``y.copy_(x)`` of a 1 GiB float32 tensor, bytes read + written over the median time;
2. MX quantize-dequantize (``fake_quantize``: read x, write float32) and quantize to packed codes
   (``quantize_packed``: read x, write packed codes and scale bytes) of a ``size x size`` float32 and bfloat16
   tensor, for mxfp4 / mxfp6_e2m3 / mxfp8_e4m3 (OCP FLOOR and Quark's EVEN scales) and nvfp4 (given tensor
   scale): the bytes moved over the median time, as a fraction of (1) (target: >= 0.80);
3. the fused dequantize-matmul ``linear_w4`` at batch 1 (bf16 activations) for int4 / uint4 per group of 128
   and MXFP4 weights of Llama-like shapes, against torch's bf16 ``F.linear`` on the dequantized weight
   (target: >= 2x faster).

Every kernel result is also checked once against the core (bit for bit; the matmul within its tolerance). Times
are CUDA-event medians after warm-up. With no GPU it prints that no GPU is present and exits 0: nothing is
measured. Results: bench/results/KERNELS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's qcore, however the script is started


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=8192, help="side of the square tensor for (2) (default 8192)")
    p.add_argument("--repeat", type=int, default=50, help="timed calls per figure (median; default 50)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--interpret", action="store_true",
                   help="run on the CPU under TRITON_INTERPRET=1 with tiny sizes: checks the script, times are "
                        "meaningless")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        os.environ.setdefault("QCORE_TRITON", "1")
    import torch

    if not args.interpret and not torch.cuda.is_available():
        print("bench_kernels: no GPU is present (torch.cuda.is_available() is False): the Triton kernel benchmark "
              "needs a CUDA or ROCm GPU; nothing was measured.")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench_kernels: triton is not installed (pip install triton): nothing was measured.")
        return 0
    import qcore
    import qcore.adapters.triton as kernels
    from qcore.testing import compare

    dev = torch.device("cpu") if args.interpret else torch.device("cuda")
    size = 64 if args.interpret else args.size
    repeat = 2 if args.interpret else args.repeat
    shapes = [(64, 256)] if args.interpret else [(4096, 4096), (14336, 4096), (4096, 14336),
                                                             (11008, 4096), (4096, 11008)]
    gpu = "cpu (interpreter)" if args.interpret else torch.cuda.get_device_name(dev)
    hip = getattr(torch.version, "hip", None)
    print(f"qcore {getattr(qcore, '__version__', '?')}, torch {torch.__version__}, triton {triton.__version__}, "
          f"python {platform.python_version()}")
    print(f"device: {gpu}{' (ROCm ' + hip + ')' if hip else ''}; medians of {repeat} calls")

    def timed(fn) -> float:
        """Median seconds of ``fn()``."""
        for _ in range(1 if args.interpret else 3):
            fn()
        if args.interpret:
            ts = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)
        ts = []
        for _ in range(repeat):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        return statistics.median(ts)

    res: dict = {"meta": {"device": gpu, "torch": torch.__version__, "triton": triton.__version__,
                          "size": size, "repeat": repeat, "interpret": args.interpret}}

    # 1. bandwidth
    n = (1 << 14) if args.interpret else (1 << 28)
    src = torch.empty(n, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src))
    bw = 2 * src.nbytes / t
    res["bandwidth_GBps"] = bw / 1e9
    print(f"\nmemory bandwidth (copy of {src.nbytes / 2**30:.2f} GiB float32): {bw / 1e9:.1f} GB/s")
    src = dst = None  # free the GiB

    # 2. quantization throughput
    print(f"\nquantization of a {size}x{size} tensor (fraction = bytes moved / time / bandwidth; target >= 0.80)")
    print(f"{'op':<30}{'input':>9}{'ms':>10}{'GB/s':>10}{'fraction':>10}{'bits':>6}")
    rows = []
    g = torch.Generator(device="cpu").manual_seed(0)
    base = torch.randn(size, size, generator=g).to(dev)
    cases = [("mxfp4", {}), ("mxfp4", {"scale_mode": qcore.ScaleMode.EVEN}), ("mxfp6_e2m3", {}),
             ("mxfp8_e4m3", {}), ("nvfp4", {"tensor_scale": 0.01})]
    if args.interpret:
        cases = [cases[0], cases[-1]]
    for dtype in (torch.float32,) if args.interpret else (torch.float32, torch.bfloat16):
        x = base.to(dtype)
        for fmt, kw in cases:
            label = fmt + ("/even" if "scale_mode" in kw else "")
            spec = qcore.make_spec(fmt, **{k: v for k, v in kw.items() if k != "tensor_scale"})
            tkw = {k: v for k, v in kw.items() if k == "tensor_scale"}
            ref_rows = x[:64].float().cpu()
            ok = compare(kernels.fake_quantize(x[:64], spec, **tkw), qcore.fake_quantize(ref_rows, spec, **tkw)).ok
            t = timed(lambda: kernels.fake_quantize(x, spec, **tkw))
            moved = x.numel() * (x.element_size() + 4)
            rows.append(_row(f"fake_quantize {label}", dtype, t, moved, bw, ok))
            p = kernels.quantize_packed(x[:64], spec, **tkw)
            q = qcore.quantize(ref_rows, spec, **tkw)
            ok = bool(torch.equal(p.packed.cpu(), qcore.packing.pack(q.codes, spec.dtype, axis=-1))) and \
                bool(torch.equal(p.scale_codes.cpu(), q.scale_codes))
            t = timed(lambda: kernels.quantize_packed(x, spec, **tkw))
            full = kernels.quantize_packed(x, spec, **tkw)
            moved = x.numel() * x.element_size() + full.packed.numel() + full.scale_codes.numel() * \
                full.scale_codes.element_size()
            rows.append(_row(f"quantize_packed {label}", dtype, t, moved, bw, ok))
        del x
    res["quantization"] = rows
    del base

    # 3. batch-1 matmul
    print("\nfused dequantize-matmul at batch 1, bf16 activations (speedup = torch bf16 F.linear time / kernel "
          "time; target >= 2)")
    print(f"{'weight':<16}{'N x K':>14}{'bf16 us':>10}{'kernel us':>11}{'speedup':>9}{'max rel err':>13}")
    mm = []
    import torch.nn.functional as F

    weights = [("int4_g128", qcore.make_spec("int4", granularity=qcore.PerGroup(128, -1))),
               ("uint4_g128", qcore.make_spec("uint4", granularity=qcore.PerGroup(128, -1))),
               ("mxfp4", qcore.make_spec("mxfp4"))]
    for fmt, spec in weights[1:] if args.interpret else weights:
        for N, K in shapes:
            w = torch.randn(N, K, generator=g).to(dev)
            qw = qcore.quantize(w, spec)
            packed = qcore.packing.pack(qw.codes, spec.dtype, axis=-1)
            scales = qw.scale_codes if spec.pow2_scale else qw.scales
            zp = None if qw.zero_points is None else qw.zero_points.to(torch.uint8)
            wb = qcore.dequantize(qw).to(torch.bfloat16)
            w = qw = None
            x = torch.randn(1, K, generator=g).to(dev).to(torch.bfloat16)
            y = kernels.linear_w4(x, packed, scales, zp, spec=spec, k=K)
            ref = F.linear(x.float(), wb.float())
            err = float(((y.float() - ref).abs() / (ref.abs() + 1e-3)).max())
            tk = timed(lambda: kernels.linear_w4(x, packed, scales, zp, spec=spec, k=K))
            tb = timed(lambda: F.linear(x, wb))
            mm.append({"weight": fmt, "N": N, "K": K, "bf16_us": tb * 1e6, "kernel_us": tk * 1e6,
                       "speedup": tb / tk, "max_rel_err": err})
            print(f"{fmt:<16}{f'{N}x{K}':>14}{tb * 1e6:>10.1f}{tk * 1e6:>11.1f}{tb / tk:>9.2f}{err:>13.2e}")
    res["matmul_batch1"] = mm

    print("\ntargets")
    mx = [r for r in rows if r["op"].startswith("fake_quantize mx")]
    worst_mx = min(r["fraction"] for r in mx)
    worst_mm = min(r["speedup"] for r in mm)
    bits = all(r["bits"] for r in rows)
    summary = [f"MX quantize-dequantize: worst fraction of bandwidth {worst_mx:.2f} (target >= 0.80): "
               f"{'met' if worst_mx >= 0.8 else 'NOT met'}",
               f"int4 / MXFP4 matmul at batch 1: worst speedup over bf16 {worst_mm:.2f}x (target >= 2): "
               f"{'met' if worst_mm >= 2 else 'NOT met'}",
               f"kernel outputs equal to the core (bits): {'yes' if bits else 'NO'}"]
    if args.interpret:
        summary.append("--interpret: CPU interpreter, tiny sizes: these times say nothing about a GPU")
    for line in summary:
        print("  " + line)
    res["summary"] = summary
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def _row(op, dtype, t, moved, bw, ok) -> dict:
    name = str(dtype).replace("torch.", "")
    r = {"op": op, "input": name, "ms": t * 1e3, "GBps": moved / t / 1e9, "fraction": moved / t / bw, "bits": ok}
    print(f"{op:<30}{name:>9}{t * 1e3:>10.3f}{moved / t / 1e9:>10.1f}{moved / t / bw:>10.2f}"
          f"{'yes' if ok else 'NO':>6}")
    return r


if __name__ == "__main__":
    sys.exit(main())
