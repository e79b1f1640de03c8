"""meshlm.plan against reality on 2 and 4 gloo processes, for every shipped layout:
parameter, gradient and optimizer-state bytes per rank exactly; communication bytes per
step exactly (counted by meshlm.runtime.comm in a real step); activations within 10% of the bytes
held from the end of forward to backward, and the at-use parameter copies held over the
same span exactly.

NOTE [measuring held activations]
    Saved-tensor hooks cannot see inside a checkpointed block (its own hooks replace ours,
    and what it keeps is a cache of selected op outputs), and the fsdp-family layouts
    checkpoint every block (NOTE [re-gather in backward] in meshlm/runtime/lowering/policies.py).  So the measurement
    is hook-free: a TorchDispatchMode notes the storage of every op output in forward
    (the local shard of a DTensor output) with a weak reference; at the end of forward the
    storages still alive, less the parameters, the inputs and the loss, at their size then,
    are exactly what autograd and checkpointing hold for backward.  Storages first made inside the
    parameters' gathers (at use, or a bucket's) are the held parameter copies ("gathered").
"""

from __future__ import annotations

import threading
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness import dist_pool_fixture

B, S = 4, 8
pool2 = dist_pool_fixture(2, timeout_s=60)
pool4 = dist_pool_fixture(4, timeout_s=60)


def _local(t):
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _storage(w):
    """The storage behind a live StorageWeakRef."""
    return torch.UntypedStorage._new_with_weak_ptr(w.cdata)


class _Seen:
    """A storage first made by an op in forward: a weak reference, whether a gather made it,
    its bytes when ``held`` ran, and whether another thread freed it (NOTE [storage the
    backend frees] in meshlm/runtime/memory.py)."""

    def __init__(self, st, gathered: bool, thread: int):
        from torch.multiprocessing.reductions import StorageWeakRef

        self.ref, self.gathered, self.thread = StorageWeakRef(st), gathered, thread
        self.at_held = 0
        self.off_thread = False
        weakref.finalize(st, self._freed)

    def _freed(self) -> None:
        self.off_thread = threading.get_ident() != self.thread


class _HeldAfterForward(TorchDispatchMode):
    """NOTE [measuring held activations]."""

    in_at_use = [0]

    def __init__(self):
        super().__init__()
        self.seen: dict[int, _Seen] = {}
        self.counted: list[_Seen] = []
        self.thread = threading.get_ident()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            t = getattr(_local(t), "elem", _local(t))  # AsyncCollectiveTensor wraps a plain tensor
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            old = self.seen.get(st.data_ptr())
            # first maker of a live storage (one freed since, at 0 bytes, has left its address)
            if st.nbytes() and (old is None or old.ref.expired() or _storage(old.ref).data_ptr() != st.data_ptr()):
                self.seen[st.data_ptr()] = _Seen(st, bool(self.in_at_use[0]), self.thread)
        return out

    def held(self, exclude: set[int]) -> tuple[int, int]:
        """(activation bytes, at-use parameter copy bytes) still alive, at their present
        size (a block's gathered parameters are freed to 0 bytes until backward: NOTE
        [free and re-gather] in meshlm/runtime/bucket/regather.py)."""
        self.counted = [e for p, e in self.seen.items() if not e.ref.expired() and p not in exclude]
        for e in self.counted:
            e.at_held = _storage(e.ref).nbytes()
        return sum(e.at_held for e in self.counted if not e.gathered), sum(e.at_held for e in self.counted if e.gathered)

    def backend_slack(self) -> int:
        """Bytes ``held`` counted that the backend's thread freed later: a collective's buffer
        that gloo's work object still referenced (NOTE [storage the backend frees] in
        meshlm/runtime/memory.py).  Call it once the step is over."""
        return sum(e.at_held for e in self.counted if e.off_thread)


def _count_at_use() -> None:
    """Mark what the parameter gathers make: per parameter (``AtUse``) and flat
    (``bucket.Gather``: the blocks', whose copies are freed after forward, and a local
    root's, NOTE [local root] in meshlm/runtime/lowering/local_root.py)."""
    from meshlm.runtime import bucket
    from meshlm.runtime.lowering import atuse

    for fn in (atuse.AtUse, bucket.Gather):
        if getattr(fn, "_test_counted", False):
            continue
        orig = fn.forward

        def forward(ctx, *args, _orig=orig):
            _HeldAfterForward.in_at_use[0] += 1
            try:
                return _orig(ctx, *args)
            finally:
                _HeldAfterForward.in_at_use[0] -= 1

        fn.forward = staticmethod(forward)
        fn._test_counted = True


def _measure(layout: str, mesh_shape: dict, ac: str = "none", param_dtype: str = "float32"):
    from meshlm.runtime.comm import CommCounter
    from meshlm.app.config import TrainConfig
    from harness.setup import tiny_sharded
    from meshlm.app.train import apply_activation_checkpointing, shard_dtypes

    import meshlm

    # as meshlm train shards it (NOTE [mixed precision] in meshlm/layout/precision.py)
    kw = shard_dtypes(TrainConfig(param_dtype=param_dtype), meshlm.load_layout(layout), mesh_shape)
    mesh, model, opt, x, y = tiny_sharded(layout, mesh_shape, batch=B, seq=S, **kw)
    apply_activation_checkpointing(model, ac)
    _count_at_use()
    cc = CommCounter(mesh)
    held = _HeldAfterForward()
    with cc:
        with held:
            loss = model(x, y)
        ptrs = {_local(t).untyped_storage().data_ptr() for t in [*model.parameters(), x, y, loss]}
        act, gathered = held.held(ptrs)
        loss.backward()
        grads_bwd = _grad_storages(model, opt)
        with cc.phase("optimizer"):
            opt.step()

    def nbytes(ts):
        seen = {}
        for t in ts:
            if t is not None:
                st = _local(t).untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        return seen

    params = nbytes(model.parameters())
    # gradients at whichever of the end of backward and the step holds more (ZeRO-1's main
    # gradients are released as the step reduces them: NOTE [main grads] in meshlm/runtime/main_grad.py)
    grads = _grad_storages(model, opt)  # live now (a freed one's address may be reused since)
    grad_bytes = max(sum(v for k, v in d.items() if k not in params) for d in (grads_bwd, grads))
    state = nbytes([v for s in opt.inner.state.values() for v in s.values() if torch.is_tensor(v)]
                   + [m for fqn, m in opt.masters().items() if all(m is not p for p in model.parameters())])
    comm = {k: int(v["bytes"]) for k, v in cc.summary(by_phase=True).items()}
    return {"params": sum(params.values()), "grads": grad_bytes,
            "optimizer": sum(v for k, v in state.items() if k not in params and k not in grads),
            "activations": act, "gathered": gathered, "comm": comm}


def _grad_storages(model, opt) -> dict[int, int]:
    """Storage pointer -> bytes of every gradient: ``.grad``, ``main_grad`` and the masters'."""
    out = {}
    for t in ([p.grad for p in model.parameters()] + [getattr(p, "main_grad", None) for p in model.parameters()]
              + [m.grad for m in opt.masters().values()]):
        if t is not None:
            st = _local(t).untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    return out


MESHES = {
    2: {"single": {"dp": 2}, "ddp": {"dp": 2}, "zero1": {"dp": 2}, "zero2": {"dp": 2}, "fsdp": {"fsdp": 2},
        "hsdp": {"fsdp": 2}, "tp": {"tp": 2}, "tp_sp": {"tp": 2}, "fsdp_tp": {"fsdp": 2}, "fsdp_tp_sp": {"tp": 2}},
    4: {"single": {"dp": 4}, "ddp": {"dp": 4}, "zero1": {"dp": 4}, "zero2": {"dp": 4}, "fsdp": {"fsdp": 4},
        "hsdp": {"dp": 2, "fsdp": 2}, "tp": {"tp": 4}, "tp_sp": {"tp": 4}, "fsdp_tp": {"fsdp": 2, "tp": 2},
        "fsdp_tp_sp": {"fsdp": 2, "tp": 2}},
}


def _check(pool, world, layout, ac="none", param_dtype="float32"):
    from meshlm.app.config import load_config
    from meshlm.plan import plan
    from meshlm.app.plan import from_run_config

    mesh = MESHES[world][layout]
    got = pool.run(_measure, layout, mesh, ac, param_dtype)[0]
    kw = from_run_config(load_config([f"train.param_dtype={param_dtype}"]))  # the dtypes meshlm plan uses
    p = plan("llama_tiny", layout, mesh, global_batch=B, seq=S, activation_checkpointing=ac,
             param_dtype=kw["param_dtype"], master_dtype=kw["master_dtype"], compute_dtype=kw["compute_dtype"],
             reduce_dtype=kw["reduce_dtype"])
    for k in ("params", "grads", "optimizer"):
        assert p.memory[k] == got[k], f"{layout} {mesh} {k}: predicted {p.memory[k]} measured {got[k]}"
    pred_comm = {k: int(v["bytes"]) for k, v in p.comm_summary(by_phase=True).items()}
    assert pred_comm == got["comm"], f"{layout} {mesh} comm: predicted {pred_comm} measured {got['comm']}"
    assert p.memory["gathered"] == got["gathered"], f"{layout} {mesh} held parameter copies: {p.memory['gathered']} vs {got['gathered']}"
    a, m = p.memory["activations"], got["activations"]
    print(f"{layout} {mesh}: activations predicted {a} measured {m} ({a / m - 1:+.1%})")
    assert abs(a - m) <= 0.10 * m, f"{layout} {mesh} activations: predicted {a} measured {m}"


LAYOUTS = list(MESHES[2])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_exact_2(pool2, layout):
    _check(pool2, 2, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_exact_4(pool4, layout):
    _check(pool4, 4, layout)


@pytest.mark.parametrize("ac", ["selective", "full"])
def test_plan_exact_checkpointed(pool4, ac):
    """Under ``train.activation_checkpointing``, on a re-gathering tensor-parallel layout:
    train's checkpoint alone decides what a block keeps (the lowering nests none of its
    own in eager mode), and the plan predicts that."""
    _check(pool4, 4, "fsdp_tp_sp", ac)


@pytest.mark.parametrize("layout", ["ddp", "zero1", "zero2", "fsdp", "hsdp", "tp_sp", "fsdp_tp"])
def test_plan_exact_bf16(pool4, layout):
    """``train.param_dtype=bfloat16`` as ``meshlm train`` runs it (NOTE [mixed precision]
    in meshlm/layout/precision.py: bf16 at use and float32 gradient reductions; float32 storage
    and optimizer state, except zero1/zero2, which store bf16 parameters beside float32
    masters and main gradients): the plan ``meshlm plan`` makes for it is exact too."""
    _check(pool4, 4, layout, param_dtype="bfloat16")
