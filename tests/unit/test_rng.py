"""meshlm.dropout and its counter-based masks (NOTE [dropout keys] in meshlm/core/rng.py), on one
device: statistics, determinism per key, and the property every layout relies on: the
mask of a block of a tensor is the block of the tensor's mask."""

import math

import pytest
import torch

import meshlm
from meshlm.core import rng
from meshlm.core.errors import AnnotationError
from meshlm.models import Llama, llama_config

KEYS = [torch.tensor(k, dtype=torch.int64) for k in (0, 1, 12345, 2**40 + 7, 2**62 - 1)]


def _bound(n: int, q: float) -> float:
    """Six standard deviations of the mean of n Bernoulli(q) draws: an ideal generator
    exceeds it with probability about 2e-9.  The keys here are fixed, so each check is
    deterministic; a hash with a bias of that size (or correlated neighbours) fails."""
    return 6 * math.sqrt(q * (1 - q) / n)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("key", KEYS, ids=[str(int(k)) for k in KEYS])
def test_keep_fraction(p, key):
    shape = (64, 128, 128)  # 2^20 elements
    keep = rng.keep_mask(key, p, shape)
    n = keep.numel()
    frac = keep.double().mean().item()
    assert abs(frac - (1 - p)) <= _bound(n, 1 - p), frac
    # Neighbours along the last and the first dim are independent: both kept ~ (1-p)^2.
    for a, b in ((keep[..., 1:], keep[..., :-1]), (keep[1:], keep[:-1])):
        both = (a & b).double().mean().item()
        assert abs(both - (1 - p) ** 2) <= _bound(a.numel(), (1 - p) ** 2), both


def test_determinism_and_keys():
    shape = (8, 16, 64)
    a = rng.keep_mask(KEYS[2], 0.5, shape)
    assert torch.equal(a, rng.keep_mask(KEYS[2].clone(), 0.5, shape))
    for k in KEYS:
        if int(k) != int(KEYS[2]):
            b = rng.keep_mask(k, 0.5, shape)
            agree = (a == b).double().mean().item()  # independent masks agree on half
            assert abs(agree - 0.5) <= _bound(a.numel(), 0.5), (int(k), agree)


def test_block_of_the_mask_is_the_mask_of_the_block():
    g = (6, 10, 7)
    full = rng.keep_mask(KEYS[3], 0.3, g)
    for off, shape in (((0, 0, 0), (3, 10, 7)), ((3, 4, 0), (3, 5, 7)), ((1, 0, 2), (2, 10, 5))):
        block = rng.keep_mask(KEYS[3], 0.3, shape, off, g)
        sl = tuple(slice(o, o + n) for o, n in zip(off, shape))
        assert torch.equal(block, full[sl])


def test_indices_beyond_32_bits():
    """Global indices >= 2^32 fold their high word into the hash: a block there is
    consistent with its sub-blocks and is not the mask of the index 2^32 lower."""
    g = (2**20, 2**13)  # 2^33 elements, never materialised
    row = 2**19 + 5  # starts at index 2^32 + 5 * 2^13
    hi = rng.keep_mask(KEYS[1], 0.5, (2, 2**13), (row, 0), g)
    lo = rng.keep_mask(KEYS[1], 0.5, (2, 2**13), (row - 2**19, 0), g)
    assert torch.equal(hi[1:], rng.keep_mask(KEYS[1], 0.5, (1, 2**13), (row + 1, 0), g))
    agree = (hi == lo).double().mean().item()
    assert abs(agree - 0.5) <= _bound(hi.numel(), 0.5), agree


def test_mul32_matches_32_bit_arithmetic():
    x = torch.tensor([0, 1, 2**31, 2**32 - 1, 0x12345678], dtype=torch.int64)
    for c in (0x7FEB352D, 0x846CA68B):
        want = [(int(v) * c) % 2**32 for v in x]
        assert rng._mul32(x, c).tolist() == want


def test_dropout_one_device():
    x = torch.randn(4, 8, 16, requires_grad=True)
    torch.manual_seed(3)
    y = meshlm.dropout(x, 0.25, ("batch", "seq", "embed"))
    torch.manual_seed(3)
    key = rng.draw_key()
    keep = rng.keep_mask(key, 0.25, x.shape)
    assert torch.equal(y, x * (keep.float() * (1 / 0.75)))
    y.sum().backward()
    assert torch.equal(x.grad, keep.float() / 0.75)
    # Same seed, same mask; the next call draws another key.
    torch.manual_seed(3)
    a, b = meshlm.dropout(x, 0.25, ("batch", "seq", "embed")), meshlm.dropout(x, 0.25, ("batch", "seq", "embed"))
    assert torch.equal(a, y) and not torch.equal(a, b)


def test_dropout_off_draws_nothing():
    x = torch.randn(2, 3)
    state = torch.get_rng_state()
    assert meshlm.dropout(x, 0.5, ("batch", None), training=False) is x
    assert meshlm.dropout(x, 0.0, ("batch", None)) is x
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(meshlm.dropout(x, 1.0, ("batch", None)), torch.zeros_like(x))
    with pytest.raises(ValueError):
        meshlm.dropout(x, 1.5, ("batch", None))
    with pytest.raises(AnnotationError):
        meshlm.dropout(x, 0.5, ("batch",))


def test_llama_dropout_train_and_eval():
    cfg = llama_config("llama_tiny", dropout=0.1)
    tokens = torch.randint(0, cfg.vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    m, plain = Llama(cfg), Llama(llama_config("llama_tiny"))
    torch.manual_seed(0)
    a = m(tokens, tokens)
    torch.manual_seed(0)
    assert torch.equal(a, m(tokens, tokens))
    assert not torch.equal(a, plain(tokens, tokens))
    m.eval()
    assert torch.equal(m(tokens, tokens), plain(tokens, tokens))


def test_rows_are_a_block_of_the_batch():
    """A rank's local rows (index i of n) draw the rows i of the whole batch's mask."""
    key = KEYS[4]
    x = torch.ones(8, 4, 6)
    whole = rng.dropout_whole(x, 0.5, key)
    for i in range(4):
        part = rng.dropout_rows(x[2 * i : 2 * i + 2], 0.5, ("batch", "seq", "embed"), key, (i, 4))
        assert torch.equal(part, whole[2 * i : 2 * i + 2])
    # The batch need not be dim 0.
    xt = x.transpose(0, 1).contiguous()
    wt = rng.dropout_whole(xt, 0.5, key)
    assert torch.equal(rng.dropout_rows(xt[:, 4:6], 0.5, ("seq", "batch", "embed"), key, (2, 4)), wt[:, 4:6])


def test_forward_seed_is_a_hash_of_seed_step_and_micro_batch():
    """A change of the derivation changes every run's masks: the values are pinned.  A sum
    such as 1000 * step + micro would make (step 0, micro 1000) replay (step 1, micro 0)."""
    assert rng.forward_seed(0, 1, 0) == 587689796025622926
    assert rng.forward_seed(0, 1, 1) == 7629128703749145003
    seeds = {rng.forward_seed(s, k, j) for s in range(3) for k in range(4) for j in range(3)}
    assert len(seeds) == 36 and all(0 <= x < 2**63 for x in seeds)


def _step_masks(monkeypatch, model, step: int, before: int) -> list[torch.Tensor]:
    """The keep-masks that ``meshlm train``'s micro-batches (meshlm.train.step.accumulate:
    2 micro-batches) draw at ``step``, the global generator seeded with ``before`` (and then
    drawn from) before the step."""
    from meshlm.app.config import TrainConfig, load_config
    from meshlm.train.step import accumulate

    masks: list[torch.Tensor] = []
    real = rng.keep_mask

    def spy(*args, **kwargs):
        masks.append(real(*args, **kwargs))
        return masks[-1]

    monkeypatch.setattr(rng, "keep_mask", spy)
    gen = torch.Generator().manual_seed(0)
    batches = iter([(torch.randint(0, 256, (2, 8), generator=gen),) * 2 for _ in range(2)])
    passes = accumulate(
        model,
        lambda: next(batches),
        TrainConfig(seed=3, grad_accum=2),
        load_config(["model=llama_tiny"]).model,
        "cpu",
        0,
    )
    torch.manual_seed(before)
    torch.rand(before)
    passes(step)
    model.zero_grad()
    monkeypatch.setattr(rng, "keep_mask", real)
    return masks


def test_step_masks_do_not_depend_on_the_generator_before_the_step(monkeypatch):
    """``meshlm train`` seeds torch's generator at each micro-batch from (train.seed, step,
    micro-batch) (NOTE [dropout keys]): whatever state a resumed run's generator is in (a
    fresh seed at another world size, a restored one at the same), a step draws the same
    keys and masks."""
    model = Llama(llama_config("llama_tiny", dropout=0.1))
    a = _step_masks(monkeypatch, model, 5, before=0)
    b = _step_masks(monkeypatch, model, 5, before=12345)
    assert len(a) == 2 * 2 * 2  # micro-batches x layers x (attention, MLP) residual dropouts
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # not vacuous: another step, and each micro-batch and layer, draw other masks
    c = _step_masks(monkeypatch, model, 6, before=0)
    assert not any(torch.equal(x, y) for x, y in zip(a, c))
    assert len({tuple(m.flatten().tolist()) for m in a}) == len(a)
