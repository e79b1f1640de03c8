"""Sharded models in one process never see each other's state (NOTE [run state] in
meshlm/core/state.py, NOTE [process-wide tables] in meshlm/runtime/state.py).

On 2 gloo processes, each rank shards three Llamas under different layouts, each on a mesh
of its own: fsdp and zero2 with overlapped reduction (their blocks' gradient reductions are
left in flight and wait on the model's own ``InFlight``), and tp_sp (a DTensor root, whose
constrain handler lives in the run state).  They train in interleaved SGD steps, each
against its own one-device plain-torch reference: each step's loss and gradients against a
plain copy holding the sharded weights (the probe), the weights after each step against the
reference's within the bounds propagated through the update (harness.tolerances, NOTE
[tolerances after steps]).  After every step nothing is pending: every model's in-flight
reductions and prefetches are empty, only the stepping model's reductions were ever in
flight, and the run state is at its defaults.  Then the fsdp model is deleted: once
collected, its bucket slots are empty and no table holds its mesh, while the zero2 model
keeps its buckets, and the two others train on, still matching their references.
"""

from harness import dist_pool_fixture

pool2 = dist_pool_fixture(2, timeout_s=120)

LR = 0.5  # plain SGD: a gradient off by 2x moves the weights far more than rounding


class _Side:
    """One model: sharded, its optimizer, its reference and the reference's optimizer."""

    def __init__(self, name, layout, mesh_shape, seed, overlap, used):
        import torch

        import meshlm
        from meshlm.models import Llama, llama_config
        from meshlm.runtime.lowering import shard_state
        from meshlm.runtime.optim.sharded import ShardedOptimizer

        cfg = llama_config("llama_tiny")
        self.name, self.layout, self.seed = name, layout, seed
        self.mesh = meshlm.make_mesh(mesh_shape)
        self.model = meshlm.shard(Llama(cfg, device="meta"), layout, self.mesh, seed=seed, overlap=overlap)
        self.opt = ShardedOptimizer(self.model, torch.optim.SGD, lr=LR)
        self.ref = Llama(cfg, device="cpu", seed=seed)
        self.ref_opt = torch.optim.SGD(self.ref.parameters(), lr=LR)
        self.probe = Llama(cfg, device="cpu", seed=seed)
        self.bounds: dict = {}
        box = shard_state(self.model).in_flight
        later = box.later
        box.later = lambda *a: used.append(name) or later(*a)  # which model's reductions waited

    def step(self, k: int) -> None:
        import torch

        import meshlm
        from harness import tolerances as tol
        from harness.parity import TokenBatches
        from harness.recipes import full_many

        tokens, labels = TokenBatches()(k, 0)[0]
        weights = full_many(dict(self.model.named_parameters()))
        with torch.no_grad():
            for n, p in self.probe.named_parameters():
                p.copy_(weights[n])
                p.grad = None
        want = self.probe(tokens, labels)
        want.backward()
        g_probe = {n: p.grad for n, p in self.probe.named_parameters()}
        got = self.model(
            meshlm.shard_batch(tokens, self.layout, self.mesh), meshlm.shard_batch(labels, self.layout, self.mesh)
        )
        got.backward()
        what = f"{self.name} ({self.layout}) step {k}"
        torch.testing.assert_close(
            got.detach(), want.detach(), rtol=tol.LOSS_RTOL, atol=0, msg=lambda m: f"{what} loss: {m}"
        )
        grads = full_many({n: p.grad for n, p in self.model.named_parameters()})
        for n, g in grads.items():
            bad = (g - g_probe[n]).abs() > tol.grad_tol(g_probe[n])
            assert not bad.any(), f"{what}: gradient of {n} off by {float((g - g_probe[n]).abs().max()):.3g}"
        self.opt.step()
        self.opt.zero_grad()
        ref_params = dict(self.ref.named_parameters())
        w_old = {n: p.detach().clone() for n, p in ref_params.items()}
        self.ref(tokens, labels).backward()
        self.ref_opt.step()
        now = full_many(dict(self.model.named_parameters()))
        for n, p in ref_params.items():
            b = self.bounds.setdefault(n, tol.StepBounds())
            b.update("sgd", {"lr": LR}, k, p.grad, g_probe[n], {}, w_old[n], p.detach())
            err = (now[n] - p.detach()).abs()
            assert (err <= b.bound["param"]).all(), f"{what}: {n} off its reference by {float(err.max()):.3g}"
        self.ref_opt.zero_grad()


def _quiet(sides) -> None:
    """Nothing pending after a step: no reduction in flight, no prefetch, the run state at its defaults."""
    from meshlm.core.state import RUN
    from meshlm.runtime.lowering import shard_state

    assert RUN.changed() == {}, RUN.changed()
    for s in sides:
        st = shard_state(s.model)
        assert len(st.in_flight) == 0 and st.prefetch.inflight == {} and st.gathered is None, s.name


def _interleaved(steps: int) -> dict:
    import gc
    import weakref

    from meshlm.runtime import bucket
    from meshlm.runtime.lowering import shard_state

    used: list = []
    sides = [
        _Side("a", "fsdp", "fsdp=2", 0, True, used),
        _Side("b", "zero2", "dp=2", 1, True, used),
        _Side("c", "tp_sp", "tp=2", 2, False, used),
    ]
    waited = []
    for k in range(1, steps + 1):
        for side in sides:
            used.clear()
            side.step(k)
            waited.append((side.name, sorted(set(used))))
            _quiet(sides)
    keys = [
        {m._meshlm_block.key for m in s.model.modules() if getattr(m, "_meshlm_block", None) is not None} - {None}
        for s in sides
    ]
    assert keys[0] and keys[1] and not keys[0] & keys[1], keys
    a, rest = sides[0], sides[1:]
    gone, mesh_a = weakref.ref(shard_state(a.model)), a.mesh
    del sides, side, a
    gc.collect()
    out = {
        "waited": waited,
        "dead": gone() is None,
        "emptied": all(bucket.BUCKETS[k] is None for k in keys[0]),
        "holds_a": any(x is not None and x.mesh is mesh_a for x in bucket.BUCKETS),
        "kept_b": all(bucket.BUCKETS[k] is not None and bucket.BUCKETS[k].mesh is rest[0].mesh for k in keys[1]),
    }
    for side in rest:
        side.step(steps + 1)
        _quiet(rest)
    return out


def test_models_train_interleaved_each_against_its_reference(pool2):
    steps = 2
    for r in pool2.run(_interleaved, steps):
        # the overlapped models' reductions were left in flight (and settled) on their own InFlight only
        assert r["waited"] == [("a", ["a"]), ("b", ["b"]), ("c", [])] * steps, r["waited"]
        assert r["dead"] and r["emptied"] and not r["holds_a"] and r["kept_b"], r
