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

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshlm.axes import Axes, closest, declared_axes
from meshlm.errors import LayoutError

if TYPE_CHECKING:
    from torch import nn

    from meshlm.layout import Layout

SECTION = "scopes"
#: Logical axes that only activations carry; an inline scope may map them in ``compute``.
ACTIVATION_AXES = ("batch", "seq", "kv_seq", "patch")


@dataclass(frozen=True)
class Scope:
    """One entry of a layout's ``scopes``: the submodule path and its complete rules."""

    path: str
    layout: "Layout"
    #: per section, the keys given inline (empty for a scope that names another layout)
    inline: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def covers(self, fqn: str) -> bool:
        """Whether the parameter or module ``fqn`` lies under this scope."""
        return fqn == self.path or fqn.startswith(self.path + ".")


def parse_scopes(raw: object, top: "Layout", source: str) -> tuple[Scope, ...]:
    """The ``scopes`` section of the layout ``top`` (parsed without it) from ``source``."""
    from meshlm.layout import SECTIONS, load_layout, parse_layout

    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise LayoutError(
            f"{source}: {SECTION} maps submodule paths to a layout name or to inline sections "
            f"(e.g. `vision: fsdp`); got {raw!r}"
        )
    out: list[Scope] = []
    for path, val in raw.items():
        where = f"{source}: {SECTION}.{path}"
        if not isinstance(path, str) or not all(p.isidentifier() or p.isdigit() for p in path.split(".")):
            raise LayoutError(f"{where}: {path!r} is not a submodule path (dotted names, e.g. `vision` or `model.vit`)")
        if isinstance(val, str):
            lay = load_layout(val)
            if lay.scopes:
                raise LayoutError(f"{where}: layout {val!r} has scopes of its own; a scope's layout cannot be scoped")
            inline: tuple = ()
        elif isinstance(val, Mapping):
            if SECTION in val:
                raise LayoutError(f"{where}: a scope cannot have scopes of its own")
            merged = {sec: _section(top, sec) for sec in SECTIONS}
            merged.update({sec: v for sec, v in val.items()})
            lay = parse_layout(merged, name=f"{top.name}[{path}]", source=where)
            inline = tuple((sec, tuple(v)) for sec, v in val.items() if isinstance(v, Mapping))
        else:
            raise LayoutError(f"{where}: expected a layout name or a mapping of sections, got {val!r}")
        if lay.offload is not None:
            raise LayoutError(
                f"{where}: offload is set for the whole model; move the offload section to the top level of "
                f"{source.split(':')[0]}"
            )
        _check_whole_model(top, lay, where)
        out.append(Scope(path, dataclasses.replace(lay, name=lay.name, description=""), inline))
    _check_overlap(out, source)
    return tuple(out)


def _section(layout: "Layout", sec: str) -> object:
    v = getattr(layout, sec)
    return {k: list(a) for k, a in v.items()} if isinstance(v, Mapping) else v


def _check_whole_model(top: "Layout", lay: "Layout", where: str) -> None:
    from meshlm.layout import is_pipelined

    if (top.grads == "local") != (lay.grads == "local"):
        raise LayoutError(
            f"{where}: `grads: local` (reduce gradients once, at the optimizer step) is "
            f"{'set' if lay.grads == 'local' else 'not set'} in this scope but "
            f"{'set' if top.grads == 'local' else 'not set'} at the top level; it is a whole-model choice: "
            "make both agree"
        )
    if is_pipelined(top) or is_pipelined(lay):
        raise LayoutError(
            f"{where}: `layers: pp` (pipeline stages) with scopes: a pipelined layout cannot have scopes yet "
            "(stages cut the whole model's stack of blocks); drop `layers: pp` or the scopes"
        )


def _check_overlap(scopes: list[Scope], source: str) -> None:
    for i, a in enumerate(scopes):
        for b in scopes[i + 1 :]:
            if a.covers(b.path) or b.covers(a.path):
                raise LayoutError(
                    f"{source}: scopes `{a.path}` and `{b.path}` overlap (one lies inside the other); a module "
                    "takes the rules of one scope only: drop one, or scope disjoint submodules"
                )


def scope_of(layout: "Layout", fqn: str) -> "Scope | None":
    """The scope ``fqn`` (a parameter or module path) lies under, or None (top level)."""
    for s in layout.scopes:
        if s.covers(fqn):
            return s
    return None


def check_scopes(model: "nn.Module", layout: "Layout", param_axes: "Mapping[str, Axes]") -> None:
    """Check ``layout``'s scopes against ``model``, whose parameters have the logical axes
    ``param_axes`` (FQN -> axes; NOTE [scoped layouts])."""
    if not layout.scopes:
        return
    from meshlm.annotate import is_block

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
