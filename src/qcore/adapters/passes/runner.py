"""The one layer runner: a torch model's decoder layers run one at a time over kept inputs.

GPTQ / AWQ / SmoothQuant (``qcore.adapters.passes.sequential``), AMP sensitivities (``qcore.adapters.passes.amp``) and the
streamed checkpoint (``qcore.adapters.passes.streaming``) all work this way:

1. ``find_decoder_layers``: the decoder layers (a path such as ``"model.layers"``, or the model's longest
   ``nn.ModuleList`` of identical blocks);
2. ``LayerRunner.capture``: the calibration batches run through the model until the first decoder layer; its
   call (positional and keyword arguments: hidden states, attention mask, position embeddings; KV caches off)
   is kept once per batch as ``LayerInputs``. ``LayerRunner.record`` instead keeps every layer's inputs during
   full forwards (AMP, which needs the outputs too);
3. ``LayerRunner.run(step, inputs)``: for each layer ``i`` in turn, ``step(i, layer, inputs)`` is the pass (it
   reads statistics from forwards of this layer alone, ``forward_layer(layer, inputs, keep=False)``, and may
   rewrite the layer's weights); then the layer's outputs over ``inputs``, with its weights as the pass left
   them, become the next layer's inputs (``forward_layer(..., keep=True)``). A pass that replays its own streams
   (streaming keeps two) gives ``replay=False``;
4. ``LayerRunner.run_from(k, batches, inputs=...)``: full-model forwards that start at layer ``k`` (the layers
   before it stand in by returning their input; layer ``k`` gets the kept inputs), or, for ``k ==
   len(layers)``, forwards of the modules after the layers from kept final hidden states.

One abort path: every hook the runner registers is removed on any exit; with ``rewrites=True`` an error or
interrupt in a pass after the capture marks the model ``_qcore_partial`` (``quantize_model`` then refuses it)
and an ``Exception`` is re-raised as ``AlgorithmError`` naming the pass and the layer (``KeyboardInterrupt`` /
``SystemExit`` keep their type, with a warning). Progress bars: ``qcore.adapters.batches.progress_bar`` (tqdm,
``leave=False``), off with ``progress=False``. Device: the batches are moved to the model's device (its first
parameter's) unless given ``device=``. ``Spill`` appends a layer's encoded tensors to a file so the layer can be
dropped (streaming). ``run(..., checkpoint=)``: each layer saved in a work directory, a saved run resumed after
its last complete layer (``qcore.adapters.passes.checkpointing``).
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional

import torch
from torch import nn

from qcore.formats.safetensors_io import TensorRecord

from ..batches import call_model, check_batch, describe_batch, device_of, progress_bar, to_device
from ..families import decoder_layers_path

_log = logging.getLogger("qcore.adapters")

__all__ = ["AlgorithmError", "FloatStream", "LayerInputs", "LayerRunner", "Spill", "Stop", "capture",
           "find_decoder_layers", "forward_layer", "hidden_of"]

_CACHE_KWARGS = ("past_key_value", "past_key_values", "layer_past")


class AlgorithmError(RuntimeError):
    """An algorithm failed after some decoder layers were already rewritten (the model must be reloaded): ``what``
    (the pass), ``layer`` (the decoder layer it failed on), ``cause`` (the failure, one line), so that a command
    line reports it in its own words."""

    def __init__(self, message: str, *, what: str = "", layer: int = -1, cause: str = ""):
        super().__init__(message)
        self.what, self.layer, self.cause = what, layer, cause


class Stop(Exception):
    """Raised by a hook to cut a forward short; the runner's loops skip the rest of that batch's forward."""


def find_decoder_layers(model: nn.Module, path: Optional[str] = None) -> tuple[str, nn.ModuleList]:
    """``(dotted path, ModuleList)`` of the model's decoder layers: ``path`` if given, else where the model's
    architecture record (``qcore.adapters.families``) says they are (a vision-language model: its language
    tower's), else the longest ``nn.ModuleList`` whose children are all of one type (ties: the one holding the most
    parameters)."""
    if path is not None:
        try:
            m = model.get_submodule(path)
        except AttributeError:
            lists = [n for n, x in model.named_modules() if isinstance(x, nn.ModuleList)]
            raise ValueError(f"decoder_layers {path!r} is not a module of the model; its ModuleLists: {lists[:5]}") from None
        if not isinstance(m, nn.ModuleList) or len(m) == 0:
            raise ValueError(f"decoder_layers {path!r} is a {type(m).__name__}, not a non-empty nn.ModuleList")
        return path, m
    known = decoder_layers_path(model)
    if known is not None and len(model.get_submodule(known)) > 0:
        return known, model.get_submodule(known)
    best = None
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(c) for c in m}) == 1:
            key = (len(m), sum(p.numel() for p in m.parameters()))
            if best is None or key > best[0]:
                best = (key, name, m)
    if best is None:
        raise ValueError("could not find the model's decoder layers (no nn.ModuleList of identical blocks); give "
                         "decoder_layers='model.layers' (Quark: model_decoder_layers) in the algorithm config")
    return best[1], best[2]


class LayerInputs:
    """One decoder layer's calls, one per batch: ``args[i]`` (a tuple) and ``kwargs[i]`` (a dict).
    ``tuple_out``: whether the layer that produced them returned a tuple (None: not known, e.g. captured)."""

    __slots__ = ("args", "kwargs", "tuple_out")

    def __init__(self, args: list, kwargs: list, tuple_out: Optional[bool] = None):
        self.args, self.kwargs, self.tuple_out = args, kwargs, tuple_out

    def __len__(self):
        return len(self.args)

    def hidden(self, i: int) -> torch.Tensor:
        """Batch ``i``'s hidden states (the first positional argument, else ``hidden_states=``)."""
        return self.args[i][0] if self.args[i] else self.kwargs[i]["hidden_states"]


class FloatStream(NamedTuple):
    """The float model's view of one decoder layer (``LayerRunner.run(..., float_inputs=)``): ``inputs``, what the
    float model's layers before it give on the calibration batches, and ``outputs``, this layer's float outputs
    over them (computed before the step rewrites any weight). Algorithms that correct the error of the already
    quantized layers (GPTAQ, Qronos) or fit a layer to its float outputs (AutoRound) read them beside the
    quantized stream's ``inputs``."""

    inputs: LayerInputs
    outputs: LayerInputs


def _replay_call(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A decoder layer's call ``(args, kwargs)`` as kept for replaying it: tensors detached, no KV cache."""
    kw = dict(kwargs)
    for k in _CACHE_KWARGS:
        if k in kw:
            kw[k] = None
    if "use_cache" in kw:
        kw["use_cache"] = False
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args), kw


def hidden_of(out):
    """The hidden states of a decoder layer's output (a tensor, or the first item of a tuple)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def forward_layer(layer: nn.Module, inputs: LayerInputs, *, keep: bool) -> Optional[LayerInputs]:
    """Run ``layer`` over every batch of ``inputs`` (a ``Stop`` raised by a hook ends that batch's call; with
    ``keep`` it is an error); with ``keep`` return the next layer's ``LayerInputs`` (the same keyword arguments,
    the output's hidden states)."""
    nxt_args = []
    tuple_out = None
    for b, (args, kwargs) in enumerate(zip(inputs.args, inputs.kwargs)):
        try:
            out = layer(*args, **kwargs)
        except Stop:
            if keep:  # the next layer's inputs would silently miss this batch
                raise RuntimeError(f"a hook stopped the replay of batch {b} through the layer; a pass must remove "
                                   f"its hooks before the runner replays the layer") from None
            continue
        if keep:
            tuple_out = isinstance(out, (tuple, list))
            h = hidden_of(out)
            if args:
                nxt_args.append((h,) + tuple(args[1:]))
            else:
                nxt_args.append(args)
                kwargs["hidden_states"] = h
    return LayerInputs(nxt_args, inputs.kwargs, tuple_out) if keep else None


class _NoCache:
    """``model.config.use_cache`` off inside the block (restored after)."""

    def __init__(self, model: nn.Module):
        self.cfg = getattr(model, "config", None)
        self.old = getattr(self.cfg, "use_cache", None)

    def __enter__(self):
        if self.old is not None:
            self.cfg.use_cache = False
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            self.cfg.use_cache = self.old
        return False


def capture(model: nn.Module, layer: nn.Module, batches: Sequence, *, device=None, progress: bool = True,
            desc: str = "capturing layer inputs") -> LayerInputs:
    """The inputs of ``layer`` (the first decoder layer) for every batch: the model runs on each batch (moved to
    ``device`` when given) until the layer's call, which is kept and cut short. A batch that does not fit the
    model, or a forward that never reaches the layer, raises ``ValueError`` naming the batch."""

    args_l: list = []
    kwargs_l: list = []

    def pre(mod, args, kwargs):
        a, kw = _replay_call(args, kwargs)
        args_l.append(a)
        kwargs_l.append(kw)
        raise Stop

    h = layer.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with _NoCache(model):
            for i, batch in enumerate(progress_bar(batches, total=len(batches), desc=desc, enabled=progress)):
                check_batch(model, batch, i)
                try:
                    call_model(model, batch if device is None else to_device(batch, device))
                except Stop:
                    continue
                except (RuntimeError, ValueError, TypeError, IndexError) as e:
                    raise ValueError(f"calibration batch {i} ({describe_batch(batch)}) does not fit the model: "
                                     f"{type(e).__name__}: {e}") from e
                raise ValueError(f"calibration batch {i}: the model's forward never reached its first decoder layer")
    finally:
        h.remove()
    return LayerInputs(args_l, kwargs_l)


class _Skip(nn.Module):
    """Stands for a decoder layer before the one run: returns its hidden-state input unchanged (or, with
    ``source``, ``source()``), in the layer's output structure."""

    def __init__(self, tuple_out: bool, source: Optional[Callable[[], torch.Tensor]] = None):
        super().__init__()
        self.tuple_out, self.source = tuple_out, source

    def forward(self, *args, **kwargs):
        if self.source is not None:
            h = self.source()
        else:
            h = args[0] if args else kwargs.get("hidden_states")
        return (h,) if self.tuple_out else h


def _flag(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {v!r}")
    return v


class LayerRunner:
    """A model's decoder layers run one at a time (module docstring).

    model: the torch model. path: the decoder layers' dotted path (None: found). layers: the ``ModuleList``
    itself (with ``path``; e.g. a meta skeleton's). required: with False a model without identifiable decoder
    layers gives ``layers = path = None`` (then only whole-model forwards: ``record`` / ``run_from(None)``).
    device: where batches are moved (default: the model's first parameter's device). progress: tqdm bars.
    """

    def __init__(self, model: nn.Module, *, path: Optional[str] = None, layers: Optional[nn.ModuleList] = None,
                 required: bool = True, device=None, progress: bool = True):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if path is not None and not isinstance(path, str):
            raise TypeError(f"path must be a dotted module path (str) or None, got {path!r}")
        if layers is not None and (path is None or not isinstance(layers, nn.ModuleList) or len(layers) == 0):
            raise ValueError(f"layers: got {type(layers).__name__}{'' if path else ' without path='}; expected a "
                             f"non-empty nn.ModuleList with its path=")
        self.model = model
        self.progress = _flag("progress", progress)
        _flag("required", required)
        if layers is not None:
            self.path, self.layers = path, layers
        else:
            try:
                self.path, self.layers = find_decoder_layers(model, path)
            except ValueError:
                if required or path is not None:
                    raise
                self.path, self.layers = None, None
        if device is None:
            device = device_of(model)
        self.device = torch.device(device)

    def __len__(self):
        return 0 if self.layers is None else len(self.layers)

    def layer_of(self, name: str) -> Optional[int]:
        """The index of the decoder layer holding module ``name`` (None: outside the decoder layers)."""
        if self.layers is None or not name.startswith(self.path + "."):
            return None
        idx = name[len(self.path) + 1:].split(".")[0]
        return int(idx) if idx.isdigit() else None

    # -- inputs ---------------------------------------------------------------------------------------------

    def capture(self, batches: Sequence, *, desc: str = "capturing layer inputs") -> LayerInputs:
        """The first decoder layer's inputs for every batch (``capture``)."""
        if isinstance(batches, (torch.Tensor, str)) or not isinstance(batches, Sequence):
            raise TypeError(f"batches: got {type(batches).__name__}; expected a non-empty list of batches")
        if len(batches) == 0:
            raise ValueError(f"batches: got {batches!r}; expected a non-empty list of batches")
        self._need_layers("capture")
        return capture(self.model, self.layers[0], batches, device=self.device, progress=self.progress, desc=desc)

    def record(self, batches: Sequence, *, each: Optional[Callable[[int, Any], None]] = None,
               desc: str = "float model") -> list[LayerInputs]:
        """Whole-model forwards over ``batches`` (as given: not moved) keeping every decoder layer's inputs;
        ``each(i, output)`` sees batch ``i``'s model output. Returns one ``LayerInputs`` per layer (``[]``
        without layers)."""

        n = len(self)
        kept: list = [([], []) for _ in range(n)]
        tuple_out: list = [None]

        def keep(i):
            def pre(mod, args, kwargs):
                a, kw = _replay_call(args, kwargs)
                kept[i][0].append(a)
                kept[i][1].append(kw)
            return pre

        def out_type(mod, args, out):
            tuple_out[0] = isinstance(out, (tuple, list))

        hooks = [self.layers[i].register_forward_pre_hook(keep(i), with_kwargs=True) for i in range(n)]
        if n:
            hooks.append(self.layers[0].register_forward_hook(out_type))
        try:
            with torch.no_grad(), _NoCache(self.model):
                for i, b in enumerate(progress_bar(batches, total=len(batches), desc=desc, enabled=self.progress)):
                    out = call_model(self.model, b)
                    if each is not None:
                        each(i, out)
        finally:
            for h in hooks:
                h.remove()
        return [LayerInputs(a, k, tuple_out[0]) for a, k in kept]

    # -- passes ---------------------------------------------------------------------------------------------

    def run(self, step: Callable[..., None], inputs: Optional[LayerInputs] = None,
            *, desc: str = "layer by layer", replay: bool = True, keep_last: bool = False, rewrites: bool = False,
            what: str = "the pass", checkpoint=None, float_inputs: Optional[LayerInputs] = None
            ) -> Optional[LayerInputs]:
        """``step(i, layer, inputs)`` for each decoder layer in turn; with ``replay`` the layer (as the step left
        it) then runs over ``inputs`` to give the next layer's (after the last layer only with ``keep_last``:
        the final hidden states, returned). ``rewrites``: the steps change the model's weights: a failure marks
        the model partial and raises ``AlgorithmError`` naming ``what`` and the layer (module docstring).
        ``checkpoint``: a ``qcore.adapters.passes.checkpointing.LayerCheckpoint``: the layers a work directory
        holds are restored and the run starts after them; each layer is saved there when done.

        ``float_inputs`` (needs ``replay``; usually the same captured ``LayerInputs`` as ``inputs``): a second
        stream, the float model's. Before each step the layer, still float, runs over it, and the step is called
        as ``step(i, layer, inputs, FloatStream(float_inputs, float_outputs))``; the float outputs are the next
        layer's float inputs. Memory: two more copies of one layer's inputs. A work directory keeps both
        streams."""

        if not callable(step):
            raise TypeError(f"step must be callable as step(i, layer, inputs), got {type(step).__name__}")
        for name, v in (("replay", replay), ("keep_last", keep_last), ("rewrites", rewrites)):
            _flag(name, v)
        if replay and not isinstance(inputs, LayerInputs):
            raise TypeError(f"inputs must be LayerInputs (LayerRunner.capture's) when replay=True, got "
                            f"{type(inputs).__name__}")
        if float_inputs is not None and not (replay and isinstance(float_inputs, LayerInputs)):
            raise TypeError(f"float_inputs must be LayerInputs, with replay=True, got {type(float_inputs).__name__} "
                            f"(replay={replay})")
        self._need_layers("run")
        n = len(self.layers)
        current: Optional[int] = None
        start = 0
        try:
            if checkpoint is not None:  # a work directory: the layers it holds are restored, the run goes on
                current = 0
                start, inputs, float_inputs = checkpoint.begin(self.layers, inputs, n, device=self.device,
                                                               float_inputs=float_inputs)
                if start:
                    desc = f"{desc} (resuming at layer {start} of {n})"
            for i in progress_bar(range(start, n), total=n - start, desc=desc, enabled=self.progress):
                current = i
                if float_inputs is not None:
                    float_out = forward_layer(self.layers[i], float_inputs, keep=True)
                    step(i, self.layers[i], inputs, FloatStream(float_inputs, float_out))
                    float_inputs = float_out
                else:
                    step(i, self.layers[i], inputs)
                if replay and (i + 1 < n or keep_last):
                    inputs = forward_layer(self.layers[i], inputs, keep=True)
                if checkpoint is not None:
                    checkpoint.done(i, self.layers[i], inputs if replay else None, float_inputs)
        except BaseException as e:
            if current is None or not rewrites:
                raise
            self.model._qcore_partial = True  # quantize_model refuses a half-rewritten model
            msg = (f"while running {what} on decoder layer {current} of {self.path!r}; layers 0..{current} may "
                   f"already be rewritten: reload the model before quantizing it again")
            if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: keep their type
                if checkpoint is not None:  # the caller says how to resume, in its own words (a flag, an argument)
                    _log.warning("interrupted while running %s on decoder layer %d of %r; the layers done are saved "
                                 "in the work directory %s", what, current, self.path, str(checkpoint.work.path))
                elif hasattr(e, "add_note"):  # the advice (to a Python caller) in the traceback, not on a command
                    e.add_note(f"interrupted {msg}")  # line's stderr
                else:  # Python 3.10
                    _log.warning("interrupted %s", msg)
                raise
            cause = str(e).splitlines()[0] if str(e).strip() else ""
            raise AlgorithmError(f"{type(e).__name__}: {e} ({msg})", what=str(what), layer=current,
                                 cause=f"{type(e).__name__}: {cause}" if cause else type(e).__name__) from e
        return inputs if replay and keep_last else None

    def run_from(self, k: Optional[int], batches: Sequence, *, inputs: Optional[LayerInputs] = None,
                 stop: Optional[int] = None, move: bool = False, desc: Optional[str] = None):
        """Whole-model forwards over ``batches`` (moved to the device with ``move``) starting at decoder layer
        ``k``: the layers before it return their input, layer ``k`` gets ``inputs`` (its kept calls, one per
        batch). ``k == len(layers)``: every layer stands aside and ``inputs`` holds the final hidden states
        (the modules after the layers run on them). ``k`` None (or 0 without ``stop``): plain forwards.
        ``stop``: the forward ends after that layer (nothing yielded). Yields each batch's model output."""

        n = len(self)
        it = batches if desc is None else progress_bar(batches, total=len(batches), desc=desc, enabled=self.progress)
        if k is None or (k == 0 and stop is None):
            with torch.no_grad():
                for b in it:
                    yield call_model(self.model, to_device(b, self.device) if move else b)
            return
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= n:
            raise ValueError(f"k: got {k!r}; expected None or a layer index in [0, {n}]")
        if not isinstance(inputs, LayerInputs) or len(inputs) != len(batches):
            raise ValueError(f"inputs: expected LayerInputs with one call per batch ({len(batches)}), got "
                             f"{type(inputs).__name__}{f' of {len(inputs)}' if isinstance(inputs, LayerInputs) else ''}")
        if stop is not None and not (isinstance(stop, int) and k <= stop < n):
            raise ValueError(f"stop: got {stop!r}; expected None or a layer index in [{k}, {n})")
        tuple_out = bool(inputs.tuple_out)
        saved = [self.layers[j] for j in range(k)]
        cur = {"i": 0}

        def pre(mod, args, kwargs):
            a, kw = inputs.args[cur["i"]], inputs.kwargs[cur["i"]]
            return a, dict(kw)

        def halt(mod, args, out):
            raise Stop

        hooks = []
        try:
            if k < n:
                hooks.append(self.layers[k].register_forward_pre_hook(pre, with_kwargs=True))
            if stop is not None:
                hooks.append(self.layers[stop].register_forward_hook(halt))
            for j in range(k):
                src = (lambda: inputs.hidden(cur["i"])) if (j == 0 and k == n) else None
                self.layers[j] = _Skip(tuple_out, src)
            with torch.no_grad():
                for i, b in enumerate(it):
                    cur["i"] = i
                    try:
                        out = call_model(self.model, to_device(b, self.device) if move else b)
                    except Stop:
                        continue
                    yield out
        finally:
            for h in hooks:
                h.remove()
            for j in range(k):
                self.layers[j] = saved[j]

    def _need_layers(self, what: str) -> None:
        if self.layers is None:
            raise ValueError(f"LayerRunner.{what}: the model has no identifiable decoder layers (no nn.ModuleList "
                             f"of identical blocks); give path=")


class Spill:
    """Append-only file of encoded tensors (``qcore.formats.safetensors_io.TensorRecord``): ``add`` writes a
    record's bytes now and returns a record under ``name`` that reads them back later, so a pass can drop its
    layer once its tensors are encoded (streaming)."""

    def __init__(self, path: pathlib.Path):
        self.path = pathlib.Path(path)
        self.f = open(self.path, "wb")
        self.pos = 0

    def add(self, r, name: str):

        data = r.produce()
        if len(data) != r.nbytes:
            raise ValueError(f"tensor {r.name!r}: produced {len(data)} bytes, expected {r.nbytes}")
        self.f.write(data)
        off, self.pos = self.pos, self.pos + len(data)
        path, n = self.path, len(data)

        def produce(path=path, off=off, n=n) -> bytes:
            with open(path, "rb") as f:
                f.seek(off)
                return f.read(n)
        return TensorRecord(name, r.dtype, r.shape, produce)

    def close(self) -> None:
        if not self.f.closed:
            self.f.flush()
            self.f.close()
