"""Context parallel (``seq: cp``, docs/cp.md) against one device: the loss, the gradient each
optimizer steps with and the parameters after three steps of two micro-batches, for every
cp layout, ring and all-gather attention, with and without the causal load balancing, with dropout and activation
checkpointing, and at 2,048 tokens (one step); and
the bytes the attention moves against the formula of NOTE [cp attention]
(meshlm/runtime/cp/ring.py), and the gradients' reductions on cp.  GPT-2's learned positions and a user's own attention on
``F.scaled_dot_product_attention`` run every shipped cp layout in tests/dist/test_nn_models.py,
test_hf_gpt2.py and test_user_model.py.  The checks run in the workers
(harness.parity.check_training; tolerances in meshlm/train/tolerances.py)."""

from pathlib import Path

import pytest
import yaml

from harness import dist_pool_fixture
from harness.parity import LlamaBuild, TokenBatches, assert_parity, check_training

pool4 = dist_pool_fixture(4, timeout_s=120)
pool8 = dist_pool_fixture(8, timeout_s=120)

ONE_BLOCK = LlamaBuild(overrides=(("layers", 1),))
LAYOUTS = Path(__file__).resolve().parents[2] / "layouts"


def _variant(tmp_path: Path, base: str, **context) -> str:
    """A copy of shipped layout ``base`` with its ``context`` section changed."""
    data = yaml.safe_load((LAYOUTS / f"{base}.yaml").read_text())
    data["context"] = {**data.get("context", {}), **context}
    name = f"{base}_" + "_".join(f"{k}{v}" for k, v in context.items())
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _dtensor_root(res, layout):
    """A cp layout runs its root under DTensor (the sequence is split: not pure data parallel)."""
    forwards = sum(len(v) for v in res[0]["loss"].values())
    assert all(r["root"] == {"local": 0, "dtensor": forwards} for r in res), (layout, [r["root"] for r in res])


@pytest.mark.parametrize(
    "attention,balance,mesh,optims",
    [
        ("ring", True, "fsdp=2,cp=2", ("sgd", "adamw")),  # AdamW's state: the optimizer's path is the same below
        ("ring", False, "fsdp=2,cp=2", ("sgd",)),
        ("allgather", True, "fsdp=2,cp=2", ("sgd",)),
        ("allgather", False, "cp=4", ("sgd",)),
        ("ring", True, "cp=4", ("sgd",)),
    ],
)
def test_fsdp_cp_parity(pool4, tmp_path, attention, balance, mesh, optims):
    layout = _variant(tmp_path, "fsdp_cp", attention=attention, balance=balance)
    res = pool4.run(check_training, layout, mesh, batches=TokenBatches(seq=32), optims=optims)
    assert_parity(res)
    _dtensor_root(res, layout)


def test_fsdp_tp_cp_parity_on_8(pool8):
    """The shipped 8-process mesh fsdp2_tp2_cp2: ZeRO-3, tensor and context parallel at once,
    two steps of one micro-batch (16 tokens, 4 rows) of a one-block Llama against one device
    (the 3-D mesh is the point; fsdp_tp_cp on tp=2 x cp=2 runs 2,048 tokens and compiled below)."""
    res = pool8.run(
        check_training,
        "fsdp_tp_cp",
        "fsdp=2,tp=2,cp=2",
        build=ONE_BLOCK,
        batches=TokenBatches(batch=4, seq=16),
        optims=("sgd",),
        steps=2,
        grad_accum=1,
    )
    assert_parity(res)


@pytest.mark.parametrize("layout,mesh", [("fsdp_cp", "fsdp=2,cp=2"), ("fsdp_tp_cp", "tp=2,cp=2")])
def test_cp_parity_at_2048_tokens(pool4, layout, mesh):
    """Sequences of 2,048 tokens, as long-context training runs them (2 rows, one micro-batch,
    one block): the loss, the gradients and the parameters after an SGD step."""
    res = pool4.run(
        check_training,
        layout,
        mesh,
        build=ONE_BLOCK,
        batches=TokenBatches(batch=2, seq=2048),
        optims=("sgd",),
        steps=1,
        grad_accum=1,
    )
    assert_parity(res)


@pytest.mark.parametrize(
    "base,mesh,attention",
    [
        ("fsdp_cp", "fsdp=2,cp=2", "ring"),
        ("fsdp_cp", "fsdp=2,cp=2", "allgather"),
        ("fsdp_tp_cp", "tp=2,cp=2", "ring"),
    ],
)
def test_compiled_cp_parity(pool4, tmp_path, base, mesh, attention):
    """``train.compile=aot_eager`` under the cp layouts with balanced chunks: every block compiled
    whole (fullgraph), the attention as the two opaque custom ops of NOTE [cp ops], the
    strided-shard index math kept out of the trace (NOTE [compiled cp] in
    meshlm/runtime/compile.py); under fsdp_tp_cp the heads and mlp split over tp as well."""
    layout = _variant(tmp_path, base, attention=attention, balance=True)
    job_timeout = pool4.job_timeout_s
    pool4.job_timeout_s = 300  # four processes compiling on two cores: not a hang
    try:
        res = pool4.run(
            check_training,
            layout,
            mesh,
            batches=TokenBatches(seq=32),
            optims=("sgd",),
            compile="aot_eager",
            steps=2,
            grad_accum=1,
        )
    finally:
        pool4.job_timeout_s = job_timeout
    assert_parity(res)
    _dtensor_root(res, layout)


def test_cp_parity_with_dropout(pool4):
    """Residual dropout draws each element's one-device mask on the rank that holds it, balanced
    chunks included (NOTE [balanced chunks] in meshlm/_torch_compat/dtensor_cp.py), and
    activation checkpointing recomputes the same masks (the forward under checkpointing draws
    them as a plain forward does)."""
    res = pool4.run(
        check_training,
        "fsdp_cp",
        "fsdp=2,cp=2",
        build=LlamaBuild(overrides=(("dropout", 0.1),)),
        batches=TokenBatches(seq=32),
        optims=("sgd",),
        activation_checkpointing="full",
    )
    assert_parity(res)


def _attention_bytes(layout: str, mesh_shape: str, seq: int) -> dict:
    """Bytes on the cp axis of one forward and backward of llama_tiny, by phase and kind,
    and the local bytes K of one layer's keys (NOTE [cp attention])."""
    import torch

    import meshlm
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.comm import CommCounter

    cfg = llama_config("llama_tiny")
    mesh = meshlm.make_mesh(mesh_shape)
    model = meshlm.shard(Llama(cfg, device="meta"), layout, mesh, seed=0)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 256, (4, seq), generator=g), torch.randint(0, 256, (4, seq), generator=g))
    tokens, labels = meshlm.shard_batch(batch, layout, mesh)
    cc = CommCounter(mesh)
    with cc:
        with cc.phase("forward"):
            loss = model(tokens, labels)
        loss.backward()
    got: dict = {}
    for r in cc.records:
        if r.axes == ("cp",):
            got[(r.phase, r.kind)] = got.get((r.phase, r.kind), 0) + r.bytes
    sizes = dict(kv.split("=") for kv in mesh_shape.split(","))
    rows = 4 // int(sizes.get("fsdp", 1))
    # Llama repeats its kv heads before SDPA (docs/cp.md, limits): SDPA's keys have all the
    # query heads; a model calling SDPA with enable_gqa=True exchanges its kv heads
    # (tests/dist/test_cp_attention.py counts that case)
    k_bytes = rows * cfg.heads * (seq // int(sizes["cp"])) * cfg.hd * 4
    return {"got": got, "K": k_bytes, "layers": cfg.layers, "n": int(sizes["cp"])}


@pytest.mark.parametrize("attention", ["ring", "allgather"])
def test_cp_attention_bytes_are_the_formula(pool4, tmp_path, attention):
    """Keys and values cross the cp group as SDPA takes them, as NOTE [cp attention] counts
    them, per layer; the other
    bytes on cp are the named extras: the gradients' all-reduce (parameters are replicated
    over cp) and the loss's scalar."""
    layout = _variant(tmp_path, "fsdp_cp", attention=attention)
    r = pool4.run(_attention_bytes, layout, "fsdp=2,cp=2", 64)[0]
    K, L, n = r["K"], r["layers"], r["n"]
    F = K  # the float32 accumulator of dk (or dv): k's numel in float32, k being float32 here
    if attention == "ring":
        want = {
            ("forward", "send"): L * 2 * (n - 1) * K,
            ("forward", "recv"): L * 2 * (n - 1) * K,
            ("backward", "send"): L * (2 * (n - 1) * K + 2 * n * F),
            ("backward", "recv"): L * (2 * (n - 1) * K + 2 * n * F),
        }
    else:
        want = {
            ("forward", "all_gather"): L * 2 * n * K,
            ("backward", "all_gather"): L * 2 * n * K,
            ("backward", "reduce_scatter"): L * 2 * n * F,
        }
    got = {k: v for k, v in r["got"].items() if k[1] != "all_reduce"}
    assert got == want, (got, want)
    extras = {k: v for k, v in r["got"].items() if k[1] == "all_reduce"}
    assert extras.get(("forward", "all_reduce")) == 4, extras  # the loss: one float32
    assert set(extras) <= {("forward", "all_reduce"), ("backward", "all_reduce")}, extras


def _grad_reductions(layout: str, mesh_shape: str) -> dict:
    """The all-reduces on cp in one backward of llama_tiny (count and bytes), and the count and
    bytes of a plain torch llama_tiny's parameters."""
    import torch

    import meshlm
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.comm import CommCounter

    cfg = llama_config("llama_tiny")
    mesh = meshlm.make_mesh(mesh_shape)
    model = meshlm.shard(Llama(cfg, device="meta"), layout, mesh, seed=0)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 256, (4, 64), generator=g), torch.randint(0, 256, (4, 64), generator=g))
    tokens, labels = meshlm.shard_batch(batch, layout, mesh)
    loss = model(tokens, labels)
    cc = CommCounter(mesh)
    with cc:
        loss.backward()
    ars = [r for r in cc.records if r.axes == ("cp",) and r.kind == "all_reduce"]
    plain = list(Llama(cfg).parameters())
    return {
        "count": len(ars),
        "bytes": sum(r.bytes for r in ars),
        "params": len(plain),
        "param_bytes": sum(p.numel() * p.element_size() for p in plain),
    }


def test_cp_gradients_reduce_per_block_on_a_cp_only_mesh(pool4, tmp_path):
    """On cp=4 (no data axis) the gradients of the parameters, replicated over cp, are summed
    over cp a block at a time (NOTE [cp gradients in buckets]): every parameter's bytes once,
    in fewer all-reduces than parameters (they were one blocking all-reduce per parameter)."""
    r = pool4.run(_grad_reductions, _variant(tmp_path, "fsdp_cp", attention="ring"), "cp=4")[0]
    assert r["bytes"] == r["param_bytes"], r
    assert r["count"] <= r["params"] // 3, r


def _balanced_moves():
    """Moves between split and whole on a balanced cp axis (NOTE [balanced chunks]): a
    sequence fed in balanced order comes back in natural order through a gather, a row-
    parallel matmul and a flatten of (batch, seq) into _StridedShard rows."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import meshlm
    from meshlm._torch_compat.dtensor_cp import to_balanced
    from meshlm.models import Llama, llama_config

    mesh = meshlm.make_mesh("tp=2,cp=2")
    # the model holds the mesh's balanced settings while it lives (NOTE [cp settings per model])
    _model = meshlm.shard(Llama(llama_config("llama_tiny"), device="meta"), "fsdp_tp_cp", mesh, seed=0)
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(4, 16, 64, generator=g), torch.randn(32, 64, generator=g)
    hd = distribute_tensor(to_balanced(h, 1, 2), mesh, [Shard(2), Shard(1)])  # balanced: the permuted contiguous
    wd = distribute_tensor(w, mesh, [Shard(1), Replicate()])
    return {
        "gather": float((hd.full_tensor() - h).abs().max()),
        "linear": float((F.linear(hd, wd).full_tensor() - F.linear(h, w)).abs().max() / F.linear(h, w).abs().max()),
        "flatten": float((hd.flatten(0, 1).full_tensor() - h.flatten(0, 1)).abs().max()),
    }


def test_balanced_moves_keep_natural_order(pool4):
    for got in pool4.run(_balanced_moves):
        assert got["gather"] == 0.0 and got["flatten"] == 0.0 and got["linear"] < 1e-6, got


def _two_models(layout_a: str, layout_b: str) -> dict:
    """Two Llamas on equal meshes (fsdp=2 x cp=2, two make_mesh calls) whose layouts differ
    in ``context`` (NOTE [cp settings per model] in meshlm/runtime/cp/active.py): A balanced
    with ring attention, B unbalanced with all-gather, sharded one after the other.  Two SGD
    steps, the models' forwards and backwards interleaved (A, B forward; A, B backward; then
    B before A), each step's loss and gradients against a plain torch copy holding the
    sharded model's weights; the attention's collectives of each model counted on its own.
    Then what cannot be exact is refused: one backward through both, an output split over
    cp, a third model sharded with B's balance once A returned an output split over cp, and
    both models compiled."""
    import torch

    import meshlm
    from harness import tolerances as tol
    from harness.recipes import full_many
    from meshlm.core.errors import ConfigError
    from meshlm.models import Llama, llama_config
    from meshlm.runtime.comm import CommCounter
    from meshlm.runtime.compile import compile_blocks
    from meshlm.runtime.optim.sharded import ShardedOptimizer

    cfg = llama_config("llama_tiny")
    lr = 0.5
    sides = {}
    for name, layout, seed in (("a", layout_a, 0), ("b", layout_b, 1)):
        mesh = meshlm.make_mesh("fsdp=2,cp=2")
        model = meshlm.shard(Llama(cfg, device="meta"), layout, mesh, seed=seed)
        sides[name] = dict(layout=layout, mesh=mesh, model=model, opt=ShardedOptimizer(model, torch.optim.SGD, lr=lr))
    probe = Llama(cfg, device="cpu", seed=0)

    def batch(name, k):
        tokens, labels = TokenBatches(seq=32)(k, 0 if name == "a" else 1)[0]
        s = sides[name]
        return (tokens, labels), meshlm.shard_batch((tokens, labels), s["layout"], s["mesh"])

    def want(name, k):
        (tokens, labels), _ = batch(name, k)
        weights = full_many(dict(sides[name]["model"].named_parameters()))
        with torch.no_grad():
            for n, p in probe.named_parameters():
                p.copy_(weights[n])
                p.grad = None
        loss = probe(tokens, labels)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in probe.named_parameters()}

    errors = []

    def check(name, k, got, ref):
        loss, grads = ref
        err = float((got.detach() - loss).abs() / loss.abs())
        if err > tol.LOSS_RTOL:
            errors.append(f"{name} step {k}: loss off by {err:.3g} relative")
        for n, g in full_many({n: p.grad for n, p in sides[name]["model"].named_parameters()}).items():
            if ((g - grads[n]).abs() > tol.grad_tol(grads[n])).any():
                errors.append(f"{name} step {k}: gradient of {n} off by {float((g - grads[n]).abs().max()):.3g}")

    for k, order in ((1, "ab"), (2, "ba")):
        refs = {n: want(n, k) for n in order}
        losses = {n: sides[n]["model"](*batch(n, k)[1]) for n in order}
        for n in order:
            losses[n].backward()
        for n in order:
            check(n, k, losses[n], refs[n])
            sides[n]["opt"].step()
            sides[n]["opt"].zero_grad()
    kinds = {}
    for n, side in sides.items():
        cc = CommCounter(side["mesh"])
        with cc:
            side["model"](*batch(n, 3)[1]).backward()
        side["opt"].zero_grad()
        kinds[n] = sorted({r.kind for r in cc.records if r.axes == ("cp",) and r.kind != "all_reduce"})
    del side
    (tokens, _), (xa, ya) = batch("a", 4)
    refused = {}

    def refusal(what, fn, *args):
        try:
            fn(*args)
        except ConfigError as e:
            refused[what] = str(e)

    def both(a, b):
        (a(xa, ya) + b(*batch("b", 4)[1])).backward()

    a, b = sides["a"]["model"], sides["b"]["model"]
    refusal("one backward", both, a, b)
    refusal("split output", a, xa)
    refusal("shard", meshlm.shard, Llama(cfg, device="meta"), layout_b, meshlm.make_mesh("fsdp=2,cp=2"))
    for m in (a, b):
        compile_blocks(m, "aot_eager")
    refusal("compiled", a, xa, ya)  # refused before anything is traced
    return {"errors": errors, "kinds": kinds, "refused": refused}


def test_two_models_keep_their_own_cp_settings(pool4, tmp_path):
    """NOTE [cp settings per model]: each model's context settings hold for its own forward and
    backward on equal meshes, and what could mix them is refused, naming both models' settings."""
    a = _variant(tmp_path, "fsdp_cp", attention="ring", balance=True)
    b = _variant(tmp_path, "fsdp_cp", attention="allgather", balance=False)
    for r in pool4.run(_two_models, a, b):
        assert r["errors"] == [], r["errors"]
        assert r["kinds"] == {"a": ["recv", "send"], "b": ["all_gather", "reduce_scatter"]}, r["kinds"]
        assert set(r["refused"]) == {"one backward", "split output", "compiled", "shard"}, r["refused"]
        for what, msg in r["refused"].items():
            assert "balance true" in msg and "balance false" in msg, (what, msg)
