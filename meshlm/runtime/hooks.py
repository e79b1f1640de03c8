"""How meshlm attaches to a user's module, and detaches from it.

NOTE [attachments]
    meshlm changes a module in four ways, and only through this module:

    - its class (``swap_class``): a subclass made here (``derived_class``) that adds what
      the attachment needs (the lowering's parameter getters and block and root forwards,
      the ``__call__`` of an offloaded or staged block);
    - its own call (``wrap_call``, ``compile_call``): ``Module._compiled_call_impl``, which
      ``module(...)`` runs in place of ``Module._call_impl`` (a pipeline's block call, a
      block compiled in place);
    - forward hooks (``add_hooks``): a scoped layout's constraint handler, the pipeline
      cut's probe;
    - attributes in its ``__dict__`` (``set_attrs``): the lowering's per-module state, an
      offloaded block's swapper, a ``forward`` wrapped for activation checkpointing.

    Every change is journaled on the module it changed (``module.__dict__[JOURNAL]``), with
    what it replaced and who made it (its owner: ``LOWERING``, ``SCOPE``, ... below).  ``detach(module)`` undoes them
    all, newest first, so that the module is again exactly what it was: its class, its own
    call (or none), its hooks and its attributes; ``detach(module, owner)`` undoes one
    owner's.  A class, a call or an attribute changed again by a later attachment of
    another owner is undone from the top only: detaching the earlier owner alone is an
    error that names both.  ``detach_all(model)`` detaches every submodule.

    A journal does not cover a module's parameters and buffers: the lowering replaces
    the parameters by DTensors, and ``meshlm.unshard`` (meshlm/runtime/unshard.py) gathers
    them back into plain tensors before it detaches everything.

NOTE [sharded class names]
    A class made here is named by what was attached and the user's class: the lowering's
    ``ShardedLlamaBlock`` (parameters gathered at use, the block runtime, the sharded root),
    an offloaded block's ``OffloadedShardedLlamaBlock``, a block of staged decoding's
    ``StagedLlamaBlock``: each attachment adds its prefix once, newest first, so that a
    printed model says how it runs.  ``__module__`` is the user's class's, and so is
    ``__qualname__`` with the new name in its last part (``make.<locals>.ShardedMlp``).
    Such a class is not importable by that name, and a module changed by meshlm is not a
    module that can be rebuilt elsewhere (its parameters are shards on a process group):
    pickling or copying one raises a MeshlmError that says to ``meshlm.unshard`` it first.
    ``original_class`` is the user's class under any of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from torch import nn

from meshlm import _torch_compat as compat
from meshlm.core.errors import MeshlmError

JOURNAL = "_meshlm_journal"  # a module's list of Change, oldest first
MISSING = object()  # the value of an attribute the module did not have

# The owners: who attaches, and what with
LOWERING = "lowering"  # meshlm.shard: Sharded<...> classes, each module's lowering state, Absent parameters
SCOPE = "scope"  # a scoped layout's constraint handler: forward hooks
CHECKPOINTING = "checkpointing"  # activation checkpointing: a block's forward wrapped
COMPILE = "compile"  # compile_blocks: a block compiled in place (its call), or its body (an attribute)
PIPELINE = "pipeline"  # a pipeline stage's block calls; the Pipeline, on the root
PROBE = "probe"  # the pipeline cut's probe: forward hooks while it runs
OFFLOAD = "offload"  # offloaded parameters: Offloaded<...> blocks
STAGES = "stages"  # staged decoding: Staged<...> blocks


@dataclass(frozen=True, eq=False)
class Change:
    """One change to one module (NOTE [attachments])."""

    owner: str
    kind: str  # "class", "call", "hook" or "attr"
    name: str  # the attribute's name ("attr"); "" otherwise
    before: Any  # the class, the module's own call (None: it had none), the hook's handle, the attribute's value


# --------------------------------------------------------------------------- classes
# Derived classes by (base, prefix, key): immutable per-class things, shared by every
# instance of every model, so that torch.compile sees one type for every layer of a class.
_DERIVED: dict[tuple, type] = {}


def derived_class(base: type, prefix: str, attrs: dict[str, Any], key: Any = None) -> type:
    """A subclass of ``base`` with ``attrs``, named ``prefix`` + the user's class name (NOTE
    [sharded class names]); one per (base, prefix, key), ``key`` defaulting to ``attrs``
    (whose values must then be hashable)."""
    k = (base, prefix, tuple(sorted(attrs.items())) if key is None else key)
    cls = _DERIVED.get(k)
    if cls is None:
        user = original_class(base)
        had = base.__dict__.get("__meshlm_prefixes__", ())
        prefixes = had if prefix in had else (prefix, *had)
        name = "".join(prefixes) + user.__name__
        outer, dot, _ = user.__qualname__.rpartition(".")
        ns = {
            **attrs,
            "__module__": user.__module__,
            "__qualname__": f"{outer}{dot}{name}",
            "__meshlm_user__": user,
            "__meshlm_prefixes__": prefixes,
            "__reduce_ex__": _refuse_pickle,
        }
        cls = _DERIVED[k] = type(name, (base,), ns)
    return cls


def original_class(cls: type) -> type:
    """The user's class under any class made by ``derived_class`` (``cls`` itself otherwise)."""
    return cls.__dict__.get("__meshlm_user__", cls)


def _refuse_pickle(self, _protocol):
    raise MeshlmError(
        f"{type(self).__qualname__} is {original_class(type(self)).__qualname__} as meshlm runs it "
        f"({', '.join(owners(self)) or 'changed by meshlm'}): its class cannot be rebuilt elsewhere, so it is not "
        "pickled or copied. Call meshlm.unshard(model) first for the plain module with its full weights, or save "
        "the weights with meshlm's checkpoints (NOTE [sharded class names] in meshlm/runtime/hooks.py)"
    )


# --------------------------------------------------------------------------- attaching
def swap_class(m: nn.Module, owner: str, cls: type) -> None:
    """Make ``cls`` (a class from ``derived_class``) the class of ``m``."""
    _record(m, owner, "class", "", type(m))
    m.__class__ = cls


def wrap_call(m: nn.Module, owner: str, outer: Callable) -> None:
    """Make ``m(*args, **kwargs)`` call ``outer(inner, *args, **kwargs)``, ``inner`` being what
    it called so far, outside any compiled region (``compat.wrap_module_call``)."""
    _record(m, owner, "call", "", compat.own_call(m))
    compat.wrap_module_call(m, outer)


def compile_call(m: nn.Module, owner: str, wrap: Optional[Callable] = None, **compile_kwargs) -> None:
    """Compile ``m`` in place (``Module.compile``); ``wrap(compiled)``, if given, is called
    in place of the compiled call."""
    _record(m, owner, "call", "", compat.own_call(m))
    m.compile(**compile_kwargs)
    if wrap is not None:
        compat.set_own_call(m, wrap(compat.own_call(m)))


def add_hooks(
    m: nn.Module,
    owner: str,
    pre: Optional[Callable] = None,
    post: Optional[Callable] = None,
    *,
    with_kwargs: bool = False,
    always_call: bool = False,
) -> None:
    """A forward pre-hook and/or forward hook on ``m`` (``register_forward_pre_hook``,
    ``register_forward_hook``, with their ``with_kwargs`` and ``always_call``)."""
    if pre is not None:
        _record(m, owner, "hook", "", m.register_forward_pre_hook(pre, with_kwargs=with_kwargs))
    if post is not None:
        handle = m.register_forward_hook(post, with_kwargs=with_kwargs, always_call=always_call)
        _record(m, owner, "hook", "", handle)


def set_attrs(m: nn.Module, owner: str, **attrs: Any) -> None:
    """Set plain attributes of ``m`` (in its ``__dict__``, past any class property)."""
    for name, value in attrs.items():
        if name in m._parameters or name in m._buffers or name in m._modules:
            raise MeshlmError(
                f"internal error: meshlm ({owner}) would set attribute {name!r} of {type(m).__name__}, "
                "which is one of its parameters, buffers or submodules"
            )
        _record(m, owner, "attr", name, m.__dict__.get(name, MISSING))
        m.__dict__[name] = value


def _record(m: nn.Module, owner: str, kind: str, name: str, before: Any) -> None:
    m.__dict__.setdefault(JOURNAL, []).append(Change(owner, kind, name, before))


# --------------------------------------------------------------------------- detaching
def changes(m: nn.Module) -> list[Change]:
    """The changes attached to ``m``, oldest first."""
    return list(m.__dict__.get(JOURNAL, ()))


def owners(m: nn.Module) -> list[str]:
    """Who attached to ``m``, in the order they first did."""
    return list(dict.fromkeys(c.owner for c in changes(m)))


def attached(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every submodule of ``model`` (itself included) with an attachment."""
    return ((n, m) for n, m in model.named_modules() if JOURNAL in m.__dict__)


def detach(m: nn.Module, owner: Optional[str] = None) -> None:
    """Undo ``owner``'s changes to ``m`` (every owner's: None), newest first (NOTE
    [attachments])."""
    journal = m.__dict__.get(JOURNAL)
    if not journal:
        return
    undo = [i for i, c in enumerate(journal) if owner is None or c.owner == owner]
    for i in undo if owner is not None else ():
        c = journal[i]
        if c.kind == "hook":
            continue
        above = [d for d in journal[i + 1 :] if d.kind == c.kind and d.name == c.name and d.owner != owner]
        if above:
            what = f"attribute {c.name!r}" if c.kind == "attr" else f"its {c.kind}"
            raise MeshlmError(
                f"cannot detach {owner!r} from {type(m).__name__}: {what} was changed by {above[-1].owner!r} "
                f"after it; detach {above[-1].owner!r} first (or everything: meshlm.runtime.hooks.detach(module))"
            )
    for i in reversed(undo):
        _undo(m, journal.pop(i))
    if not journal:
        del m.__dict__[JOURNAL]


def detach_all(model: nn.Module, owner: Optional[str] = None) -> None:
    """``detach`` every submodule of ``model`` (itself included)."""
    for m in list(model.modules()):
        detach(m, owner)


def _undo(m: nn.Module, c: Change) -> None:
    if c.kind == "class":
        m.__class__ = c.before
    elif c.kind == "call":
        compat.set_own_call(m, c.before)
    elif c.kind == "hook":
        c.before.remove()
    elif c.before is MISSING:
        m.__dict__.pop(c.name, None)
    else:
        m.__dict__[c.name] = c.before
