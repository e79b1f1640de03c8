"""Parameter groups of a sharded model by rule: the parameters weight decay leaves alone.

NOTE [no-decay rules]
    ``optim.no_decay`` lists rules; a parameter any rule matches is stepped with
    ``weight_decay=0`` (norm weights and biases, by the usual recipe), the others with the
    optimizer's own.  A rule is either

    - ``axes:A,B``: the parameters whose logical axes are exactly ``(A, B)`` (``axes:embed``
      is every 1-D parameter along ``embed``: a Llama's norm weights; ``axes:mlp`` a bias
      over ``mlp``), the axes the model declares (``param_axes``), so the rule holds
      whatever the layout does to the tensor; or
    - a glob over the parameter's FQN (``*.bias``, ``*norm*``; ``fnmatch``).

    A rule that matches no parameter of the model is an error (a typo would otherwise
    leave every parameter decayed).  The groups go to ``ShardedOptimizer(param_groups=...)``
    (NOTE [parameter groups] in meshlm/runtime/optim/sharded.py).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

from meshlm.core.errors import ConfigError


def rule_matches(rule: str, fqn: str, axes: tuple) -> bool:
    """Whether ``rule`` (NOTE [no-decay rules]) picks the parameter ``fqn`` of logical ``axes``."""
    if rule.startswith("axes:"):
        want = tuple(a.strip() for a in rule[len("axes:") :].split(",") if a.strip())
        return tuple(axes) == want
    return fnmatch.fnmatchcase(fqn, rule)


def check_rules(rules: Sequence[str]) -> None:
    for r in rules:
        if not isinstance(r, str) or not r.strip() or r.strip() == "axes:":
            raise ConfigError(
                f"optim.no_decay: {r!r} is not a rule; write axes:AXIS[,AXIS] (a parameter's logical axes, "
                "e.g. axes:embed) or a glob over parameter names (e.g. '*.bias')"
            )


def no_decay_groups(model: nn.Module, rules: Sequence[str], *, check_unmatched: bool = True) -> list[dict]:
    """``ShardedOptimizer``'s ``param_groups`` for a sharded ``model``: one group, with
    ``weight_decay=0``, of the trainable parameters any of ``rules`` matches (NOTE [no-decay
    rules]); [] without rules.  ``check_unmatched``: a rule matching nothing is a
    ConfigError (off for a pipeline stage, which holds part of the model)."""
    from meshlm.runtime.lowering import shard_state

    rules = list(rules)
    check_rules(rules)
    if not rules:
        return []
    plans = shard_state(model).plans
    picked, used = [], set()
    for fqn, p in model.named_parameters():
        if not p.requires_grad or fqn not in plans:
            continue
        hits = {r for r in rules if rule_matches(r, fqn, plans[fqn].axes)}
        used |= hits
        if hits:
            picked.append(fqn)
    unused = [r for r in rules if r not in used]
    if unused and check_unmatched:
        sample = sorted({f"axes:{','.join(pl.axes)}" for pl in plans.values()})
        raise ConfigError(
            f"optim.no_decay: the rule {unused[0]!r} matches no parameter of the model; the parameters' logical "
            f"axes are {', '.join(sample)} (or write a glob over names, e.g. '*.bias')"
        )
    return [{"params": picked, "weight_decay": 0.0}] if picked else []
