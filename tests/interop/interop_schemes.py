"""The Quark schemes the interop suite exports with both Quark and qcore (shared by conftest and the tests)."""

# Quark scheme (":KV" = KV-cache scheme) -> the export's directory name (= the fixture name in quark_configs/)
SCHEMES = {"int8": "int8", "fp8:fp8": "fp8_kv_fp8", "uint4_wo_128": "uint4_wo_128", "int4_wo_128": "int4_wo_128",
           "mxfp4": "mxfp4", "mxfp6_e2m3": "mxfp6_e2m3"}
NAMES = list(SCHEMES.values())
# the qcore preset (and its KV option) that is the same scheme
QCORE_PRESETS = {"int8": ("int8", None), "fp8_kv_fp8": ("fp8", "fp8"), "uint4_wo_128": ("uint4_wo_128", None),
                 "int4_wo_128": ("int4_wo_128", None), "mxfp4": ("mxfp4", None), "mxfp6_e2m3": ("mxfp6_e2m3", None)}
