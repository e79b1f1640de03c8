"""Sharding rules for CPU flash attention (part of the adapter in
``meshlm/_torch_compat/dtensor_ops.py``, installed by its ``install``; NOTE [private torch]
there): ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward have none in
torch 2.11-2.13.  Heads (dim 1) or batch (dim 0) sharded in, the same out, or all replicated.
An attention mask (decoding with a KV cache, NOTE [KV cache] in meshlm/infer/cache.py) is
sharded like the query where it has that dim, and replicated where it broadcasts (size 1).

The rules are in DTensor's sharding propagator only while an op on meshlm's meshes runs
(NOTE [scoped patches] in dtensor_scope.py): a rule registered for good would stand for
every mesh, where torch without it decomposes the op (2.13) or refuses it.  DTensor caches
an op's sharding by its arguments' meshes, which for meshlm's meshes are never equal to
another's, so a cached decision never crosses over."""

from __future__ import annotations

from torch.distributed.tensor import DTensor, Replicate, Shard

from meshlm._torch_compat.dtensor_base import aten
from meshlm._torch_compat.dtensor_base import default as _default

_ABSENT = object()


def _mask(attn_mask, d):
    if attn_mask is None:
        return []
    return [Shard(d) if d is not None and attn_mask.shape[d] > 1 else Replicate()]


def _fwd(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    out = []
    for d in (0, 1):  # batch or heads
        out.append(([Shard(d), Shard(d)], [Shard(d), Shard(d), Shard(d), None, None] + _mask(attn_mask, d)))
    r = Replicate()
    out.append(([r, r], [r, r, r, None, None] + _mask(attn_mask, None)))
    return out


def _bwd(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    res = []
    for d in (0, 1):
        s = Shard(d)
        res.append(([s, s, s], [s, s, s, s, s, s, None, None] + _mask(attn_mask, d)))
    r = Replicate()
    res.append(([r, r, r], [r, r, r, r, r, r, None, None] + _mask(attn_mask, None)))
    return res


def sdpa_cpu_rules() -> dict:
    """op -> the handler meshlm runs for it on its meshes (empty where torch has no CPU flash
    attention op): DTensor's own dispatch with meshlm's sharding rule in place."""
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if fwd is None:
        return {}
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward
    return {fwd.default: _scoped_rule(fwd.default, _fwd), bwd.default: _scoped_rule(bwd.default, _bwd)}


def _scoped_rule(op, rule):
    """The handler that puts ``rule`` (built by torch's ``register_sharding``, then taken
    back out of the propagator) in DTensor's propagator for one call of ``op``."""
    from torch.distributed.tensor.experimental import register_sharding

    prop = DTensor._op_dispatcher.sharding_propagator
    before = _take(prop, op)
    register_sharding(op)(rule)
    mine = _take(prop, op)
    _put(prop, op, before)

    def handler(op_call, args, kwargs):
        others = _take(prop, op)
        _put(prop, op, mine)
        try:
            return _default(op_call, args, kwargs)
        finally:
            _put(prop, op, others)

    return handler


def _take(prop, op) -> tuple:
    """The propagator's strategy and schema info for ``op`` (each maybe absent), removed."""
    return prop.op_strategy_funcs.pop(op, _ABSENT), prop.op_to_schema_info.pop(op, _ABSENT)


def _put(prop, op, entries: tuple) -> None:
    for table, entry in zip((prop.op_strategy_funcs, prop.op_to_schema_info), entries):
        table.pop(op, None)
        if entry is not _ABSENT:
            table[op] = entry
