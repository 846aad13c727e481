"""The fused torch path: the same pure functions, run through ``torch.compile``.

``compiled(fn, spec)`` returns ``fn`` with ``spec`` bound, compiled by torch.compile (inductor) once per spec;
torch recompiles per shape class by itself. Results are bit-identical to the eager path (tests check this):
the functions use only exact operations (integer bit work, power-of-two scaling, one correctly-rounded
division), which inductor does not reassociate.

If compilation is unavailable or fails (no C compiler, an unsupported device), the eager function is used
and a ``RuntimeWarning`` says why, once per spec. The memo below only caches compiled callables; it holds no
configuration and changes no result.
"""

from __future__ import annotations

import functools
import sys
import warnings

_MEMO: dict = {}


def compiled(fn, spec):
    """``fn(x, spec, ...)`` with ``spec`` bound, compiled with torch.compile; eager fallback on failure."""
    key = (fn.__qualname__, spec)
    entry = _MEMO.get(key)
    if entry is None:
        torch = sys.modules.get("torch")
        bound = _own_code_object(fn, spec, len(_MEMO))
        try:
            entry = torch.compile(bound, dynamic=None)
        except Exception as exc:  # pragma: no cover - depends on the installation
            warnings.warn(f"qcore: torch.compile unavailable ({exc}); using the eager path", RuntimeWarning)
            entry = bound
        _MEMO[key] = entry
    return _Guarded(entry, functools.partial(fn, spec=spec), key)


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
    """Call the compiled function; if compiling fails at the first call, fall back to eager for good."""

    def __init__(self, fast, eager, key):
        self.fast, self.eager, self.key = fast, eager, key

    def __call__(self, *args, **kwargs):
        if self.fast is self.eager:
            return self.eager(*args, **kwargs)
        try:
            return self.fast(*args, **kwargs)
        except Exception as exc:
            if _is_user_error(exc):
                raise
            warnings.warn(f"qcore: torch.compile failed ({type(exc).__name__}: {exc}); using the eager path",
                          RuntimeWarning)
            _MEMO[self.key] = self.eager
            return self.eager(*args, **kwargs)


def _is_user_error(exc) -> bool:
    """ValueError/TypeError raised by qcore's own validation pass through unchanged."""
    inner = exc
    while inner is not None:
        if isinstance(inner, (ValueError, TypeError)) and type(inner).__module__ == "builtins":
            return True
        inner = inner.__cause__
    return False
