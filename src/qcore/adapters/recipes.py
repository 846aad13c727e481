"""The best training-free recipe of each scheme, as data: what ``--algo best`` runs (issue 34).

``RECIPES`` maps a preset name to a ``Recipe``: the algorithms to run before rounding (as ``--algo`` takes them:
names or dicts with settings) and, where it pays, an observer that replaces the preset's weight observer (a
searched scale rule). Each entry was chosen from measurements on the embedded SmolLM2-135M with the anchors
protocol (``qcore quantize --scheme NAME --algo best``; bench/FP4.md and bench/results/ALGORITHMS.md hold the
runs, their commands and the alternatives measured); ``measured`` says what the recipe gives there and
``source`` which file has the run. ``qcore schemes`` prints each scheme's recipe, and docs/algorithms.md has
the same table (a test keeps the two equal).

``best_recipe(name)`` is the recipe of a preset (``ValueError`` naming the presets that have one otherwise) and
``apply_recipe(config, recipe)`` the config it gives: the recipe's algorithms, followed by those given after
``best`` (only ``distill`` may follow, as it trains what the recipe produced), and the weight observer replaced
in every layer config that quantizes a weight.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from typing import Any, Optional

from qcore.algorithms.config import parse_algorithm, parse_algorithms

from .config import LayerConfig, ModelConfig, Observer, TensorConfig
from .presets import PRESETS

__all__ = ["Recipe", "RECIPES", "BEST", "best_recipe", "apply_recipe", "recipe_label"]

#: the ``--algo`` entry that stands for a scheme's recipe
BEST = "best"


@dataclass(frozen=True)
class Recipe:
    """``algorithms``: run before rounding, in order (as ``--algo`` takes them; parsed and checked here).
    ``weight_observer``: replaces the weight observer of the scheme (None: the preset's own rule).
    ``measured``: what the recipe gives on SmolLM2-135M (anchors protocol), ``source``: the file with the run."""

    algorithms: tuple
    weight_observer: Optional[Observer] = None
    measured: str = ""
    source: str = ""

    def __post_init__(self):
        object.__setattr__(self, "algorithms", parse_algorithms(tuple(self.algorithms)))
        if self.weight_observer is not None and not isinstance(self.weight_observer, typing.get_args(Observer)):
            raise TypeError(f"Recipe.weight_observer must be an observer or None, got {self.weight_observer!r}")


_BENCH = "bench/results/ALGORITHMS.md"
_FP4 = "bench/FP4.md"

#: preset name -> its best training-free recipe on SmolLM2-135M (fp32 perplexity 14.01)
RECIPES: dict[str, Recipe] = {
    "w_mxfp4_a_mxfp4": Recipe(({"name": "quarot", "block": 32}, "qronos"), measured="ppl 21.10", source=_FP4),
    "mxfp4": Recipe(({"name": "quarot", "block": 32}, "qronos"), measured="as w_mxfp4_a_mxfp4", source=_FP4),
    "mxfp4_weight_only": Recipe(("gptq",), measured="ppl 15.57", source=_BENCH),
    "nvfp4": Recipe(("qronos",), measured="ppl 17.02", source=_FP4),
    "w_int4_a_int4_per_token_dynamic": Recipe(("quarot", "qronos"), measured="ppl 24.43", source=_FP4),
    "uint4_wo_64": Recipe(("qronos",), measured="ppl 14.58", source=_BENCH),
    "w_uint4_per_group_asym": Recipe(("qronos",), measured="ppl 14.58 at group 64", source=_BENCH),
}


def best_recipe(name: Any) -> Recipe:
    """The recipe of preset ``name`` (``ValueError`` naming the schemes that have one, for any other)."""
    if not isinstance(name, str) or name not in RECIPES:
        what = "a preset without a measured recipe" if isinstance(name, str) and name in PRESETS else \
            "not a preset"
        raise ValueError(f"scheme {name!r} is {what}; the schemes with a best recipe are {', '.join(RECIPES)} "
                         f"(docs/algorithms.md, 'The best recipe of each scheme')")
    return RECIPES[name]


def _with_observer(lc: Optional[LayerConfig], obs: Observer) -> Optional[LayerConfig]:
    if lc is None or lc.weight is None:
        return lc
    return dataclasses.replace(lc, weight=TensorConfig(lc.weight.spec, dynamic=lc.weight.dynamic, observer=obs))


def apply_recipe(config: ModelConfig, recipe: Recipe, *, after: tuple = ()) -> ModelConfig:
    """``config`` with ``recipe``'s algorithms (then ``after``, parsed: only ``distill``) and weight observer."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"apply_recipe: config must be a ModelConfig, got {type(config).__name__}")
    if not isinstance(recipe, Recipe):
        raise TypeError(f"apply_recipe: recipe must be a Recipe, got {type(recipe).__name__}")
    after = parse_algorithms(tuple(after))
    if any(a.name != "distill" for a in after):
        raise ValueError(f"after {BEST!r} only distill may follow (it trains what the recipe produced), got "
                         f"{[a.name for a in after]}")
    config = config.replace(algorithms=recipe.algorithms + after)
    obs = recipe.weight_observer
    if obs is None:
        return config
    return config.replace(layer=_with_observer(config.layer, obs),
                          by_type={k: _with_observer(v, obs) for k, v in config.by_type.items()},
                          by_name={k: _with_observer(v, obs) for k, v in config.by_name.items()})


def recipe_label(recipe: Recipe) -> str:
    """``quarot,gptq`` (and ``; weights: <observer>``): a recipe in one line, as ``qcore schemes`` prints it."""
    algos = ",".join(_entry(a) for a in recipe.algorithms)
    obs = recipe.weight_observer
    return algos + (f"; weight scales: {obs.to_dict()['kind']}" if obs is not None else "")


def _entry(a) -> str:
    """An algorithm as ``--algo`` takes it: its name, or a JSON object of the name and the settings that differ from
    the defaults."""
    d, default = a.to_dict(), parse_algorithm(a.name).to_dict()
    diff = {k: v for k, v in d.items() if k != "name" and default.get(k) != v}
    return a.name if not diff else json.dumps({"name": a.name, **diff}, separators=(",", ":"))
