"""The fuzzing harness of tests/fuzz (issue 33): real files qcore writes, mutated, fed to qcore's readers.

Every example of every target is held to one contract (``attempt`` + ``check_refusal``):

- the reader returns, and what it read equals what an independent reader reads from the same bytes (the
  safetensors library, gguf-py, onnx, compressed-tensors, or the float model given the stored tensors
  dequantized by numpy in the test), or
- it raises ``ValueError`` / ``TypeError`` (``CorruptCheckpointError`` is a ``ValueError``) whose message is one
  line and names the file and the mutated field or tensor;
- never another exception type, never a hang (``TIMEOUT_S`` per example, SIGALRM), never a file written,
  changed or removed (every file under the watched folders, by name, size, mtime and SHA-256), never memory
  growth beyond ``MEMORY_FACTOR x the input's size + MEMORY_CONSTANT`` (the peak resident set size of the
  process during the call over the one before it: /proc/self/clear_refs resets the peak per example;
  tracemalloc's peak where that file cannot be written).

Counts: each target runs a few dozen examples in the default suite (a few seconds) and several hundred under
``-m slow`` (``counts(default, many)``); examples are derandomized (the same on every run, no example database),
so CI is deterministic. ``STATS`` counts what each target saw (accepted, refused by class); the terminal summary
prints it (tests/fuzz/conftest.py).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import math
import pathlib
import re
import signal
import traceback
import tracemalloc
from typing import Any, Callable, Iterable, Optional, Sequence

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

TIMEOUT_S = 60.0
MEMORY_FACTOR = 4
MEMORY_CONSTANT = 192 << 20

FUZZ = dict(deadline=None, derandomize=True, database=None, print_blob=True,
            suppress_health_check=list(HealthCheck))

STATS: dict = collections.defaultdict(collections.Counter)


def counts(default: int, many: int) -> list:
    """``pytest.mark.parametrize("n", counts(...))``: ``default`` examples in the default run, ``many`` under
    ``-m slow``."""
    return [pytest.param(default, id=f"{default}"), pytest.param(many, id=f"{many}", marks=pytest.mark.slow)]


def fuzz(n: int):
    """The settings of a fuzz target run with ``n`` examples."""
    return settings(max_examples=n, **FUZZ)


# ---------------------------------------------------------------------------------------------------------------
# the contract
# ---------------------------------------------------------------------------------------------------------------


class Hang(BaseException):
    """Raised by SIGALRM inside the reader (a BaseException, so that no ``except Exception`` of the reader can
    turn it into an ordinary refusal)."""


@contextlib.contextmanager
def deadline(seconds: float):
    def ring(signum, frame):
        raise Hang(f"no answer after {seconds:g} s")
    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def snapshot(roots: Iterable) -> dict:
    """Every file and folder under ``roots``: ``{path: (size, mtime_ns, sha256)}`` (folders: "dir")."""
    out: dict = {}
    for root in roots:
        root = pathlib.Path(root)
        if not root.exists():
            out[str(root)] = None
            continue
        for p in sorted([root, *root.rglob("*")]):
            if p.is_dir():
                out[str(p)] = "dir"
            else:
                s = p.stat()
                out[str(p)] = (s.st_size, s.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) << 10


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclasses.dataclass
class Outcome:
    value: Any
    error: Optional[BaseException]
    growth: int  # bytes

    @property
    def ok(self) -> bool:
        return self.error is None


def attempt(fn: Callable[[], Any], *, watch: Sequence, size: int, timeout: float = TIMEOUT_S) -> Outcome:
    """Run ``fn()`` under the contract's guards (module docstring); returns its value or the exception it raised.
    Fails the example on a hang, a changed file under ``watch`` or memory growth over the bound for an input of
    ``size`` bytes."""
    before = snapshot(watch)
    rss = _reset_peak()
    if rss:
        base = _status("VmRSS")
    else:
        tracemalloc.start()
    value = err = None
    try:
        with deadline(timeout):
            value = fn()
    except Hang as e:
        raise AssertionError(f"the reader hung: {e}") from None
    except Exception as e:  # judged by the caller (check_refusal)
        err = e
    finally:
        if rss:
            growth = _status("VmHWM") - base
        else:
            growth = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    after = snapshot(watch)
    if after != before:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        raise AssertionError(f"the reader wrote, changed or removed files: {changed[:5]}")
    bound = MEMORY_FACTOR * size + MEMORY_CONSTANT
    assert growth <= bound, f"memory grew by {growth >> 20} MiB reading {size} bytes (bound {bound >> 20} MiB)"
    return Outcome(value, err, growth)


def check_refusal(err: BaseException, *, files: Sequence[str], fields: Sequence[str] = (),
                  classes: tuple = (ValueError, TypeError)) -> str:
    """``err`` is a refusal the contract allows: one of ``classes``, a one-line message naming one of ``files``
    and (when given) one of ``fields`` (a tuple among them: all of its parts). Returns the message."""
    if not isinstance(err, classes):
        tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))[-3000:]
        raise AssertionError(f"{type(err).__name__} is not a refusal ({[c.__name__ for c in classes]}):\n{tb}")
    msg = str(err)
    assert msg.strip() and "\n" not in msg.strip(), f"not a one-line message: {msg!r}"
    assert any(f in msg for f in files), f"the message names none of the files {list(files)}: {msg!r}"
    if fields:  # a tuple among them: all its parts named (e.g. a layer and a tensor suffix)
        assert any(all(p in msg for p in f) if isinstance(f, tuple) else f in msg for f in fields), \
            f"the message names none of {list(fields)}: {msg!r}"
    return msg


def record(target: str, out: Outcome) -> None:
    STATS[target]["examples"] += 1
    STATS[target]["accepted" if out.ok else f"refused ({type(out.error).__name__})"] += 1


# ---------------------------------------------------------------------------------------------------------------
# JSON mutations
# ---------------------------------------------------------------------------------------------------------------

_DEEP = "[" * 100_000 + "]" * 100_000
SPECIAL = [None, True, False, 0, 1, -1, 2, 3, 7, 2 ** 31 - 1, 2 ** 31, 2 ** 53 + 1, 2 ** 63, 2 ** 64, 10 ** 30,
           -10 ** 30, 0.5, -0.0, 1.5, 1e-45, 5e-324, 1e308, math.nan, math.inf, -math.inf, "", "x", "NaN", "1",
           "float32", "int8", [], {}, [0], [1, 2], [-1], [[1]], {"x": 1}]


class Edit:
    """One mutation of a JSON document: ``text`` the new file content, ``path`` the node it touched, ``op``,
    ``value`` what was written there (failure reports show these, not the whole text)."""

    def __init__(self, text: str, path: tuple, op: str, value: str = ""):
        self.text, self.path, self.op, self.value = text, path, op, value

    @property
    def strict(self) -> bool:
        """Whether ``text`` is standard JSON (RFC 8259: no NaN / Infinity tokens, not cut short; Python's json
        reads NaN and Infinity, serde_json and most other readers do not)."""
        try:
            json.loads(self.text, parse_constant=_not_json)
            return True
        except (ValueError, RecursionError):
            return False

    def __repr__(self) -> str:
        return f"Edit({self.op} at {list(self.path)}: {self.value})"

    @property
    def fields(self) -> tuple:
        """Names an error about this edit may use: the keys on its path, innermost first."""
        keys = [str(k) for k in self.path if isinstance(k, str)]
        if self.op == "extra":  # the unknown key added beside (or inside) the node
            keys.append("qcore_fuzz_extra")
        return tuple(reversed(keys))


def _not_json(token: str):
    raise ValueError(token)


def json_nodes(doc: Any, path: tuple = ()) -> list:
    """``[(path, value)]`` of every node below ``doc``."""
    out = []
    if isinstance(doc, dict):
        items = list(doc.items())
    elif isinstance(doc, list):
        items = list(enumerate(doc))
    else:
        return out
    for k, v in items:
        out.append((path + (k,), v))
        out.extend(json_nodes(v, path + (k,)))
    return out


def _get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


_RAW = "\u0000qcore-fuzz-raw\u0000"


def _dumps(doc: Any, raw: Optional[str] = None) -> str:
    text = json.dumps(doc, indent=1, allow_nan=True)
    return text if raw is None else text.replace(json.dumps(_RAW), raw)


def _typed(draw, v: Any, vocabulary: Sequence[str]):
    """A replacement of ``v`` of a kind chosen by ``v``'s type (near it, or the wrong type)."""
    if isinstance(v, bool):
        return draw(st.sampled_from([not v, int(v), str(v).lower(), None]))
    if isinstance(v, int):
        return draw(st.sampled_from([v + 1, v - 1, -v, 0, v * 2 ** 20, v + 2 ** 32, float(v), str(v), True, -1]))
    if isinstance(v, float):
        return draw(st.sampled_from([-v, 0.0, v * 1e300, v * 1e-300, math.nan, math.inf, str(v), int(v)]))
    if isinstance(v, str):
        return draw(st.sampled_from([*(vocabulary or ["x"]), "", v.upper(), v + "x", v[:-1], 123, [v]]))
    if v is None:
        return draw(st.sampled_from([0, "", {}, [], True, "null"]))
    if isinstance(v, list):
        opts = [[], v[::-1], [v], "x"]
        if v:
            i = draw(st.integers(0, len(v) - 1))
            opts += [v[:i] + v[i + 1:], v[:i + 1] + v[i:], v[0]]
        return draw(st.sampled_from(opts))
    opts: list = [{}, list(v.values()), None, [v]]
    if v:
        k = draw(st.sampled_from(sorted(v)))
        opts.append({kk: vv for kk, vv in v.items() if kk != k})
    return draw(st.sampled_from(opts))


def _strings(doc) -> list:
    out = {v for _, v in json_nodes(doc) if isinstance(v, str) and len(v) < 40}
    return sorted(out)


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 80 else f"{r[:60]}... ({len(r)} characters)"


@st.composite
def json_edit(draw, doc: Any, *, under: tuple = (), ops: Optional[Sequence[str]] = None,
              vocabulary: Sequence[str] = ()) -> Edit:
    """One mutation of the JSON value ``doc`` at a node at or below ``under``: ``special`` (a value from
    ``SPECIAL``), ``typed`` (by the node's type: near values, wrong types), ``raw`` (NaN / Infinity tokens,
    100,000 levels of nesting, a huge number), ``delete`` (the key or element), ``extra`` (an unknown key next
    to it), ``duplicate`` (the key written twice, either value first), ``truncate`` (the text cut short)."""
    nodes = [p for p, _ in json_nodes(doc) if p[:len(under)] == under and len(p) > len(under)]
    path = draw(st.sampled_from(nodes))
    op = draw(st.sampled_from(list(ops or ["special", "typed", "typed", "raw", "delete", "extra", "duplicate",
                                           "truncate"])))
    doc = json.loads(json.dumps(doc))
    parent, key = _get(doc, path[:-1]), path[-1]
    vocab = list(vocabulary) + _strings(doc)
    if op in ("special", "typed"):
        v = draw(st.sampled_from(SPECIAL)) if op == "special" else _typed(draw, parent[key], vocab)
        parent[key] = v
        return Edit(_dumps(doc), path, op, _short(v))
    if op == "raw":
        parent[key] = _RAW
        raw = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", _DEEP, "1e999", "123456789012345678901234567890",
                                    "-0"]))
        return Edit(_dumps(doc, raw), path, op, _short(raw))
    if op == "delete":
        del parent[key]
        return Edit(_dumps(doc), path, op)
    if op == "extra":
        v = draw(st.sampled_from(SPECIAL[:12]))
        if isinstance(parent[key], dict):
            parent[key]["qcore_fuzz_extra"] = v
        elif isinstance(parent, dict):
            parent["qcore_fuzz_extra"] = v
        else:
            parent.append(v)
        return Edit(_dumps(doc), path, op, _short(v))
    if op == "duplicate" and isinstance(parent, dict):
        other = draw(st.sampled_from(SPECIAL[:12] + [parent[key]]))
        first = draw(st.booleans())
        mark = "qcore_fuzz_duplicate_of_" + str(key)
        items = list(parent.items())
        parent.clear()
        for k, v in items:
            if k == key and first:
                parent[mark] = other
            parent[k] = v
            if k == key and not first:
                parent[mark] = other
        text = _dumps(doc).replace(json.dumps(mark), json.dumps(str(key)))
        return Edit(text, path, op, f"{_short(other)} {'before' if first else 'after'} the original")
    text = _dumps(doc)
    cut = draw(st.integers(0, max(0, len(text) - 1)))
    return Edit(text[:cut], path, "truncate", f"at character {cut} of {len(text)}")


class Bytes:
    """Mutated file bytes (``data``; failure reports show ``what`` was done instead) and the names an error about
    the change may use (``fields``)."""

    def __init__(self, data: bytes, what: str, fields: tuple = ()):
        self.data, self.what, self.fields = data, what, fields

    def __repr__(self) -> str:
        return f"Bytes({self.what})"


@st.composite
def byte_edit(draw, data: bytes, *, lo: int = 0, hi: Optional[int] = None) -> Bytes:
    """``data`` with a few bytes in ``[lo, hi)`` flipped, set or zeroed, or cut short, or with bytes appended."""
    hi = len(data) if hi is None else hi
    b = bytearray(data)
    op = draw(st.sampled_from(["flip", "set", "set", "truncate", "append", "zero_run"]))
    if op == "truncate":
        n = draw(st.integers(0, max(0, len(b) - 1)))
        return Bytes(bytes(b[:n]), f"cut to {n} of {len(b)} bytes")
    if op == "append":
        extra = draw(st.binary(min_size=1, max_size=16))
        return Bytes(bytes(b) + extra, f"{extra!r} appended")
    if hi <= lo:
        return Bytes(bytes(b), "unchanged")
    done = []
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(lo, hi - 1))
        if op == "flip":
            bit = draw(st.integers(0, 7))
            b[i] ^= 1 << bit
            done.append(f"bit {bit} of byte {i} flipped")
        elif op == "set":
            v = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF, draw(st.integers(0, 255))]))
            b[i] = v
            done.append(f"byte {i} set to {v:#x}")
        else:
            n = draw(st.integers(1, 8))
            b[i:i + n] = bytes(len(b[i:i + n]))
            done.append(f"bytes {i}..{i + n - 1} zeroed")
    return Bytes(bytes(b), "; ".join(done))


FLOAT_VALUES = [math.inf, -math.inf, math.nan, 0.0, -0.0, -1.0, 1e-45, 1e-40, 1e-30, 3.4e38, 1e30, 65504.0,
                70000.0, 2.0 ** -24, 0.5, 2.0]
"""What a scale tensor's value is set to: non-finite, zero and negative, subnormal, huge, float16's edge."""
