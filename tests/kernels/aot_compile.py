"""Compile every kernel ahead of time for an NVIDIA (sm_90) and an AMD (gfx942, MI300) target, no GPU needed:
``python tests/kernels/aot_compile.py`` (run by test_triton_compile.py in a fresh process, without
TRITON_INTERPRET). Prints one line per kernel; for NVIDIA it also checks the quantization kernels' PTX: only
correctly rounded float operations (``div.rn.f32``, ``mul.f32`` / ``mul.rn.f32``), no ``fma``, no flush to zero,
no approximate division."""

import inspect
import os
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "src"))
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import qcore  # noqa: E402
from qcore import PerGroup  # noqa: E402
import qcore.adapters.triton._kernels as K  # noqa: E402
from qcore.adapters.triton._specs import as_spec, decode_consts, element_consts, scale_consts  # noqa: E402

TARGETS = {"cuda": GPUTarget("cuda", 90, 32), "hip": GPUTarget("hip", "gfx942", 64)}
BAD_PTX = re.compile(r"\b(fma\.\S+|\S+\.ftz\.\S+|div\.(full|approx)\.\S+)")


def build(fn, types, consts, target, check_ptx):
    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: ("constexpr" if p in consts else types[p]) for p in params}
    src = ASTSource(fn, sig, constexprs={(params.index(p),): v for p, v in consts.items()})
    k = triton.compile(src, target=TARGETS[target], options={"enable_fp_fusion": False})
    if target == "cuda" and check_ptx:
        bad = sorted(set(m.group(0) for m in BAD_PTX.finditer(k.asm["ptx"])))
        if bad:
            raise SystemExit(f"{fn.fn.__name__}: PTX has {bad}")
    print(target, fn.fn.__name__, "ok")


def main(targets):
    group_types = dict(x_ptr="*bf16", val_ptr="*fp32", code_ptr="*u8", pack_ptr="*u8", scale_ptr="*fp32",
                       scode_ptr="*i32", zp_ptr="*fp32", ts_ptr="*fp32", total="i32", ngc="i32", C="i32", PB="i32")
    for target in targets:
        for spec in (as_spec("nvfp4"), qcore.make_spec("uint4", granularity=PerGroup(32)), as_spec("mxfp6_e2m3")):
            bits = spec.dtype.bits
            c = dict(G=spec.granularity.size, BLOCK=spec.granularity.size, NG=64, **scale_consts(spec),
                     **element_consts(spec), WRITE_VAL=True, WRITE_CODE=True, PACK=bits if bits in (4, 6) else 0,
                     WRITE_SCALE=True, CODE_SIGNED=False)
            build(K._group_quant_kernel, group_types, c, target, True)
        c = dict(LAYOUT=0, G=1, USE_MUL=False, **element_consts(as_spec("float8_e4m3fnuz")), WRITE_VAL=True,
                 WRITE_CODE=True, CODE_SIGNED=False, BLOCK=1024)
        build(K._elem_quant_kernel, dict(x_ptr="*fp32", val_ptr="*fp32", code_ptr="*u8", s_ptr="*fp32",
                                         mul_ptr="*fp32", dq_ptr="*fp32", zp_ptr="*fp32", n="i64", P1="i32",
                                         P2="i32"), c, target, True)
        c = dict(**scale_consts(qcore.make_spec("uint8", axis=0)), QMIN=0, QMAX=255, BLOCK=1024)
        build(K._stats_scale_kernel, dict(amax_ptr="*fp32", lo_ptr="*fp32", hi_ptr="*fp32", ts_ptr="*fp32",
                                          scale_ptr="*fp32", mul_ptr="*fp32", dq_ptr="*fp32", zp_ptr="*fp32",
                                          scode_ptr="*i32", n="i32"), c, target, True)
        c = dict(LAYOUT=1, G=32, BLOCK=1024, **decode_consts(as_spec("float8_e5m2")))
        build(K._dequant_kernel, dict(code_ptr="*u8", s_ptr="*fp32", dq_ptr="*fp32", zp_ptr="*fp32",
                                      out_ptr="*fp32", n="i64", P1="i32", P2="i32"), c, target, True)
        c = dict(G=32, FMT=2, HAS_ZP=False, HAS_BIAS=True, BM=16, BN=64, BK=128, IEEE=False, EMULATE=False,
                 X_BF16=True)
        build(K._w4_matmul_kernel, dict(x_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", zp_ptr="*i32", b_ptr="*bf16",
                                        y_ptr="*bf16", M="i32", N="i32", K="i32", PK="i32", NGK="i32",
                                        sxm="i32", sym="i32"), c, target, False)
        for direct in (True, False):
            c = dict(G=128, FMT=1, HAS_ZP=True, HAS_BIAS=True, DIRECT=direct, BN=32, BK=128, X_BF16=True,
                     X_F16=False, EMULATE=False)
            build(K._w4_gemv_kernel, dict(x_ptr="*bf16", w_ptr="*u8", s_ptr="*fp32", zp_ptr="*i32", b_ptr="*bf16",
                                          part_ptr="*fp32", y_ptr="*bf16", M="i32", N="i32", K="i32", PK="i32",
                                          NGK="i32", sxm="i32", KCHUNK="i32"), c, target, False)
        build(K._splitk_sum_kernel, dict(part_ptr="*fp32", b_ptr="*bf16", y_ptr="*bf16", S="i32", MN="i32", N="i32"),
              dict(HAS_BIAS=True, EMULATE=False, X_BF16=True, BLOCK=1024), target, True)
        build(K._w4_dequant_kernel, dict(w_ptr="*u8", s_ptr="*fp32", zp_ptr="*i32", out_ptr="*fp32", N="i32",
                                         K="i32", PK="i32", NGK="i32"),
              dict(G=32, FMT=1, HAS_ZP=True, BN=32, BK=64), target, True)
        for md, k2 in ((1, 1024), (12, 16)):
            mp = 1 << max(0, (md - 1).bit_length())
            build(K._fwht_kernel, dict(x_ptr="*fp32", h_ptr="*i32", out_ptr="*fp32", rdiv="fp32"),
                  dict(MD=md, MP=mp, K2=k2, LOGK2=k2.bit_length() - 1), target, True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(TARGETS))
