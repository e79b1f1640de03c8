"""Optimizers over sharded parameters, with optimizer state where the layout says.

``ShardedOptimizer(model, torch.optim.AdamW, lr=...)`` wraps any torch optimizer.  When a
parameter's optimizer placements (and master dtype) equal its storage, the torch optimizer
updates the parameter in place.  Otherwise (ZeRO-1/2, or fp32 master weights under mixed
precision) it keeps a *master* copy in the optimizer placements: at the step the gradient is
reduced into them (a reduce-scatter for ZeRO-1's local gradients, nothing for ZeRO-2's), the
master is updated, and the parameter is refreshed from it (an all-gather for ZeRO-1/2).

NOTE [local step]
    The update of an elementwise optimizer (SGD, Adam, AdamW, ...) on a shard depends on
    that shard alone, so ``step`` runs the torch optimizer on each master's *local* tensor
    and state (aliases of the DTensors' storage), not through DTensor dispatch, which costs
    more than the arithmetic.  ``inner.state`` stays keyed by the DTensor masters with
    DTensor values (checkpoints see no difference).

NOTE [fused and views]
    torch's fused optimizers on the CPU (``AdamW(fused=True)``, torch 2.11-2.13) step a
    tensor that is not contiguous as if it were: they write outside the view and leave it
    wrong.  A ZeRO-1/2 master that is a view of the parameter's block along an inner dim
    (

    NOTE [optimizer chunks] in meshlm/runtime/optim/chunks.py: the chunks of the step's flat
    collectives, and masters that are views of the parameter.

NOTE [parameter groups]
    ``param_groups=[{"params": [fqn, ...], "weight_decay": 0.0}, ...]`` gives torch's
    parameter groups, each naming parameters by FQN (or the parameter objects), with the
    options that differ from the keyword arguments.  The groups hold the masters (the
    parameter itself where it is its own), so a group's options (its learning rate, weight
    decay) apply to the shards as to the whole tensor on one device.  A parameter no group
    names goes into a first group with the defaults.  ``meshlm.train.param_groups`` makes
    the groups of a no-weight-decay rule (``optim.no_decay``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from meshlm import _torch_compat as compat
from meshlm.runtime import main_grad, unused
from meshlm.runtime.bucket import redistribute_flat
from meshlm.runtime.lowering import iter_params, placements, shard_state
from meshlm.runtime.memory import where
from meshlm.runtime.optim.chunks import chunk_keys, shard_view


class ShardedOptimizer:
    """A torch optimizer on a sharded model; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        optim_cls: type = torch.optim.AdamW,
        master_dtype: Optional[torch.dtype] = None,
        *,
        bucket_mb: Optional[float] = None,
        offload: Any = None,
        offload_params: Any = None,
        offload_grads: Any = None,
        param_groups: Optional[list[dict]] = None,
        **kwargs: Any,
    ):
        if bucket_mb is not None and not bucket_mb > 0:
            raise ValueError(
                f"ShardedOptimizer(bucket_mb={bucket_mb}): must be a positive number of MiB, or None "
                "for one chunk per block"
            )
        st = shard_state(model)
        whole = optim_cls not in _ELEMENTWISE  # NOTE [whole-tensor step]
        self.model = model
        self.mesh = st.mesh
        # process groups beyond the mesh's that hold other parts of the model: a pipeline's
        # stages (meshlm/runtime/pipeline/), whose squared norms grad_norm adds up too
        self.norm_groups: list = []
        self._pairs: list[tuple[str, nn.Parameter, nn.Parameter]] = []
        masters, specs = [], []
        for fqn, _m, _n, p in iter_params(model):
            if not p.requires_grad:
                continue
            plan = st.plans[fqn]
            opt_pl = (Replicate(),) * st.mesh.ndim if whole else placements(plan.optimizer, st.mesh)
            # a parameter with main gradients (NOTE [main grads]) gets a master in their dtype
            mdt = master_dtype or (st.grad_dtype if st.grad_dtype is not None else p.dtype)
            direct = (
                tuple(p.placements) == opt_pl
                and mdt == p.dtype
                and plan.grads is not None
                and placements(plan.grads, st.mesh) == opt_pl
            )
            specs.append((fqn, p, opt_pl, mdt, direct))
        if offload_params is not None:  # before any master is made from a parameter that may be on its tier
            from meshlm.runtime.offload.params import refuse_copies

            refuse_copies(
                offload_params, [f for f, p, _o, _d, direct in specs if not direct and offload_params.manages(p)]
            )
        for fqn, p, opt_pl, mdt, direct in specs:
            init = main_grad.take_init_master(p)  # the unrounded initial weights (NOTE [main grads])
            if direct:
                master = p
            elif init is not None and init.dtype == mdt:
                master = nn.Parameter(init if tuple(init.placements) == opt_pl else init.redistribute(st.mesh, opt_pl))
            else:
                view = shard_view(p, opt_pl) if mdt == p.dtype else None
                with torch.no_grad():
                    master = nn.Parameter(
                        view if view is not None else p.detach().redistribute(st.mesh, opt_pl).to(mdt).clone()
                    )
            self._pairs.append((fqn, p, master))
            masters.append(master)
        self._keys = chunk_keys(
            model, [p for _f, p, _m in self._pairs], None if bucket_mb is None else int(bucket_mb * 2**20)
        )
        self.inner = optim_cls(_groups(param_groups, self._pairs), **kwargs)
        # NOTE [unused parameters] in meshlm/runtime/unused.py: where ranks may disagree on what they used
        self._usage_groups = unused.local_reductions(model, st)
        self._ready = False
        self._local_step = not whole
        self._locals: dict[int, nn.Parameter] = {}
        self._wrapped: dict[tuple[int, str], Tensor] = {}  # (id(master), state key) -> DTensor state
        # offload: a meshlm.runtime.offload.store.Swapper for masters and state (NOTE [offloaded step]);
        # offload_params: a meshlm.runtime.offload.params.ParamOffload, whose blocks the step moves too;
        # offload_grads: a Swapper for the gradients (NOTE [offloaded gradients])
        self.offload = self.grad_offload = None
        self.early = None  # NOTE [early reduction] (reduce_early)
        if offload_grads is not None:
            from meshlm.runtime.offload.grads import GradOffload

            self.grad_offload = GradOffload(self, offload_grads)
        if offload is not None or offload_params is not None or offload_grads is not None:
            from meshlm.runtime.offload.optimizer import OptimizerOffload

            self.offload = OptimizerOffload(self, offload, offload_params, grads=self.grad_offload)
            self.offload.swap_out(self.offload.pairs())

    def reduce_early(self, micro: int) -> None:
        """Start each chunk's gradient reduction in the backward pass that makes its last
        gradient, the ``micro``-th of a step (NOTE [early reduction] in meshlm/runtime/optim/early.py)."""
        from meshlm.runtime.optim.early import EarlyReduction

        if self.early is not None:
            self.early.close()
        self.early = EarlyReduction(self, micro)

    @property
    def param_groups(self):
        return self.inner.param_groups

    def masters(self) -> dict[str, nn.Parameter]:
        """FQN -> the tensor the optimizer updates (the parameter itself, or its master)."""
        return {fqn: m for fqn, _p, m in self._pairs}

    def reduce_grads(self) -> None:
        """Bring every gradient into optimizer placements and dtype (once per step).  A
        parameter's gradient is its ``main_grad`` where it has one (NOTE [main grads]),
        else its ``.grad``."""
        # `with torch.no_grad()` in these methods, not the decorator: mutmut (docs/mutation.md)
        # skips decorated functions.
        with torch.no_grad():
            if self._ready:
                return
            dropped = self._unused()
            if self.grad_offload is not None:  # NOTE [offloaded gradients]
                self.grad_offload.reduce(self)
                self._drop(dropped)
                self._ready = True
                return
            moving: dict = {}  # chunk -> [(param, master)]
            for (_fqn, p, m), key in zip(self._pairs, self._keys):
                if m is p:
                    continue
                g = main_grad.get(p)
                g = p.grad if g is None else g
                if g is None:
                    m.grad = None
                elif tuple(g.placements) != tuple(m.placements):
                    moving.setdefault(key, []).append((p, m))
                else:
                    m.grad = g.to(m.dtype)
            # one flat reduce-scatter per data axis and block (NOTE [optimizer chunks]), two
            # chunks in flight at once (NOTE [reductions in flight] in meshlm/runtime/bucket/flat.py); a
            # chunk's main gradients go as its collective reads them (NOTE [main grads])
            now, keys = [], []
            for key, pms in moving.items():
                early = self.early.take(key, pms) if self.early is not None else None
                if early is not None:  # started in backward (NOTE [early reduction])
                    for (p, m), g in zip(pms, early):
                        m.grad = g
                    continue
                now += pms
                keys += [key] * len(pms)
            gs = [(main_grad.get(p) if main_grad.get(p) is not None else p.grad).to(m.dtype) for p, m in now]
            for p, _m in now:
                main_grad.release(p)
            out = redistribute_flat(gs, [m.placements for _p, m in now], keys, consume=True)
            for (_p, m), g in zip(now, out):
                m.grad = g
            if self.early is not None:
                self.early.reset()
            self._drop(dropped)
            self._ready = True

    def _unused(self) -> list[int]:
        """The pairs whose parameter no rank used in this step (NOTE [unused parameters])."""
        flags = unused.used_anywhere(
            [unused.used_here(p) for _f, p, _m in self._pairs], self._usage_groups, self.mesh.device_type
        )
        return [i for i, used in enumerate(flags) if not used]

    def _drop(self, which: list[int]) -> None:
        """No gradient for these pairs: the torch optimizer skips them, as on one device."""
        for i in which:
            _f, p, m = self._pairs[i]
            p.grad = None
            main_grad.release(p)
            m.grad = None

    def scale_grads(self, factor: float) -> None:
        """Multiply the gradients the optimizer steps with by ``factor`` (after
        ``reduce_grads``; offloaded ones without reading them: NOTE [offloaded gradients])."""
        with torch.no_grad():
            if self.grad_offload is not None:
                self.grad_offload.scale(self.grads(), factor)
            else:
                for g in self.grads():
                    g.mul_(factor)

    def grads(self) -> list[Tensor]:
        """The gradients the optimizer steps with (after ``reduce_grads``)."""
        return [
            compat.local_tensor(m.grad) if isinstance(m.grad, DTensor) else m.grad
            for _f, _p, m in self._pairs
            if m.grad is not None
        ]

    def grad_norm(self) -> Tensor:
        """The global gradient norm (over all shards, every rank the same value)."""
        with torch.no_grad():
            self.reduce_grads()
            grads = [m.grad for _f, _p, m in self._pairs if m.grad is not None]
            go = self.grad_offload
            return grad_norm(grads, self.mesh, self.norm_groups, visit=None if go is None else go.each)

    def clip_grad_norm_(self, max_norm: float, norm: Tensor | float | None = None) -> Tensor:
        """Clip the global gradient norm (over all shards) to ``max_norm``; return the norm
        before clipping.  One all-reduce per mesh dim (``grad_norm``), none when ``norm``
        (this step's ``grad_norm()``) is given."""
        with torch.no_grad():
            total = self.grad_norm() if norm is None else torch.as_tensor(norm, dtype=torch.float32)
            coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
            if coef < 1.0:
                self.scale_grads(coef)
            return total

    def resident(self):
        """A context in which offloaded masters and state are in memory (NOTE [offloaded
        step]); a no-op without offload."""
        return self.offload.resident() if self.offload is not None else contextlib.nullcontext()

    def step(self) -> None:
        self.reduce_grads()
        fresh = {}
        if self.offload is not None:
            fresh = self.offload.step()
        elif self._local_step:
            self._step_local()
        else:
            self.inner.step()
        with torch.no_grad():
            pending, keys = [], []
            for (_fqn, p, m), key in zip(self._pairs, self._keys):
                if m is p:
                    continue
                new = fresh.pop(id(m), None)
                new = m.detach().to(p.dtype) if new is None else new
                if tuple(new.placements) != tuple(p.placements):
                    pending.append((p, new))
                    keys.append(key)
                else:
                    p.copy_(new)
            # the updated shards, all-gathered in one flat collective per data axis and block,
            # written straight into the parameters (NOTE [optimizer chunks])
            ps = [p for p, _n in pending]
            for p, new in zip(
                ps, redistribute_flat([n for _p, n in pending], [p.placements for p in ps], keys, into=ps)
            ):
                if new is not p:
                    p.copy_(new)
        self._ready = False

    def _step_local(self) -> None:
        """``inner.step()`` on local tensors (NOTE [local step]; NOTE [fused and views])."""
        inner = self.inner
        swapped = []
        copies = []  # (contiguous copy stepped, the master's local view it goes back into)
        for group in inner.param_groups:
            swapped.append(group["params"])
            local_params = []
            for m in group["params"]:
                loc = compat.local_tensor(m)
                g = m.grad
                g = None if g is None else (compat.local_tensor(g) if isinstance(g, DTensor) else g)
                if group.get("fused") and not loc.is_contiguous():
                    lp = nn.Parameter(loc.contiguous(), requires_grad=m.requires_grad)
                    copies.append((lp, loc))
                    g = None if g is None else g.contiguous()
                else:
                    lp = self._locals.get(id(m))
                    if lp is None or where(lp.data) != where(loc):
                        lp = self._locals[id(m)] = nn.Parameter(loc, requires_grad=m.requires_grad)
                lp.grad = g
                st = inner.state.pop(m, None)
                if st:
                    inner.state[lp] = {
                        k: (compat.local_tensor(v) if isinstance(v, DTensor) else v) for k, v in st.items()
                    }
                local_params.append(lp)
            group["params"] = local_params
        try:
            inner.step()
            with torch.no_grad():
                for lp, loc in copies:
                    loc.copy_(lp)
        finally:
            for group, masters in zip(inner.param_groups, swapped):
                for lp, m in zip(group["params"], masters):
                    lp.grad = None
                    st = inner.state.pop(lp, None)
                    if st:
                        inner.state[m] = {k: self._like(v, m, k) for k, v in st.items()}
                group["params"] = masters

    def _like(self, v: Tensor, m: Tensor, key: str) -> Tensor:
        """A local optimizer-state tensor shaped like master ``m``'s shard, as a DTensor
        placed like ``m`` (sharing storage; built once per state tensor); anything else
        (the step count) as it is."""
        if not (isinstance(m, DTensor) and not isinstance(v, DTensor) and v.shape == compat.local_tensor(m).shape):
            return v
        d = self._wrapped.get((id(m), key))
        if d is None or where(compat.local_tensor(d)) != where(v) or compat.local_tensor(d).shape != v.shape:
            d = self._wrapped[(id(m), key)] = DTensor.from_local(
                v, m.device_mesh, m.placements, run_check=False, shape=m.shape, stride=m.stride()
            )
        return d

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _fqn, p, m in self._pairs:
            p.grad = None
            main_grad.release(p)
            unused.reset(p)
            if m is not p:
                m.grad = None
        if self.grad_offload is not None:
            self.grad_offload.release()
        if self.early is not None:
            self.early.reset()
        self._ready = False

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.inner.load_state_dict(sd)


def _groups(spec: Optional[list[dict]], pairs: list) -> list[dict]:
    """torch's parameter groups of the masters (NOTE [parameter groups])."""
    masters = [m for _f, _p, m in pairs]
    if spec is None:
        return [{"params": masters}]
    by_name = {f: m for f, _p, m in pairs}
    by_param = {id(p): m for _f, p, m in pairs}
    out, taken = [], set()
    for i, g in enumerate(spec):
        if "params" not in g:
            raise ValueError(f"ShardedOptimizer(param_groups=...): group {i} has no 'params' entry")
        ms = []
        for x in g["params"]:
            m = by_name.get(x) if isinstance(x, str) else by_param.get(id(x))
            if m is None:
                what = (
                    repr(x) if isinstance(x, str) else f"a {type(x).__name__} that is not one of the model's parameters"
                )
                raise ValueError(
                    f"ShardedOptimizer(param_groups=...): group {i} names {what}; name the model's trainable "
                    "parameters by FQN (model.named_parameters()) or pass the parameters themselves"
                )
            if id(m) in taken:
                raise ValueError(f"ShardedOptimizer(param_groups=...): a parameter is in two groups (group {i})")
            taken.add(id(m))
            ms.append(m)
        out.append({**g, "params": ms})
    rest = [m for m in masters if id(m) not in taken]
    return ([{"params": rest}] if rest else []) + [g for g in out if g["params"]]


# Optimizers whose update of each element depends only on that element's parameter,
# gradient and state (NOTE [local step]).
_ELEMENTWISE = {
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
}


def grad_norm(grads: list[Tensor], mesh, extra_groups=(), visit=None) -> Tensor:
    """Global L2 norm of DTensor gradients (no Partial placements): each rank's sum of
    squares, divided by how many ranks hold a replica of it, summed over the mesh.

    Computed on the gradients' device and all-reduced over the mesh's own process groups,
    one per mesh dim of size > 1: the default group may be of another backend (a CUDA job's
    is NCCL, which takes no CPU tensor) or span other ranks.  Accumulated in float64, which
    gloo and NCCL both reduce: the squares of float32 gradients stay finite there, so the
    norm is Inf or NaN only when a gradient is (``LossScaler`` relies on it).
    ``extra_groups``: process groups whose ranks hold the other parts of the model (a
    pipeline's stages), over which the sum of squares is all-reduced as well.  ``visit``:
    a generator over ``grads`` that has each in memory while it is read (offloaded
    gradients, NOTE [offloaded gradients])."""
    parts = []
    for g in grads if visit is None else visit(grads):
        if isinstance(g, DTensor):
            if any(p.is_partial() for p in g.placements):
                raise RuntimeError("grad_norm needs reduced gradients; call reduce_grads() first")
            reps = math.prod(mesh.size(i) for i, p in enumerate(g.placements) if p.is_replicate())
            local = compat.local_tensor(g)
        else:  # a plain tensor: the same on every rank
            reps, local = mesh.size(), g
        parts.append(torch.linalg.vector_norm(local, dtype=torch.float64).square() / reps)
    device = parts[0].device if parts else torch.device(mesh.device_type)
    total = torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64, device=device)
    if dist.is_initialized():
        for i in range(mesh.ndim):
            if mesh.size(i) > 1:
                total = compat.all_reduce(total, "sum", mesh.get_group(i))
        for g in extra_groups:
            total = compat.all_reduce(total, "sum", g)
        if compat.in_flight(total):
            total = total.wait()
    return total.sqrt().float()
