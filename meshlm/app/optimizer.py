"""The ``optim`` config node: any optimizer class, named by ``_target_``, stepped by
``ShardedOptimizer``; its parameter groups (``optim.no_decay``) and the implementation
keywords of ``train.optimizer_impl``.

NOTE [optim node]
    ``optim`` is an open node, as ``model`` is (NOTE [model node] in meshlm/models/node.py)::

        _target_: torch.optim.AdamW      # any torch.optim.Optimizer, or a class taking params first
        no_decay: [axes:embed, "*.bias"] # meshlm's own: weight decay 0 for these (NOTE [no-decay rules])
        betas: [0.9, 0.95]               # everything else: keyword arguments of the target
        weight_decay: 0.1

    The group ``optim=adamw|adam|sgd|adafactor`` picks a shipped node (conf/optim/); a
    ``_target_`` given without a group starts from the empty ``optim=custom``, so AdamW's
    betas do not reach an SGD.  The learning rate is the schedule's (``train.lr``,
    ``train.schedule``: NOTE [lr schedules] in meshlm/train/schedule.py), set on every
    group before each step, so ``optim.lr`` is refused.  A target that cannot be imported,
    is not a class taking the parameters first, does not take a key, or is given a value of
    another type than it declares fails before any process starts naming ``optim.<key>``.
    An optimizer torch does not list as elementwise (NOTE [local step] in
    meshlm/runtime/optim/sharded.py) steps each parameter whole (NOTE [whole-tensor step]).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Optional

from meshlm.core.errors import ConfigError

OWN_KEYS = ("_target_", "no_decay")  # meshlm's keys of the node, never passed to the target
DEFAULT_TARGET = "torch.optim.AdamW"


@dataclass
class OptimConfig:
    """``optim``: ``target`` (``_target_`` in YAML), ``no_decay`` rules and ``args``, the
    target's keyword arguments (NOTE [optim node])."""

    target: Optional[str] = DEFAULT_TARGET
    no_decay: list = field(default_factory=list)  #: rules: axes:AXIS[,AXIS] or a glob over names
    args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any) -> "OptimConfig":
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ConfigError(f"config section 'optim' must be a mapping, got {data!r}")
        target = data.get("_target_")
        if target is not None and not isinstance(target, str):
            raise ConfigError(f"optim._target_={target!r} must be a dotted class name, e.g. torch.optim.SGD")
        rules = data.get("no_decay") or []
        if isinstance(rules, str):
            rules = [rules]
        if not isinstance(rules, (list, tuple)):
            raise ConfigError(f"optim.no_decay={rules!r} must be a list of rules, e.g. [axes:embed,'*.bias']")
        return cls(target=target, no_decay=list(rules), args={k: v for k, v in data.items() if k not in OWN_KEYS})

    def to_dict(self) -> dict[str, Any]:
        return {"_target_": self.target, "no_decay": list(self.no_decay), **self.args}

    @property
    def label(self) -> str:
        return (self.target or "?").rsplit(".", 1)[-1]


def optimizer_class(cfg: OptimConfig) -> type:
    """The target class; ConfigError naming ``optim._target_``."""
    from meshlm.models.node import import_object

    if not cfg.target:
        raise ConfigError(
            "optim._target_ is not set: pick a shipped optimizer (optim=adamw, adam, sgd, adafactor) or name "
            "a class (optim._target_=torch.optim.SGD)"
        )
    cls = import_object(cfg.target, "optim._target_")
    if not inspect.isclass(cls):
        raise ConfigError(
            f"optim._target_={cfg.target} is a {type(cls).__name__}, not an optimizer class (a torch.optim.Optimizer, "
            "or a class whose first argument is the parameters)"
        )
    return cls


def check_optim(cfg: OptimConfig) -> None:
    """The target is a class taking the parameters first, and the node's keys are its
    arguments, of the types it declares (NOTE [optim node])."""
    from meshlm.core.arg_types import check_value, parameter_types
    from meshlm.core.axes import closest
    from meshlm.train.param_groups import check_rules

    check_rules(cfg.no_decay)
    cls = optimizer_class(cfg)
    if "lr" in cfg.args:
        raise ConfigError(
            f"optim.lr={cfg.args['lr']!r}: the learning rate is the schedule's; set train.lr (its peak), "
            "train.min_lr and train.schedule instead, and drop optim.lr"
        )
    if "params" in cfg.args:
        raise ConfigError("optim.params: meshlm passes the model's parameters itself; drop optim.params")
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return
    ps = list(sig.parameters.values())
    if not ps or ps[0].kind not in (ps[0].POSITIONAL_ONLY, ps[0].POSITIONAL_OR_KEYWORD):
        raise ConfigError(
            f"optim._target_={cfg.target}: its first argument must be the parameters (as torch.optim's are); "
            f"it takes ({', '.join(p.name for p in ps)})"
        )
    rest = {p.name: p for p in ps[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not any(p.kind is p.VAR_KEYWORD for p in ps):
        for k in cfg.args:
            if k not in rest:
                raise ConfigError(
                    f"optim.{k}: {cfg.target} takes no argument {k!r}{closest(k, list(rest))}; it takes: "
                    f"{', '.join(rest) or 'none'}"
                )
    for n, p in rest.items():
        if p.default is p.empty and n not in cfg.args and n != "lr":
            raise ConfigError(f"optim.{n} is required by {cfg.target}: set optim.{n}=VALUE")
    declared = parameter_types(cls, sig)
    for k, v in cfg.args.items():
        if k in declared:
            check_value(f"optim.{k}", v, *declared[k], owner=cfg.target or "")


def takes(cls: type, name: str) -> bool:
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def impl_kwargs(cfg: OptimConfig, t, offload, device) -> dict[str, Any]:
    """``train.optimizer_impl``'s keywords for the target: auto picks torch's fused AdamW
    where an offloaded step runs on the CPU (``meshlm.runtime.offload.runtime.adamw_impl``),
    for AdamW and Adam; a choice the target cannot take is a ConfigError."""
    import torch

    from meshlm.runtime.offload.runtime import adamw_impl

    cls = optimizer_class(cfg)
    if t.optimizer_impl == "auto":
        return adamw_impl(t, offload, device) if cls in (torch.optim.AdamW, torch.optim.Adam) else {}
    name = "fused" if t.optimizer_impl == "fused" else "foreach"
    kw = {name: t.optimizer_impl != "for_loop"}
    if not takes(cls, name):
        raise ConfigError(
            f"train.optimizer_impl={t.optimizer_impl}: {cfg.target} takes no {name!r} argument; "
            "set train.optimizer_impl=auto"
        )
    return kw


def optimizer_kwargs(cfg: OptimConfig, lr: float) -> dict[str, Any]:
    """The target's keyword arguments: the node's, YAML lists as tuples (``betas``), and the
    first step's learning rate where the target takes ``lr``."""
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.args.items()}
    if takes(optimizer_class(cfg), "lr"):
        kw["lr"] = lr
    return kw


def make_optimizer(cfg, model, *, lr: float, pipelined: bool = False, **sharded_kw):
    """``ShardedOptimizer`` over ``model`` for the run config ``cfg``: ``cfg.optim``'s class
    and arguments, its no-decay groups, at learning rate ``lr``."""
    from meshlm.runtime.optim.sharded import ShardedOptimizer
    from meshlm.train.param_groups import no_decay_groups

    o = cfg.optim
    groups = no_decay_groups(model, o.no_decay, check_unmatched=not pipelined) or None
    return ShardedOptimizer(model, optimizer_class(o), param_groups=groups, **optimizer_kwargs(o, lr), **sharded_kw)
