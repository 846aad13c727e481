"""MoE calibration: every expert sees the calibration tokens; the model still computes its routed output.

A sparse mixture-of-experts block routes each token to its top-k experts only, so during calibration an expert
the router rarely picks sees few tokens (or none) and its statistics (static activation scales, GPTQ Hessians,
AWQ/SmoothQuant activation ranges) come from almost nothing. The peers' practice (llm-compressor's
``calibrate_all_experts``) is followed here: during calibration every token is sent to every expert, and only the
routed top-k outputs are kept, so the model's output is the one it computes normally.

``moe_calibration(model)`` is a context manager doing that for every MoE block of ``model``::

    with moe_calibration(model, min_tokens=16) as moe:
        for batch in batches:
            model(batch)
    print(moe.coverage())          # tokens routed to each expert of each block

How: a forward hook on each block's router widens its top-k answer to all E experts: the routed experts first,
in the router's order and with the router's weights, then the other experts with weight 0. The block passes that
to its experts module, which computes every expert on every token (its observers and hooks see every token) and
adds ``weight x output``: the unrouted experts add exact zeros (the routed slots come first, so a sum over the
slots adds the same terms in the same order). The block's output is bit for bit the routed one with transformers'
``batched_mm`` experts (one product per token); with ``eager`` / ``grouped_mm`` an expert's matrix product runs on
more rows, which BLAS may round differently by a few ulps (measured: <= 4e-7 of the largest logit in float32, 0 in
bfloat16, on tiny models). Counting: the router's own top-k index, per block and expert.

The structural knowledge (which child is the router, which the experts) is one small table, ``MOE_LAYOUTS``;
the architecture records (``qcore.adapters.families``) may replace it. A block is a module with a router child
returning ``(logits, top-k weights, top-k index)`` and an experts child called as ``experts(hidden, top-k index,
top-k weights)`` (transformers 5: Mixtral, Qwen2-MoE (its shared expert untouched), Qwen3-MoE, OLMoE, DeepSeek-V3,
PhiMoE, GraniteMoE, gpt-oss, tested); the experts module's class does not matter (a qcore quantized experts
module with that call works the same, as long as it computes every expert listed in the index).
The first call of each block checks that the widened index reaches its experts module, and refuses otherwise.

Caveat: an unrouted expert's output is multiplied by 0; an expert overflowing to Inf on a token it was not routed
(possible in float16) would turn that token's output into NaN, which calibration then reports as a NaN statistic.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .modules import CalibrationError

__all__ = ["MoELayout", "MOE_LAYOUTS", "MoEBlock", "find_moe_blocks", "BlockCoverage", "ExpertCoverage",
           "MoECalibration", "moe_calibration"]


# ---------------------------------------------------------------------------------------------------------------
# what a MoE block looks like (data)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoELayout:
    """Where a sparse MoE block keeps its router and its experts.

    router: the block's child computing ``(logits (T, E), top-k weights (T, k), top-k index (T, k))`` from the
        block's tokens (T, hidden).
    experts: the block's child the block calls as ``experts(hidden, top-k index, top-k weights)``.
    num_experts: attributes of the router giving E, tried in order (else the rows of its 2-D ``weight``).
    top_k: the router's attribute giving k: a child without it (a plain ``nn.Linear`` gate returning logits
        only, or its qcore wrapper) is not a router.
    """
    router: str
    experts: str
    num_experts: tuple[str, ...] = ("num_experts", "n_routed_experts")
    top_k: str = "top_k"


#: The MoE layouts recognised: transformers 5's sparse MoE blocks: ``gate`` + ``experts`` (Mixtral, Qwen2-MoE,
#: Qwen3-MoE, OLMoE, DeepSeek-V3, ...) and ``router`` + ``experts`` (PhiMoE, GraniteMoE, gpt-oss, ...).
MOE_LAYOUTS: tuple[MoELayout, ...] = (MoELayout(router="gate", experts="experts"),
                                      MoELayout(router="router", experts="experts"))


@dataclass(frozen=True)
class MoEBlock:
    """One MoE block of a model: its module name, the router's and experts' child names, E and k."""
    name: str
    router: str
    experts: str
    num_experts: int
    top_k: int


def _num_experts(router: nn.Module, layout: MoELayout) -> Optional[int]:
    for attr in layout.num_experts:
        e = getattr(router, attr, None)
        if isinstance(e, int) and not isinstance(e, bool) and e > 0:
            return e
    w = getattr(router, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] > 0:
        return int(w.shape[0])
    return None


def find_moe_blocks(model: nn.Module, *, layouts: tuple[MoELayout, ...] = MOE_LAYOUTS) -> list[MoEBlock]:
    """The MoE blocks of ``model`` (in module order): the modules with a router child and an experts child as
    one of ``layouts`` says (the router with an int ``top_k``: a plain ``nn.Linear`` gate is not one)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch nn.Module, got {type(model).__name__}")
    if not isinstance(layouts, tuple) or not all(isinstance(x, MoELayout) for x in layouts):
        raise TypeError(f"layouts must be a tuple of MoELayout, got {layouts!r}")
    found = []
    for name, m in model.named_modules():
        for lay in layouts:
            router = m._modules.get(lay.router)
            experts = m._modules.get(lay.experts)
            if router is None or experts is None:
                continue
            e, k = _num_experts(router, lay), getattr(router, lay.top_k, None)
            if e is not None and isinstance(k, int) and not isinstance(k, bool) and 0 < k <= e:
                found.append(MoEBlock(name, lay.router, lay.experts, e, k))
                break
    return found


# ---------------------------------------------------------------------------------------------------------------
# the coverage report (values)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockCoverage:
    """Calibration tokens of one MoE block.

    name: the block's module name. tokens: tokens its router saw. routed: per expert, the tokens the router sent
    to it (its top-k). all_experts: whether every expert computed on every token.
    """
    name: str
    tokens: int
    routed: tuple[int, ...]
    all_experts: bool

    @property
    def seen(self) -> tuple[int, ...]:
        """Per expert, the tokens it computed on: every token under all-expert routing, else its routed ones."""
        return (self.tokens,) * len(self.routed) if self.all_experts else self.routed


@dataclass(frozen=True)
class ExpertCoverage:
    """Tokens per expert per MoE block over a calibration, and the experts routed fewer than ``min_tokens``.

    blocks: one ``BlockCoverage`` per MoE block, in module order. Empty for a model without MoE blocks.
    """
    blocks: tuple[BlockCoverage, ...]
    min_tokens: int
    all_experts: bool

    @property
    def under(self) -> tuple[tuple[str, int, int], ...]:
        """``(block name, expert index, routed tokens)`` of every expert routed fewer than ``min_tokens``."""
        return tuple((b.name, e, n) for b in self.blocks for e, n in enumerate(b.routed) if n < self.min_tokens)

    def __getitem__(self, name: str) -> BlockCoverage:
        for b in self.blocks:
            if b.name == name:
                return b
        raise KeyError(f"no MoE block {name!r}; blocks: {[b.name for b in self.blocks][:5]}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (the ``qcore quantize`` report's ``moe_coverage``)."""
        return {"all_experts": self.all_experts, "min_tokens": self.min_tokens,
                "blocks": {b.name: {"tokens": b.tokens, "routed": list(b.routed)} for b in self.blocks},
                "under_calibrated": [{"block": n, "expert": e, "routed": r} for n, e, r in self.under]}

    def __str__(self) -> str:
        if not self.blocks:
            return "no MoE blocks"
        lines = [f"{b.name}: {b.tokens} tokens, routed per expert {list(b.routed)}" for b in self.blocks]
        u = self.under
        lines.append(f"{len(u)} expert(s) routed fewer than {self.min_tokens} tokens" + (
            ": " + ", ".join(f"{n}[{e}] ({r})" for n, e, r in u[:8]) + (", ..." if len(u) > 8 else "") if u else ""))
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# the context manager
# ---------------------------------------------------------------------------------------------------------------


def _widen(index: torch.Tensor, weights: torch.Tensor, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T, E)`` index and weights: the routed experts first (as routed), then the others in order, weight 0."""
    t, k = index.shape
    rest = torch.ones(t, e, dtype=torch.bool, device=index.device)
    rest.scatter_(1, index.long(), False)
    others = torch.arange(e, device=index.device, dtype=index.dtype).expand(t, e)[rest].view(t, e - k)
    full_w = torch.cat([weights, weights.new_zeros(t, e - k)], dim=1)
    return torch.cat([index, others], dim=1), full_w


class MoECalibration:
    """The state of one ``moe_calibration`` context: the blocks, the routed-token counts, counting on or off."""

    def __init__(self, blocks: list[MoEBlock], *, all_experts: bool, min_tokens: int):
        self.blocks = tuple(blocks)
        self.all_experts = all_experts
        self.min_tokens = min_tokens
        self._counts: dict[str, Optional[torch.Tensor]] = {b.name: None for b in blocks}
        self._tokens: dict[str, int] = {b.name: 0 for b in blocks}
        self._counting = True
        self._counted = False  # any router call counted

    @contextmanager
    def counting(self, enabled: bool) -> Iterator[None]:
        """Count routed tokens only when ``enabled`` inside this context (all-expert routing stays on): e.g. a
        layer runner that forwards a layer several times per batch counts only its one pass per batch."""
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {enabled!r}")
        before, self._counting = self._counting, enabled
        try:
            yield
        finally:
            self._counting = before

    def _count(self, name: str, index: torch.Tensor, e: int) -> None:
        if not self._counting:
            return
        c = torch.bincount(index.reshape(-1), minlength=e)
        prev = self._counts[name]
        self._counts[name] = c if prev is None else prev + c.to(prev.device)
        self._tokens[name] += int(index.shape[0])
        self._counted = True

    def coverage(self) -> ExpertCoverage:
        """The tokens counted so far (also after the context ended)."""
        out = []
        for b in self.blocks:
            c = self._counts[b.name]
            routed = (0,) * b.num_experts if c is None else tuple(int(x) for x in c.tolist())
            out.append(BlockCoverage(b.name, self._tokens[b.name], routed, self.all_experts))
        return ExpertCoverage(tuple(out), self.min_tokens, self.all_experts)


_ACTIVE = "_qcore_moe_calibration"  # marks a router under a moe_calibration context (nesting is refused)


def _router_hook(state: MoECalibration, block: MoEBlock, pending: dict):
    def hook(mod, args, out):
        if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(x, torch.Tensor) for x in out)):
            raise CalibrationError(f"moe_calibration: the router {block.name}.{block.router} "
                                   f"({type(mod).__name__}) returned {type(out).__name__}, not (logits, top-k "
                                   f"weights, top-k index); this block's layout is not one of MOE_LAYOUTS")
        logits, weights, index = out
        e = block.num_experts
        if (index.dim() != 2 or index.dtype in (torch.bool,) or index.is_floating_point()
                or weights.shape != index.shape or index.shape[1] > e):
            raise CalibrationError(f"moe_calibration: the router {block.name}.{block.router} returned a top-k "
                                   f"index {tuple(index.shape)} {index.dtype} and weights {tuple(weights.shape)}; "
                                   f"expected two (tokens, k) tensors with k <= {e} experts")
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= e):
            raise CalibrationError(f"moe_calibration: the router {block.name}.{block.router} sent tokens to "
                                   f"expert {int(index.max()) if int(index.max()) >= e else int(index.min())}, "
                                   f"outside [0, {e})")
        _never_reached(block, pending)
        state._count(block.name, index, e)
        if not state.all_experts or index.shape[1] == e:
            return None
        srt = index.sort(dim=1).values
        if bool((srt[:, 1:] == srt[:, :-1]).any()):
            raise CalibrationError(f"moe_calibration: the router {block.name}.{block.router} sent a token to one "
                                   f"expert twice; all-expert routing needs distinct top-k experts per token")
        full_i, full_w = _widen(index, weights, e)
        if not pending["checked"]:
            pending["index"] = full_i
        return logits, full_w, full_i
    return hook


def _never_reached(block: MoEBlock, pending: dict) -> None:
    if pending["index"] is not None and not pending["checked"]:
        raise CalibrationError(f"moe_calibration: {block.name}.{block.experts} was not called after its router "
                               f"{block.name}.{block.router}; this block computes its experts otherwise (pass "
                               f"all_experts=False, or describe it in MOE_LAYOUTS)")


def _experts_hook(block: MoEBlock, pending: dict):
    def hook(mod, args, kwargs):
        want = pending.get("index")
        if want is None or pending["checked"]:
            return None
        if not any(a is want for a in list(args) + list(kwargs.values())):
            raise CalibrationError(f"moe_calibration: {block.name}.{block.experts} ({type(mod).__name__}) was not "
                                   f"called with its router's top-k index; this block computes its experts "
                                   f"otherwise (pass all_experts=False, or describe it in MOE_LAYOUTS)")
        pending["checked"] = True
        pending["index"] = None
        return None
    return hook


@contextmanager
def moe_calibration(model: nn.Module, *, all_experts: bool = True, min_tokens: int = 1, warn: bool = True,
                    layouts: tuple[MoELayout, ...] = MOE_LAYOUTS) -> Iterator[MoECalibration]:
    """Inside this context every MoE block of ``model`` sends every token to every expert and keeps the routed
    top-k outputs only (the model's outputs are unchanged); the tokens routed to each expert are counted.

    all_experts: False leaves the routing as it is and only counts.
    min_tokens: experts routed fewer tokens are reported (``ExpertCoverage.under``) and, with ``warn``, named in
        a ``warnings.warn`` when the context ends normally after counting any token.
    layouts: where the blocks keep their router and experts (``MOE_LAYOUTS``).

    Yields a ``MoECalibration``: ``.blocks``, ``.coverage()`` (an ``ExpertCoverage``, also after the context),
    ``.counting(False)`` to pause counting. On exit, also by an error, every hook is removed: nothing stays
    patched. A model without MoE blocks is left alone (an empty coverage). Nesting on one model is refused.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch nn.Module, got {type(model).__name__}")
    if not isinstance(all_experts, bool):
        raise TypeError(f"all_experts must be a bool, got {all_experts!r}")
    if not isinstance(min_tokens, int) or isinstance(min_tokens, bool):
        raise TypeError(f"min_tokens must be an int (tokens routed to an expert), got {min_tokens!r}")
    if min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
    if not isinstance(warn, bool):
        raise TypeError(f"warn must be a bool, got {warn!r}")
    blocks = find_moe_blocks(model, layouts=layouts)
    mods = [(b, model.get_submodule(b.name)) for b in blocks]
    busy = [b.name for b, m in mods if getattr(m._modules[b.router], _ACTIVE, False)]
    if busy:
        raise ValueError(f"moe_calibration: the MoE blocks {busy[:3]} are already under a moe_calibration context "
                         f"(nesting is refused: it would count and widen twice)")
    state = MoECalibration(blocks, all_experts=all_experts, min_tokens=min_tokens)
    handles = []
    routers = []
    pendings = []
    try:
        for b, m in mods:
            router, experts = m._modules[b.router], m._modules[b.experts]
            pending = {"index": None, "checked": not all_experts}
            pendings.append((b, pending))
            handles.append(router.register_forward_hook(_router_hook(state, b, pending)))
            if all_experts:
                handles.append(experts.register_forward_pre_hook(_experts_hook(b, pending), with_kwargs=True))
            setattr(router, _ACTIVE, True)
            routers.append(router)
        yield state
    finally:
        for h in handles:
            h.remove()
        for r in routers:
            try:
                delattr(r, _ACTIVE)
            except AttributeError:
                pass
    for b, pending in pendings:
        _never_reached(b, pending)
    if warn and state._counted:
        cov = state.coverage()
        u = cov.under
        if u:
            few = "no calibration token" if min_tokens == 1 else f"fewer than {min_tokens} calibration tokens"
            warnings.warn(f"MoE calibration: {len(u)} expert(s) were routed {few}: "
                          + ", ".join(f"{n} expert {e} ({r})" for n, e, r in u[:10])
                          + (", ..." if len(u) > 10 else "") + (
                              " (all-expert routing gave them every token, but their statistics come from tokens "
                              "the router does not send them)" if all_experts else
                              " (their statistics come from those tokens only)"), stacklevel=3)
