"""Shared fixtures of the pure-algorithm tests."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported: 2 shared cores

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def torch():
    t = pytest.importorskip("torch")
    before = t.get_num_threads()
    t.set_num_threads(1)
    yield t
    t.set_num_threads(before)
