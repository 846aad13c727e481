"""Calibration statistics over several processes (``torch.distributed``): each rank runs the model on its share
of the calibration batches, the statistics (which are sums, maxima and minima over batches) are reduced over
the ranks, and every rank then computes the same quantized weights.

    import torch.distributed as dist
    from qcore.adapters import quantize_model
    from qcore.adapters.distributed import Distributed

    dist.init_process_group("nccl")                       # or "gloo" on CPU; torchrun sets RANK, WORLD_SIZE
    mine = batches[dist.get_rank()::dist.get_world_size()]  # this rank's share (any split; at least one batch)
    quantize_model(model, config, mine, distributed=Distributed())   # every rank: the same weights

``Distributed(group=None)`` is an explicit value (no global state of qcore's; ``group`` is a
``torch.distributed`` process group, ``None`` for the default one, which must be initialised). What it reduces:

- GPTQ's ``HessianStats`` (``sum(x^T x)`` in float64 and the row count): one ``all_reduce(SUM)`` in float64
  per Hessian, before GPTQ runs; GPTQ then runs on every rank on the same reduced Hessian (deterministic: the
  same weights on every rank, nothing is broadcast).
- static activation observers (``quantize_model``'s calibration): MinMax statistics by max / min over ranks
  (exact: the same scales as one process seeing every batch); Percentile / MSE per-batch sums by a float64 sum
  over ranks (gathered and added in rank order, the same on every rank).
- other algorithms' statistics through ``sum`` / ``max`` / ``min`` (``all_reduce_sum``, ``all_reduce_max``,
  ``all_reduce_min``).

Equality with one process holding every batch: the layer forwards of a batch do not depend on which rank runs
them, max / min are exact, and a float64 sum is order-independent whenever every addition is exact. One
process accumulates ``((p1 + p2) + p3) + ...`` where ``p_b`` is batch ``b``'s float32 ``x^T x``; two ranks
give ``(p1 + p2) + (p3 + p4)``. Each ``p_b`` has a 24-bit significand, so each of these float64 additions is
exact when, entry by entry, the largest and smallest non-zero ``|p_b|`` are less than ``2**(29 - log2(B))``
apart (``B`` batches): then both orders give the exact sum and the weights are bit for bit those of one process
(checked by ``tests/adapters/test_distributed.py``). An entry spanning more than that (a tiny off-diagonal
value in one batch, a large one in another) may round differently in the last float64 bit: the ranks still
agree with each other exactly, and they differ from one process only if that bit flips a float32 rounding
inside GPTQ. Reproducing one process's rounding in every case needs every batch's ``x^T x`` (the left fold
cannot be rebuilt from partial sums), i.e. ``B / world`` Hessians per rank kept in memory; qcore does not do
that.

Failure: ``quantize_model(..., distributed=...)`` first checks, with one collective, that every rank has the
same config and model structure and at least one batch (else ``ValueError`` on every rank, before any work).
An error on one rank after that (e.g. NaN activations in its batches) leaves the other ranks waiting in a
collective: run under ``torchrun`` (which stops the others) or give ``init_process_group`` a ``timeout``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qcore.algorithms.gptq import HessianStats
from qcore.stats import RunningStats

__all__ = ["Distributed", "all_reduce_sum", "all_reduce_max", "all_reduce_min", "reduce_hessian"]


def _dist(group=None):
    import torch.distributed as dist
    if not dist.is_available():
        raise ValueError("distributed: torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        raise ValueError("distributed: the default process group is not initialised; call "
                         "torch.distributed.init_process_group(...) first (torchrun sets RANK and WORLD_SIZE)")
    return dist


def _check_tensor(t, name="t") -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def all_reduce_sum(t: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    """The sum of ``t`` over the ranks, as a new tensor (``t`` is unchanged): floating tensors are summed and
    returned in float64, integer and bool tensors in int64."""
    dist = _dist(group)
    t = _check_tensor(t)
    buf = t.detach().to(torch.float64 if t.is_floating_point() else torch.int64, copy=True)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    return buf


def all_reduce_max(t: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    """The elementwise maximum of ``t`` over the ranks (a new tensor of ``t``'s dtype; exact)."""
    dist = _dist(group)
    buf = _check_tensor(t).detach().clone()
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    return buf


def all_reduce_min(t: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    """The elementwise minimum of ``t`` over the ranks (a new tensor of ``t``'s dtype; exact)."""
    dist = _dist(group)
    buf = _check_tensor(t).detach().clone()
    dist.all_reduce(buf, op=dist.ReduceOp.MIN, group=group)
    return buf


def reduce_hessian(stats: HessianStats, *, group: Any = None) -> HessianStats:
    """GPTQ's statistics summed over the ranks: ``sum`` (float64) and ``count`` in one float64 ``all_reduce``
    (counts below 2**53 are exact in float64). ``stats`` is unchanged; numpy stats give numpy stats."""
    if not isinstance(stats, HessianStats):
        raise TypeError(f"stats must be a HessianStats, got {type(stats).__name__}")
    dist = _dist(group)
    s = stats.sum
    was_numpy = not isinstance(s, torch.Tensor)
    st = torch.from_numpy(np.asarray(s)) if was_numpy else s
    n = stats.n
    buf = torch.empty(n * n + 1, dtype=torch.float64, device=st.device)
    buf[:-1] = st.detach().reshape(-1)
    buf[-1] = float(stats.count)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    total = buf[:-1].reshape(n, n)
    count = int(buf[-1].item())
    return HessianStats(total.numpy() if was_numpy else total, count)


@dataclass(frozen=True)
class Distributed:
    """Reduce calibration statistics over the ranks of ``group`` (a ``torch.distributed`` process group; None:
    the default group, initialised by the caller). Pass it as ``quantize_model(..., distributed=Distributed())``;
    as ``run_algorithms``' ``reduce``, calling it on a ``HessianStats`` sums it over the ranks."""

    group: Any = None

    @property
    def rank(self) -> int:
        return _dist(self.group).get_rank(self.group)

    @property
    def world_size(self) -> int:
        return _dist(self.group).get_world_size(self.group)

    def check(self) -> "Distributed":
        """``self`` if torch.distributed is initialised (else ``ValueError``, naming what to do)."""
        _dist(self.group)
        return self

    def __call__(self, stats: HessianStats) -> HessianStats:
        return reduce_hessian(stats, group=self.group)

    def hessian(self, stats: HessianStats) -> HessianStats:
        return reduce_hessian(stats, group=self.group)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(t, group=self.group)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_max(t, group=self.group)

    def min(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_min(t, group=self.group)

    def gather(self, obj: Any) -> list:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        dist = _dist(self.group)
        out: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    # -- used by quantize_model --------------------------------------------------------------------------

    def check_consistent(self, *, fingerprint: str, n_batches: int) -> None:
        """One collective: every rank has the same ``fingerprint`` (config and model structure) and at least one
        calibration batch; else ``ValueError`` on every rank (all ranks see the same gathered values)."""
        got = self.gather((fingerprint, int(n_batches)))
        empty = [r for r, (_, n) in enumerate(got) if n < 1]
        if empty:
            raise ValueError(f"distributed: ranks {empty} have no calibration batches; give every rank at least one "
                             f"(batches per rank: {[n for _, n in got]})")
        fps = [f for f, _ in got]
        if len(set(fps)) > 1:
            differ = [r for r, f in enumerate(fps) if f != fps[0]]
            raise ValueError(f"distributed: ranks {differ} have a different config or model structure from rank 0; "
                             f"every rank must quantize the same model with the same config")

    def reduce_observers(self, observers: list) -> None:
        """Combine the static activation observers of every rank (same modules in the same order on every rank)
        in place: MinMax statistics by max / min, Percentile / MSE sums and batch counts by sums in rank order."""
        local = [_observer_state(o) for o in observers]
        every = self.gather(local)
        for i, o in enumerate(observers):
            _set_observer_state(o, [states[i] for states in every])


def _cpu(t):
    return None if t is None else t.detach().cpu()


def _observer_state(o) -> dict:
    s = o.stats
    return {"absmax": _cpu(s.absmax), "lo": _cpu(s.lo), "hi": _cpu(s.hi), "count": s.count, "sum": _cpu(o.sum),
            "sum_zp": _cpu(o.sum_zp), "n": o.n, "device": str(next((t.device for t in (s.absmax, o.sum)
                                                                      if t is not None), "cpu"))}


def _fold(values: list, op):
    out = None
    for v in values:
        if v is not None:
            out = v if out is None else op(out, v)
    return out


def _set_observer_state(o, states: list[dict]) -> None:
    dev = next((torch.device(s["device"]) for s in states if s["n"] > 0), torch.device("cpu"))
    if o.stats.absmax is not None:  # this rank saw batches: keep its own device
        dev = o.stats.absmax.device
    elif o.sum is not None:
        dev = o.sum.device

    def put(t):
        return None if t is None else t.to(dev)

    amax = _fold([s["absmax"] for s in states], torch.maximum)
    if amax is not None:
        o.stats = RunningStats(o.stats.granularity, absmax=put(amax), lo=put(_fold([s["lo"] for s in states], torch.minimum)),
                               hi=put(_fold([s["hi"] for s in states], torch.maximum)),
                               count=sum(s["count"] for s in states))
    o.sum = put(_fold([s["sum"] for s in states], torch.add))
    o.sum_zp = put(_fold([s["sum_zp"] for s in states], torch.add))
    o.n = sum(s["n"] for s in states)


def fingerprint(model: torch.nn.Module, config: Any, plans: list) -> str:
    """A digest of what must be the same on every rank: the config, the quantized modules and every parameter's
    name, shape and dtype."""
    h = hashlib.sha256()
    h.update(json.dumps(config.to_dict(), sort_keys=True, default=str).encode())
    h.update(repr([(p.name, p.type) for p in plans]).encode())
    h.update(repr([(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]).encode())
    return h.hexdigest()
