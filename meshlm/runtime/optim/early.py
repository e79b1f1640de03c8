"""A chunk's gradients reduced as soon as the step's backward has made them.

NOTE [early reduction]
    Under a pipeline layout with several micro-batches a stage keeps its gradients local
    through the micro-batches, and ``ShardedOptimizer.reduce_grads`` reduces them at the
    step (NOTE [pipelined step] in meshlm/runtime/pipeline/pipe.py): after the last micro-batch's
    backward, with nothing left to overlap.  With early reduction (``Pipeline.attach``), a
    post-accumulate-grad hook counts each parameter's accumulations; once every parameter
    of an optimizer chunk (NOTE [optimizer chunks] in meshlm/runtime/optim/chunks.py) has had the
    step's last one (one per micro-batch), the chunk's reduction is started and left in
    flight while backward goes on to the blocks before it, as FSDP2 reduce-scatters each
    block inside the last micro-batch's backward.  ``reduce_grads`` takes the result at the
    step.  It is the collective the step would issue (the same chunk, the same flat buffer,
    the same order), so the gradients are the same bit for bit.  A chunk one of whose
    gradients is missing, kept as main gradients (NOTE [main grads]) or offloaded, or whose
    parameters do not all move, is reduced at the step as before.

    Off by default on a CPU mesh, as the overlapped reduction is (NOTE [overlapped
    reduction] in meshlm/runtime/bucket/op.py): gloo's threads take the cores the backward runs on.
    Measured on 2 cores, 4 ranks (benchmarks/pipeline_titan.py --reps 21 --backend inductor
    --early, fsdp_pp, compiled): 0.219 s a step with it against 0.209 s without (1.03x and
    0.98x torchtitan's; the reduction at the step, two chunks in flight, NOTE [reductions in
    flight] in meshlm/runtime/bucket/flat.py, costs less than the backward loses to gloo's threads).
    Not yet measured on a GPU, where NCCL runs the reduction beside the compute.
"""

from __future__ import annotations

from typing import Optional

from torch.distributed.tensor import DTensor

from meshlm._torch_compat.dtensor_ops import waited
from meshlm.runtime import main_grad
from meshlm.runtime.bucket import redistribute_flat


class EarlyReduction:
    """The early reductions of a ``ShardedOptimizer`` whose gradients accumulate over
    ``micro`` backward passes a step (NOTE [early reduction])."""

    def __init__(self, opt, micro: int):
        self.opt, self.micro = opt, micro
        self.chunks: dict = {}  # chunk key -> [(param, master)] whose master is a copy
        for (_f, p, m), key in zip(opt._pairs, opt._keys):
            if m is not p:
                self.chunks.setdefault(key, []).append((p, m))
        self._key_of = {id(p): key for key, pms in self.chunks.items() for p, _m in pms}
        self.counts: dict[int, int] = {}  # id(param) -> accumulations this step
        self.left: dict = {}  # chunk key -> parameters still to have their last accumulation
        self.flight: dict = {}  # chunk key -> (its pairs, the reduced gradients in flight)
        self.launched = 0  # chunks started early, over the run
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for pms in self.chunks.values() for p, _ in pms]

    def _hook(self, p) -> None:
        n = self.counts[id(p)] = self.counts.get(id(p), 0) + 1
        if n != self.micro:
            return
        key = self._key_of[id(p)]
        self.left[key] = self.left.get(key, len(self.chunks[key])) - 1
        if self.left[key] == 0:
            self._launch(key)

    def _launch(self, key) -> None:
        pms = self.chunks[key]
        if self.opt.grad_offload is not None or self.opt._ready:
            return
        for p, m in pms:
            g = p.grad
            if main_grad.get(p) is not None or not isinstance(g, DTensor) or tuple(g.placements) == tuple(m.placements):
                return
        gs = [p.grad.to(m.dtype) for p, m in pms]
        self.flight[key] = (pms, redistribute_flat(gs, [m.placements for _p, m in pms], [key] * len(pms), wait=False))
        self.launched += 1

    def take(self, key, pms: list) -> Optional[list]:
        """The reduced gradients of chunk ``key`` when it was started early for exactly these
        (param, master) pairs, waited for; else None."""
        hit = self.flight.pop(key, None)
        if hit is None or [id(p) for p, _m in hit[0]] != [id(p) for p, _m in pms]:
            return None
        return [waited(g) for g in hit[1]]

    def reset(self) -> None:
        """A new step: nothing counted, nothing in flight."""
        self.counts.clear()
        self.left.clear()
        self.flight.clear()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
