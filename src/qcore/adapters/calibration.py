"""What is done to a planned model's quantized modules as a whole: ``calibrate`` (static activation scales from
the observers, over calibration batches), ``freeze`` (packed low-bit codes + scales, in place) and ``model_bytes``
(the bytes a model holds)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from .batches import FoundState, call_model, check_batch, describe_batch, device_of, progress_bar, to_device
from ._calib_tail import TailSkip
from .modules import CalibrationError, QuantModule
from .moe import moe_calibration
from .plan import quantized_modules

_log = logging.getLogger("qcore.adapters")

__all__ = ["calibrate", "freeze", "model_bytes"]


def calibrate(model: nn.Module, data: Iterable, *, progress: bool = True, distributed: Any = None,
              moe_all_experts: bool = True) -> int:
    """Run ``data`` through ``model`` under ``no_grad`` and set the static activation scales of its quantized
    modules from their observers (statistics only; activations are never kept). Returns the number of batches.

    Batches: a tensor (``model(batch)``), a dict (``model(**batch)``) or a tuple/list (``model(*batch)``),
    moved to the model's device. On any error the observers are dropped and the scales are left as they were.
    distributed: a ``qcore.adapters.distributed.Distributed``: ``data`` is this rank's share; the observers are
    combined over the ranks before the scales are set (every rank gets the same scales).
    moe_all_experts: every MoE block sends every token to every expert while calibrating (its output stays the
        routed one), so every expert's observers see tokens; the tokens routed to each expert are counted into
        ``model.qcore_moe_coverage`` (an ``ExpertCoverage``; this rank's share) and experts routed none are
        warned about (``qcore.adapters.moe``). False: the router's top-k only (an unrouted expert's observers
        see nothing, and calibration refuses).
    """
    if not isinstance(moe_all_experts, bool):
        raise TypeError(f"moe_all_experts must be a bool, got {moe_all_experts!r}")
    if isinstance(data, (torch.Tensor, Mapping)) or not isinstance(data, Iterable):
        raise TypeError(f"calibration data must be an iterable of batches (a list or a DataLoader), got "
                        f"{type(data).__name__}; wrap a single batch in a list: [batch]")
    mods = [m for m in model.modules() if isinstance(m, QuantModule) and m.static_roles()]
    if not mods:
        return 0
    device = device_of(model)
    for m in mods:
        m.start_calibration()
    n = 0
    found = FoundState(model)
    model.eval()
    try:
        try:
            total = len(data)  # type: ignore[arg-type]
        except TypeError:  # a DataLoader over an IterableDataset, a generator
            total = None
        with torch.no_grad(), moe_calibration(model, all_experts=moe_all_experts) as moe, \
                TailSkip(mods, enabled=not moe.blocks) as tail:  # forwards end after the last observed module
            for i, batch in enumerate(progress_bar(data, total=total, desc="calibrating", enabled=progress)):
                check_batch(model, batch, i)
                try:
                    call_model(model, to_device(batch, device))
                except TailSkip.Done:
                    pass
                except CalibrationError:
                    raise
                except (RuntimeError, ValueError, TypeError, IndexError) as e:
                    raise ValueError(f"calibration batch {i} ({describe_batch(batch)}) does not fit the model: "
                                     f"{type(e).__name__}: {e}") from e
                tail.batch_done()
                n += 1
        if n == 0:
            raise ValueError("calibration data is empty; static activation scales need at least one batch")
        if distributed is not None:
            distributed.reduce_observers([o for m in mods for _, o in sorted(m.observers.items())])
        for m in mods:
            m.finish_calibration()
        if moe.blocks:
            model.qcore_moe_coverage = moe.coverage()
    except BaseException:
        for m in mods:
            m.abort_calibration()
        raise
    finally:
        found.restore()
    return n


def freeze(model: nn.Module, *, progress: bool = False) -> nn.Module:
    """Turn every quantized module's weight into packed low-bit codes + scales (in place; irreversible).

    Logs the model's bytes before and after (``logging`` at INFO, logger ``qcore.adapters``); ``model_bytes``
    gives them too."""
    mods = quantized_modules(model)
    if not mods:
        raise ValueError("freeze: the model has no qcore quantized modules; run quantize_model first")
    before = model_bytes(model)
    for m in progress_bar(list(mods.values()), desc="freezing", enabled=progress):
        m.freeze()
    after = model_bytes(model)
    _log.info("froze %d modules: %s -> %s bytes (%.3fx)", len(mods), f"{before:,}", f"{after:,}",
              after / before if before else 1.0)
    return model


def model_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers (each storage counted once: tied weights once)."""
    seen: dict[Any, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if t is None:
            continue
        key = (t.device, t.untyped_storage().data_ptr()) if t.numel() else id(t)
        seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes() if t.numel() else 0)
    return sum(seen.values())
