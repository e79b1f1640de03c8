"""Layout-exact randomness: dropout masks that are a function of (key, global element index).

NOTE [dropout keys]
    ``meshlm.dropout(x, p, axes)`` draws the same mask for ``x`` under every layout as on
    one device, bit for bit, so a model with dropout has the one-device loss and gradients
    under any layout (up to the summation order the parity tolerances allow):

    - Each call draws one key, an int64 0-d tensor, from torch's global default CPU
      generator (``draw_key``).  meshlm requires that generator to be in the same state on
      every rank, and every rank makes the same calls in the same order as the one-device
      model, so every rank and the one-device model draw the same keys.
    - ``meshlm train`` sets that state at the start of every micro-batch's forward, from
      ``(train.seed, step, micro-batch)`` alone (``seed_forward``: ``torch.manual_seed`` of
      a sha256 of the three, ``forward_seed``), on every rank, rather than carrying it over
      from the previous step.  So the keys of micro-batch ``j`` of step ``k`` are the same
      on any world size, under any layout, after any resume, whatever state the generator
      was in before (a fresh ``train.seed`` at another world size, or the state a checkpoint
      restored: NOTE [checkpoint rng] below), and a step's masks are a function of (seed,
      step, global row, position, layer) only.  ``train.grad_accum`` is part of that
      function: micro-batch ``j`` holds rows ``[j*b, (j+1)*b)`` of the step's global batch
      (``b = train.batch_size / train.grad_accum``, the loader's order), its keys come from
      ``(seed, step, j)`` and its elements are indexed within the micro-batch, so the same
      run with another ``grad_accum`` (the same data) draws other masks.  Indexing rows
      within the step's batch instead would need the micro-batch's row offset inside
      ``keep_mask``, kept through recomputes that a pipeline schedule runs after later
      micro-batches' forwards, and as a graph input under torch.compile; not done.  The
      pipeline gives each micro-batch's forward the same seeded state on every stage
      (``MicroBatches.starts``, NOTE [stage forward] in meshlm/runtime/pipeline/stage.py), so pp
      draws the keys plain gradient accumulation draws.
    - The keep decision of an element is ``hash(key, i) >= p * 2^24``, with ``i`` the
      element's linear index in the *global* tensor (``keep_mask``).  Each rank computes
      the indices of the elements it holds: from its DTensor placements under a DTensor
      root (``_Handler``), or from its rows of the global batch on local tensors (the local
      root and local blocks, NOTE [local root] in meshlm/runtime/lowering/local_root.py, NOTE [local blocks] in
      meshlm/runtime/bucket/__init__.py; the run state's ``rows``).  So data-parallel ranks,
      which hold different rows, draw different masks, and the ranks of a tensor-parallel
      group, which hold the same elements of a replicated activation, draw the same mask
      (Megatron's and torchtitan's rules), with no per-rank generator state at all.
    - The hash is integer arithmetic (lowbias32, two rounds) on int64 tensors whose values
      stay below 2^50, so it never overflows and is the same on every device, dtype and
      backend.  The output is ``x * (keep * 1/(1-p))``, an ordinary autograd multiply.
    - Recomputation redraws the same key: torch.utils.checkpoint restores the RNG state
      before its recompute (``preserve_rng_state``), which covers ``train.activation_
      checkpointing`` and meshlm's re-gather checkpoints (NOTE [re-gather in backward]);
      the root forward itself runs exactly once per call (NOTE [local root] in meshlm/runtime/lowering/local_root.py).
    - torch.compile: the key draw is an ``aten.randint`` in the graph.  aot_eager runs it
      on the global generator, as eager does.  Inductor replaces random ops with its own
      generator unless ``torch._inductor.config.fallback_random`` is set, which
      ``meshlm.runtime.compile.compile_blocks`` sets for the inductor backend (the one random op
      of a block is a 0-d key, so the fallback costs nothing).

    NOTE [checkpoint rng]: a checkpoint still saves each rank's generator states
    (``rng/rank<r>.pt``) and restores them when the world size is unchanged, for loops of
    one's own around ``meshlm.train.checkpoint``; ``meshlm train`` does not depend on them (it
    reseeds at every micro-batch, and evaluation runs in eval mode, which draws nothing).
    ``torch.manual_seed`` also seeds every accelerator's generator, so a model's own
    ``F.dropout`` on CUDA is reproducible across a resume under the same layout too (but
    not layout-exact, below); under pp only the CPU generator's state is set per
    micro-batch and stage.

    ``F.dropout`` and other torch random ops are *not* layout-exact: on local rows every
    data-parallel rank would draw the same mask for different rows (the global generator
    is the same on every rank), and under DTensor they follow DTensor's own RNG tracker.
    Use ``meshlm.dropout`` in model code.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from meshlm.core import state
from meshlm.core.axes import Axes
from meshlm.core.errors import AnnotationError
from meshlm.core.state import RUN

__all__ = [
    "THRESHOLD_BITS",
    "Handler",
    "draw_key",
    "dropout_plain",
    "dropout_rows",
    "dropout_whole",
    "forward_seed",
    "keep_mask",
    "seed_forward",
]

_M32 = 0xFFFFFFFF
THRESHOLD_BITS = 24  # the keep decision compares the hash's top 24 bits with p * 2^24


def draw_key() -> Tensor:
    """One dropout key: an int64 0-d CPU tensor from torch's global default generator
    (NOTE [dropout keys]).  62 bits, so that two keys collide with negligible probability."""
    return torch.randint(0, 2**62, (), dtype=torch.int64)


def forward_seed(seed: int, step: int, micro: int) -> int:
    """The seed torch's generators start micro-batch ``micro`` (from 0) of optimizer step
    ``step`` from, in a run of seed ``seed`` (NOTE [dropout keys]): a hash of the three, not a
    sum, so that no other (seed, step, micro) replays it.  sha256, unlike ``hash()``, is the
    same in every process; 63 bits, which every torch generator accepts."""
    digest = hashlib.sha256(f"meshlm-forward:{seed}:{step}:{micro}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_forward(seed: int, step: int, micro: int) -> None:
    """Seed torch's generators (the CPU one the dropout keys come from, and every
    accelerator's) for micro-batch ``micro`` of step ``step`` (:func:`forward_seed`), so that
    what its forward draws depends on neither the world size nor the generator state before."""
    torch.manual_seed(forward_seed(seed, step, micro))


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x * c mod 2^32`` for int64 ``x`` in [0, 2^32) and a 32-bit constant ``c``, in two
    16-bit halves of ``c`` so that no product exceeds 2^48 (int64 never overflows)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: Tensor) -> Tensor:
    """lowbias32 (Chris Wellons' hash-prospector): a bijection of [0, 2^32) with good
    avalanche, on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _global_index(local_shape: Sequence[int], offsets: Sequence[int], global_shape: Sequence[int], device) -> Tensor:
    """The linear index in a C-contiguous tensor of ``global_shape`` of every element of the
    block of ``local_shape`` that starts at ``offsets`` (int64, shape ``local_shape``)."""
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    nd = len(local_shape)
    for d in range(nd - 1, -1, -1):
        r = torch.arange(offsets[d], offsets[d] + local_shape[d], dtype=torch.int64, device=device) * stride
        idx = idx + r.view((-1,) + (1,) * (nd - 1 - d))
        stride *= int(global_shape[d])
    return idx.expand(tuple(local_shape))


def keep_mask(
    key: Tensor,
    p: float,
    local_shape: Sequence[int],
    offsets: Sequence[int] | None = None,
    global_shape: Sequence[int] | None = None,
    device=None,
) -> Tensor:
    """The keep-mask (bool) of the block of ``local_shape`` at ``offsets`` (default: 0) of a
    tensor of ``global_shape`` (default: ``local_shape``) under ``key``: element ``i`` of
    the global tensor is kept iff the top 24 bits of ``hash(key, i)`` are >= ``p * 2^24``
    (rounded), so every element is kept with probability ``1 - p`` up to 2^-25.  The same
    element gets the same decision whichever block it is computed in (NOTE [dropout keys])."""
    offsets = tuple(offsets) if offsets is not None else (0,) * len(local_shape)
    global_shape = tuple(global_shape) if global_shape is not None else tuple(local_shape)
    i = _global_index(tuple(local_shape), offsets, global_shape, device)
    key = key.to(device=device, dtype=torch.int64)
    ka, kb = key & _M32, (key >> 32) & _M32
    h = _mix32((i & _M32) ^ ka)
    h = _mix32(h ^ ((i >> 32) & _M32) ^ kb)  # indices >= 2^32 fold their high word in here
    return (h >> (32 - THRESHOLD_BITS)) >= _threshold(p)


def _threshold(p: float) -> int:
    return round(p * (1 << THRESHOLD_BITS))


def _check_p(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout: p must be in [0, 1], got {p}")


def apply_mask(x: Tensor, keep: Tensor, p: float) -> Tensor:
    """``x`` with the dropped elements zeroed and the kept ones scaled by 1 / (1 - p)."""
    if p >= 1.0:
        return x * keep.to(x.dtype)  # every element dropped
    return x * (keep.to(x.dtype) * (1.0 / (1.0 - p)))


def dropout_whole(x: Tensor, p: float, key: Tensor) -> Tensor:
    """Dropout of a tensor that is whole here (one device, or replicated)."""
    return apply_mask(x, keep_mask(key, p, x.shape, device=x.device), p)


def dropout_rows(x: Tensor, p: float, axes: Axes, key: Tensor, rows: tuple[int, int]) -> Tensor:
    """Dropout of a plain tensor that holds this rank's rows of the global batch: ``rows`` =
    (this rank's index among the ranks that split the batch, how many split it); the dim
    named ``batch`` in ``axes`` is the ``index``-th of ``n`` equal blocks, the others are
    whole (NOTE [local blocks] in meshlm/runtime/bucket/__init__.py: pure data parallelism)."""
    _check_axes(x, axes)
    index, n = rows
    if n == 1 or "batch" not in axes:
        return dropout_whole(x, p, key)
    d = list(axes).index("batch")
    offsets = [0] * x.ndim
    offsets[d] = index * x.shape[d]
    gshape = list(x.shape)
    gshape[d] = x.shape[d] * n
    return apply_mask(x, keep_mask(key, p, x.shape, offsets, gshape, x.device), p)


def dropout_plain(x: Tensor, p: float, axes: Axes, key: Tensor, rows: tuple[int, int] | None = None) -> Tensor:
    """Dropout of a plain tensor: this rank's rows if ``rows`` or a local block (the run
    state's ``rows``) says so, else whole (one device, or a plain tensor made inside a
    DTensor root, which is replicated).  Also what ``meshlm.dropout`` does without a
    handler: in the recompute of a local block's checkpoint in backward, outside the root's
    forward, the run state still holds the block's rows (``on_rows``)."""
    rows = rows if rows is not None else RUN.rows
    if rows is not None:
        return dropout_rows(x, p, axes, key, rows)
    _check_axes(x, axes)
    return dropout_whole(x, p, key)


def _check_axes(x: Tensor, axes: Axes) -> None:
    if len(axes) != x.ndim:
        raise AnnotationError(
            f"dropout: {len(axes)} logical axes {tuple(axes)} for a tensor of {x.ndim} dims {tuple(x.shape)}"
        )


def on_rows(rows: tuple[int, int] | None, fn: Callable) -> Callable:
    """``fn`` run with the run state's ``rows`` set to ``rows`` (this rank's (index, count)
    among the ranks that split the batch while a local block runs; under a DTensor root a
    plain tensor is then this rank's rows, not a replicated tensor: NOTE [dropout keys]),
    also when torch.utils.checkpoint runs it again in backward (outside the block's
    forward).  A swap and restore, not ``state.scope``: torch.compile traces this inside a
    checkpointed block on every torch meshlm supports."""

    def run(*args, **kwargs):
        saved = state.swap(rows=rows)
        try:
            return fn(*args, **kwargs)
        finally:
            state.restore(saved)

    return run


def _shard_offsets(gshape: Sequence[int], placements, coord: Sequence[int], sizes: Sequence[int]):
    """(local shape, global offsets) of this rank's block of a DTensor of ``gshape``: each
    Shard(d) splits dim d as ``torch.chunk`` does, mesh dims in order (DTensor's default,
    non-strided order; uneven shards included).  Plain ints, no DeviceMesh access, so it is
    a constant to torch.compile."""
    shape, off = list(gshape), [0] * len(gshape)
    for pl, c, k in zip(placements, coord, sizes):
        if pl.is_shard():
            d = pl.dim
            chunk = -(-shape[d] // k)
            start = min(c * chunk, shape[d])
            off[d] += start
            shape[d] = max(0, min(chunk, shape[d] - start))
        elif not (pl.is_replicate() or pl.is_partial()):
            raise AnnotationError(
                f"dropout: unsupported placement {pl} (meshlm places activations with "
                "Shard, Replicate and Partial only)"
            )
    return shape, off


class Handler:
    """The handler ``meshlm.core.annotate`` calls while a lowered model runs: ``__call__`` is
    ``constrain`` (the given function), ``dropout`` the layout-exact dropout.  ``rows``: the
    model's root runs on this rank's rows of the batch (index, count; NOTE [local root]);
    None: it runs on DTensors.  ``coord``/``sizes``: this rank's mesh coordinate and the
    mesh's dim sizes (plain ints, read once outside any trace)."""

    def __init__(
        self,
        constrain: Callable[[Tensor, Axes], Tensor],
        coord: Sequence[int],
        sizes: Sequence[int],
        rows: tuple[int, int] | None = None,
        balanced: int | None = None,
    ):
        self.constrain = constrain
        self.coord = tuple(coord)
        self.sizes = tuple(sizes)
        self.rows = rows
        self.balanced = balanced  # the mesh index of a cp axis split in balanced chunks, if any

    def __call__(self, x: Tensor, axes: Axes) -> Tensor:
        return self.constrain(x, axes)

    def dropout(self, x: Tensor, p: float, axes: Axes, key: Tensor) -> Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(x, DTensor):
            return self._dropout_dtensor(x, p, axes, key)
        return dropout_plain(x, p, axes, key, self.rows)

    def _dropout_dtensor(self, x, p: float, axes: Axes, key: Tensor):
        from torch.distributed.tensor import DTensor, Replicate

        _check_axes(x, axes)
        pl = tuple(x.placements)
        if any(q.is_partial() for q in pl):  # the mask applies to the sum, not to each term
            pl = tuple(Replicate() if q.is_partial() else q for q in pl)
            x = x.redistribute(x.device_mesh, pl)
        if len(pl) != len(self.coord):
            raise AnnotationError(
                f"dropout: a DTensor on a {len(pl)}-D mesh inside a model lowered onto a {len(self.coord)}-D mesh"
            )
        local = x.to_local()
        b = self.balanced
        if b is not None and pl[b].is_shard():
            keep = self._balanced_keep(key, p, tuple(x.shape), pl, b, local.device)
            shape = list(keep.shape)
        else:
            shape, off = _shard_offsets(tuple(x.shape), pl, self.coord, self.sizes)
            keep = None
        if tuple(shape) != tuple(local.shape):
            raise AnnotationError(
                f"dropout: local shape {tuple(local.shape)} of a DTensor of shape "
                f"{tuple(x.shape)} with placements {pl}; expected {tuple(shape)}"
            )
        if keep is None:
            keep = keep_mask(key, p, shape, off, tuple(x.shape), local.device)
        scale = keep.to(local.dtype) if p >= 1.0 else keep.to(local.dtype) * (1.0 / (1.0 - p))
        mask = DTensor.from_local(scale, x.device_mesh, pl, run_check=False, shape=x.shape, stride=x.stride())
        return x * mask

    def _balanced_keep(self, key: Tensor, p: float, gshape, pl, b: int, device) -> Tensor:
        """The keep-mask of this rank's two chunks of the dim split over a balanced cp (mesh
        index ``b``; NOTE [balanced chunks] in meshlm/_torch_compat/dtensor_cp.py): chunks r
        and 2n-1-r of 2n, each drawn at its own global offsets."""
        from torch.distributed.tensor import Replicate

        d, n, r = pl[b].dim, self.sizes[b], self.coord[b]
        whole = tuple(Replicate() if i == b else q for i, q in enumerate(pl))
        shape, off = _shard_offsets(gshape, whole, self.coord, self.sizes)
        c = shape[d] // (2 * n)
        parts = []
        for k in (r, 2 * n - 1 - r):
            sh, of = list(shape), list(off)
            sh[d], of[d] = c, off[d] + k * c
            parts.append(keep_mask(key, p, sh, of, gshape, device))
        return torch.cat(parts, dim=d)


def rank_index(coord: Sequence[int], sizes: Sequence[int]) -> int:
    """This rank's linear index in the mesh (mesh dims outer -> inner): under pure data
    parallelism, its index among the ranks that split the batch (NOTE [shard order])."""
    i = 0
    for c, k in zip(coord, sizes):
        i = i * k + c
    return i
