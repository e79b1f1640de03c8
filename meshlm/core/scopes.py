"""Scoped layouts: other rules for some submodules (a vision encoder, a projector).

NOTE [scoped layouts]
    A layout's ``scopes`` section maps submodule paths (as ``named_modules`` spells them:
    ``vision``, ``model.encoder``) to rules: the name of another layout (``vision: fsdp``)
    or an inline mapping of sections (``vision: {params: {embed: fsdp}}``).  An inline
    scope's sections replace the top-level sections of the same name, key by key nothing is
    merged; the sections it leaves out are the top level's.  Then:

    - a parameter under a scope's path (the path itself, or below it) is planned with the
      scope's ``params``, ``compute``, ``grads`` and ``optimizer`` rules; every other
      parameter with the top level's;
    - the scope module's forward runs under its own constraint handler, so each
      ``constrain`` inside it places the activation by the scope's ``compute`` rules;
      an activation that crosses a scope's edge is redistributed at the first
      ``constrain`` on the other side (under DTensor, the gradient crosses back the same
      way in backward);
    - the root's inputs and outputs follow the top level's rules.

    Whole-model settings stay whole-model: a scope cannot differ from the top level in
    ``grads: local`` (when gradients are reduced) or set ``offload``, and cannot have scopes
    of its own; a pipelined layout (``layers: pp``) cannot have scopes yet.  Checked when the layout meets the model
    (``check_scopes``): every path names a submodule; no scope lies inside another; a scope
    holds whole blocks (it is neither a block nor inside one, since a compiled block has one
    handler); an inline scope's ``params``/``grads``/``optimizer`` keys are logical axes of
    some parameter under the scope, and its ``compute`` keys those or activation axes
    (``batch``, ``seq``, ``kv_seq``, ``patch``) or axes the scope's modules declare.  A scope
    that names another layout may name axes its submodule lacks, as any layout may.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshlm.core.axes import Axes, closest, declared_axes
from meshlm.core.errors import LayoutError

if TYPE_CHECKING:
    from torch import nn

SECTION = "scopes"  # the section's name in a layout (parsed by meshlm/layout/rules.py: parse_scopes)
#: Logical axes that only activations carry; an inline scope may map them in ``compute``.
ACTIVATION_AXES = ("batch", "seq", "kv_seq", "patch")


@dataclass(frozen=True)
class Scope:
    """One entry of a layout's ``scopes``: the submodule path and its complete rules."""

    path: str
    layout: Any  # a meshlm.layout.rules.Layout without scopes
    #: per section, the keys given inline (empty for a scope that names another layout)
    inline: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def covers(self, fqn: str) -> bool:
        """Whether the parameter or module ``fqn`` lies under this scope."""
        return fqn == self.path or fqn.startswith(self.path + ".")


def check_overlap(scopes: "list[Scope]", source: str) -> None:
    for i, a in enumerate(scopes):
        for b in scopes[i + 1 :]:
            if a.covers(b.path) or b.covers(a.path):
                raise LayoutError(
                    f"{source}: scopes `{a.path}` and `{b.path}` overlap (one lies inside the other); a module "
                    "takes the rules of one scope only: drop one, or scope disjoint submodules"
                )


def scope_of(layout: Any, fqn: str) -> "Scope | None":
    """The scope ``fqn`` (a parameter or module path) lies under, or None (top level)."""
    for s in layout.scopes:
        if s.covers(fqn):
            return s
    return None


def check_scopes(model: "nn.Module", layout: Any, param_axes: "Mapping[str, Axes]") -> None:
    """Check ``layout``'s scopes against ``model``, whose parameters have the logical axes
    ``param_axes`` (FQN -> axes; NOTE [scoped layouts])."""
    if not layout.scopes:
        return
    from meshlm.core.annotate import is_block

    modules = dict(model.named_modules())
    blocks = [n for n, m in modules.items() if is_block(m)]
    for s in layout.scopes:
        where = f"{layout.source}: {SECTION}.{s.path}"
        if s.path not in modules:
            near = closest(s.path, [n for n in modules if n])
            tops = ", ".join(n for n in modules if n and "." not in n)
            raise LayoutError(
                f"{where}: no submodule `{s.path}` in model {type(model).__name__}{near}. Its top-level "
                f"submodules: {tops or 'none'}. A scope path is a name from model.named_modules()."
            )
        inside = [b for b in blocks if b == s.path or s.path.startswith(b + ".")]
        if inside:
            raise LayoutError(
                f"{where}: `{s.path}` is {'a block' if inside[0] == s.path else f'inside block `{inside[0]}`'}; "
                "a scope holds whole blocks: scope the module that contains them"
            )
        have = {a for fqn, axes in param_axes.items() if s.covers(fqn) for a in axes if a is not None}
        declared = {n for p, m in modules.items() if s.covers(p) for n in declared_axes(m)}
        for sec, keys in s.inline:
            allowed = have | (set(ACTIVATION_AXES) | declared if sec == "compute" else set())
            rules = s.layout.rules(sec)
            for k in keys:
                if k not in allowed and isinstance(rules, Mapping) and rules.get(k):
                    raise LayoutError(
                        f"{where}: {sec}.{k}: no parameter under `{s.path}` has logical axis {k!r}"
                        f"{closest(k, allowed)} (its parameters' axes: {', '.join(sorted(have)) or 'none'}). "
                        "Remove the rule, or fix the axis name."
                    )
