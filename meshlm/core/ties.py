"""Each parameter's logical axes as the model declares them, tied parameters included.

NOTE [ties]
    torch ties weights by registering one Parameter object in two modules
    (``lm_head.weight = wte.weight``).  meshlm lowers such a parameter as one parameter:
    - it has one FQN, that of its first slot in ``named_modules()`` order (the name
      ``named_parameters()`` gives it), so one plan, one optimizer entry, one checkpoint
      entry; ``state_dict()`` keeps every slot's key, as torch does;
    - its logical axes are those of every slot that annotates it, which must agree; a slot
      that annotates nothing (a plain ``nn.Linear`` head) takes the others' (the axes
      describe the stored tensor, whoever uses it);
    - lowered, the first slot's attribute is the parameter's gather-at-use getter and every
      other slot's attribute reads through it, so both uses see one gathered tensor where
      the root or a block gathers it at entry, and autograd sums the uses' gradients
      before the reduction: the gradient is the sum of both uses, as on one device;
    - its slots are all outside blocks, or all inside one outer block: a block gathers its
      own parameters at its entry and frees them after, so a parameter shared between two
      blocks, or a block and the root, would be read where it is not gathered (an error
      that says so; share a module between blocks instead by calling it from both);
    - initialised from a seed, every slot's ``init_weights`` draws (so the generator stream
      does not depend on ties) and the first slot's draw is kept, on one device
      (``init_params``) as shard by shard.
    One *module* registered at several places (the same ``nn.Linear`` as ``blocks.0.up``
    and ``blocks.1.up``) is the other way to share weights, and it is exact too: its
    parameters are one Parameter each, named at their first path, and every block that
    holds the module gathers them at its entry and reduces their gradient at its exit into
    the one ``.grad``, so the gradient is the sum of both uses, as on one device
    (tests/dist/test_plain_models.py).  Under a pipeline layout the places may land on
    different stages, each with its own copy: ``shared_across_blocks`` raises an
    AnnotationError naming both paths there.
"""

from __future__ import annotations

from typing import Collection, Iterator

from torch import Tensor, nn

from meshlm.core.annotate import param_axes_of
from meshlm.core.axes import Axes, check_logical
from meshlm.core.errors import AnnotationError

#: (fqn, module, attribute name) of one place a parameter is registered.
Slot = tuple[str, nn.Module, str]


def slots(model: nn.Module) -> dict[int, list[Slot]]:
    """Every slot of every parameter (by ``id``), in ``named_modules()`` order."""
    out: dict[int, list[Slot]] = {}
    for mname, m in model.named_modules():
        for n, p in m._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((f"{mname}.{n}" if mname else n, m, n))
    return out


def tied(model: nn.Module) -> Iterator[tuple[list[Slot], Tensor]]:
    """(slots, parameter) of every parameter registered in more than one slot."""
    for ss in slots(model).values():
        if len(ss) > 1:
            yield ss, ss[0][1]._parameters[ss[0][2]]


def param_axes(ss: list[Slot], p: Tensor, known: Collection[str]) -> Axes:
    """The logical axes of the parameter ``p`` registered in slots ``ss`` (NOTE [ties]),
    each checked against the model's vocabulary ``known`` (NOTE [open vocabulary])."""
    fqn, m, name = ss[0]
    found = [(f, sm, n, tuple(param_axes_of(sm)[n])) for f, sm, n in ss if n in param_axes_of(sm)]
    if not found:
        raise AnnotationError(_unannotated(fqn, m, name, p, [f for f, _m, _n in ss[1:]]))
    f0, m0, n0, axes = found[0]
    for f, sm, n, ax in found[1:]:
        if ax != axes:
            raise AnnotationError(
                f"parameter `{fqn}` is tied: `{f0}` and `{f}` are one Parameter, but {type(m0).__name__} "
                f"declares {axes} for it and {type(sm).__name__} {ax}. A tied parameter is one tensor with one "
                f"set of logical axes: give both the same axes (e.g. meshlm.set_axes on one of the modules), or "
                f"untie them (NOTE [ties] in meshlm/core/ties.py)."
            )
    if len(axes) != p.ndim:
        raise AnnotationError(
            f"parameter `{fqn}` has {p.ndim} dims {tuple(p.shape)} but "
            f"{type(m0).__name__}.param_axes[{n0!r}] = {axes} names {len(axes)}: give one logical axis per dim."
        )
    for a in axes:
        if a is not None:
            check_logical(a, f"parameter `{fqn}` ({type(m0).__name__}.param_axes[{n0!r}] = {axes})", known)
    return axes


def _unannotated(fqn: str, m: nn.Module, name: str, p: Tensor, aliases: list[str]) -> str:
    cls = type(m).__name__
    path = fqn.rpartition(".")[0]
    where = f"model.get_submodule({path!r})" if path else "model"
    tie = f" (tied to {', '.join(f'`{a}`' for a in aliases)}, which declare none either)" if aliases else ""
    if type(m).__module__.startswith("torch."):
        from meshlm.core import nn as mnn

        alt = getattr(mnn, cls, None)
        use = f"build it as meshlm.nn.{cls} (which takes its axes as an argument), or " if alt is not None else ""
        how = (
            f"{use}annotate this instance: meshlm.set_axes({where}, {name}=(...)) with one logical axis "
            f"(or None) per dim as stored"
        )
        return (
            f"parameter `{fqn}` (shape {tuple(p.shape)}) has no logical axes{tie}: torch's {cls} declares "
            f"none. To shard it, {how}; meshlm never replicates an unannotated parameter silently."
        )
    return (
        f"parameter `{fqn}` (shape {tuple(p.shape)}) has no logical axes{tie}: {cls}.param_axes has no "
        f"entry {name!r}. Add `{name!r}: (...)` with one logical axis (or None) per dim to {cls}.param_axes, "
        f"or annotate this instance: meshlm.set_axes({where}, {name}=(...)); meshlm never replicates an "
        "unannotated parameter silently."
    )


def aliases(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(module, name, first module, its name) for every slot of a tied parameter but its
    first; raises unless each tied parameter's slots are all outside blocks or all in one
    outer block (NOTE [ties])."""
    from meshlm.core.annotate import outer_blocks

    names = {id(m): n for n, m in model.named_modules()}
    block_of: dict[int, str] = {}
    for b in outer_blocks(model):
        for sub in b.modules():
            block_of[id(sub)] = names[id(b)]
    out = []
    for ss, _p in tied(model):
        homes = {block_of.get(id(m)) for _f, m, _n in ss}
        if len(homes) > 1:
            where = ", ".join(
                f"`{f}` ({'in block ' + repr(block_of[id(m)]) if id(m) in block_of else 'outside blocks'})"
                for f, m, _n in ss
            )
            raise AnnotationError(
                f"parameter `{ss[0][0]}` is tied across blocks: {where}. A block gathers its own parameters at "
                "its entry, so meshlm ties parameters whose uses are all outside blocks (an embedding and the "
                "output head) or all inside one block. To share weights between blocks, share the module "
                "(call one module from both places) instead of one Parameter in two modules (NOTE [ties] in "
                "meshlm/core/ties.py)."
            )
        _f0, m0, n0 = ss[0]
        out += [(m, n, m0, n0) for _f, m, n in ss[1:]]
    return out


def shared_across_blocks(model: nn.Module, why: str) -> None:
    """Raise an AnnotationError naming both paths if a module holding parameters is
    registered in two outer blocks, or in a block and outside blocks (NOTE [ties]); ``why``:
    what cannot hold such a module."""
    from meshlm.core.annotate import outer_blocks

    blocks = {id(b) for b in outer_blocks(model)}
    places: dict[int, list[tuple[str, str]]] = {}  # module id -> (path, its outer block's path or "")
    for path, m in model.named_modules(remove_duplicate=False):
        if any(p is not None for p in m._parameters.values()):
            parts = path.split(".") if path else []
            pres = [".".join(parts[: i + 1]) for i in range(len(parts))]
            home = next((pre for pre in pres if id(model.get_submodule(pre)) in blocks), "")
            places.setdefault(id(m), []).append((path, home))
    for ps in places.values():
        for a, ha in ps[1:]:
            if ha != ps[0][1]:
                raise AnnotationError(
                    f"module `{ps[0][0]}` is also registered as `{a}` ({_where(ps[0][1])} and {_where(ha)}): "
                    f"{why}, so the two places would hold two copies of one weight. Give each place its own "
                    "module, or train under a layout without pp, where one module in two blocks is one weight "
                    "(NOTE [ties] in meshlm/core/ties.py)."
                )


def _where(home: str) -> str:
    return f"in block `{home}`" if home else "outside blocks"
