"""The AMD Quark side of the Quark interop tests: a standalone script for a Python that has amd-quark 0.13.

Run it with the interpreter of a separate virtual environment holding ``amd-quark==0.13``, ``torch``,
``transformers`` and ``safetensors`` (``tests/interop/conftest.py`` builds one; see ``tests/interop/README.md``).
It never imports qcore: it is the independent client that qcore's exports must satisfy and whose exports qcore
must read. One process handles a batch (importing Quark costs 10-30 s, its first import compiles a C++ extension):

    python quark_client.py warm
    python quark_client.py export --model DIR --calib IDS.npy --out OUT --scheme int8 --scheme fp8:fp8 ...
        [--kv-cache fp8] [--eval-ids IDS.npy --eval-out EVAL]
    python quark_client.py logits --ids IDS.npy --out OUT DIR [DIR ...]     # OUT/<basename(DIR)>.npy
    python quark_client.py logits --ids IDS.npy --out LOGITS.npy DIR          # one model: a file

``export``: for each ``--scheme NAME[:KV]`` (``KV``: the KV-cache scheme, else ``--kv-cache``'s, else none), load
the float model from ``DIR`` (``AutoModelForCausalLM``, float32), build the config with Quark's
``LLMTemplate.get(model_type)`` (``"llama"`` when Quark has no template for the model type)
``.get_config(scheme=NAME, kv_cache_scheme=KV)``, calibrate with the rows of ``IDS.npy`` (int64 ``[n, seq]``, one
row per calibration batch), freeze, and write ``OUT/<NAME>`` (``OUT/<NAME>_kv_<KV>`` with a KV-cache scheme) with
``export_safetensors(custom_mode="quark", weight_format="real_quantized", pack_method="reorder")``; tokenizer files
of ``DIR`` are copied when Quark did not. Its record lists the written files and ``output_scales``: the per-tensor
output scales of the frozen model before export (the KV-cache scales: Quark's exporter then writes the maximum of
each ``kv_cache_group`` for both k_proj and v_proj). With ``--eval-ids``, also save the logits on those ids of the
float model (``EVAL/float.npy``), of Quark's in-memory frozen quantized model (``EVAL/<name>.npy``), and of the
same model object after ``export_safetensors`` (``EVAL/<name>.exported.npy``: the exporter swaps its layers for
QParamsLinear and merges the KV scales in place).

``logits``: load each ``DIR`` with ``AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.float32)`` (for
``quant_method: "quark"`` that is transformers' Quark integration, which builds amd-quark's ``QParamsLinear``
layers) and save float32 logits ``[n, seq, vocab]`` of the ids.

Every result is one stdout line ``QUARK_CLIENT_JSON {...}`` (other output of Quark may interleave); ``logits``
reports the module classes it ran (``modules``: counts of ``nn.Linear`` subclasses and Quark modules by class
name; ``quantizers``: how many QParamsLinear layers carry a weight / input / output quantizer) so a test can tell
Quark's loader really quantized rather than silently loading floats. Exit status 2: bad arguments; 1: a failure.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import shutil
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported: idle OpenMP threads sleep
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PREFIX = "QUARK_CLIENT_JSON "
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")


def emit(record: dict) -> None:
    print(PREFIX + json.dumps(record, sort_keys=True), flush=True)


def _torch():
    import torch

    torch.set_num_threads(2)
    return torch


def versions() -> dict:
    import quark
    import torch
    import transformers

    return {"quark": quark.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0]}


def load_ids(path: str):
    import numpy as np

    ids = np.load(path)
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise SystemExit(f"{path}: expected an integer array [n, seq], got {ids.dtype} {ids.shape}")
    return _torch().from_numpy(ids.astype(np.int64))


def load_float(model_dir: str):
    torch = _torch()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if getattr(model.config, "quantization_config", None) is not None:
        raise SystemExit(f"{model_dir}: holds a quantized model (quantization_config in config.json); "
                         "export needs a float model")
    return model


def run_logits(model, ids):
    torch = _torch()
    with torch.no_grad():
        return model(input_ids=ids).logits.float().numpy()


def module_report(model) -> dict:
    from torch import nn

    modules = collections.Counter()
    quantizers = collections.Counter()
    for m in model.modules():
        cls = type(m)
        if isinstance(m, nn.Linear) or cls.__module__.startswith("quark."):
            modules[cls.__name__] += 1
        if cls.__name__.startswith("QParamsLinear"):
            for which in ("weight", "input", "output", "bias"):
                if getattr(m, f"{which}_quantizer", None) is not None:
                    quantizers[which] += 1
    return {"modules": dict(modules), "quantizers": dict(quantizers)}


def quant_method(model_dir: str) -> str | None:
    path = pathlib.Path(model_dir, "config.json")
    if not path.is_file():
        raise SystemExit(f"{model_dir}: no config.json; expected a Hugging Face model directory")
    return (json.loads(path.read_text()).get("quantization_config") or {}).get("quant_method")


def parse_scheme(token: str, default_kv: str | None) -> tuple[str, str | None, str]:
    name, _, kv = token.partition(":")
    kv = kv or default_kv
    return name, kv, (f"{name}_kv_{kv}" if kv else name)


def cmd_warm(args) -> int:
    t0 = time.perf_counter()
    import quark.torch  # noqa: F401  (the first import compiles Quark's C++ extension)

    emit({"cmd": "warm", "seconds": round(time.perf_counter() - t0, 2), "versions": versions(),
          "qcore_imported": "qcore" in sys.modules})
    return 0


def cmd_export(args) -> int:
    t0 = time.perf_counter()
    torch = _torch()
    from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors

    import_s = time.perf_counter() - t0
    jobs = [parse_scheme(t, args.kv_cache) for t in args.scheme]
    names = [j[2] for j in jobs]
    if len(set(names)) != len(names):
        raise SystemExit(f"--scheme: the same export twice: {names}")
    for name, kv, _ in jobs:
        if name not in LLMTemplate._SUPPORTED_SCHEMES:
            raise SystemExit(f"--scheme {name!r}: not a Quark scheme; expected one of {LLMTemplate._SUPPORTED_SCHEMES}")
    calib_ids = load_ids(args.calib)
    calib = [calib_ids[i:i + 1] for i in range(calib_ids.shape[0])]
    eval_ids = load_ids(args.eval_ids) if args.eval_ids else None
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    eval_out = pathlib.Path(args.eval_out) if args.eval_out else None
    if eval_ids is not None:
        import numpy as np

        eval_out.mkdir(parents=True, exist_ok=True)
        np.save(eval_out / "float.npy", run_logits(load_float(args.model), eval_ids))
    emit({"cmd": "export", "event": "ready", "import_seconds": round(import_s, 2), "versions": versions()})

    for scheme, kv, name in jobs:
        t1 = time.perf_counter()
        model = load_float(args.model)
        model_type = model.config.model_type
        template_name = model_type if model_type in LLMTemplate.list_available() else "llama"
        config = LLMTemplate.get(template_name).get_config(scheme=scheme, kv_cache_scheme=kv)
        quantizer = ModelQuantizer(config)
        model = quantizer.quantize_model(model, calib)
        model = quantizer.freeze(model)
        if eval_ids is not None:
            import numpy as np

            np.save(eval_out / f"{name}.npy", run_logits(model, eval_ids))
        output_scales = {n: float(m._output_quantizer.scale) for n, m in model.named_modules()
                         if getattr(m, "_output_quantizer", None) is not None
                         and getattr(m._output_quantizer, "scale", None) is not None
                         and m._output_quantizer.scale.numel() == 1}
        target = out / name
        if target.exists():
            shutil.rmtree(target)
        with torch.no_grad():
            export_safetensors(model=model, output_dir=str(target), custom_mode="quark",
                               weight_format="real_quantized", pack_method="reorder")
        if eval_ids is not None:
            np.save(eval_out / f"{name}.exported.npy", run_logits(model, eval_ids))
        copied = []
        for fname in TOKENIZER_FILES:
            src = pathlib.Path(args.model, fname)
            if src.is_file() and not (target / fname).exists():
                shutil.copy2(src, target / fname)
                copied.append(fname)
        emit({"cmd": "export", "scheme": scheme, "kv_cache": kv, "name": name, "template": template_name,
              "out": str(target), "files": sorted(p.name for p in target.iterdir()), "tokenizer_copied": copied,
              "output_scales": output_scales, "seconds": round(time.perf_counter() - t1, 2)})
    emit({"cmd": "export", "event": "done", "seconds": round(time.perf_counter() - t0, 2),
          "qcore_imported": "qcore" in sys.modules})
    return 0


def cmd_logits(args) -> int:
    import numpy as np

    t0 = time.perf_counter()
    _torch()
    from transformers import AutoModelForCausalLM

    if any(quant_method(d) == "quark" for d in args.model):
        import quark.torch  # noqa: F401  (transformers would import it in from_pretrained; here it is timed)
    import_s = time.perf_counter() - t0
    ids = load_ids(args.ids)
    out = pathlib.Path(args.out)
    single = out.suffix == ".npy"
    if single and len(args.model) != 1:
        raise SystemExit(f"--out {out}: a .npy file takes exactly one model, got {len(args.model)}")
    names = [pathlib.Path(d).resolve().name for d in args.model]
    if not single and len(set(names)) != len(names):
        raise SystemExit(f"models: two directories with the same name: {names}")
    (out.parent if single else out).mkdir(parents=True, exist_ok=True)
    emit({"cmd": "logits", "event": "ready", "import_seconds": round(import_s, 2), "versions": versions()})
    torch = _torch()
    for model_dir, name in zip(args.model, names):
        t1 = time.perf_counter()
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        except Exception as e:  # --keep-going: one record naming the failure, then the next model
            if not args.keep_going:
                raise
            emit({"cmd": "logits", "model": str(model_dir), "name": name,
                  "error": f"{type(e).__name__}: {e}"[:2000], "seconds": round(time.perf_counter() - t1, 2)})
            continue
        qc = getattr(model.config, "quantization_config", None)
        if qc is not None and not isinstance(qc, dict):
            qc = qc.to_dict()
        target = out if single else out / f"{name}.npy"
        np.save(target, run_logits(model, ids))
        emit({"cmd": "logits", "model": str(model_dir), "name": name, "out": str(target),
              "quant_method": (qc or {}).get("quant_method"), **module_report(model),
              "seconds": round(time.perf_counter() - t1, 2)})
    emit({"cmd": "logits", "event": "done", "seconds": round(time.perf_counter() - t0, 2),
          "qcore_imported": "qcore" in sys.modules})
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("warm", help="import quark.torch once (compiles its C++ extension) and print versions")
    ex = sub.add_parser("export", help="quantize a float HF model with Quark and export real_quantized safetensors")
    ex.add_argument("--model", required=True, help="float Hugging Face model directory")
    ex.add_argument("--scheme", required=True, action="append",
                    help="NAME or NAME:KV (an LLMTemplate scheme, KV its KV-cache scheme); repeat for a batch")
    ex.add_argument("--kv-cache", default=None, help="KV-cache scheme for the --scheme values without ':KV'")
    ex.add_argument("--calib", required=True, help="calibration token ids, .npy int [n, seq]")
    ex.add_argument("--out", required=True, help="writes OUT/<NAME> or OUT/<NAME>_kv_<KV> per scheme")
    ex.add_argument("--eval-ids", default=None, help="also save float and in-memory quantized logits on these ids")
    ex.add_argument("--eval-out", default=None, help="directory for --eval-ids' logits: float.npy, <name>.npy")
    lo = sub.add_parser("logits", help="load HF model directories with transformers and save their logits")
    lo.add_argument("model", nargs="+", help="model directories")
    lo.add_argument("--ids", required=True, help="token ids, .npy int [n, seq]")
    lo.add_argument("--out", required=True, help="a .npy file (one model) or a directory: OUT/<basename>.npy")
    lo.add_argument("--keep-going", action="store_true",
                    help="a model that fails to load gets a record with 'error' instead of ending the run")
    args = ap.parse_args(argv)
    if args.cmd == "export" and (args.eval_ids is None) != (args.eval_out is None):
        ap.error("--eval-ids and --eval-out go together")
    return {"warm": cmd_warm, "export": cmd_export, "logits": cmd_logits}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
