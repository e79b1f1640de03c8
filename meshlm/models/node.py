"""The ``model`` config node: any callable that returns a ``torch.nn.Module``, named by ``_target_``.

NOTE [model node]
    ``model`` is a Hydra node instantiated by ``_target_`` (``hydra.utils.instantiate``, in
    :func:`meshlm.app.model_build.build_model`: the command builds it, and this module, which
    the library's data loaders read too, imports no Hydra)::

        _target_: meshlm.models.llama_model     # any importable callable returning an nn.Module
        name: llama_tiny                        # meshlm's own: the label in logs and summaries
        init_from: null                         # meshlm's own: Hugging Face weights to start from
        vocab: 256                              # everything else: keyword arguments of the target
        ...

    meshlm's own keys (``name``, ``init_from``) are not passed to the target.  The target is
    called with the node's other keys as keyword arguments plus ``device`` (``"meta"`` for
    training, planning and ``meshlm layout show``: the lowering materialises each rank's
    shard; then ``"cpu"`` under ``torch.manual_seed(train.seed)`` for a plain model whose
    modules lack ``init_weights``, NOTE [model build] in meshlm/app/model_plain.py), passed
    only if its signature takes ``device`` (or ``**kwargs``), and always
    inside ``with torch.device(device)``, so a model that creates its parameters without a
    device argument lands there too.  Nested nodes with their own ``_target_`` are
    instantiated first; other nested values arrive as plain dicts and lists.

    ``meshlm train model._target_=pkg.Model model.width=256`` needs no change to meshlm: a
    ``model.KEY=VALUE`` override adds the key when the node lacks it, and a ``_target_``
    given without a ``model=NAME`` group starts from the empty node ``conf/model/custom.yaml``
    (:func:`model_overrides`), so a shipped model's arguments do not leak into yours.  A
    target that cannot be imported, does not take a key, lacks a required one, or is given a
    value of another type than it declares (``model.embed=big`` for an ``int``; NOTE
    [argument types] in meshlm/core/arg_types.py) fails before any process starts with a
    ConfigError naming ``model.<key>``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from meshlm.core.arg_types import check_value, parameter_types
from meshlm.core.axes import closest
from meshlm.core.errors import ConfigError

if TYPE_CHECKING:  # torch loads where a loss is checked (meshlm.app.config imports this module, and stays light)
    from torch import Tensor

OWN_KEYS = ("_target_", "name", "init_from")  # meshlm's keys of the node, never passed to the target
LLAMA_TARGET = "meshlm.models.llama_model"
#: shipped targets that take their config dataclass's fields as ``**fields``, and the function
#: that checks those fields and builds the dataclass (no model): what check_args calls for them
SHIPPED_FIELDS = {
    LLAMA_TARGET: "meshlm.models.llama.llama_fields",
    "meshlm.models.gpt2_model": "meshlm.models.gpt2.gpt2_fields",
    "meshlm.models.vlm_model": "meshlm.models.vlm.vlm_fields",
}


@dataclass
class ModelConfig:
    """``model``: ``target`` (``_target_`` in YAML), meshlm's own keys, and ``args``, the
    target's keyword arguments (NOTE [model node])."""

    target: Optional[str] = LLAMA_TARGET
    name: Optional[str] = None  #: label in logs and summaries; None: the target's last dotted name
    init_from: Optional[str] = None  #: Hugging Face dir / safetensors to start from (meshlm.load_hf)
    args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any) -> ModelConfig:
        """From the node as Hydra composes it (``_target_``, ``name``, ``init_from`` and the
        target's keyword arguments)."""
        if data is None:  # no model section: the default (the shipped Llama's default fields)
            return cls()
        if not isinstance(data, dict):
            raise ConfigError(f"config section 'model' must be a mapping, got {data!r}")
        args = {k: v for k, v in data.items() if k not in OWN_KEYS}
        for key in ("_target_", "name", "init_from"):
            v = data.get(key)
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"model.{key}={v!r} must be a string")
        return cls(
            target=data.get("_target_") or None, name=data.get("name"), init_from=data.get("init_from"), args=args
        )

    def to_dict(self) -> dict[str, Any]:
        """The node in its YAML form: ``from_dict(to_dict())`` gives it back."""
        return {"_target_": self.target, "name": self.name, "init_from": self.init_from, **self.args}

    @property
    def label(self) -> str:
        """What logs and summaries call the model."""
        if self.init_from:
            return self.init_from
        return self.name or (self.target or "model").rsplit(".", 1)[-1]

    def is_llama(self) -> bool:
        return self.target == LLAMA_TARGET

    def llama(self):
        """The :class:`meshlm.models.LlamaConfig` of a node whose target is the shipped Llama."""
        from meshlm.models.llama import llama_fields

        if not self.is_llama():
            raise ConfigError(
                f"model._target_={self.target}: this command plans the shipped Llama ({LLAMA_TARGET}) only"
            )
        return llama_fields(**self.args)


def locate(cfg: ModelConfig) -> Callable[..., Any]:
    """The target callable; ConfigError naming ``model._target_`` if it is unset, cannot be
    imported or is not callable."""
    if not cfg.target:
        raise ConfigError(
            "model._target_ is not set: pick a shipped model (model=llama_tiny) or name the callable "
            "that builds yours (model._target_=mypkg.MyModel)"
        )
    fn = import_object(cfg.target)
    if not callable(fn):
        raise ConfigError(
            f"model._target_={cfg.target} is a {type(fn).__name__}, not a callable that returns a torch.nn.Module"
        )
    return fn


def import_object(path: str, key: str = "model._target_") -> Any:
    """The object at dotted ``path``: its longest importable module prefix, then attributes
    (errors name ``key``)."""
    import importlib

    how = "check the dotted path and that its package is importable (on PYTHONPATH)"
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        try:
            obj = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name == mod or (e.name and mod.startswith(e.name + ".")):
                continue  # this prefix is no module: try a shorter one
            raise ConfigError(f"{key}={path}: importing {mod} failed ({e})") from e
        for a in parts[i:]:
            if not hasattr(obj, a):
                raise ConfigError(
                    f"{key}={path} cannot be imported: {getattr(obj, '__name__', mod)} has no attribute {a!r}; {how}"
                )
            obj = getattr(obj, a)
        return obj
    raise ConfigError(f"{key}={path} cannot be imported: no module named {parts[0]!r}; {how}")


def takes_device(sig: Optional[inspect.Signature]) -> bool:
    """Whether a target of signature ``sig`` is passed ``device`` (NOTE [model node])."""
    if sig is None:
        return False
    return "device" in sig.parameters or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def target_signature(fn: Callable) -> Optional[inspect.Signature]:
    """``fn``'s signature, or None where it has none."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C types have none
        return None


def check_args(cfg: ModelConfig) -> None:
    """The target exists, its signature takes the node's keys and each value is of the type
    the target declares (NOTE [argument types] in meshlm/core/arg_types.py): a typo, a missing
    required argument or a value of the wrong type fails naming ``model.<key>`` (before any
    process starts)."""
    fn = locate(cfg)
    if "device" in cfg.args:
        raise ConfigError(
            f"model.device={cfg.args['device']!r}: meshlm passes the device itself (meta, then each "
            "rank's shards on train.device); drop model.device"
        )
    sig = target_signature(fn)
    if sig is None:
        return
    params = sig.parameters
    takes = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "device"]
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for k in cfg.args:
            if k not in params or params[k].kind not in (params[k].POSITIONAL_OR_KEYWORD, params[k].KEYWORD_ONLY):
                raise ConfigError(
                    f"model.{k}: {cfg.target} takes no argument {k!r}{closest(k, takes)}; it takes: "
                    f"{', '.join(takes) or 'none'}"
                )
    for n, p in params.items():
        if (
            p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.default is p.empty
            and n not in cfg.args
            and n != "device"
        ):
            raise ConfigError(f"model.{n} is required by {cfg.target}: set model.{n}=VALUE")
    # NOTE [argument types] in meshlm/core/arg_types.py: each value against what the target declares for it
    declared = parameter_types(fn, sig)
    for k, v in cfg.args.items():
        if k in declared:
            check_value(f"model.{k}", v, *declared[k], owner=cfg.target or "")
    if cfg.target in SHIPPED_FIELDS:  # a shipped model's **fields: its config dataclass checks them
        import importlib

        module, name = SHIPPED_FIELDS[cfg.target].rsplit(".", 1)
        getattr(importlib.import_module(module), name)(**cfg.args)


def loss_of(out: Any, cfg: ModelConfig) -> Tensor:
    """The scalar loss in what ``model(tokens, targets)`` returned: the output itself, or its
    ``"loss"`` entry (a dict) or ``.loss`` attribute (Hugging Face's outputs).  Anything else
    is a ConfigError that says what the trainer needs."""
    import torch
    from torch import Tensor

    loss = out
    if isinstance(out, dict):
        loss = out.get("loss")
    elif not isinstance(out, Tensor) and hasattr(out, "loss"):
        loss = out.loss
    if not isinstance(loss, Tensor) or loss.ndim != 0 or not loss.is_floating_point():
        if isinstance(loss, Tensor):
            what = f"a tensor of shape {tuple(loss.shape)}" if loss.ndim else f"a {loss.dtype} scalar"
        elif isinstance(out, dict):
            what = "a dict without a 'loss' entry" if loss is None else f"a 'loss' that is a {type(loss).__name__}"
        else:
            what = f"a {type(out).__name__}"
        raise ConfigError(
            f"model {cfg.label}: forward(tokens, targets) returned {what}; meshlm train needs the "
            "scalar loss to minimise: a 0-d floating tensor, or a dict with a 'loss' entry"
        )
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise ConfigError(
            f"model {cfg.label}: the loss forward(tokens, targets) returned does not depend on any "
            "trainable parameter (requires_grad is False); compute it from the model's parameters"
        )
    return loss


def model_overrides(overrides: "list[str]") -> list[str]:
    """Command-line overrides rewritten for an open ``model`` node (NOTE [model node]):
    ``model.KEY=VALUE`` becomes ``++model.KEY=VALUE`` (set, or add when the node lacks the
    key), and a ``model._target_`` without a ``model=NAME`` group selects ``model=custom``."""
    out = []
    for o in overrides:
        key, eq, _ = o.partition("=")
        out.append(f"++{o}" if eq and key.startswith("model.") else o)
    group = any(o.split("=", 1)[0].lstrip("+~") == "model" for o in overrides)
    target = any(o.split("=", 1)[0].lstrip("+~") == "model._target_" for o in overrides)
    if target and not group:
        out.append("model=custom")
    return out
