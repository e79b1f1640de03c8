"""What one side of a diff captured: every tensor of one training step, whole, in order.

A :class:`Record` is one tensor at one point of the step: its kind (``init``, ``block``,
``constrain``, ``loss``, ``norm``, ``grad``, ``param``), the module path and tensor name that
say where it is, its logical axes where the model declared them, how this side held it
(``placements``) and its full logical value on the CPU.  A :class:`Capture` is a side's
records in its execution order, and what the comparison needs to know about the side
(``meta``: its world size, compute dtype, optimizer and its hyperparameters, clipping).

Plain data, so that a side's worker processes can hand it back through a file
(``to_state``/``from_state``: dicts, lists, strings, numbers and tensors, which
``torch.load(weights_only=True)`` reads) or a pickle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch import Tensor

# The kinds of record, in the order their phases run in a step: the weights the step starts
# from, the forward (block outputs and constrained activations, interleaved as they run), the
# step's loss, the gradients the optimizer steps with (made in backward, reduced), the global
# gradient norm computed from them, and the parameters after the step.
KINDS = ("init", "block", "constrain", "loss", "grad", "norm", "param")
PHASE = {"init": 0, "block": 1, "constrain": 1, "loss": 2, "grad": 3, "norm": 4, "param": 5}


@dataclass
class Record:
    """One captured tensor (module docstring)."""

    kind: str
    module: str  # module path from the root ("" for the root itself)
    tensor: str  # "output", "constrain 2", a parameter's own name, "loss", "grad norm"
    axes: Optional[tuple]  # logical axes, one per dim (None: not declared)
    placements: str  # how this side held it, e.g. "fsdp:S(0) tp:R", "local rows (dp:S(0))", "whole"
    value: Tensor  # the full logical value, on the CPU

    @property
    def key(self) -> tuple[str, str, str]:
        """What identifies the same tensor on the other side."""
        return (self.kind, self.module, self.tensor)

    @property
    def where(self) -> str:
        """The parameter's FQN for init/grad/param records, else the module path."""
        if self.kind in ("init", "grad", "param"):
            return f"{self.module}.{self.tensor}" if self.module else self.tensor
        return self.module or "(root)"


@dataclass
class Capture:
    """A side's records in its execution order, and its ``meta`` (module docstring)."""

    records: list[Record] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def by_key(self) -> dict[tuple, Record]:
        return {r.key: r for r in self.records}

    def to_state(self) -> dict:
        return {
            "meta": dict(self.meta),
            "records": [
                {
                    "kind": r.kind,
                    "module": r.module,
                    "tensor": r.tensor,
                    "axes": None if r.axes is None else list(r.axes),
                    "placements": r.placements,
                    "value": r.value,
                }
                for r in self.records
            ],
        }

    @classmethod
    def from_state(cls, state: dict) -> "Capture":
        recs = [
            Record(
                d["kind"],
                d["module"],
                d["tensor"],
                None if d["axes"] is None else tuple(d["axes"]),
                d["placements"],
                d["value"],
            )
            for d in state["records"]
        ]
        return cls(recs, dict(state["meta"]))
