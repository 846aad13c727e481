import pathlib
import sys

# tests/qcore holds independent reference implementations (e.g. quark_reference.py) imported by tests.
sys.path.insert(0, str(pathlib.Path(__file__).parent / "qcore"))
