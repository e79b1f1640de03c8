"""Parity of sharded training against the same training on one device, for any model.

``check_training(layout, mesh_shape, ...)`` runs inside every rank of a gloo process group
(``DistPool.run``).  For each optimizer it builds two copies of the model from one seed:
the *reference*, a plain torch model stepped by a plain ``torch.optim`` optimizer on one
process, and the *sharded* model, lowered by ``meshlm.shard`` and stepped by
``ShardedOptimizer``.  Both take ``steps`` optimizer steps, each accumulating
``grad_accum`` micro-batches the way ``meshlm.app.train`` does (``(loss / grad_accum)
.backward()``, then step, then ``zero_grad``), on the same global batches (the sharded
model gets this rank's slice of each).  It asserts (tolerances and their derivation in
``harness.tolerances``, NOTE [tolerances after steps]):

* the sharded initialisation equals the one-device one exactly, and so do the optimizer's
  masters;
* after every backward, every gradient sits where the layout's ``grads`` section puts it
  (or Partial over the data axes where it is reduced at the step, ZeRO-1) and none is an
  ``AsyncCollectiveTensor`` still in flight;
* at every step, each micro-batch's loss, and the gradient the optimizer actually steps
  with (``opt.reduce_grads()``, then ``opt.masters()[fqn].grad``: after the ZeRO-1/2
  reduction at the step, masters included), equal those of a plain torch copy of the model
  holding the sharded model's current weights (the *probe*; at step 1 the reference itself),
  within the one-step tolerances; and so does the global gradient norm clipping uses
  (``opt.grad_norm()``, over every pipeline stage), within the norm of those tolerances;
* after every step, every parameter, every master and every optimizer state tensor
  (``opt.inner.state[master]``: SGD's momentum buffer, AdamW's exp_avg, exp_avg_sq and step)
  equal the reference's within bounds propagated through the optimizer's update rule, and
  every module buffer (a positional table, running statistics: NOTE [buffers] in
  meshlm/runtime/lowering/buffers.py) the reference's, integer ones exactly.

``precision="bf16"`` checks mixed precision as ``meshlm train`` runs it under
``train.param_dtype=bfloat16`` (the sharded model gets ``meshlm.app.train.shard_dtypes``: bf16
compute over float32 storage, or bf16 storage with float32 masters and main gradients for
ZeRO-1/2), against the same recipe in plain torch: a bf16 copy of the model at the float32
weights, its gradients accumulated in float32, a float32 optimizer (``harness.
parity_mp``).  The checks are the ones above, with the probe loaded with the sharded float32
masters and one-step tolerances in units of the probe's own bf16 rounding error (NOTE
[mixed-precision parity] in tolerances.py); a parameter stored in bf16 is bounded as its
master rounded; and every gradient must be float32 after backward, and every gradient
reduction over a data axis float32 (eager runs).

Nothing of the reference comes from the code under test: its gradients are its own, its
optimizer is torch's, and the probe is a plain torch model given only the gathered weights.
The model is anything ``build(device, seed)`` returns whose forward returns a scalar loss;
Llama on token batches is the default (``LlamaBuild``, ``TokenBatches``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from harness import parity_pp
from harness import tolerances as tol
from harness.parity_mp import BF16
from harness.recipes import FP32, full_many
from harness.recipes import forward_seed as _forward_seed
from harness.recipes import full as _full
from meshlm import _torch_compat as compat
from meshlm.core.weighting import rescale

# The optimizers the harness knows bounds for (NOTE [tolerances after steps]).  SGD's lr is
# large enough that a gradient off by 2x moves the weights by far more than rounding.
OPTIMS: dict[str, tuple[type, dict]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}),
    # Adam without weight decay steps as AdamW with none: its bounds are AdamW's at weight_decay 0
    "adam": (torch.optim.Adam, {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}),
}
#: the update rule whose bounds an optimizer's error follows (NOTE [tolerances after steps])
BOUNDS = {"adam": ("adamw", {"weight_decay": 0.0})}


@dataclass(frozen=True)
class LlamaBuild:
    """``build`` for ``check_training``: ``meshlm.models.Llama`` of a named config."""

    model: str = "llama_tiny"
    overrides: tuple = ()  # (name, value) pairs for llama_config

    def __call__(self, device: str, seed: int) -> nn.Module:
        from meshlm.models import Llama, llama_config

        return Llama(llama_config(self.model, **dict(self.overrides)), device=device, seed=seed)


@dataclass(frozen=True)
class MoEBuild:
    """``build`` for ``check_training``: ``meshlm.models.MoETransformer`` of a named config;
    ``away``: experts whose selection bias keeps every token from them."""

    model: str = "moe_tiny"
    overrides: tuple = ()  # (name, value) pairs for moe_config
    away: tuple = ()

    def __call__(self, device: str, seed: int) -> nn.Module:
        from meshlm.models import MoETransformer, moe_config

        m = MoETransformer(moe_config(self.model, **dict(self.overrides)), device=device, seed=seed)
        if self.away and device != "meta":
            for blk in m.layers:
                blk.moe.selection_bias[list(self.away)] = -10.0
        return m


@dataclass(frozen=True)
class VlmBuild:
    """``build`` for ``check_training``: ``meshlm.models.VLM`` of ``vlm_tiny``."""

    def __call__(self, device: str, seed: int) -> nn.Module:
        from meshlm.models import VLM, vlm_config

        return VLM(vlm_config("vlm_tiny"), device=device, seed=seed)


@dataclass(frozen=True)
class VlmBatches:
    """``batches`` for ``check_training`` with ``VlmBuild``: micro-batches of 8 rows of 24
    tokens, each row with its 16 image tokens at a different offset, except the text-only
    rows ``text_rows`` (zero images, no image tokens)."""

    text_rows: tuple[int, ...] = ()

    def __call__(self, step: int, micro: int) -> tuple[tuple, dict]:
        from meshlm.models import vlm_config

        c = vlm_config("vlm_tiny")
        g = torch.Generator().manual_seed(100 * step + micro)
        b, s, p = 8, 24, c.patches
        tokens = torch.randint(0, 256, (b, s), generator=g)
        labels = torch.randint(0, 256, (b, s), generator=g)
        images = torch.rand(b, c.channels, c.image_size, c.image_size, generator=g)
        for r in range(b):
            if r in self.text_rows:
                images[r] = 0.0
                continue
            at = r % (s - p + 1)
            tokens[r, at : at + p] = c.image_token
            labels[r, at : at + p] = -100
        return (tokens, labels, images), {}


@dataclass(frozen=True)
class TokenBatches:
    """``batches`` for ``check_training``: (tokens, labels) of ``batch`` x ``seq`` random
    ids, different for every (step, micro-batch).  ``ignored_targets``: some labels are
    -100 (``F.cross_entropy``'s ignore_index), unevenly over the rows, so the ranks' loss
    means have different weights."""

    vocab: int = 256
    batch: int = 8
    seq: int = 16
    ignored_targets: bool = False
    seed: int = 1234

    def __call__(self, step: int, micro: int) -> tuple[tuple, dict]:
        gen = torch.Generator().manual_seed(self.seed + 1000 * step + micro)
        tokens = torch.randint(0, self.vocab, (self.batch, self.seq), generator=gen)
        labels = torch.randint(0, self.vocab, (self.batch, self.seq), generator=gen)
        if self.ignored_targets:  # row 0 keeps 2 of its targets, row 1 none, the last row all but one
            labels[0, 2:] = -100
            labels[1] = -100
            labels[-1, :1] = -100
        return (tokens, labels), {}


def check_training(
    layout: str,
    mesh_shape: str,
    *,
    build: Callable[[str, int], nn.Module] | None = None,
    batches: Callable[[int, int], tuple[tuple, dict]] | None = None,
    input_axes: Mapping[Any, Sequence[str | None]] | None = None,
    optims: Sequence[str] = ("sgd", "adamw"),
    steps: int = 3,
    grad_accum: int = 2,
    compile: str | None = None,
    comms: str = "graph",
    overlap: bool | None = None,
    shard_kw: dict | None = None,
    hparams: dict | None = None,
    seed: int = 0,
    from_seed: bool = True,
    strict: bool = True,
    activation_checkpointing: str = "none",
    precision: str = "fp32",
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
    after: Callable[..., Any] | None = None,
    no_decay: Sequence[str] = (),
    ref_no_decay: Callable[[str, Tensor], bool] | None = None,
    lr_factor: Callable[[int], float] | None = None,
) -> dict:
    """Train ``build``'s model sharded under ``layout`` on ``mesh_shape`` and on one device
    side by side and check them (module docstring).

    ``build(device, seed)``: the model on ``device`` ("cpu", or "meta" for a model that
    ``meshlm.shard`` initialises from ``seed`` shard by shard; ``from_seed=False`` shards a
    "cpu" model's own weights instead).  ``batches(step, micro)``: the global
    ``(args, kwargs)`` of a micro-batch; every tensor in them is split with
    ``meshlm.shard_batch``, along ``input_axes[i]`` (positional) or ``input_axes[name]``
    (keyword) where given.  ``optims``: keys of ``OPTIMS``, each on its own pair of model
    copies, its hyperparameters updated from ``hparams[name]``.  ``compile``: a
    ``torch.compile`` backend for ``meshlm.runtime.compile.compile_blocks``; ``comms``, ``overlap``
    and ``shard_kw`` go to it and to ``meshlm.shard``.  ``strict=False`` reports instead of
    raising.  ``precision``: "fp32", or "bf16" for mixed precision as ``meshlm train`` runs
    it, against the same recipe in plain torch (``harness.parity_mp``).  A layout
    with ``layers: pp`` on a mesh with ``pp`` > 1 runs as a pipeline (``schedule``,
    ``stages_per_rank``: ``meshlm.runtime.pipeline``; ``harness.parity_pp``), its
    ``grad_accum`` micro-batches through the schedule.  ``after(model, ref, bounds, job)``
    is called once each optimizer's steps are done and checked, with the sharded model, the
    reference, each parameter's bound on |sharded - reference| by FQN (every parameter,
    gathered over pipeline stages) and the job (its ``batches``, ``build``, ``_shard``,
    ``runner``); what it returns is reported under ``after``, by optimizer.  ``no_decay``:
    meshlm's no-decay rules (``meshlm.train.param_groups``) for the sharded optimizer's
    groups, ``ref_no_decay(name, param)`` the reference's own choice of the parameters
    stepped with ``weight_decay=0``; ``lr_factor(k)``: the learning rate of step ``k``, as a
    multiple of the optimizer's ``lr``, in every group of both optimizers (a schedule).

    Returns per optimizer the worst error/tolerance ratio of each checked quantity
    (``worst``), this rank's sharded losses (``loss``), and how many sharded forwards ran
    on a local root or under DTensor (``root``; NOTE [local root] in meshlm/runtime/lowering/local_root.py).
    """
    import meshlm
    from meshlm.runtime.activation_checkpointing import apply_activation_checkpointing
    from meshlm.runtime.lowering import shard_state

    compat.dynamo_reset()
    piped = parity_pp.wants_pipeline(layout, mesh_shape)
    if piped:
        from meshlm.runtime.pipeline import pipeline_mesh

        full_mesh, mesh = pipeline_mesh(mesh_shape)
    else:
        mesh = meshlm.make_mesh(mesh_shape)
    recipe = _recipe(precision, mesh)
    job = _Job(
        layout,
        mesh,
        build or LlamaBuild(),
        batches or TokenBatches(),
        dict(input_axes or {}),
        grad_accum,
        strict,
        recipe,
        _OneByOne(),
        no_decay=tuple(no_decay),
        ref_no_decay=ref_no_decay,
        lr_factor=lr_factor,
    )
    dtypes = recipe.shard_dtypes(layout, mesh, compile, comms)
    roots = {"local": 0, "dtensor": 0}
    worst, losses, extra = {}, {}, {}
    for name in optims:
        cls, hp = OPTIMS[name]
        hp = {**hp, **(hparams or {}).get(name, {})}
        kw = {**dtypes, **(shard_kw or {})}
        if piped:
            pipe = parity_pp.build(
                job, full_mesh, mesh, seed, from_seed, schedule, stages_per_rank, overlap=overlap, **kw
            )
            model, job.runner = pipe.model, parity_pp.Piped(pipe)
        else:
            model = meshlm.shard(
                job.build("meta" if from_seed else "cpu", seed), layout, mesh, seed=seed, overlap=overlap, **kw
            )
        ref = job.build("cpu", seed)
        refp = dict(ref.named_parameters())
        mine = full_many(dict(model.named_parameters()))
        for n, p in model.named_parameters():  # a narrower storage holds the weights rounded to it
            torch.testing.assert_close(
                mine[n],
                refp[n].detach().to(p.dtype),
                rtol=0,
                atol=tol.INIT_ATOL,
                msg=lambda m, n=n: f"init of {n}: {m}",
            )
        apply_activation_checkpointing(model, activation_checkpointing)
        if compile:
            from meshlm.runtime.compile import compile_blocks

            compile_blocks(model, compile, comms=comms)
        worst[name], losses[name] = job.train(name, cls, hp, model, ref, seed, steps)
        for k, v in shard_state(model).roots.items():
            roots[k] += v
        if after is not None:
            extra[name] = after(model, ref, job.runner.everywhere(job.param_bounds), job)
    return {"worst": worst, "loss": losses, "root": roots, "after": extra}


def assert_parity(results: list) -> None:
    """``check_training``'s results from every rank: the ranks saw the same losses, and every
    checked quantity (loss, gradient, parameter, optimizer state) was within its tolerance."""
    assert all(r["loss"] == results[0]["loss"] for r in results), "ranks disagree on the loss"
    for r in results:
        for name, worst in r["worst"].items():
            assert set(worst) >= {"loss", "grad", "param", "state"}, (name, worst)
            assert all(v <= 1.0 for v in worst.values()), (name, worst)


class _OneByOne:
    """The micro-batches of a step one after another, as meshlm.app.train runs them without pp."""

    def passes(self, job: "_Job", model: nn.Module, micro: list, seed: int, step: int) -> list[Tensor]:
        return job.one_by_one(model, micro, seed, step)

    def everywhere(self, weights: dict[str, Tensor]) -> dict[str, Tensor]:
        return weights

    def setup(self, opt) -> None:
        pass


def _recipe(precision: str, mesh) -> FP32:
    if precision == "fp32":
        return FP32()
    if precision == "bf16":
        return BF16(mesh)
    raise ValueError(f"check_training(precision={precision!r}): 'fp32' or 'bf16'")


@dataclass
class _Job:
    layout: str
    mesh: Any
    build: Callable
    batches: Callable
    input_axes: dict
    grad_accum: int
    strict: bool
    recipe: FP32
    runner: Any = None  # how a step's micro-batches run: _OneByOne, or parity_pp.Piped (pipeline layouts)
    param_bounds: dict = field(default_factory=dict)  # after train: FQN -> bound on |param - reference| (held here)
    grad_factor: float = 1.0  # what the step's micro-batch weights rescale the gradients by (one_by_one)
    no_decay: tuple = ()  # meshlm's no-decay rules for the sharded optimizer
    ref_no_decay: Callable | None = None  # (name, param) -> True: the reference steps it without weight decay
    lr_factor: Callable | None = None  # step -> learning rate of every group, as a multiple of the optimizer's

    def plain(self, weights: dict[str, Tensor], seed: int, slot: dict, key: str) -> nn.Module:
        """A plain torch copy of the model holding ``weights`` (built once per ``key`` in ``slot``)."""
        m = slot.get(key)
        if m is None:
            m = slot[key] = self.build("cpu", seed)
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(weights[n])
                p.grad = None
        return m

    def _check(self, what: str, err: Tensor, bound: Tensor, worst: dict, key: str) -> None:
        r = tol.ratio(err, bound)
        worst[key] = max(worst.get(key, 0.0), r)
        if self.strict and not r <= 1.0:
            i = int(torch.argmax((err.abs() - bound).reshape(-1))) if err.numel() else 0
            raise AssertionError(
                f"{self.layout} on {self.mesh.shape}: {what} exceeds its tolerance {r:.3g}x "
                f"(element {i}: error {float(err.reshape(-1)[i]):.3g}, tolerance "
                f"{float(bound.reshape(-1)[i]):.3g}; tests/harness/tolerances.py)"
            )

    def _shard(self, args: tuple, kwargs: dict) -> tuple[list, dict]:
        import meshlm

        def one(key, x):
            if not isinstance(x, Tensor):
                return x
            axes = self.input_axes.get(key)
            return meshlm.shard_batch(x, self.layout, self.mesh, None if axes is None else tuple(axes))

        return [one(i, a) for i, a in enumerate(args)], {k: one(k, v) for k, v in kwargs.items()}

    def train(
        self, name: str, cls: type, hp: dict, model: nn.Module, ref: nn.Module, seed: int, steps: int
    ) -> tuple[dict, list]:
        from meshlm.runtime.optim.sharded import ShardedOptimizer
        from meshlm.train.param_groups import no_decay_groups

        piped = not isinstance(self.runner, _OneByOne)
        groups = no_decay_groups(model, self.no_decay, check_unmatched=not piped) or None
        opt = ShardedOptimizer(model, cls, param_groups=groups, **hp)
        self.runner.setup(opt)
        refp = dict(ref.named_parameters())
        if self.ref_no_decay is None:
            ref_opt = cls(ref.parameters(), **hp)
        else:  # the reference's own groups, chosen on the plain model
            off = [p for n, p in refp.items() if self.ref_no_decay(n, p)]
            on = [p for n, p in refp.items() if not self.ref_no_decay(n, p)]
            ref_opt = cls([g for g in ({"params": on}, {"params": off, "weight_decay": 0.0}) if g["params"]], **hp)
        group_of = {id(p): g for g in ref_opt.param_groups for p in g["params"]}
        kind, fixed = BOUNDS.get(name, (name, {}))
        bounds = {n: tol.StepBounds() for n in refp}
        plain: dict = {}  # the probe, and whatever plain copies the recipe needs
        worst: dict = {}
        losses = []
        rcp = self.recipe
        for n, m in full_many(opt.masters()).items():  # the master starts from the float32 initial weights
            torch.testing.assert_close(
                m, refp[n].detach(), rtol=0, atol=tol.INIT_ATOL, msg=lambda s, n=n: f"initial master of {n}: {s}"
            )
        for k in range(1, steps + 1):
            if self.lr_factor is not None:
                for g in [*ref_opt.param_groups, *opt.param_groups]:
                    g["lr"] = hp["lr"] * self.lr_factor(k)
            micro = [self.batches(k, j) for j in range(self.grad_accum)]
            weights = self.runner.everywhere(rcp.probe_weights(model, opt))
            ref_losses = rcp.accumulate(ref, micro, self.grad_accum, seed, k)
            if all(torch.equal(weights[n], p) for n, p in refp.items()):
                probe_losses, probe_grads = ref_losses, {n: p.grad for n, p in refp.items()}
            else:  # the reference has drifted by rounding: a plain copy at the sharded weights
                probe = self.plain(weights, seed, plain, "probe")
                probe_losses = rcp.accumulate(probe, micro, self.grad_accum, seed, k)
                probe_grads = {n: p.grad for n, p in probe.named_parameters()}
            loss_tols, grad_tols = rcp.tolerances(self, weights, micro, probe_losses, probe_grads, seed, k)
            with rcp.watching(self.mesh, f"{self.layout} on {self.mesh.shape}, {name} step {k}") as at_step:
                for j, loss in enumerate(self.runner.passes(self, model, micro, seed, k)):
                    losses.append(float(loss))
                    self._check(
                        f"{name} step {k} micro-batch {j}: loss",
                        loss.float() - probe_losses[j].float(),
                        loss_tols[j],
                        worst,
                        "loss",
                    )
                # the gradients the optimizer steps with: reduced at the step (ZeRO-1/2), on the masters
                with at_step():
                    rescale(self.grad_factor, opt)
                    opt.reduce_grads()
            masters = opt.masters()
            for (
                n,
                m,
            ) in masters.items():  # NOTE [unused parameters] in meshlm/runtime/unused.py: torch.optim skips these
                if (m.grad is None) != (probe_grads[n] is None):
                    raise AssertionError(
                        f"{self.layout} on {self.mesh.shape}, {name} step {k}: {n} has "
                        f"{'no gradient' if m.grad is None else 'a gradient'} where one device has "
                        f"{'none' if probe_grads[n] is None else 'one'}"
                    )
            for n, g in full_many({n: m.grad for n, m in masters.items() if m.grad is not None}).items():
                gp = probe_grads[n]
                self._check(
                    f"{name} step {k}: gradient of {n} the optimizer steps with",
                    g - gp,
                    grad_tols[n],
                    worst,
                    "grad",
                )
            # the global norm clipping uses (every stage's parameters under a pipeline)
            ref_norm, norm_bound = tol.norm_and_bound(probe_grads, grad_tols)
            self._check(
                f"{name} step {k}: gradient norm", opt.grad_norm().double() - ref_norm, norm_bound, worst, "grad"
            )
            old = {n: p.detach().clone() for n, p in refp.items()}
            ref_opt.step()
            opt.step()
            mine_p = dict(model.named_parameters())
            after = full_many(
                {("param", n): p for n, p in mine_p.items()}
                | {("master", n): m for n, m in masters.items()}
                | {("state", n, key): v for n, m in masters.items() for key, v in opt.inner.state[m].items()}
            )
            for n, p in refp.items():
                if n not in mine_p:  # held by another pipeline stage, which checks it
                    continue
                st = ref_opt.state[p]
                if p.grad is not None:  # else the optimizer skipped it: its weights and state stay as they were
                    g = group_of[id(p)]  # this parameter's group: its lr at this step, its weight decay
                    php = {**hp, **{h: g[h] for h in ("lr", "weight_decay") if h in g}, **fixed}
                    bounds[n].update(kind, php, k, p.grad, probe_grads[n], st, old[n], p.detach(), grad_tols[n])
                bound = {"param": torch.zeros_like(p), **bounds[n].bound}
                stored = after[("param", n)]
                self._check(
                    f"{name} step {k}: parameter {n}",
                    stored.float() - p.detach(),
                    tol.stored_bound(bound["param"], p.detach(), stored.dtype),
                    worst,
                    "param",
                )
                self._check(
                    f"{name} step {k}: master of {n}",
                    after[("master", n)].to(p.dtype) - p.detach(),
                    bound["param"],
                    worst,
                    "param",
                )
                for key, val in st.items():
                    got = after[("state", n, key)]
                    if key == "step":
                        assert float(got) == float(val), f"{name} step {k}: step count of {n}"
                        continue
                    self._check(
                        f"{name} step {k}: optimizer state {key} of {n}",
                        got - val,
                        bound[key],
                        worst,
                        "state",
                    )
            self._check_buffers(name, k, model, ref, worst)
            ref_opt.zero_grad()
            opt.zero_grad()
        held = dict(model.named_parameters())
        self.param_bounds = {n: bounds[n].bound.get("param", torch.zeros_like(p)) for n, p in refp.items() if n in held}
        return worst, losses

    def _check_buffers(self, name: str, k: int, model: nn.Module, ref: nn.Module, worst: dict) -> None:
        """Every buffer equals the reference's (NOTE [buffers] in meshlm/runtime/lowering/buffers.py)."""
        mine = dict(model.named_buffers())
        for n, b in ref.named_buffers():
            if n not in mine:  # held by another pipeline stage
                continue
            got = mine[n].detach().cpu()
            if not b.is_floating_point():
                assert torch.equal(got, b), f"{name} step {k}: buffer {n} is {got}, one device {b}"
                continue
            bound = torch.full_like(b, tol.BUFFER_ATOL_OF_MAX * float(b.abs().max()))
            self._check(f"{name} step {k}: buffer {n}", got.float() - b.float(), bound, worst, "buffer")

    def one_by_one(self, model: nn.Module, micro: list, seed: int, step: int) -> list[Tensor]:
        """Forward and backward of each micro-batch (this rank's slice) in turn: the losses."""
        from meshlm.core.weighting import Accumulation

        out = []
        acc = Accumulation(len(micro))  # as meshlm.app.train weighs micro-batches (NOTE [token weighting])
        for j, (args, kwargs) in enumerate(micro):
            a, kw = self._shard(args, kwargs)
            torch.manual_seed(_forward_seed(seed, step, j))
            loss = model(*a, **kw)
            (loss * acc.coefficient(loss)).backward()
            self._check_placed(model)
            out.append(_full(loss))
        self.grad_factor = acc.grad_factor()
        return out

    def _check_placed(self, model: nn.Module) -> None:
        """Every gradient where the layout's ``grads`` section puts it, settled."""

        from meshlm.runtime import main_grad
        from meshlm.runtime.lowering import placements, shard_state

        st = shard_state(model)
        for n, p in model.named_parameters():
            g = p.grad if main_grad.get(p) is None else main_grad.get(p)  # NOTE [main grads]
            if g is None:  # not used so far in this step (NOTE [unused parameters] in meshlm/runtime/unused.py)
                continue
            assert isinstance(g, DTensor), f"grad of {n} is not a DTensor"
            want_dtype = self.recipe.grad_dtype
            assert want_dtype is None or g.dtype == want_dtype, f"grad of {n} in {g.dtype}, not {want_dtype}"
            plan = st.plans[n]
            if plan.grads is not None:
                want = placements(plan.grads, self.mesh)
                assert tuple(g.placements) == want, f"grad of {n} has placements {g.placements}, layout says {want}"
            else:  # ZeRO-1, pipelines: unreduced over the data axes until the step, as computed elsewhere
                want = _local_grad_placements(placements(plan.compute, g.device_mesh), g.device_mesh, st.layout)
                got = _whole_from_inputs(tuple(g.placements), want, g.device_mesh)
                assert got == want, f"grad of {n} has placements {g.placements}, expected {want}"
            assert not compat.in_flight(compat.local_tensor(g)), f"grad of {n} is still in flight after backward"


def _whole_from_inputs(got: tuple, want: tuple, mesh) -> tuple:
    """``got`` with Replicate read as the Partial ``want`` has on each mesh axis that does not
    split the model's inputs (``ep``: its ranks read the same examples,
    ``meshlm.layout.rules.INPUT_MESH_AXES``): a parameter used on the inputs before the batch
    is split there (the embedding) gets its gradient whole over that axis, already summed."""
    from torch.distributed.tensor import Partial, Replicate

    from meshlm.layout.rules import INPUT_MESH_AXES

    names = mesh.mesh_dim_names
    return tuple(
        w if g == Replicate() and w == Partial() and names[i] not in INPUT_MESH_AXES else g
        for i, (g, w) in enumerate(zip(got, want))
    )


def _local_grad_placements(compute, mesh, layout) -> tuple:
    """A gradient kept local until the step: Partial over each mesh axis the batch or the
    sequence is split on (size > 1, the parameter replicated there: each rank saw part of
    the tokens), the compute placement on every other."""
    from torch.distributed.tensor import Partial, Replicate

    split = set()
    for key in ("batch", "seq"):
        rule = layout.compute.get(key) or ()
        split |= {rule} if isinstance(rule, str) else set(rule)
    names = mesh.mesh_dim_names
    return tuple(
        Partial() if names[i] in split and mesh.size(i) > 1 and c == Replicate() else c for i, c in enumerate(compute)
    )
