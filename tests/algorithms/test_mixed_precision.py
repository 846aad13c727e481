"""The AMP search (qcore.algorithms.mixed_precision): agreement with brute force, budgets respected, the
optimality bound, determinism, errors."""

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

import qcore
from qcore.algorithms.mixed_precision import MixedPrecision, search

BITS = {"mxfp4": 4.25, "fp8": 8.0, "bf16": 16.0}


def _instance(rng, n_layers, schemes=("mxfp4", "fp8", "bf16"), integer=False):
    sens, weights = {}, {}
    for i in range(n_layers):
        name = f"layer{i}"
        weights[name] = int(rng.integers(1, 9)) * (4 if integer else int(rng.integers(1, 50)))
        # coarser schemes lose more (as real sensitivities do), but not always by the same factor
        s4 = float(rng.exponential(1.0))
        sens[name] = {"mxfp4": s4, "fp8": s4 * float(rng.uniform(0, 0.3)), "bf16": 0.0}
        sens[name] = {k: sens[name][k] for k in schemes}
    return sens, weights


def _brute(sens, weights, bits, *, budget=None, max_loss=None):
    layers = list(sens)
    total = sum(weights.values())
    best = None
    for combo in itertools.product(*[list(sens[k]) for k in layers]):
        cost = sum(Fraction(weights[k]) * Fraction(bits[s]) for k, s in zip(layers, combo))
        loss = math.fsum(sens[k][s] for k, s in zip(layers, combo))
        if budget is not None and cost <= budget * total:
            key = (loss, cost)
        elif max_loss is not None and loss <= max_loss:
            key = (cost, loss)
        else:
            continue
        if best is None or key < best[0]:
            best = (key, combo)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_agrees_with_brute_force_when_the_discretisation_is_exact(seed):
    # integer bits and a resolution equal to the extra budget: the unit is one bit, every extra cost is whole
    rng = np.random.default_rng(seed)
    bits = {"mxfp4": 4, "fp8": 8, "bf16": 16}
    sens, weights = _instance(rng, int(rng.integers(2, 7)), integer=True)
    total = sum(weights.values())
    target = float(rng.uniform(4.2, 12))
    budget_bits = math.floor(target * total)
    target = budget_bits / total
    room = budget_bits - 4 * total
    if room <= 0:
        return
    r = search(sens, weights, bits, target_bits=target, resolution=room)
    (loss, _), combo = _brute(sens, weights, bits, budget=Fraction(budget_bits, total))
    assert r.gap_bits == pytest.approx(len(sens) / total) or r.gap_bits == 0.0
    assert r.predicted_loss == pytest.approx(loss, abs=1e-12)
    assert r.average_bits <= target + 1e-12


@pytest.mark.parametrize("seed", range(20))
def test_target_respected_and_within_the_documented_bound(seed):
    rng = np.random.default_rng(100 + seed)
    sens, weights = _instance(rng, int(rng.integers(1, 7)))
    total = sum(weights.values())
    target = float(rng.uniform(4.25, 10))
    r = search(sens, weights, BITS, target_bits=target, resolution=int(rng.integers(1, 200)))
    assert isinstance(r, MixedPrecision)
    cost = sum(Fraction(weights[k]) * Fraction(BITS[s]) for k, s in r.choice)
    assert cost <= Fraction(target) * total  # exact: never over the budget
    assert r.average_bits == pytest.approx(float(cost / total))
    assert r.predicted_loss == pytest.approx(math.fsum(sens[k][s] for k, s in r.choice))
    exact = _brute(sens, weights, BITS, budget=Fraction(target))
    assert r.predicted_loss >= exact[0][0] - 1e-12  # the brute force is optimal
    reduced = _brute(sens, weights, BITS, budget=Fraction(target) - Fraction(r.gap_bits))
    if reduced is not None:  # no worse than the optimum of the budget reduced by the bound
        assert r.predicted_loss <= reduced[0][0] + 1e-12
    assert [k for k, _ in r.choice] == list(sens)


@pytest.mark.parametrize("seed", range(12))
def test_max_loss_gives_the_cheapest_assignment_within_the_bound(seed):
    rng = np.random.default_rng(200 + seed)
    sens, weights = _instance(rng, int(rng.integers(1, 6)))
    total = sum(weights.values())
    least = math.fsum(min(v.values()) for v in sens.values())
    most = math.fsum(max(v.values()) for v in sens.values())
    limit = float(rng.uniform(least, most))
    r = search(sens, weights, BITS, max_loss=limit, resolution=500)
    assert r.predicted_loss <= limit
    (cost, _), _ = _brute(sens, weights, BITS, max_loss=limit)
    assert r.average_bits >= float(cost / total) - 1e-12
    assert r.average_bits <= float(cost / total) + r.gap_bits + 1e-12
    assert r.max_loss == limit and r.target_bits is None


def test_a_budget_that_does_not_bind_takes_each_layers_least_loss_and_ties_go_cheaper():
    sens = {"a": {"mxfp4": 1.0, "fp8": 0.0, "bf16": 0.0}, "b": {"mxfp4": 2.0, "fp8": 0.5, "bf16": 0.1}}
    r = search(sens, {"a": 10, "b": 10}, BITS, target_bits=16)
    assert r.as_dict() == {"a": "fp8", "b": "bf16"}  # a: fp8 and bf16 tie at 0.0, fp8 is cheaper
    assert r.gap_bits == 0.0 and r.average_bits == 12.0


def test_known_small_instance():
    # 5 bits average over two equal layers: only one layer can leave mxfp4, the more sensitive one
    sens = {"q": {"mxfp4": 3.0, "fp8": 0.1}, "down": {"mxfp4": 9.0, "fp8": 0.2}}
    r = search(sens, {"q": 100, "down": 100}, BITS, target_bits=6.125)
    assert r.as_dict() == {"q": "mxfp4", "down": "fp8"}
    assert r.average_bits == 6.125 and r.predicted_loss == pytest.approx(3.2)
    assert r.share("fp8") == 0.5 and r.share("bf16") == 0.0
    assert dict(r.scheme_weights) == {"mxfp4": 100, "fp8": 100}
    # the cheapest total at the minimum, a single scheme when only one is offered
    assert search(sens, {"q": 100, "down": 100}, BITS, target_bits=4.25).as_dict() == {"q": "mxfp4", "down": "mxfp4"}
    assert search({"x": {"fp8": 1.0}}, {"x": 3}, BITS, max_loss=1.0).as_dict() == {"x": "fp8"}


def test_deterministic_and_a_value():
    rng = np.random.default_rng(7)
    sens, weights = _instance(rng, 30)
    a = search(sens, weights, BITS, target_bits=5.0)
    b = search(dict(sens), dict(weights), dict(BITS), target_bits=5.0)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.average_bits = 1.0


def test_per_layer_bits_from_the_spec():
    # bits per weight from QuantSpec.bits_per_element: MXFP4 4.25; fp8 per tensor 8 + 32/numel
    mx = qcore.make_spec("mxfp4", axis=1)
    fp8 = qcore.make_spec("float8_e4m3fn")
    shapes = {"a": (64, 32), "b": (32, 64), "c": (4, 64)}
    bits = {k: {"mxfp4": mx.bits_per_element(s), "fp8": fp8.bits_per_element(s)} for k, s in shapes.items()}
    assert bits["c"]["mxfp4"] == 4.25 and bits["c"]["fp8"] == 8 + 32 / 256
    assert mx.bits_per_element((4, 16)) == 4.5  # a short row: one padded block of 32 scales 16 elements
    sens = {"a": {"mxfp4": 1.0, "fp8": 0.0}, "b": {"mxfp4": 5.0, "fp8": 0.0}, "c": {"mxfp4": 0.1, "fp8": 0.0}}
    weights = {k: s[0] * s[1] for k, s in shapes.items()}
    r = search(sens, weights, bits, target_bits=6.1)  # b in fp8 (6.02 average) fits, c too (6.25) does not
    assert r.as_dict() == {"a": "mxfp4", "b": "fp8", "c": "mxfp4"}


def test_errors_name_the_argument():
    sens = {"a": {"mxfp4": 1.0, "fp8": 0.0}}
    w = {"a": 10}
    with pytest.raises(ValueError, match="exactly one of target_bits and max_loss"):
        search(sens, w, BITS)
    with pytest.raises(ValueError, match="exactly one of target_bits and max_loss"):
        search(sens, w, BITS, target_bits=5, max_loss=1)
    with pytest.raises(ValueError, match=r"target_bits: got 4\.0; expected at least 4\.25"):
        search(sens, w, BITS, target_bits=4.0)
    with pytest.raises(ValueError, match="max_loss: got -1; expected at least 0"):
        search(sens, w, BITS, max_loss=-1)
    with pytest.raises(ValueError, match="target_bits: got nan"):
        search(sens, w, BITS, target_bits=float("nan"))
    with pytest.raises(ValueError, match="weights"):
        search(sens, {"b": 10}, BITS, target_bits=5)
    with pytest.raises(ValueError, match=r"weights\['a'\]: got 0; expected a positive int"):
        search(sens, {"a": 0}, BITS, target_bits=5)
    with pytest.raises(ValueError, match="an entry for scheme 'int3'"):
        search({"a": {"int3": 1.0}}, w, BITS, target_bits=5)
    with pytest.raises(ValueError, match=r"sensitivity\['a'\]\['fp8'\]: got inf"):
        search({"a": {"fp8": math.inf}}, w, BITS, target_bits=9)
    with pytest.raises(ValueError, match="sensitivity"):
        search({}, {}, BITS, target_bits=5)
    with pytest.raises(ValueError, match=r"sensitivity\['a'\]"):
        search({"a": {}}, w, BITS, target_bits=5)
    with pytest.raises(ValueError, match=r"bits\['fp8'\]: got -8"):
        search(sens, w, {"mxfp4": 4.25, "fp8": -8}, target_bits=5)
    with pytest.raises(ValueError, match="resolution"):
        search(sens, w, BITS, target_bits=5, resolution=0)
    with pytest.raises(TypeError, match="target_bits must be a number"):
        search(sens, w, BITS, target_bits="5")
    with pytest.raises(ValueError, match="not a mix"):
        search(sens, w, {"a": {"mxfp4": 4.25}, "fp8": 8}, target_bits=5)
