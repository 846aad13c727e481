"""The ``qcore`` command line (``qcore ...`` or ``python -m qcore ...``).

Commands are subcommands; each one is a ``_add_<name>(subparsers)`` function in ``_COMMANDS`` that registers its
parser and sets ``func`` (a function of the parsed arguments returning the exit code). Exit codes: 0 success,
1 the check found mismatches (or missing outputs), 2 usage errors (bad arguments, unknown formats, a mode that
fits none of the formats, a directory that would be overwritten), 141 (128 + SIGPIPE) when the reader of
stdout went away (``qcore conformance check ... | head``): like a standard Unix tool, the command then stops
quietly, without a traceback. Error messages name command-line flags, not Python arguments, and are one line on
stderr (a usage error points at ``--help`` instead of printing the usage block; ``--debug`` shows the traceback). Only numpy is
imported: torch and qcore.adapters stay out of these commands and out of ``qcore --help``. The model commands
(``qcore quantize``, ``qcore eval``, ``qcore schemes``, ``qcore convert``) are listed here; their parsers and
implementations are in ``qcore.adapters.cli``, imported only when one of them is parsed (``qcore quantize --help``
included).

    qcore conformance export DIR --formats mxfp4,float8_e4m3fn [--modes all] [--key 0] [--overwrite]
    qcore conformance check VECTORS --outputs OUT [--ulps N] [--formats ...] [--cases ...] [--allow-missing]
                            [--strict-nan] [--max-examples N] [--json]
    qcore conformance modes [--formats ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from . import __version__, conformance
from ._argtypes import Needs, check_needs, comma_list, nonempty, nonnegative_int
from .dtypes import DTYPES, BlockDType
from .formats import inspect as fi  # numpy only: works without torch

__all__ = ["main", "build_parser"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a process ended by SIGPIPE


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors raise instead of exiting (main turns them into exit code 2 and one line on
    stderr, which points at ``--help`` instead of printing the usage block). ``fill``: a function that adds the
    parser's arguments the first time it parses (the model commands, whose flags live in qcore.adapters.cli)."""

    def __init__(self, *args, fill=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._fill = fill

    def parse_known_args(self, args=None, namespace=None):
        if self._fill is not None:
            fill, self._fill = self._fill, None
            fill(self)
        return super().parse_known_args(args, namespace)

    def error(self, message):
        raise _UsageError(f"{self.prog}: error: {' '.join(message.split())} (see: {self.prog} --help)")


# ---------------------------------------------------------------------------------------------------------------
# qcore conformance ...
# ---------------------------------------------------------------------------------------------------------------


def _conformance_export(args) -> int:
    for flag, check, value in (("--formats", conformance.normalize_formats, args.formats),
                               ("--modes", conformance.normalize_modes, args.modes)):
        try:  # each flag's own error names it, before anything is written
            check(value)
        except (ValueError, TypeError) as e:
            msg = str(e)
            raise ValueError(f"{flag}: {msg[len('formats: '):] if msg.startswith('formats: ') else msg}") from None
    try:
        m = conformance.export(args.directory, args.formats, modes=args.modes, key=args.key,
                               overwrite=args.overwrite)
    except conformance.DirectoryNotEmptyError as e:
        raise conformance.DirectoryNotEmptyError(e.directory, "pass --overwrite to replace it") from None
    n_files = sum(len(c["files"]) for c in m.cases)
    print(f"wrote {len(m.cases)} case(s), {n_files} array(s) (.npy + .bin) for {', '.join(m.formats)} to "
          f"{m.directory}")
    for c in m.cases:
        print(f"  {c['name']}")
    for s in m.data["skipped"]:
        print(f"  skipped {s['format']} {s['mode']}: {s['reason']}")
    print(f"manifest: {m.directory / 'manifest.json'} and {m.directory / 'manifest.tsv'}")
    return EXIT_OK


def _conformance_check(args) -> int:
    r = conformance.check(args.vectors, args.outputs, ulps=args.ulps, formats=args.formats, cases=args.cases,
                          allow_missing=args.allow_missing, nan_equal=not args.strict_nan,
                          max_examples=args.max_examples)
    if args.json:
        print(json.dumps(r.to_dict(), indent=1))
    else:
        print(r.format(max_examples=args.max_examples))
    return EXIT_OK if r.ok else EXIT_FAIL


def _conformance_modes(args) -> int:
    names = args.formats or [n for n, d in DTYPES.items() if isinstance(d, BlockDType)]
    for n in names:  # before printing anything: an unknown name is a usage error naming the flag
        try:
            conformance.default_modes(n)
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"--formats: {e}") from None
    print("element formats (op cast):", ", ".join(conformance.ELEMENT_MODES))
    print("block formats (op quantize):", ", ".join(conformance.BLOCK_MODES))
    print("two-level block formats (op quantize):", ", ".join(conformance.TWO_LEVEL_MODES))
    print("defaults:")
    for n in names:
        print(f"  {n}: {', '.join(conformance.default_modes(n))}")
    return EXIT_OK


def _add_conformance(sub) -> None:
    p = sub.add_parser("conformance", help="export conformance vectors / check a kernel's outputs against them",
                       description="Conformance vectors on disk for test suites without Python "
                                   "(see docs/kernel_testing.md).")
    csub = p.add_subparsers(dest="conformance_command", metavar="{export,check,modes}")
    csub.required = True

    e = csub.add_parser("export", help="write inputs and expected outputs (.npy, .bin, manifest.json/.tsv)")
    e.add_argument("directory", type=nonempty,
                   help="output directory (must not exist or be empty, unless --overwrite)")
    e.add_argument("--formats", required=True, type=comma_list,
                   help="comma-separated format names, e.g. mxfp4,float8_e4m3fn")
    e.add_argument("--modes", type=comma_list, default=None,
                   help="comma-separated modes (element: nearest_even[_saturate|_nosaturate], nearest_away, "
                        "toward_zero, floor, ceil; block: scale_floor, scale_ceil, scale_even, scale_rceil; or all); "
                        "default: each format's defaults")
    e.add_argument("--key", type=nonnegative_int, default=0, help="seed of the random probes (default 0)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing non-empty directory")
    e.set_defaults(func=_conformance_export)

    c = csub.add_parser("check", help="compare a kernel's outputs with exported vectors, bit for bit")
    c.add_argument("vectors", type=nonempty, help="directory written by 'qcore conformance export'")
    c.add_argument("--outputs", required=True, type=nonempty,
                   help="directory with the kernel's outputs: <case>/<expected file stem>.npy or .bin")
    c.add_argument("--ulps", type=nonnegative_int, default=0,
                   help="tolerance in units in the last place for float files (default 0)")
    c.add_argument("--formats", type=comma_list, default=None, help="check only these formats' cases")
    c.add_argument("--cases", type=comma_list, default=None, help="check only these cases")
    c.add_argument("--allow-missing", action="store_true", help="missing output files are not a failure")
    c.add_argument("--strict-nan", action="store_true",
                   help="NaN sign and payload bits must match too (default: any NaN matches any NaN)")
    c.add_argument("--max-examples", type=nonnegative_int, default=5, help="mismatches shown per file (default 5)")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(func=_conformance_check)

    m = csub.add_parser("modes", help="list the modes and each format's default modes")
    m.add_argument("--formats", type=comma_list, default=None)
    m.set_defaults(func=_conformance_modes)


# ---------------------------------------------------------------------------------------------------------------
# model commands: listed here (no torch); their parsers and implementations are in qcore.adapters.cli, imported
# when one of them is parsed
# ---------------------------------------------------------------------------------------------------------------

# name -> the one line ``qcore --help`` shows
_MODEL_COMMANDS = {
    "quantize": "quantize a model, evaluate it before and after, report",
    "eval": "perplexity / lm-evaluation-harness tasks of a model",
    "schemes": "list the quantization presets",
    "convert": "convert a quantized checkpoint between formats (hf, gguf, compressed-tensors, onnx), lossless "
               "where both hold the grid",
    "imatrix": "compute a model's importance matrix on the calibration windows; write llama.cpp's imatrix file",
}


def _model_command(name: str):
    """``_add_<name>`` of a model command: a parser that gets its flags from ``qcore.adapters.cli.add_arguments``
    when it parses (``qcore --help`` and the numpy commands never import torch)."""
    def fill(parser) -> None:
        # torch's OpenMP threads sleep instead of spinning while they wait (read once, when torch loads): on a
        # loaded 2-core machine spinning waits made small parallel operations wait for descheduled threads (GPTQ
        # on one 576 x 1536 weight: 24 s spinning, 1.3 s passive; docs/algorithms.md); idle, no difference
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        try:
            from qcore.adapters import cli as adapters_cli
        except ModuleNotFoundError as e:
            raise _UsageError(f"qcore {name}: error: this command needs torch and transformers ({e}); "
                              f"pip install 'qcore-numerics[hf]'") from None
        adapters_cli.add_arguments(name, parser)

    def add(sub) -> None:
        sub.add_parser(name, help=_MODEL_COMMANDS[name], fill=fill)
    return add


#: what ``qcore inspect``'s flags need to have an effect (``qcore._argtypes.Needs``; the conformance commands'
#: flags have one wherever they are given)
_INSPECT_NEEDS = (Needs("layers", lambda o: not o["json"], "has no effect with --json, which lists every layer"),)


def _inspect(args) -> int:
    try:
        check_needs(_INSPECT_NEEDS, vars(args), given={k for k in ("layers", "json") if getattr(args, k)},
                    show=lambda k, v: "--" + k)
        info = fi.inspect_path(args.directory)
    except (OSError, ValueError, ModuleNotFoundError) as e:
        if args.debug:
            raise
        print(f"qcore inspect: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(info, indent=1) if args.json else fi.format_report(info, layers=args.layers))
    return 0


def _add_inspect(sub) -> None:
    i = sub.add_parser("inspect", help="what an exported checkpoint holds: config, tensors, formats, bits per weight",
                       description="Describe a quantized checkpoint: an HF directory (qcore, AMD Quark or "
                                   "compressed-tensors export: its quantization config, each layer's format and "
                                   "bits per weight, tensor dtypes, size on disk; reads only config.json and the "
                                   "safetensors headers, and checks that every file is complete), a .gguf file "
                                   "(tensor types, bits per weight by block type) or an ONNX export directory "
                                   "(initializers: dtype, quantized form, bits per weight).")
    i.add_argument("directory", metavar="PATH", type=nonempty, help="checkpoint directory (config.json + "
                   "*.safetensors), .gguf "
                   "file, or ONNX export directory (model.onnx)")
    i.add_argument("--layers", action="store_true", help="one row per quantized layer / tensor")
    i.add_argument("--json", action="store_true", help="print the description as JSON (per layer included)")
    i.add_argument("--debug", action="store_true", help="show tracebacks")
    i.set_defaults(func=_inspect)


# Top-level commands, in help order.
_COMMANDS = (
    ("quantize", _model_command("quantize")),
    ("eval", _model_command("eval")),
    ("schemes", _model_command("schemes")),
    ("convert", _model_command("convert")),
    ("imatrix", _model_command("imatrix")),
    ("inspect", _add_inspect),
    ("conformance", _add_conformance),
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="qcore", description="qcore: exact low-precision numerics.")
    parser.add_argument("--version", action="version", version=f"qcore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(n for n, _ in _COMMANDS) + "}",
                                parser_class=_Parser)
    sub.required = True
    for _, add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 check failed, 2 usage error, 141 stdout closed)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)
    except _UsageError as e:
        print(str(e), file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as e:  # --help / --version
        return int(e.code or 0) if isinstance(e.code, int) else EXIT_USAGE
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here, not at interpreter exit
        return code
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except (ValueError, TypeError, OSError, RecursionError) as e:
        if getattr(args, "debug", False):
            raise
        where = " ".join(filter(None, [args.command, getattr(args, "conformance_command", None)]))
        msg = " ".join(str(e).split()) or type(e).__name__  # one line, whatever the message holds
        if isinstance(e, RecursionError):
            msg = f"input nested too deeply ({msg})"
        print(f"qcore {where}: error: {msg}", file=sys.stderr)
        return EXIT_USAGE


def _silence_stdout() -> None:
    """After EPIPE: point stdout at /dev/null so that the interpreter's last flush does not print a traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a real file (captured in tests): nothing to silence
        pass
