"""Online rotations as module state: ``InputRotation``, a forward pre-hook multiplying a Linear's input by an
orthogonal ``Q`` (QuaRot's and SpinQuant's online Hadamard transforms, ``qcore.adapters.passes.rotation``), and the
hooks a model carries: ``input_rotations`` lists them, ``online_plan`` / ``install_online`` say and install those
a rotation config puts on a model (what exporters write and importers re-install), ``online_hooks`` installs them
for a rotation pass, ``remove_online`` drops them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Sequence

import torch
from torch import nn

from qcore.algorithms.hadamard import (block_rotation, check_block, reference_fwht, fwht, is_constructible,
                                       random_signs, rotation)

from .. import triton as kernels
from ..families import locate

__all__ = ["InputRotation", "ReferenceInputRotation", "input_rotations", "online_plan", "install_online",
           "online_hooks", "remove_online"]


def _get(m, name):
    try:
        return m.get_submodule(name)
    except AttributeError:
        return None


class InputRotation:
    """A forward pre-hook multiplying a Linear's input by the orthogonal ``Q`` of size ``size``
    (``qcore.adapters.passes.rotation``'s docstring, item 4): ``x @ Q`` with ``Q = rotation(size, key=key).T``
    (``block``: ``Q = block_rotation(size, block=block, key=key).T``, the fast transform on each aligned run of
    ``block`` features). A value (size, key, block); the matrix is rebuilt from it, so a model with these hooks deep-copies and pickles. The signs (or the
    dense matrix of a size with no construction) are cached per (device, dtype) on first use; under autograd the
    transform is one ``torch.autograd.Function`` whose backward is the adjoint transform (``fwht(...,
    transpose=True)``), not the graph of the transform's elementwise operations (issue 23)."""

    __slots__ = ("size", "key", "block", "_signs", "_dense", "_cache")

    def __init__(self, size: int, *, key: Optional[int] = None, block: Optional[int] = None):
        self.size, self.key = int(size), key
        self.block = None if block is None else check_block(self.size, block, what="size")
        self._signs = self._dense = None
        self._cache = {}

    def __repr__(self) -> str:
        b = "" if self.block is None else f", block={self.block}"
        return f"InputRotation(size={self.size}, key={self.key}{b})"

    def __getstate__(self):
        return {"size": self.size, "key": self.key, "block": self.block}

    def __setstate__(self, st):
        self.size, self.key, self.block = st["size"], st["key"], st.get("block")
        self._signs = self._dense = None
        self._cache = {}

    def matrix(self) -> torch.Tensor:
        """``Q`` as a float64 [size, size] tensor."""
        if self.block is not None:
            return torch.from_numpy(block_rotation(self.size, block=self.block, key=self.key).T.copy())
        return torch.from_numpy(rotation(self.size, key=self.key).T.copy())

    def __call__(self, module, args):
        x = args[0]
        return (self.apply(x),) + tuple(args[1:])

    def _on(self, what: str, device, dtype) -> torch.Tensor:
        """The signs (``what="signs"``) or the dense ``Q`` (``"dense"``) on ``device`` in ``dtype``, built once."""
        k = (what, str(device), dtype)
        t = self._cache.get(k)
        if t is None:
            if what == "signs":
                if self._signs is None:
                    self._signs = torch.from_numpy(random_signs(self.size, key=self.key))
                t = self._signs.to(device=device, dtype=dtype)
            else:
                if self._dense is None:
                    self._dense = self.matrix()
                t = self._dense.to(device=device, dtype=dtype)
            self._cache[k] = t
        return t

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.size:
            raise ValueError(f"InputRotation: input has {x.shape[-1]} features, the rotation is of size {self.size}")
        ct = torch.float64 if x.dtype == torch.float64 else torch.float32
        z = x.to(ct)
        if self.block is not None:  # the fast transform of size block on each aligned run of block features
            if self.key is not None:
                z = z * self._on("signs", x.device, ct)
            zb = z.reshape(*z.shape[:-1], self.size // self.block, self.block)
            y = _FWHT.apply(zb) if zb.requires_grad and torch.is_grad_enabled() else _fwht(zb)
            return y.reshape(z.shape).to(x.dtype)
        if is_constructible(self.size):
            if self.key is not None:
                z = z * self._on("signs", x.device, ct)
            y = _FWHT.apply(z) if z.requires_grad and torch.is_grad_enabled() else _fwht(z)
        else:
            y = z @ self._on("dense", x.device, ct)
        return y.to(x.dtype)


class _FWHT(torch.autograd.Function):
    """``fwht`` with the adjoint transform as its backward (``d/dz (z H^T / r) = g H / r``)."""

    @staticmethod
    def forward(ctx, z):
        return _fwht(z)

    @staticmethod
    def backward(ctx, g):
        return fwht(g, transpose=True)


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """``fwht(x)``, by its Triton twin (same bits) for float32 tensors on a GPU with Triton
    (``qcore.adapters.triton.available``) when no gradient is needed."""
    if x.dtype == torch.float32 and not (x.requires_grad and torch.is_grad_enabled()):
        if kernels.available(x):
            return kernels.fwht(x)
    return fwht(x)


class ReferenceInputRotation(InputRotation):
    """The landed ``InputRotation.apply`` (issue 11): signs moved per call, ``reference_fwht`` differentiated through
    its elementwise graph; the reference SpinQuant (``spinquant._reference_spinquant``) is tested against."""

    __slots__ = ()

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.size:
            raise ValueError(f"InputRotation: input has {x.shape[-1]} features, the rotation is of size {self.size}")
        if self.block is not None:
            raise ValueError("ReferenceInputRotation is the landed full-size transform; it has no block form")
        ct = torch.float64 if x.dtype == torch.float64 else torch.float32
        if is_constructible(self.size):
            if self.key is not None:
                if self._signs is None:
                    self._signs = torch.from_numpy(random_signs(self.size, key=self.key))
                y = reference_fwht(x.to(ct) * self._signs.to(device=x.device, dtype=ct))
            else:
                y = reference_fwht(x.to(ct))
        else:
            if self._dense is None:
                self._dense = self.matrix()
            y = x.to(ct) @ self._dense.to(device=x.device, dtype=ct)
        return y.to(x.dtype)


def remove_online(model: nn.Module) -> None:
    """Remove every ``InputRotation`` hook (undoing ``online_hooks`` when the weights were not rotated)."""
    for m in model.modules():
        for k in [k for k, h in m._forward_pre_hooks.items() if isinstance(h, InputRotation)]:
            del m._forward_pre_hooks[k]


def input_rotations(model: nn.Module) -> dict:
    """``{module name: InputRotation}`` for every module carrying one (``rotate_model(..., online=...)``)."""
    out = {}
    for n, m in model.named_modules():
        for h in m._forward_pre_hooks.values():
            if isinstance(h, InputRotation):
                out[n] = h
    return out


def online_module_names(fam, online) -> list:
    """The record's module for each canonical entry of ``qcore.adapters.passes.rotation.ONLINE``
    (``mlp.down_proj``: the MLP's output projection, ``self_attn.o_proj``: attention's)."""
    where = {"mlp.down_proj": fam.mlp_out, "self_attn.o_proj": fam.attn_out}
    return [where.get(o, o) for o in online]


def online_plan(model: nn.Module, algo) -> dict:
    """``{module name: InputRotation}`` that ``rotate_model`` / ``apply_rotation`` install for the rotation config
    ``algo`` (``online``, ``key``) on ``model`` (what a checkpoint's config says to re-install on loading)."""
    loc = locate(model, what=algo.name)
    path = loc.layers
    layers = _get(model, path)
    out = {}
    for li, layer in enumerate(layers):
        for i, name in enumerate(online_module_names(loc.family, algo.online)):
            lin = _get(layer, name)
            if lin is None or not hasattr(lin, "in_features"):
                raise ValueError(f"{algo.name}: {path}.{li}.{name} is not a Linear")
            out[f"{path}.{li}.{name}"] = InputRotation(lin.in_features,
                                                       key=None if algo.key is None else algo.key + 2 + i,
                                                       block=getattr(algo, "block", None))
    return out


def install_online(model: nn.Module, algo) -> dict:
    """Register ``online_plan(model, algo)``'s hooks on a model whose weights already hold the rotations (a
    reloaded checkpoint); returns the plan."""
    plan = online_plan(model, algo)
    for name, h in plan.items():
        model.get_submodule(name).register_forward_pre_hook(h)
    return plan


def online_hooks(model, online: Sequence[str], key: Optional[int], *, block: Optional[int] = None) -> dict:
    """Register the online ``InputRotation`` hooks (block-diagonal of size ``block`` when given); ``{weight
    parameter name: Q}`` whose columns must be multiplied by ``Q`` (``W @ Q``) for the model to compute the same
    function."""
    plan = install_online(model, SimpleNamespace(online=tuple(online), key=key, block=block, name="rotate_model"))
    return {f"{n}.weight": h.matrix().to(model.get_submodule(n).weight.device) for n, h in plan.items()}

