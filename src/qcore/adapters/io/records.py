"""torch tensors <-> safetensors records: the dtype names both ways and lazy ``TensorRecord``s (what every
checkpoint writer of ``qcore.adapters.io`` hands to ``qcore.formats.safetensors_io``)."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from qcore.formats.safetensors_io import TensorRecord

__all__ = ["TORCH_ST", "ST_TORCH", "to_numpy", "record", "tensor_record", "untied_state"]

TORCH_ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
             torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
             torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


ST_TORCH = {st: t for t, st in TORCH_ST.items()}  # safetensors dtype name -> torch dtype


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16):
        return t.view(torch.uint8 if t.element_size() == 1 else torch.int16).numpy()
    return t.numpy()


def record(name: str, dtype: str, arr_fn, shape: tuple) -> TensorRecord:
    return TensorRecord(name, dtype, tuple(int(d) for d in shape), lambda: np.ascontiguousarray(arr_fn()).tobytes())


def tensor_record(name: str, t: torch.Tensor) -> TensorRecord:
    if t.dtype not in TORCH_ST:
        raise TypeError(f"export: tensor {name!r} has dtype {t.dtype}, which safetensors cannot hold")
    return record(name, TORCH_ST[t.dtype], lambda: to_numpy(t), tuple(t.shape))


def untied_state(model, skip) -> "Iterator[tuple[str, torch.Tensor]]":
    """``(name, tensor)`` of ``model``'s state dict, the names in ``skip`` and None entries left out, and a tensor
    that several names share (a tied weight) once, under its first name, as ``save_pretrained`` writes it."""
    seen: set = set()
    for k, t in model.state_dict(keep_vars=True).items():
        if k in skip or t is None:
            continue
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:
            continue
        seen.add(key)
        yield k, t
