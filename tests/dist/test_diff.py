"""``meshlm diff`` (meshlm/app/diff.py, meshlm/train/diff/): one training step of llama_tiny
under two configurations, compared tensor by tensor.

The sides run on this module's gloo pools (``diff(..., run_side=...)``: a side of N devices on
the pool of N workers), which is how the tests inject a bug into one side only: each bug is
a patch of the runtime (or of the model) made inside the workers of that side for the length
of its step (``_injected``), a copy of the runtime for those processes.  Each bug must be
named where it first shows: the right kind of tensor, module and tensor.  Unmodified, every
shipped layout that runs without a pipeline agrees with ``single`` on one device, and so do
sides that differ in compilation, precision (bf16, with its measured tolerance) and
accumulation.  Tolerances: NOTE [diff tolerances] in meshlm/train/diff/compare.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshlm
from harness import dist_pool_fixture
from meshlm.app.diff import diff

pool1 = dist_pool_fixture(1, timeout_s=60)
pool2 = dist_pool_fixture(2, timeout_s=60)
pool4 = dist_pool_fixture(4, timeout_s=60)

REPO = Path(__file__).resolve().parents[2]
BASE = ["model=llama_tiny", "train.seq_len=16", "train.batch_size=8"]
REFERENCE = ["b.layout=single", "b.mesh=cpu1"]

# Every shipped layout on a mesh of at most 4 devices where it shards (vlm_fsdp_tp below, with
# its model); the pipelines with two micro-batches on both sides (their schedules need them).
LAYOUTS = [
    ("single", "dp2"), ("ddp", "dp2"), ("zero1", "dp2"), ("zero2", "dp2"), ("fsdp", "fsdp2"), ("hsdp", "dp2_fsdp2"),
    ("tp", "tp2"), ("tp_sp", "tp2"), ("fsdp_tp", "fsdp2_tp2"), ("fsdp_tp_sp", "fsdp2_tp2"), ("pp", "pp2"),
    ("fsdp_pp", "fsdp2_pp2"), ("fsdp_tp_pp", "pp2 a.mesh.tp=2"),
]  # fmt: skip
PIPELINED = {"pp", "fsdp_pp", "fsdp_tp_pp"}
# vlm_fsdp_tp scopes the VLM's vision tower: its model, fed image-caption pairs (the shapes task)
VLM = ["model=vlm_tiny", "data.format=images", "data.shapes_samples=64", "train.seq_len=64"]


@contextlib.contextmanager
def _injected(bug: str | None):
    """``bug`` patched into this worker's runtime for the block (the test docstrings say what
    each is)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    from meshlm.models import llama
    from meshlm.runtime.bucket import op
    from meshlm.runtime.lowering import atuse, local_root

    saved = atuse.AtUse.backward, op.flat_moves, local_root.BatchReduce.backward, llama.apply_rope
    hf_saved: list = []
    try:
        if bug == "norm_grad_not_reduced_over_tp":  # a 1-D weight gradient Partial over tp taken as reduced

            def at_use_backward(ctx, g):
                if g.ndim == 1 and any(p.is_partial() for p in g.placements):
                    pl = [Replicate() if p.is_partial() else p for p in g.placements]
                    g = DTensor.from_local(g.to_local(), g.device_mesh, pl, run_check=False)
                return saved[0](ctx, g)

            atuse.AtUse.backward = staticmethod(at_use_backward)
        elif bug == "grads_reduced_over_wrong_axis":  # a block bucket's reduce-scatter over tp, not fsdp

            def flat_moves(xs, pls, tg, sizes, groups, order, **kw):
                return saved[1](xs, pls, tg, sizes, list(reversed(groups)), order, **kw)

            op.flat_moves = flat_moves
        elif bug == "loss_drops_grad_accum":  # the local root's loss back-propagates 1, not 1/grad_accum

            def batch_reduce_backward(ctx, g, _total):
                one = torch.ones_like(g)
                return (one if ctx.scale is None else one * ctx.scale.to(g.dtype)), None, None, None

            local_root.BatchReduce.backward = staticmethod(batch_reduce_backward)
        elif bug == "query_rope_offset_by_rank":  # rank r's queries rotated as if at positions r * seq on

            def apply_rope(x, cos, sin):
                r, seq, hd = dist.get_rank(), cos.shape[-2], 2 * cos.shape[-1]
                if r and x.shape[1] == llama.CONFIGS["llama_tiny"].heads:  # the queries, not the keys
                    cos, sin = (
                        t[r * seq :] for t in llama.rope_tables(seq * (r + 1), hd, 10000.0, cos.device, cos.dtype)
                    )
                return saved[3](x, cos, sin)

            llama.apply_rope = apply_rope
        elif bug == "hf_second_layer_off":  # transformers' second decoder layer's output off by 0.1%
            from transformers.models.llama import modeling_llama

            layer = modeling_llama.LlamaDecoderLayer
            hf_saved.append((layer, layer.forward))

            def forward(self, *args, **kwargs):
                out = hf_saved[0][1](self, *args, **kwargs)
                if self.self_attn.layer_idx != 1:
                    return out
                return (out[0] * 1.001, *out[1:]) if isinstance(out, tuple) else out * 1.001

            layer.forward = forward
        elif bug is not None:
            raise ValueError(bug)
        yield
    finally:
        atuse.AtUse.backward, op.flat_moves, local_root.BatchReduce.backward, llama.apply_rope = saved
        for cls, forward in hf_saved:
            cls.forward = forward


def _side_job(side, bug):
    import torch.distributed as dist

    from meshlm.app.diff import side_capture

    with _injected(bug):
        cap = side_capture(side)
    return cap.to_state() if dist.get_rank() == 0 else None


_REFERENCES: dict = {}  # a reference side's capture by its overrides: the same for every test


def _run(pools: dict, bug: str | None = None):
    """``run_side`` for ``diff``: a side on the pool of its size, ``bug`` in side a only."""
    from meshlm.train.diff import Capture

    def run(side):
        key = (side.name, side.overrides)
        if side.name == "b" and key in _REFERENCES:
            return _REFERENCES[key]
        cap = Capture.from_state(pools[side.world].run(_side_job, side, bug if side.name == "a" else None)[0])
        if side.name == "b":
            _REFERENCES[key] = cap
        return cap

    return run


@pytest.fixture
def pools(pool1, pool2, pool4):
    return {1: pool1, 2: pool2, 4: pool4}


def _first(report):
    f = report.first
    assert f is not None, "the sides agree: the bug went unseen"
    return f


@pytest.mark.parametrize("layout,mesh", LAYOUTS, ids=[f"{lay}-{m.split()[0]}" for lay, m in LAYOUTS])
def test_every_layout_agrees_with_one_device(pools, layout, mesh):
    accum = ["train.grad_accum=2"] if layout in PIPELINED else []
    r = diff([*BASE, *accum, f"a.layout={layout}", *f"a.mesh={mesh}".split(), *REFERENCE], run_side=_run(pools))
    kinds = {row.kind for row in r.rows}
    assert kinds == {"init", "block", "constrain", "loss", "norm", "grad", "param"}, kinds
    assert r.agree, [(x.kind, x.label(), x.ratio) for x in r.diverged]
    assert not r.only_a and not r.only_b, (r.only_a, r.only_b)


def test_vlm_layout_agrees_with_one_device(pools):
    over = [*VLM, "train.batch_size=4", "a.layout=vlm_fsdp_tp", "a.mesh=fsdp2_tp2", *REFERENCE]
    r = diff(over, run_side=_run(pools))
    assert r.agree, [(x.kind, x.label(), x.ratio) for x in r.diverged]
    assert {"block", "constrain", "grad"} <= {row.kind for row in r.rows}


def test_norm_weight_gradient_missing_its_tp_reduction(pools):
    """Under sequence parallelism a norm weight's gradient is a sum over the sequence shards
    (Partial over tp); taken as reduced, each rank keeps its own part.  Named: the gradient of
    the final norm's weight, the first norm weight backward reaches; nothing before it."""
    r = diff([*BASE, "a.layout=tp_sp", "a.mesh=tp2", *REFERENCE], run_side=_run(pools, "norm_grad_not_reduced_over_tp"))
    f = _first(r)
    assert (f.kind, f.where) == ("grad", "norm.weight"), f
    assert f.ratio > 1e3, f
    assert all(x.ok for x in r.rows if x.kind in ("block", "constrain", "loss")), "the forward is not affected"


def test_gradient_reduced_over_the_wrong_mesh_axis(pools):
    """fsdp_tp on fsdp=2,tp=2: a block's gradients reduce-scattered over tp instead of fsdp.
    Named: the last block's down-projection, the first block gradient backward makes (the
    root's parameters, reduced one by one, are right)."""
    r = diff(
        [*BASE, "a.layout=fsdp_tp", "a.mesh=fsdp2_tp2", *REFERENCE],
        run_side=_run(pools, "grads_reduced_over_wrong_axis"),
    )
    f = _first(r)
    assert (f.kind, f.where) == ("grad", "layers.1.mlp.w_down"), f
    assert f.ratio > 1e3, f
    assert all(x.ok for x in r.rows if x.kind == "grad" and not x.where.startswith("layers.")), "root grads are right"


def test_dropped_division_by_grad_accum(pools):
    """ddp on dp=2 with two micro-batches: the local root's loss back-propagates 1 where the
    accumulation weight is 1/2.  Every gradient doubles; named: the head's, which backward
    makes first; the forward and the loss are right."""
    over = [*BASE, "train.grad_accum=2", "a.layout=ddp", "a.mesh=dp2", *REFERENCE]
    r = diff(over, run_side=_run(pools, "loss_drops_grad_accum"))
    f = _first(r)
    assert (f.kind, f.where) == ("grad", "lm_head"), f
    assert abs(f.rel - 1.0) < 1e-3, f  # doubled: |2g - g| / |g|
    assert all(x.ok for x in r.rows if x.kind in ("block", "constrain", "loss")), "the forward is not affected"


def test_wrong_rope_offset_of_a_shard(pools):
    """tp on tp=2, rank 1 rotating its heads' queries as if their positions started at rank x
    seq, its keys at 0: a query shard's RoPE offset that does not match its keys' (the bug of
    a sequence-sharded attention; an offset of both would cancel, RoPE being relative).
    Named: the attention output of the first block (queries and keys are recorded before
    RoPE, and agree)."""
    r = diff([*BASE, "a.layout=tp", "a.mesh=tp2", *REFERENCE], run_side=_run(pools, "query_rope_offset_by_rank"))
    f = _first(r)
    assert (f.kind, f.where, f.tensor) == ("constrain", "layers.0.attn", "constrain 4"), f
    assert f.axes == ("batch", "heads", None, "head_dim"), f
    assert f.ratio > 1e3, f


# --------------------------------------------------------------------------- a user's model
@meshlm.block
class _Block(nn.Module):
    def __init__(self, width: int, index: int):
        super().__init__()
        self.index = index
        self.up = meshlm.set_axes(nn.Linear(width, 2 * width), weight=("mlp", "embed"), bias=("mlp",))
        self.down = meshlm.set_axes(nn.Linear(2 * width, width), weight=("embed", "mlp"), bias=("embed",))

    def forward(self, x):
        y = x + self.down(F.gelu(self.up(x)))
        if self.index == 1 and torch.distributed.is_initialized():  # the bug: this block's output depends on the rank
            y = y + 0.01 * torch.distributed.get_rank()
        return y


class RankModel(nn.Module):
    """A plain model of the user's (weights made in ``__init__``), whose second block's
    output depends on the rank."""

    param_axes: ClassVar[dict] = {}

    def __init__(self, vocab: int = 256, width: int = 32, depth: int = 3):
        super().__init__()
        self.emb = meshlm.set_axes(nn.Embedding(vocab, width), weight=("vocab", "embed"))
        self.blocks = nn.ModuleList(_Block(width, i) for i in range(depth))
        self.head = meshlm.set_axes(nn.Linear(width, vocab, bias=False), weight=("vocab", "embed"))

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten(0, 1))


def test_user_model_whose_forward_depends_on_the_rank(pools):
    """Caught at its first affected block: the output of blocks.1 (blocks.0 agrees)."""
    over = [
        "model._target_=test_diff.RankModel",
        "train.seq_len=16",
        "train.batch_size=8",
        "a.layout=ddp",
        "a.mesh=dp2",
        *REFERENCE,
    ]
    r = diff(over, run_side=_run(pools))
    f = _first(r)
    assert (f.kind, f.where, f.tensor) == ("block", "blocks.1", "output"), f
    assert next(x for x in r.rows if x.where == "blocks.0" and x.kind == "block").ok


# --------------------------------------------------------------------------- sides that differ
def test_sides_compiled_and_eager_agree(pools):
    """tp on tp=2 with its blocks compiled (aot_eager, the recording traced into the graphs)
    against eager on one device: every tensor recorded, in agreement."""
    r = diff([*BASE, "a.layout=tp", "a.mesh=tp2", "a.train.compile=aot_eager", *REFERENCE], run_side=_run(pools))
    assert r.agree, [(x.kind, x.label(), x.ratio) for x in r.diverged]
    assert not r.only_a and not r.only_b, (r.only_a, r.only_b)
    assert sum(x.kind == "constrain" for x in r.rows) >= 20  # the compiled blocks' own constrains too


def test_bf16_side_within_its_measured_tolerance(pools):
    """fsdp on fsdp=2 in bf16 with two micro-batches against float32 on one device with one:
    within the bf16 tolerance measured on one device (NOTE [diff tolerances]); the float32
    tolerances alone would call it diverged at the first activation."""
    from meshlm.app.diff import calibration, sides
    from meshlm.train.diff import compare

    over = [*BASE, "a.layout=fsdp", "a.mesh=fsdp2", "a.train.param_dtype=bfloat16", "a.train.grad_accum=2",
            *REFERENCE]  # fmt: skip
    r = diff(over, run_side=_run(pools))
    assert r.agree, [(x.kind, x.label(), x.ratio) for x in r.diverged]
    a, b = sides(over)
    cal = calibration(a, b)
    run = _run(pools)
    fp32_only = compare(run(a), run(b), {k: (0.0, 0.0) for k in cal})
    f = _first(fp32_only)
    assert (f.kind, f.where, f.tensor) == ("constrain", "(root)", "constrain 0"), f


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from harness.hf_tiny import tiny_llama

    d = tmp_path_factory.mktemp("hf") / "tiny"
    tiny_llama().save_pretrained(str(d), safe_serialization=True)
    return str(d)


def test_transformers_side(pools, hf_dir):
    """The transformers model of a directory against meshlm's loaded from it under tp_sp:
    forward (block outputs), loss, gradients by parameter name and the step agree; with the
    second decoder layer's output off by 0.1% in transformers, named: that block's output."""
    over = [*BASE, f"a=hf:{hf_dir}", "b.layout=tp_sp", "b.mesh=tp2"]
    r = diff(over, run_side=_run(pools))
    assert r.agree, [(x.kind, x.label(), x.ratio) for x in r.diverged]
    assert {x.kind for x in r.rows} == {"init", "block", "loss", "grad", "norm", "param"}
    assert sum(x.kind == "grad" for x in r.rows) == 21  # every parameter of the 2-layer Llama by name
    f = _first(diff(over, run_side=_run(pools, "hf_second_layer_off")))
    assert (f.kind, f.where, f.tensor) == ("block", "layers.1", "output"), f


# --------------------------------------------------------------------------- the command
def _meshlm_diff(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "meshlm.app.cli", "diff", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_command_launches_the_sides_and_exits_1_on_a_divergence(tmp_path):
    """``meshlm diff`` as a user runs it: side a in 2 worker processes it starts, side b in
    its own process; sides built from different seeds diverge at the first weight, exit 1,
    with the table and the JSON report."""
    out = tmp_path / "report.json"
    r = _meshlm_diff(
        *BASE, "a.layout=ddp", "a.mesh=dp2", "a.train.seed=1", *REFERENCE, "--json", str(out), cwd=tmp_path
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "first divergence, in execution order:" in r.stdout and "init      tok_emb" in r.stdout, r.stdout
    rep = json.loads(out.read_text())
    assert rep["agree"] is False and rep["first"]["kind"] == "init" and rep["first"]["where"] == "tok_emb"
    assert rep["a"]["processes"] == 2 and rep["b"]["processes"] == 1


def test_command_exits_0_when_the_sides_agree(tmp_path, monkeypatch, capfd):
    """Both sides on one device: the command runs them in its own process, so it runs here,
    through its entry point (the exit-status contract in a process of its own: above)."""
    from meshlm.app.cli import main

    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    code = main(["diff", *BASE, "mesh=cpu1", "a.layout=fsdp", "b.layout=single", "--top", "3"])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert "the sides agree" in out and "top 3 by relative difference" in out, out
    assert list(tmp_path.glob("outputs/diff/*/*/report.json")), "the JSON report under outputs/diff/"
