"""Parity of a sharded training step against the same weights on one device.

``check_step`` runs inside every rank of a gloo process group (``DistPool.run``): it builds
the one-device reference and the sharded model from the same seed, runs forward, backward
and one AdamW step on the same global batch, and asserts (tolerances in
``meshlm.testing.tolerances``):

* the sharded initialisation equals the one-device one exactly;
* the loss and every gradient (as a full tensor) match the reference;
* every gradient sits where the layout's ``grads`` section puts it;
* the AdamW step equals the reference step given the same gradients exactly.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from meshlm.testing import tolerances as tol


def check_step(layout: str, mesh_shape: str, *, compile: Optional[str] = None, model: str = "llama_tiny",
               batch: int = 8, seq: int = 16, lr: float = 1e-2, seed: int = 0, overlap: Optional[bool] = None,
               comms: str = "graph", ignored_targets: bool = False, activation_checkpointing: str = "none",
               **overrides) -> dict:
    """One training step of ``layout`` on ``mesh_shape`` against one device (loss, every
    gradient, the AdamW step).  ``ignored_targets``: some label positions are -100
    (``F.cross_entropy``'s ignore_index), unevenly over the batch rows, so the ranks' loss
    means have different weights.  Returns the losses, the worst relative gradient error and
    how many forwards ran on a local root or under DTensor (NOTE [local root] in root.py).
    Both forwards start from the same global generator state, so a model with dropout
    (``dropout=0.1`` in ``overrides``) draws the same keys (NOTE [dropout keys] in rng.py);
    ``activation_checkpointing`` (none, full, selective) wraps the sharded model's blocks as
    ``meshlm train`` does."""
    import meshlm
    from meshlm.compile import compile_blocks
    from meshlm import root
    from meshlm.lower import placements, shard_state
    from meshlm.models import Llama, llama_config
    from meshlm.optim import ShardedOptimizer
    from meshlm.train import apply_activation_checkpointing
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    torch._dynamo.reset()
    cfg = llama_config(model, **overrides)
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, cfg.vocab, (batch, seq), generator=gen)
    labels = torch.randint(0, cfg.vocab, (batch, seq), generator=gen)
    if ignored_targets:  # row 0 keeps 2 of its targets, row 1 none, the last row all but one
        labels[0, 2:] = -100
        labels[1] = -100
        labels[-1, :1] = -100

    ref = Llama(cfg, seed=seed)
    torch.manual_seed(seed)
    ref_loss = ref(tokens, labels)
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())

    mesh = meshlm.make_mesh(mesh_shape)
    model_ = meshlm.shard(Llama(cfg, device="meta"), layout, mesh, seed=seed, overlap=overlap)
    for n, p in model_.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref_params[n].detach(), rtol=0, atol=tol.INIT_ATOL,
                                   msg=lambda m, n=n: f"init of {n}: {m}")
    apply_activation_checkpointing(model_, activation_checkpointing)
    if compile:
        compile_blocks(model_, compile, comms=comms)
    opt = ShardedOptimizer(model_, torch.optim.AdamW, lr=lr)
    roots = dict(root.ROOT_STATS)
    torch.manual_seed(seed)
    loss = model_(meshlm.shard_batch(tokens, layout, mesh), meshlm.shard_batch(labels, layout, mesh))
    roots = {k: root.ROOT_STATS[k] - v for k, v in roots.items()}
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=tol.LOSS_RTOL, atol=0)

    st = shard_state(model_)
    worst = 0.0
    full_grads = {}
    for n, p in model_.named_parameters():
        g = p.grad
        assert isinstance(g, DTensor), f"grad of {n} is not a DTensor"
        plan = st.plans[n]
        if plan.grads is not None:
            want = placements(plan.grads, mesh)
            assert tuple(g.placements) == want, f"grad of {n} has placements {g.placements}, layout says {want}"
        else:  # ZeRO-1: unreduced over the data axes until the step
            assert any(pl.is_partial() for pl in g.placements) or mesh.size() == 1, f"grad of {n}: {g.placements}"
        assert not isinstance(g._local_tensor, AsyncCollectiveTensor), f"grad of {n} is still in flight after backward"
        full = g.full_tensor()
        full_grads[n] = full
        r = ref_params[n].grad
        scale = float(r.abs().max())
        torch.testing.assert_close(full, r, rtol=tol.GRAD_RTOL, atol=tol.GRAD_ATOL_OF_MAX * scale,
                                   msg=lambda m, n=n: f"grad of {n}: {m}")
        worst = max(worst, float((full - r).abs().max()) / max(scale, 1e-30))

    # The step: the reference optimizer gets the gradients the sharded optimizer steps with
    # (for ZeRO-1 those are reduced at the step, possibly in another summation order than
    # full_tensor() used above), gathered whole: gathering moves bits without arithmetic.
    opt.reduce_grads()
    stepped = {n: m.grad for n, m in opt.masters().items()}
    for n, p in ref_params.items():
        g = stepped[n]
        p.grad = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    ref_opt.step()
    opt.step()
    for n, p in model_.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref_params[n].detach(), rtol=tol.STEP_RTOL, atol=tol.STEP_ATOL,
                                   msg=lambda m, n=n: f"AdamW step of {n}: {m}")
    return {"loss": float(loss), "ref_loss": float(ref_loss), "worst_grad_rel": worst, "root": roots}
