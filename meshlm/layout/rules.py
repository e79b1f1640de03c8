"""Layouts: YAML files that map logical axes to mesh axes.

A layout has up to four sections, each a mapping ``logical axis -> mesh axis | [mesh axes]``:

``params``     where parameters live between steps (storage).
``compute``    activations, and parameters while in use (gathered at use, ZeRO-3 style,
               when it differs from ``params``).
``grads``      where gradients are reduced to in backward (default: ``params``), or the
               string ``local``: each rank keeps its own unreduced gradient and they are
               reduced once, at the optimizer step, straight into ``optimizer`` storage
               (ZeRO-1).
``optimizer``  where the optimizer state and the update live (default: ``grads``, or
               ``params`` when grads are local).

and, apart from these, a ``scopes`` section: other rules for some submodules (NOTE [scoped
layouts] in meshlm/core/scopes.py), and an ``offload`` section: which memory tier (``device``, ``host``,
``disk``) each kind of training state lives on (NOTE [offload tiers] in
meshlm/runtime/offload/__init__.py); the run's ``offload.*`` settings override it.

Mesh axes that the mesh lacks or that have size 1 drop out, so one layout serves 1..N
devices.  ``resolve`` is pure Python: strings in, strings out.

NOTE [shard order]
    A list of mesh axes shards one dim over several mesh axes, outer -> inner, and must
    follow the canonical mesh order (``dp, fsdp, tp, cp, pp, ep``): ``batch: [dp, fsdp]``
    puts rank (dp=i, fsdp=j) on row block ``i * fsdp + j``.  That is DTensor's default
    order for several Shard placements on one dim, so lowering needs no strided shards.
    A list in another order is rejected with the fix.

NOTE [sequence yields]
    ``seq`` and ``kv_seq`` yield: when an activation has a sequence dim and another dim
    that map to the same mesh axis (``seq: tp`` and ``heads: tp`` in Megatron sequence
    parallel), the other dim takes the axis and the sequence is gathered there.  That is
    exactly Megatron-SP (sequence-sharded between blocks, head/mlp-sharded inside).  In the
    same way ``batch`` yields to ``experts``: a mixture of experts' token buffer ``(batch,
    experts, capacity, embed)`` under ``batch: [fsdp, ep]`` and ``experts: ep`` keeps its
    rows split over fsdp and its experts over ep, so constraining the buffer to it and back
    is expert parallelism's all-to-all (NOTE [moe routing] in meshlm/core/moe.py).  Any
    other double use of a mesh axis in one tensor is an error.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

import yaml

from meshlm.core.axes import MESH_AXES, Axes, check_logical, check_mesh
from meshlm.core.errors import AxisError, LayoutError
from meshlm.core.scopes import SECTION as SCOPES  # rules per submodule
from meshlm.core.scopes import Scope, check_overlap, scope_of

SECTIONS = ("params", "compute", "grads", "optimizer")
OFFLOAD = "offload"  # the memory-tier section (meshlm/layout/offload.py), not axis rules
CONTEXT = "context"  # how attention runs over cp (meshlm/layout/context.py), not axis rules
YIELDING_AXES = ("seq", "kv_seq")
#: ``batch`` yields a mesh axis to these only (NOTE [sequence yields]).
BATCH_YIELDS_TO = ("experts",)
#: Mesh axes that split the *input* token ids.  Ranks that differ only in other mesh axes
#: (tp, pp, ep) read the same examples: tensor parallel needs every token id of its batch.
INPUT_MESH_AXES = ("dp", "fsdp", "cp")

Rules = Mapping[str, tuple[str, ...]]
#: Per tensor dim, the mesh axes it is sharded over (outer -> inner); () = replicated.
DimPlan = tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Layout:
    """A parsed layout.  ``grads`` is None for "same as params" or the string "local"."""

    name: str
    source: str
    params: dict[str, tuple[str, ...]]
    compute: dict[str, tuple[str, ...]]
    grads: "dict[str, tuple[str, ...]] | str | None" = None
    optimizer: "dict[str, tuple[str, ...]] | None" = None
    description: str = ""
    #: the ``offload`` section (a meshlm.runtime.offload.OffloadSpec; None: every state on the device)
    offload: Any = None
    #: the ``scopes`` section: meshlm.core.scopes.Scope per submodule path (NOTE [scoped layouts])
    scopes: tuple = ()
    #: the ``context`` section: a meshlm.layout.context.ContextSpec (ring or allgather, balanced)
    context: Any = None

    def for_path(self, fqn: str) -> "Layout":
        """The rules for the parameter or module ``fqn``: its scope's, else these."""
        sc = scope_of(self, fqn)
        return self if sc is None else sc.layout

    def all_layouts(self) -> "list[Layout]":
        """This layout's top-level rules and each scope's (NOTE [scoped layouts])."""
        return [self, *(s.layout for s in self.scopes)]

    @property
    def grad_rules(self) -> "Rules | str":
        return self.params if self.grads is None else self.grads

    @property
    def optimizer_rules(self) -> Rules:
        if self.optimizer is not None:
            return self.optimizer
        return self.params if self.grads in (None, "local") else self.grads  # type: ignore[return-value]

    def rules(self, section: str) -> "Rules | str":
        return {
            "params": self.params,
            "compute": self.compute,
            "grads": self.grad_rules,
            "optimizer": self.optimizer_rules,
        }[section]

    def mesh_axes_used(self) -> set[str]:
        out: set[str] = set()
        for sec in (self.params, self.compute, self.optimizer_rules):
            for v in sec.values():
                out.update(v)
        if isinstance(self.grads, dict):
            for v in self.grads.values():
                out.update(v)
        for s in self.scopes:
            out |= s.layout.mesh_axes_used()
        return out


def is_pipelined(layout: Layout) -> bool:
    """Whether ``layout`` cuts the stack of blocks into pipeline stages over pp
    (``layers: pp``; meshlm/runtime/pipeline/, NOTE [pipelined step] in meshlm/runtime/pipeline/pipe.py)."""
    return "pp" in layout.params.get("layers", ()) or "pp" in layout.compute.get("layers", ())


def layout_axes(layout: Layout) -> set[str]:
    """Every logical axis ``layout`` maps, in any section (of any scope)."""
    return {
        k
        for lay in layout.all_layouts()
        for sec in SECTIONS
        for k in (lay.rules(sec) if isinstance(lay.rules(sec), Mapping) else ())
    }


def layout_dirs() -> list[Path]:
    """Where ``load_layout(name)`` looks: $MESHLM_LAYOUTS, then the shipped layouts (an
    installed meshlm's ``meshlm/layouts``, else a checkout's ``layouts/``)."""
    dirs = [Path(p) for p in os.environ.get("MESHLM_LAYOUTS", "").split(os.pathsep) if p]
    here = Path(__file__).resolve().parents[1]  # the meshlm package
    dirs += [here / "layouts", here.parent / "layouts"]
    return dirs


def shipped_layouts() -> list[str]:
    names: set[str] = set()
    for d in layout_dirs():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def load_layout(name_or_path: "str | os.PathLike | Layout") -> Layout:
    """Load ``layouts/<name>.yaml`` (or a path to a YAML file) and validate it."""
    if isinstance(name_or_path, Layout):
        return name_or_path
    s = str(name_or_path)
    path = Path(s)
    if not (s.endswith((".yaml", ".yml")) or os.sep in s) or not path.exists():
        for d in layout_dirs():
            cand = d / f"{s}.yaml"
            if cand.exists():
                path = cand
                break
        else:
            if s.endswith((".yaml", ".yml")) or os.sep in s:
                raise LayoutError(f"layout file {s} does not exist")
            raise LayoutError(
                f"unknown layout {s!r}. Shipped layouts: {', '.join(shipped_layouts())}. "
                "Pass one of those names or a path to a YAML file."
            )
    try:
        text = path.read_text()
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise LayoutError(f"layout file {path} is not valid YAML: {e}".replace("\n", " ")) from None
    if data is None:  # an empty file (or one being rewritten) is never "replicate everything" by accident
        raise LayoutError(
            f"layout file {path} is empty (no sections); a layout is a mapping with sections "
            f"{', '.join(SECTIONS)}; write `params: {{}}` for one that keeps every tensor whole"
        )
    desc = "\n".join(ln[1:].strip() for ln in text.splitlines() if ln.startswith("#")).strip()
    return parse_layout(data, name=path.stem, source=str(path), description=desc)


def parse_layout(data: object, name: str = "<dict>", source: str = "<dict>", description: str = "") -> Layout:
    """Validate a layout given as a dict (the parsed YAML)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise LayoutError(
            f"{source}: a layout is a mapping with sections {', '.join(SECTIONS)}; got {type(data).__name__}"
        )
    unknown = set(data) - set(SECTIONS) - {OFFLOAD, SCOPES, CONTEXT}
    if unknown:
        raise LayoutError(
            f"{source}: unknown section(s) {sorted(unknown)}; a layout has the sections "
            f"{', '.join(SECTIONS)} (params and compute are the usual two), {SCOPES}, {OFFLOAD} and {CONTEXT}"
        )
    from meshlm.layout.context import parse_context

    context = parse_context(data.get(CONTEXT), f"{source}: {CONTEXT}", LayoutError)
    offload = None
    if data.get(OFFLOAD) is not None:
        from meshlm.layout.offload import parse_offload

        offload = parse_offload(data[OFFLOAD], f"{source}: {OFFLOAD}", LayoutError)
    secs: dict[str, object] = {}
    for sec in SECTIONS:
        raw = data.get(sec)
        if sec == "grads" and raw == "local":
            secs[sec] = "local"
            continue
        if raw is None:
            secs[sec] = None if sec in ("grads", "optimizer") else {}
            continue
        if not isinstance(raw, dict):
            hint = " (or the string 'local')" if sec == "grads" else ""
            raise LayoutError(f"{source}: section '{sec}' must map logical axes to mesh axes{hint}; got {raw!r}")
        rules: dict[str, tuple[str, ...]] = {}
        for key, val in raw.items():
            where = f"{source}: {sec}.{key}"
            # Any name: a model may declare its own axes; the names are checked against the
            # model's vocabulary when the layout meets it (NOTE [open vocabulary] in axes.py).
            if not isinstance(key, str) or not key.isidentifier():
                raise AxisError(f"{where}: {key!r} is not a logical axis name (an identifier such as 'embed')")
            axes = (
                (val,)
                if isinstance(val, str)
                else tuple(val)
                if isinstance(val, (list, tuple))
                else (val,)
                if val
                else ()
            )
            if not all(isinstance(a, str) for a in axes):
                raise LayoutError(f"{where}: expected a mesh axis or a list of mesh axes, got {val!r}")
            for a in axes:
                check_mesh(a, where)
            if len(set(axes)) != len(axes):
                raise LayoutError(f"{where}: mesh axis listed twice in {list(axes)}")
            canon = tuple(a for a in MESH_AXES if a in axes)
            if canon != axes:
                raise LayoutError(
                    f"{where}: mesh axes {list(axes)} are not in canonical outer -> inner order; "
                    f"write {list(canon)} (see NOTE [shard order] in meshlm/layout/rules.py)"
                )
            rules[str(key)] = axes
        secs[sec] = rules
    top = Layout(
        name=name,
        source=source,
        params=secs["params"],  # type: ignore[arg-type]
        compute=secs["compute"],  # type: ignore[arg-type]
        grads=secs["grads"],  # type: ignore[arg-type]
        optimizer=secs["optimizer"],  # type: ignore[arg-type]
        description=description,
        offload=offload,
        context=context,
    )
    if data.get(SCOPES) is None:
        return top
    return dataclasses.replace(top, scopes=parse_scopes(data[SCOPES], top, source))


def resolve(
    axes: Axes,
    rules: Rules,
    mesh: Mapping[str, int],
    *,
    shape: Sequence[int] | None = None,
    what: str = "tensor",
    section: str = "compute",
    layout: Layout | None = None,
    allow_mesh: Sequence[str] | None = None,
    known: Collection[str] | None = None,
) -> DimPlan:
    """Mesh axes per dim for a tensor with logical ``axes`` under ``rules``.

    ``mesh`` maps mesh axis -> size; axes absent from it or of size 1 drop out.
    ``shape`` (optional) is checked for divisibility.  ``what`` names the tensor in errors.
    ``known``: the logical axes allowed besides the standard ones (a model's vocabulary,
    NOTE [open vocabulary] in axes.py); default: the axes the layout (or ``rules``) maps.
    """
    src = layout.source if layout is not None else "layout"
    if known is None:
        known = set(rules) | (layout_axes(layout) if layout is not None else set())
    for a in axes:
        if a is not None:
            check_logical(a, f"{what}", known)
    want: list[tuple[str, ...]] = []
    for a in axes:
        m = rules.get(a, ()) if a is not None else ()
        m = tuple(x for x in m if mesh.get(x, 1) > 1 and (allow_mesh is None or x in allow_mesh))
        want.append(m)
    # NOTE [sequence yields]: a sequence dim gives up a mesh axis another dim also claims.
    for i, a in enumerate(axes):
        if a in YIELDING_AXES and want[i]:
            others = {x for j, w in enumerate(want) if j != i and axes[j] not in YIELDING_AXES for x in w}
            want[i] = tuple(x for x in want[i] if x not in others)
        if a == "batch" and want[i]:
            others = {x for j, w in enumerate(want) if axes[j] in BATCH_YIELDS_TO for x in w}
            want[i] = tuple(x for x in want[i] if x not in others)
    seen: dict[str, int] = {}
    for i, w in enumerate(want):
        for x in w:
            if x in seen:
                j = seen[x]
                raise LayoutError(
                    f"{what}: mesh axis {x!r} is used twice, by dim {j} ({axes[j]}) and dim {i} ({axes[i]}), "
                    f"under {src}: {section}.{axes[j]} and {section}.{axes[i]}. A mesh axis can shard one dim of "
                    "a tensor only: map one of these logical axes to another mesh axis or to nothing."
                )
            seen[x] = i
    if shape is not None:
        if len(shape) != len(axes):
            raise LayoutError(
                f"{what}: {len(axes)} logical axes {tuple(axes)} for a tensor of {len(shape)} dims {tuple(shape)}"
            )
        for i, w in enumerate(want):
            n = 1
            for x in w:
                n *= mesh[x]
            if n > 1 and shape[i] % n:
                sizes = " x ".join(f"{x} (size {mesh[x]})" for x in w)
                raise LayoutError(
                    f"{what} axis {axes[i]!r} (size {shape[i]}) is not divisible by mesh axis {sizes} "
                    f"in {src}: {section}.{axes[i]}. Use a mesh whose {'/'.join(w)} size divides {shape[i]}, "
                    f"or map {axes[i]!r} to another mesh axis (or to nothing) in that layout."
                )
    return tuple(want)


def parse_scopes(raw: object, top: Layout, source: str) -> tuple[Scope, ...]:
    """The ``scopes`` section of the layout ``top`` (parsed without it) from ``source``
    (NOTE [scoped layouts] in meshlm/core/scopes.py)."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise LayoutError(
            f"{source}: {SCOPES} maps submodule paths to a layout name or to inline sections "
            f"(e.g. `vision: fsdp`); got {raw!r}"
        )
    out: list[Scope] = []
    for path, val in raw.items():
        where = f"{source}: {SCOPES}.{path}"
        if not isinstance(path, str) or not all(p.isidentifier() or p.isdigit() for p in path.split(".")):
            raise LayoutError(f"{where}: {path!r} is not a submodule path (dotted names, e.g. `vision` or `model.vit`)")
        if isinstance(val, str):
            lay = load_layout(val)
            if lay.scopes:
                raise LayoutError(f"{where}: layout {val!r} has scopes of its own; a scope's layout cannot be scoped")
            inline: tuple = ()
        elif isinstance(val, Mapping):
            if SCOPES in val:
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
    check_overlap(out, source)
    return tuple(out)


def _section(layout: Layout, sec: str) -> object:
    v = getattr(layout, sec)
    return {k: list(a) for k, a in v.items()} if isinstance(v, Mapping) else v


def _check_whole_model(top: Layout, lay: Layout, where: str) -> None:
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
