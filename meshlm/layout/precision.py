"""Mixed precision: the reduction dtype ``shard`` defaults to, and dynamic loss scaling.

NOTE [mixed precision]
    ``meshlm train`` runs mixed precision with FSDP2's semantics (its MixedPrecisionPolicy;
    Megatron's fp32 gradient reduction and accumulation are the same): parameters are cast
    to ``train.param_dtype`` at use, before any gather (so ZeRO-3's gathers move half the
    bytes); the cast's backward returns the gradient to float32 before it is reduced
    (``reduce_dtype``: float32), so gradients are reduced, accumulated over micro-batches,
    clipped and applied in float32, and the optimizer's master weights and AdamW state are
    float32.  Where the parameters are stored is chosen per layout and mesh so that the
    model state is at its floor (:func:`train_dtypes`, :func:`splits_master`):

    * the optimizer keeps its state where the parameters are stored (ddp, fsdp, hsdp, tp,
      fsdp_tp...): the stored shards are float32 and are the master (the optimizer keeps no
      second copy); ``.grad`` is float32.  4 bytes of storage per stored element, where a
      bf16 copy plus a float32 master would take 2 + 4.
    * the optimizer shards over a data axis what the parameters store whole (zero1, zero2
      on more than one rank): the stored parameters are bf16 (the at-use copy is then the
      parameter itself: nothing is cast or kept), and the optimizer keeps a sharded float32
      master (``ShardedOptimizer``'s master dtype follows the gradients').  Autograd would
      give a bf16 parameter a bf16 ``.grad``, so gradients go to float32 *main gradients*
      instead (NOTE [main grads] in main_grad.py): ZeRO-2 reduce-scatters in float32
      straight into a sharded float32 main gradient, ZeRO-1 accumulates its local float32
      gradient and reduce-scatters it at the step.  2 bytes per element stored whole plus
      (4 + 12)/N per element sharded, where float32 storage took 4 whole (+ 4/N or 4
      whole of gradient).  Under ``torch.compile`` with ``compile_comms=graph`` the
      reductions are traced into the block graphs, where main gradients cannot be added
      to: those runs keep float32 storage (``compile_blocks`` refuses the combination).

    Per-rank model state with AdamW, Ψ parameters, N data-parallel ranks: ddp 16Ψ (+2Ψ of
    bf16 at-use copies autograd keeps for backward), zero1 2Ψ + 4Ψ + 12Ψ/N, zero2
    2Ψ + 16Ψ/N, fsdp 16Ψ/N (+ one block's gathered bf16 copy while it runs), tensor
    parallel divided by t (``tests/dist/test_memory_floor.py`` measures it, peak
    included).  The at-use cast is ``lowering.atuse.AtUse`` (per parameter) and
    ``bucket.prefetch.compute_locals`` (a block's flat gather); their backwards
    (``AtUse.backward``, ``bucket.Gather.backward``) cast to the reduce dtype (a block's
    gradients as they are packed into its flat reduction buffer: NOTE [reduce in place of
    the casts] in meshlm/runtime/bucket/flat.py), reduce, and cast to the storage dtype or add into the main
    gradient.

    float16 also needs loss scaling (its smallest normal number is 6e-5: small gradients of
    activations underflow, large ones overflow at 65504): :class:`LossScaler`.  bfloat16 has
    float32's exponent range and needs none.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

log = logging.getLogger("meshlm.layout.precision")


def splits_master(layout, sizes: Mapping[str, int]) -> bool:
    """Whether ``layout``'s optimizer shards, over a data axis of size > 1 in ``sizes``, a
    parameter dimension that its storage (``params``) keeps whole: ZeRO-1/2 (NOTE [mixed
    precision])."""
    from meshlm.core.axes import DATA_AXES

    def splits(lay) -> bool:
        stored = {a for v in lay.params.values() for a in v}
        return any(
            a in DATA_AXES and a not in stored and sizes.get(a, 1) > 1 for v in lay.optimizer_rules.values() for a in v
        )

    return any(splits(lay) for lay in layout.all_layouts())  # every scope's (NOTE [scoped layouts])


def train_dtypes(
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype | None = None,
    layout=None,
    sizes: Mapping[str, int] | None = None,
    main_grads: bool = True,
) -> dict[str, torch.dtype | None]:
    """``meshlm.shard`` dtype arguments for training in ``param_dtype`` (NOTE [mixed
    precision]): float32 storage, used in ``param_dtype``, or, where ``layout`` on a mesh
    of ``sizes`` :func:`splits_master` (and ``main_grads``: the reductions run eagerly),
    storage in ``param_dtype`` with float32 main gradients.  Gradients are reduced in
    ``reduce_dtype`` (None: float32)."""
    rdt = reduce_dtype or torch.float32
    narrow = param_dtype.is_floating_point and param_dtype.itemsize < 4
    if narrow and main_grads and layout is not None and splits_master(layout, sizes or {}):
        return {
            "param_dtype": param_dtype,
            "compute_dtype": param_dtype,
            "reduce_dtype": rdt,
            "grad_dtype": torch.float32,
        }
    return {
        "param_dtype": None,
        "compute_dtype": None if param_dtype == torch.float32 else param_dtype,
        "reduce_dtype": rdt,
        "grad_dtype": None,
    }


def default_reduce_dtype(compute_dtype: torch.dtype | None, storage: Sequence[torch.dtype]) -> torch.dtype | None:
    """``shard(reduce_dtype=None)``: float32 when the compute dtype or any storage dtype is
    a float narrower than 32 bits, else None (each gradient is reduced in its own dtype)."""
    narrow = [d for d in (compute_dtype, *storage) if d is not None and d.is_floating_point and d.itemsize < 4]
    return torch.float32 if narrow else None


class LossScaler:
    """Dynamic loss scaling for float16 compute, as ``torch.amp.GradScaler`` does it, on a
    :class:`meshlm.runtime.optim.sharded.ShardedOptimizer`.

    Each micro-batch's loss is multiplied by ``scale`` before backward (:meth:`scale_loss`);
    :meth:`step` then divides the (float32) gradients by it, takes their global norm, which
    is one all-reduce over the mesh, so every rank sees the same value and makes the same
    decision, and either skips the step (a non-finite norm: some gradient overflowed;
    the scale is multiplied by ``backoff_factor``) or clips to ``max_norm`` with that same
    norm and steps (after ``growth_interval`` such steps in a row the scale is multiplied
    by ``growth_factor``).  Powers of two keep the scaling exact.  ``state_dict`` holds the
    scale and the count of good steps; ``meshlm train`` saves it in its checkpoints."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(
                f"LossScaler(init_scale={init_scale}, growth_factor={growth_factor}, backoff_factor="
                f"{backoff_factor}, growth_interval={growth_interval}): need init_scale > 0, "
                "growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1"
            )
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0  # finite steps in a row since the scale last changed
        self.skipped = 0  # steps skipped for overflow (this process's lifetime)

    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss * self.scale

    @torch.no_grad()
    def unscale_(self, opt) -> Tensor:
        """Divide every gradient by the scale (in the optimizer's placements and dtype) and
        return their global norm: non-finite iff some gradient on some rank is."""
        opt.reduce_grads()
        opt.scale_grads(1.0 / self.scale)
        return opt.grad_norm()

    def step(self, opt, max_norm: float = 0.0) -> tuple[float, bool]:
        """Unscale, check, clip (``max_norm`` > 0) and step ``opt``, or skip the step on an
        overflow; update the scale.  Returns (the unscaled gradient norm, stepped)."""
        norm = float(self.unscale_(opt))
        if not math.isfinite(norm):
            opt.zero_grad()
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return norm, False
        if max_norm > 0:
            opt.clip_grad_norm_(max_norm, norm=norm)
        opt.step()
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return norm, True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self.good_steps = int(sd["good_steps"])


def main_grads_allowed(t) -> bool:
    """Whether ``meshlm train`` may give training config ``t`` main gradients: they are
    added in eager Python code (NOTE [main grads] in main_grad.py), not inside compiled
    block graphs (``train.compile`` with ``compile_comms=graph``)."""
    return t.compile == "none" or t.compile_comms == "eager"


# dtype names in configs and CLI flags, with their short aliases (one table for meshlm)
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def shard_dtypes(t, layout=None, sizes=None) -> dict[str, torch.dtype | None]:
    """``meshlm.shard`` dtype arguments for ``t`` (the ``train`` config section) under ``layout`` on a mesh of ``sizes``
    (NOTE [mixed precision] in precision.py, ``precision.train_dtypes``): parameters used
    in ``train.param_dtype``, gradients reduced in ``train.reduce_dtype``
    and accumulated in float32; float32 storage (the master weights), or, for ZeRO-1/2
    under a narrower ``train.param_dtype``, storage in that dtype with float32 main
    gradients and a sharded float32 master.  Without ``layout``: float32 storage."""
    return train_dtypes(DTYPES[t.param_dtype], DTYPES[t.reduce_dtype], layout, sizes, main_grads=main_grads_allowed(t))
