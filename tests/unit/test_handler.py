"""The constrain handler is a field of the run state (``meshlm.core.state.scope(handler=...)``,
NOTE [run state]): set for a block of code, restored after it, and seen by code that
torch.compile traces (which recompiles for another handler)."""

from __future__ import annotations

import torch

from meshlm import _torch_compat as compat
from meshlm.core import annotate
from meshlm.core.state import RUN, scope


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
    with scope(handler=outer):
        assert float(annotate.constrain(x, ("batch",))[0]) == 2.0
        with scope(handler=inner):
            assert float(annotate.constrain(x, ("embed",))[0]) == 3.0
        assert float(annotate.constrain(x, ("batch",))[0]) == 2.0
    assert annotate.constrain(x, ("batch",)) is x and annotate.active_handler() is None
    assert outer.seen == [("batch",), ("batch",)] and inner.seen == [("embed",)]


def test_handling_restores_after_an_error():
    try:
        with scope(handler=Tag(2.0)):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert annotate.active_handler() is None and RUN.handler is None


def test_compiled_code_sees_the_handler_and_recompiles_for_another():
    compat.dynamo_reset()

    def f(x):
        return annotate.constrain(x + 1, ("batch",))

    cf = torch.compile(f, backend="aot_eager", fullgraph=True)
    x = torch.zeros(2)
    assert cf(x).tolist() == [1.0, 1.0]
    with scope(handler=Tag(2.0)):
        assert cf(x).tolist() == [2.0, 2.0]
    with scope(handler=Tag(5.0)):
        assert cf(x).tolist() == [5.0, 5.0]
    assert cf(x).tolist() == [1.0, 1.0]


def test_compiled_code_enters_and_leaves_scopes():
    """A scope's module hooks swap the handler inside traced code (NOTE [scoped layouts]),
    and a block may enter a scope: traced, both give the eager values, and the run state
    is back as it was after the call."""
    compat.dynamo_reset()

    def f(x):
        saved = annotate.swap_handler(Tag(3.0))
        y = annotate.constrain(x + 1, ("batch",))
        annotate.restore_handler(saved)
        with scope(handler=Tag(7.0)):
            z = annotate.constrain(x, ("batch",))
        return y + z + annotate.constrain(x, ("batch",))

    x = torch.ones(2)
    want = f(x).tolist()
    assert want == [14.0, 14.0] and RUN.handler is None
    cf = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert cf(x).tolist() == want and RUN.handler is None
    with scope(handler=Tag(2.0)):
        assert cf(x).tolist() == [15.0, 15.0]
        assert float(RUN.handler.k) == 2.0
    assert RUN.handler is None
