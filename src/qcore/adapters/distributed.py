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

Layer-parallel GPTQ (``Distributed(layer_parallel=True)``): data-parallel calibration alone runs every GPTQ
column loop on every rank (the same work ``world`` times). With ``layer_parallel=True`` the ranks share the column
loops of each decoder layer instead: the GPTQ target groups of a stage (Linears sharing an input: q/k/v,
o_proj, gate/up, down_proj in a Llama layer) are given to the ranks by cost (``rows * cols**2 + cols**3`` each,
greedy longest-first: ``owners``), every Hessian is still all-reduced on every rank (the same collective as
above, so the same reduced Hessian), each rank runs GPTQ on its groups only, and each group's QTensors are then
broadcast from its owner (``share``: their bytes, exactly) so that every rank writes the whole layer before its
outputs are replayed. Each group runs the same computation as in one process, on the same inputs: the weights
are bit for bit those of data-parallel calibration (and of one process, as above). The speed-up is bounded by
the stage's largest group (Amdahl: the layer forwards and the Hessians are not split; docs/distributed.md); with
``GPTQConfig(true_sequential=True)`` each stage is one group and nothing is split. Fused MoE experts run on every
rank as before.

Failure: ``quantize_model(..., distributed=...)`` first checks, with one collective, that every rank has the
same config and model structure and at least one batch (else ``ValueError`` on every rank, before any work).
An error on one rank after that (e.g. NaN activations in its batches) leaves the other ranks waiting in a
collective: run under ``torchrun`` (which stops the others) or give ``init_process_group`` a ``timeout``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from qcore.algorithms.gptq import HessianStats
from qcore.stats import RunningStats

__all__ = ["Distributed", "all_reduce_sum", "all_reduce_max", "all_reduce_min", "reduce_hessian", "owners",
           "broadcast_tensors"]


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


def owners(costs: Sequence[float], world_size: int) -> list[int]:
    """The rank that runs each task of ``costs`` (one number per task, e.g. GPTQ's ``rows * cols**2 + cols**3``):
    longest first, each to the least loaded rank (ties: the task's index order and the lowest rank), so that the
    largest load is small. Deterministic: every rank computes the same list from the same costs."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    costs = [float(c) for c in costs]
    if any(not (c >= 0) for c in costs):
        raise ValueError(f"costs must be non-negative numbers, got {costs}")
    load = [0.0] * world_size
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += costs[i]
    return out


class _Slot:
    """Where a tensor was in a structure sent by ``broadcast_tensors`` (its shape, dtype and byte range)."""

    def __init__(self, shape, dtype, start, nbytes):
        self.shape, self.dtype, self.start, self.nbytes = tuple(shape), dtype, start, nbytes


def _flatten(obj, parts: list, offset: list):
    if isinstance(obj, torch.Tensor):
        b = obj.detach().contiguous().reshape(-1).view(torch.uint8)
        slot = _Slot(obj.shape, obj.dtype, offset[0], b.numel())
        parts.append(b)
        offset[0] += b.numel()
        return slot
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _flatten(getattr(obj, f.name), parts, offset)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: _flatten(v, parts, offset) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_flatten(v, parts, offset) for v in obj)
    return obj


def _unflatten(obj, buf: torch.Tensor):
    if isinstance(obj, _Slot):
        return buf[obj.start:obj.start + obj.nbytes].clone().view(obj.dtype).reshape(obj.shape)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _unflatten(getattr(obj, f.name), buf)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: _unflatten(v, buf) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unflatten(v, buf) for v in obj)
    return obj


def broadcast_tensors(obj: Any, *, src: int, device: Any = "cpu", group: Any = None) -> Any:
    """``obj`` as rank ``src`` holds it, on every rank: a structure of dicts, lists, tuples and dataclasses (e.g.
    ``QTensor``) whose torch tensors travel as their bytes (exact, any dtype) in one broadcast, the rest pickled.
    Other ranks pass anything (ignored) and get tensors on ``device`` (with nccl: this rank's GPU); ``src`` gets
    ``obj`` itself back."""
    dist = _dist(group)
    rank = dist.get_rank(group)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < dist.get_world_size(group):
        raise ValueError(f"src must be a rank of the group (0..{dist.get_world_size(group) - 1}), got {src!r}")
    gsrc = src if group is None else dist.get_global_rank(group, src)
    if rank == src:
        parts: list = []
        offset = [0]
        skeleton = _flatten(obj, parts, offset)
        head = [(skeleton, offset[0])]
    else:
        head = [None]
    dist.broadcast_object_list(head, src=gsrc, group=group,
                               device=torch.device(device) if dist.get_backend(group) == "nccl" else None)
    skeleton, nbytes = head[0]
    if nbytes == 0:
        return obj if rank == src else skeleton
    if rank == src:
        buf = torch.cat([p.to(device) for p in parts]) if len(parts) > 1 else parts[0].to(device)
    else:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=gsrc, group=group)
    return obj if rank == src else _unflatten(skeleton, buf)


@dataclass(frozen=True)
class Distributed:
    """Reduce calibration statistics over the ranks of ``group`` (a ``torch.distributed`` process group; None:
    the default group, initialised by the caller). Pass it as ``quantize_model(..., distributed=Distributed())``;
    as ``run_algorithms``' ``reduce``, calling it on a ``HessianStats`` sums it over the ranks.

    ``layer_parallel`` (keyword-only, default False): the ranks also share GPTQ's column loops, each running the
    target groups ``owners`` gives it and broadcasting their QTensors (module docstring); the weights are the
    same, bit for bit. Every rank must pass the same value."""

    group: Any = None
    layer_parallel: bool = field(default=False, kw_only=True)

    def __post_init__(self):
        if not isinstance(self.layer_parallel, bool):
            raise TypeError(f"Distributed.layer_parallel must be a bool, got {self.layer_parallel!r}")

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

    def owners(self, costs: Sequence[float]) -> list[int]:
        """The rank that runs each task (``owners(costs, world_size)``)."""
        return owners(costs, self.world_size)

    def share(self, obj: Any, *, src: int, device: Any = "cpu") -> Any:
        """``broadcast_tensors(obj, src=src, device=device)`` over this group."""
        return broadcast_tensors(obj, src=src, device=device, group=self.group)

    def gather(self, obj: Any) -> list:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        dist = _dist(self.group)
        out: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    # -- used by quantize_model --------------------------------------------------------------------------

    def check_consistent(self, *, fingerprint: str, n_batches: int, error: Any = None) -> None:
        """One collective: every rank has the same ``fingerprint`` (config and model structure) and at least one
        calibration batch, and no rank failed its own checks (``error``: that rank's message, e.g. rank 0's
        destination refused); else ``ValueError`` on every rank (all ranks see the same gathered values)."""
        got = self.gather((fingerprint, int(n_batches), self.layer_parallel, None if error is None else str(error)))
        failed = [(r, e) for r, (_, _, _, e) in enumerate(got) if e is not None]
        if failed:
            raise ValueError(f"distributed: rank {failed[0][0]} refused the run before any work: {failed[0][1]}")
        got = [g[:3] for g in got]
        lp = [p for _, _, p in got]
        if len(set(lp)) > 1:
            raise ValueError(f"distributed: layer_parallel differs between the ranks ({lp}, in rank order); give "
                             f"every rank the same Distributed(layer_parallel=...)")
        empty = [r for r, (_, n, _) in enumerate(got) if n < 1]
        if empty:
            raise ValueError(f"distributed: ranks {empty} have no calibration batches; give every rank at least one "
                             f"(batches per rank: {[n for _, n, _ in got]})")
        fps = [f for f, _, _ in got]
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


def check_distributed(distributed: Any) -> Distributed:
    """``distributed=`` checked: a ``Distributed`` whose ``torch.distributed`` is initialised (TypeError /
    ValueError naming it otherwise)."""
    if not isinstance(distributed, Distributed):
        raise TypeError(f"distributed must be a qcore.adapters.distributed.Distributed, got "
                        f"{type(distributed).__name__}")
    return distributed.check()
