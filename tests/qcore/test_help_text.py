"""``qcore.cast`` and ``qcore.quantize`` are the functions (they shadow their modules in the ``qcore``
namespace), so the semantics must be in the functions' docstrings for ``help()`` to show them."""

import pydoc

import qcore


def _help(obj) -> str:
    return " ".join(pydoc.render_doc(obj, renderer=pydoc.plaintext).split())  # one line, single spaces


def test_help_cast_shows_the_semantics():
    assert callable(qcore.cast) and qcore.cast.__module__ == "qcore.cast"
    text = _help(qcore.cast)
    for phrase in ("subnormals included", "``saturate=True`` gives ``±max_finite``", "IEEE formats give ``±Inf``",
                   "FN/FNUZ formats give NaN", "FNUZ formats have no ``-0``", "(E8M0) give their smallest value",
                   "negative inputs (and ``-0``) give NaN", "NaN stays NaN", "ml_dtypes",
                   "float64 inputs are therefore rounded twice", "clamps to ``[min, max]``"):
        assert phrase in text, phrase
    assert "canonical NaN" in _help(qcore.encode)


def test_help_quantize_shows_the_semantics():
    text = _help(qcore.quantize)
    for phrase in ("Float elements saturate at ``±max_finite`` inside quantize",
                   "Power-of-two scales divide exactly", "clip(round(x / scale) + zero_point, qmin, qmax)",
                   "``code * 2**unit_exponent`` (MXINT8: code/64)", "``dequantize(quantize(x, spec))`` bit for bit",
                   "docs/numerics.md"):
        assert phrase in text, phrase


def test_help_by_dotted_name_reaches_the_same_text():
    # pydoc resolves "qcore.cast" through the package attribute, i.e. the function
    assert "NaN stays NaN" in " ".join(pydoc.render_doc("qcore.cast", renderer=pydoc.plaintext).split())
    assert "Power-of-two scales divide exactly" in " ".join(
        pydoc.render_doc("qcore.quantize", renderer=pydoc.plaintext).split())
