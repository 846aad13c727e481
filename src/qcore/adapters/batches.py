"""What every pass does with calibration batches and modules, shared by the quantizer and the passes: call a model
on a batch (a tensor, a dict or a tuple), move a batch to a device, check and describe batches, swap a module,
show a progress bar."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["as_found", "FoundState", "set_module", "progress_bar", "describe_batch", "device_of", "to_device", "call_model", "check_batch", "check_batches"]


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


class FoundState:
    """What ``as_found`` restores, saved from ``model`` now: every submodule's ``training`` flag, every
    parameter's ``requires_grad`` and (``hooks``) every module's hook dicts; ``restore()`` puts them back (for
    code whose try/finally is already there: ``saved = FoundState(model); model.eval(); try: ... finally:
    saved.restore()``)."""

    def __init__(self, model: nn.Module, *, hooks: bool = True):
        mods = list(model.modules())
        self.modes = [(m, m.training) for m in mods]
        self.grads = [(p, p.requires_grad) for p in model.parameters()]
        self.hooks = [(m, k, dict(getattr(m, k))) for m in mods for k in _HOOK_DICTS
                      if hooks and isinstance(getattr(m, k, None), dict)]

    def restore(self) -> None:
        for m, t in self.modes:
            m.training = t
        for p, g in self.grads:
            if p.requires_grad != g:
                p.requires_grad_(g)
        for m, k, saved in self.hooks:
            d = getattr(m, k)
            if d.keys() != saved.keys() or any(d[h] is not saved[h] for h in saved):
                d.clear()
                d.update(saved)


@contextlib.contextmanager
def as_found(model: nn.Module, *, mode: Optional[bool] = False, hooks: bool = True) -> Iterator[nn.Module]:
    """Run the body with ``model`` in ``mode`` (``False``: eval, every submodule; ``True``: train; None: as it is)
    and leave it exactly as it was found, whatever the body did or raised: every submodule's ``training`` flag
    (not only the top module's: a model in train mode with frozen submodules in eval stays so), every parameter's
    ``requires_grad``, and (``hooks``) every module's hooks (a hook the body left behind is removed, one it
    removed is put back; ``hooks=False`` for a pass that installs hooks on purpose, QuaRot's online rotations).
    What every exporter, evaluator, calibrator and pass that calls the user's model wraps its calls in (issue 33:
    ``export_onnx`` left models in training mode, dropout on; ``model.train(was_training)`` put every submodule
    in the top module's mode). ``FoundState`` is the same without the ``with``."""
    saved = FoundState(model, hooks=hooks)
    try:
        if mode is not None:
            model.train(mode)
        yield model
    finally:
        saved.restore()


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def progress_bar(it, *, total=None, desc="", enabled=True):
    if not enabled:
        return it
    from tqdm.auto import tqdm
    return tqdm(it, total=total, desc=desc, leave=False)


def describe_batch(batch) -> str:
    if isinstance(batch, torch.Tensor):
        return f"tensor {tuple(batch.shape)} {batch.dtype}"
    if isinstance(batch, Mapping):
        return "dict(" + ", ".join(f"{k}={describe_batch(v)}" for k, v in batch.items()) + ")"
    if isinstance(batch, (tuple, list)):
        return type(batch).__name__ + "(" + ", ".join(describe_batch(v) for v in batch) + ")"
    return type(batch).__name__


def device_of(model: nn.Module):
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def to_device(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def logits_of(out: Any, *, missing: str) -> "torch.Tensor":
    """The logits of a model's output: a tensor, ``.logits``, or the first item of a tuple. ``missing``: the
    TypeError's message (what needs them) when there are none; ``{type}`` in it becomes the output's type name."""
    import torch
    if isinstance(out, torch.Tensor):
        return out
    lg = getattr(out, "logits", None)
    if isinstance(lg, torch.Tensor):
        return lg
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(missing.format(type=type(out).__name__))


def call_model(model: nn.Module, batch: Any):
    """``model(batch)``, ``model(**batch)`` or ``model(*batch)`` for a tensor, a dict or a tuple/list batch."""
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(*batch)


def check_batch(model: nn.Module, batch: Any, i: int) -> None:
    expected = ("a tensor (model(batch)), a dict of tensors (model(**batch)) or a tuple/list of tensors "
                "(model(*batch))")
    if not isinstance(batch, (torch.Tensor, Mapping, tuple, list)):
        raise TypeError(f"calibration batch {i} is a {type(batch).__name__}; expected {expected}")
    main = getattr(model, "main_input_name", None)
    ids = None
    if main == "input_ids":
        if isinstance(batch, torch.Tensor):
            ids = batch
        elif isinstance(batch, Mapping):
            ids = batch.get("input_ids")
        elif batch and isinstance(batch[0], torch.Tensor):
            ids = batch[0]
    if ids is not None and (ids.dtype.is_floating_point or ids.dim() != 2):
        raise ValueError(f"calibration batch {i}: input_ids of {describe_batch(ids)}; this transformers model expects "
                         f"integer token ids of shape [batch, sequence]")
    try:
        emb = model.get_input_embeddings() if ids is not None and hasattr(model, "get_input_embeddings") else None
    except (NotImplementedError, AttributeError):  # a model that does not say: its forward will
        emb = None
    vocab = getattr(emb, "num_embeddings", None)
    if vocab is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise ValueError(f"calibration batch {i}: token id {bad} is outside the model's vocabulary [0, {vocab})")
    tensors = [batch] if isinstance(batch, torch.Tensor) else list(batch.values()) if isinstance(batch, Mapping) \
        else list(batch)
    if not tensors or any(isinstance(t, torch.Tensor) and t.numel() == 0 for t in tensors):
        raise ValueError(f"calibration batch {i} is empty ({describe_batch(batch)}); every batch needs at least one "
                         f"sample (drop it from the calibration data)")


def check_batches(model: nn.Module, data: Any) -> None:
    """Every batch of a list / tuple of calibration batches checked before any work (``check_batch``)."""
    if isinstance(data, (list, tuple)):
        for i, batch in enumerate(data):
            check_batch(model, batch, i)


def check_data(data: Any) -> None:
    """``data=`` checked: None or an iterable of batches (not a single tensor or dict)."""
    if data is not None and (isinstance(data, (torch.Tensor, Mapping)) or not isinstance(data, Iterable)):
        raise TypeError(f"data must be an iterable of batches (a list or a DataLoader), got {type(data).__name__}; "
                        f"wrap a single batch in a list: [batch]")
