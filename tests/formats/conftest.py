"""Make ``qcore.formats`` this checkout's ``formats/`` folder when ``qcore`` itself was imported from this
checkout (``python -m pytest`` from the repository root) but the installed package maps ``qcore.formats``
elsewhere or nowhere (an editable install made from another checkout). Installed normally (``pip install -e .``
here), nothing changes."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bind_formats() -> None:
    import qcore

    if pathlib.Path(qcore.__file__).resolve().parent != ROOT / "qcore":
        return  # another qcore: leave the environment alone
    try:
        import qcore.formats as formats

        if pathlib.Path(formats.__file__).resolve().parent == ROOT / "formats":
            return
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location("qcore.formats", ROOT / "formats" / "__init__.py",
                                                  submodule_search_locations=[str(ROOT / "formats")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["qcore.formats"] = module
    spec.loader.exec_module(module)
    qcore.formats = module


_bind_formats()
