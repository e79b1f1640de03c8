"""The constrain handler is a context variable (``meshlm.core.annotate.handling``): set for a
block of code, restored after it, invisible to other threads, and seen by code that
torch.compile traces (which reads its mirror and recompiles for another handler)."""

from __future__ import annotations

import threading

import torch

from meshlm import _torch_compat as compat
from meshlm.core import annotate


class Tag:
    """A handler that records what it saw and marks its output."""

    def __init__(self, k: float):
        self.k, self.seen = k, []

    def __call__(self, x, axes):
        self.seen.append(tuple(axes))
        return x * self.k


def test_handling_sets_and_restores():
    x = torch.ones(2)
    outer, inner = Tag(2.0), Tag(3.0)
    assert annotate.constrain(x, ("batch",)) is x
    with annotate.handling(outer):
        assert float(annotate.constrain(x, ("batch",))[0]) == 2.0
        with annotate.handling(inner):
            assert float(annotate.constrain(x, ("embed",))[0]) == 3.0
        assert float(annotate.constrain(x, ("batch",))[0]) == 2.0
    assert annotate.constrain(x, ("batch",)) is x and annotate.active_handler() is None
    assert outer.seen == [("batch",), ("batch",)] and inner.seen == [("embed",)]


def test_handling_restores_after_an_error():
    try:
        with annotate.handling(Tag(2.0)):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert annotate.active_handler() is None and annotate._traced_handler is None


def test_another_thread_does_not_see_the_handler():
    got = []
    with annotate.handling(Tag(2.0)):
        t = threading.Thread(target=lambda: got.append(annotate.active_handler()))
        t.start()
        t.join()
        assert annotate.active_handler() is not None
    assert got == [None]


def test_compiled_code_sees_the_handler_and_recompiles_for_another():
    compat.dynamo_reset()

    def f(x):
        return annotate.constrain(x + 1, ("batch",))

    cf = torch.compile(f, backend="aot_eager", fullgraph=True)
    x = torch.zeros(2)
    assert cf(x).tolist() == [1.0, 1.0]
    with annotate.handling(Tag(2.0)):
        assert cf(x).tolist() == [2.0, 2.0]
    with annotate.handling(Tag(5.0)):
        assert cf(x).tolist() == [5.0, 5.0]
    assert cf(x).tolist() == [1.0, 1.0]
