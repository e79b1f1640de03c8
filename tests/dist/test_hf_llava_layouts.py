"""A tiny random Hugging Face LLaVA (offline) loaded into meshlm's VLM on 4 gloo ranks: its
logits equal transformers' under data-, fully- and tensor-parallel layouts (with sequence
parallelism, and the scoped vlm_fsdp_tp), with a text-only row in the batch; the loss and
the gradients of the vision encoder, the projector and the decoder equal one device's.
One device: tests/unit/test_hf_llava.py and tests/unit/test_vlm_model.py."""

from __future__ import annotations

import pytest
import torch

from harness import dist_pool_fixture
from harness import tolerances as tol

transformers = pytest.importorskip("transformers")

LAYOUT_MESH = {
    "ddp": "dp=4",
    "fsdp": "fsdp=4",
    "tp_sp": "tp=4",
    "fsdp_tp": "fsdp=2,tp=2",
    "vlm_fsdp_tp": "fsdp=2,tp=2",
}
IMG, P = 256, 16
GRADS = (
    "vision.patch_embed",
    "vision.layers.0.attn.wq",
    "vision.layers.1.mlp.fc1.weight",
    "projector.linear_1.weight",
    "projector.linear_2.bias",
    "language.tok_emb",
    "language.layers.0.attn.wo",
)

pool4 = dist_pool_fixture(4, timeout_s=60)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from meshlm.interop.hf.load import load_hf_local
    from harness.hf_tiny import tiny_llava

    d = str(tmp_path_factory.mktemp("llava"))
    hf = tiny_llava(d)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (4, 24), generator=g)
    ids[0, :P] = IMG
    ids[2, 4 : 4 + P] = IMG
    ids[3, 8 : 8 + P] = IMG  # row 1 is text only
    pixels = torch.randn(3, 3, 16, 16, generator=g)
    images = torch.zeros(4, 3, 16, 16)
    images[[0, 2, 3]] = pixels
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    labels[(ids == IMG) | (labels == IMG)] = -100
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=pixels).logits
    one = load_hf_local(d).train()
    loss = one(ids, labels, images=images)
    loss.backward()
    grads = {n: p.grad for n, p in one.named_parameters() if n in GRADS}
    return {"dir": d, "ids": ids, "labels": labels, "images": images, "ref": ref, "loss": loss.detach(), "grads": grads}


def _run(path, layout, mesh_shape, ids, labels, images):
    import meshlm
    from meshlm.interop.hf import load_hf

    torch._dynamo.reset()
    mesh = meshlm.make_mesh(mesh_shape)
    model = load_hf(path, layout, mesh)
    tokens, targets = meshlm.shard_batch(ids, layout, mesh), meshlm.shard_batch(labels, layout, mesh)
    imgs = meshlm.shard_batch(images, layout, mesh, ("batch", "channels", None, None))
    with torch.no_grad():
        out = model(tokens, images=imgs)
    loss = model(tokens, targets, images=imgs)
    loss.backward()
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    grads = {n: full(p.grad) for n, p in model.named_parameters() if n in GRADS}
    return full(out), loss.detach(), grads


@pytest.mark.parametrize("layout", sorted(LAYOUT_MESH))
def test_logits_loss_and_grads(pool4, llava, layout):
    got = pool4.run(_run, llava["dir"], layout, LAYOUT_MESH[layout], llava["ids"], llava["labels"], llava["images"])
    for out, loss, grads in got:
        torch.testing.assert_close(out, llava["ref"], rtol=tol.HF_LOGIT_RTOL, atol=tol.HF_LOGIT_ATOL)
        torch.testing.assert_close(loss, llava["loss"], rtol=tol.LOSS_RTOL, atol=0)
        for n, g in grads.items():
            want = llava["grads"][n]
            torch.testing.assert_close(g, want, rtol=tol.GRAD_RTOL, atol=tol.GRAD_ATOL_OF_MAX * float(want.abs().max()))
