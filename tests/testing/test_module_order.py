"""The order in which the suite's modules are handed to pytest-xdist's workers (tests/conftest.py)."""
from types import SimpleNamespace

from conftest import WEIGHT_MULTIRANK, WEIGHT_OTHER, WEIGHT_SLOW, heaviest_modules_first


def item(nodeid, *markers):
    return SimpleNamespace(nodeid=nodeid, keywords=dict.fromkeys(markers, True))


def test_heavier_modules_come_first_with_their_tests_together_and_in_order():
    assert WEIGHT_SLOW > WEIGHT_MULTIRANK > WEIGHT_OTHER > 0
    items = [item("a.py::quick_1"), item("a.py::quick_2"),
             item("b.py::run", "slow", "multirank"), item("b.py::Class::quick"),
             item("c.py::ranks", "multirank"), item("c.py::quick"),
             item("d.py::quick")]
    heaviest_modules_first(items)
    assert [i.nodeid for i in items] == ["b.py::run", "b.py::Class::quick", "c.py::ranks", "c.py::quick",
                                         "a.py::quick_1", "a.py::quick_2", "d.py::quick"]
