"""The fused torch path: the same pure functions, run through ``torch.compile``.

``compiled(fn, spec)`` returns ``fn`` with ``spec`` bound, compiled by torch.compile (inductor) once per spec;
torch recompiles per shape class by itself. Results are bit-identical to the eager path (tests check this):
the functions use only exact operations (integer bit work, power-of-two scaling, one correctly-rounded
division), which inductor does not reassociate.

If torch.compile is unavailable, the eager function is used and a ``RuntimeWarning`` says why, once per spec.
Inputs are validated by the public functions *before* the compiled call (bad arguments raise their normal
ValueError/TypeError and never reach it). If a compiled call still fails (a compiler error, an unsupported
device), that call runs eager, with a ``RuntimeWarning`` once per spec; later calls try the compiled function
again. Only after ``_MAX_FAILURES`` consecutive failures (compilation that cannot work here) does the spec stay
eager for good, with a second warning. ValueError/TypeError raised by qcore's own code inside the call (data
checks) pass through unchanged. The memo below only caches compiled callables and their failure counts; it
holds no configuration and changes no result.
"""

from __future__ import annotations

import functools
import sys
import warnings

_MEMO: dict = {}


_MAX_FAILURES = 3


class _Entry:
    """Memo entry of one spec: the compiled callable (None once given up), consecutive failures, warned yet."""

    __slots__ = ("fast", "failures", "warned")

    def __init__(self, fast):
        self.fast, self.failures, self.warned = fast, 0, False


def compiled(fn, spec):
    """``fn(x, spec, ...)`` with ``spec`` bound, compiled with torch.compile; eager fallback on failure."""
    key = (fn.__qualname__, spec)
    entry = _MEMO.get(key)
    if entry is None:
        torch = sys.modules.get("torch")
        bound = _own_code_object(fn, spec, len(_MEMO))
        try:
            entry = _Entry(torch.compile(bound, dynamic=None))
        except Exception as exc:  # pragma: no cover - depends on the installation
            warnings.warn(f"qcore: torch.compile unavailable ({exc}); using the eager path", RuntimeWarning)
            entry = _Entry(None)
        _MEMO[key] = entry
    return _Guarded(entry, functools.partial(fn, spec=spec))


def _own_code_object(fn, spec, n):
    """``fn`` with ``spec`` bound, as a function with its own code object.

    Dynamo keeps one cache per code object and stops compiling a code object after a few recompilations
    (torch._dynamo.config.cache_size_limit, 8): with one shared wrapper the ninth spec would silently run
    eager. A distinct code object per spec gives each spec its own cache.
    """

    def bound(*args):
        return fn(*args, spec=spec)

    bound.__code__ = bound.__code__.replace(co_name=f"qcore_{fn.__name__}_{n}")
    return bound


class _Guarded:
    """Call the compiled function; if it fails, run this call eager (see the module docstring)."""

    def __init__(self, entry, eager):
        self.entry, self.eager = entry, eager

    def __call__(self, *args, **kwargs):
        entry = self.entry
        if entry.fast is None:
            return self.eager(*args, **kwargs)
        try:
            out = entry.fast(*args, **kwargs)
        except Exception as exc:
            if _is_user_error(exc):
                raise
            entry.failures += 1
            if entry.failures >= _MAX_FAILURES:
                entry.fast = None
                warnings.warn(f"qcore: torch.compile failed {entry.failures} times in a row for this spec "
                              f"(last: {type(exc).__name__}: {exc}); using the eager path from now on",
                              RuntimeWarning)
            elif not entry.warned:
                entry.warned = True
                warnings.warn(f"qcore: torch.compile failed ({type(exc).__name__}: {exc}); this call runs eager "
                              "(bit-identical); later calls try the compiled path again", RuntimeWarning)
            return self.eager(*args, **kwargs)
        entry.failures = 0
        return out


def _is_user_error(exc) -> bool:
    """ValueError/TypeError raised by qcore's own validation pass through unchanged."""
    inner = exc
    while inner is not None:
        if isinstance(inner, (ValueError, TypeError)) and type(inner).__module__ == "builtins":
            return True
        inner = inner.__cause__
    return False
