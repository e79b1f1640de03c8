"""Sharding rules for CPU flash attention (part of the adapter in
``meshlm/_torch_compat/dtensor_ops.py``, installed by its ``install``; NOTE [private torch]
there): ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward have none in
torch 2.11-2.13.  Heads (dim 1) or batch (dim 0) sharded in, the same out, or all replicated.
An attention mask (decoding with a KV cache, NOTE [KV cache] in meshlm/infer/cache.py) is
sharded like the query where it has that dim, and replicated where it broadcasts (size 1).
On a mesh that is not meshlm's the rule raises what DTensor raises for an op without one
(NOTE [scoped patches] in dtensor_scope.py)."""

from __future__ import annotations

import functools

from torch.distributed.tensor import Replicate, Shard

from meshlm._torch_compat.dtensor_base import aten
from meshlm._torch_compat.dtensor_scope import owns


# --------------------------------------------------------------------------- SDPA (CPU)
def _register_sdpa_cpu() -> None:
    from torch.distributed.tensor.experimental import register_sharding

    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if fwd is None:
        return

    def _mask(attn_mask, d):
        if attn_mask is None:
            return []
        return [Shard(d) if d is not None and attn_mask.shape[d] > 1 else Replicate()]

    @register_sharding(fwd.default)
    @_on_meshlm_meshes(fwd.default)
    def _fwd(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
        out = []
        for d in (0, 1):  # batch or heads
            out.append(([Shard(d), Shard(d)], [Shard(d), Shard(d), Shard(d), None, None] + _mask(attn_mask, d)))
        r = Replicate()
        out.append(([r, r], [r, r, r, None, None] + _mask(attn_mask, None)))
        return out

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    @_on_meshlm_meshes(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def _bwd(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
        res = []
        for d in (0, 1):
            s = Shard(d)
            res.append(([s, s, s], [s, s, s, s, s, s, None, None] + _mask(attn_mask, d)))
        r = Replicate()
        res.append(([r, r, r], [r, r, r, r, r, r, None, None] + _mask(attn_mask, None)))
        return res


def _on_meshlm_meshes(op):
    """A sharding rule that holds on meshlm's meshes only: elsewhere the NotImplementedError
    DTensor raises for an op it has no rule for (its first argument's spec names the mesh)."""

    def wrap_rule(rule):
        @functools.wraps(rule)
        def scoped(first, *args, **kwargs):
            if not owns(first.mesh):
                raise NotImplementedError(
                    f"{op}: DTensor has no sharding rule for it on mesh {first.mesh}; meshlm's rule covers the "
                    "meshes meshlm made or sharded onto (NOTE [scoped patches] in meshlm/_torch_compat/dtensor_scope.py)"
                )
            return rule(first, *args, **kwargs)

        return scoped

    return wrap_rule
