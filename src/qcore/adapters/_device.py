"""``check_device``: a torch device that exists on this machine, checked before any work (``qcore quantize`` /
``qcore eval`` ``--device``, ``quantize_checkpoint(device=)``)."""

from __future__ import annotations

from typing import Union

import torch


def check_device(device: Union[str, torch.device], *, what: str = "device") -> torch.device:
    """``torch.device(device)``, or ValueError naming ``what`` when it is not a device, or one this machine does
    not have (CUDA without a GPU or past the last index, MPS where it is not available, other backends)."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{what} {device}: not a torch device (expected e.g. cpu, cuda, cuda:0, mps)") from None
    if d.type == "cpu":
        return d
    if d.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"{what} {device}: no CUDA GPU is available here (use cpu)")
        if d.index is not None and d.index >= n:
            raise ValueError(f"{what} {device}: there are {n} CUDA device(s) (cuda:0 .. cuda:{n - 1})")
        return d
    if d.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ValueError(f"{what} {device}: MPS is not available here (use cpu)")
        return d
    raise ValueError(f"{what} {device}: qcore runs on cpu, cuda or mps devices")
