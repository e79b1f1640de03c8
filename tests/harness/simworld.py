"""The ranks of a device mesh as threads of one process, for single-process tests of
``meshlm.runtime.bucket``'s flat collectives (tests/unit/test_bucket.py).

``SimWorld(sizes, groups)`` stands for a mesh of shape ``sizes`` (ranks row-major over
the mesh coordinates; ``groups[i]`` names the process group of mesh dim i, as a bucket
does).  ``world.patch(monkeypatch)`` replaces the collectives ``bucket`` calls
(``all_gather_single``, ``reduce_scatter_single`` and ``all_reduce`` of ``meshlm._torch_compat``,
``bucket.flat.all_reduce_inplace``)
by exchanges among the threads; ``world.run(fn)`` calls ``fn(rank, coords)`` on one
thread per rank and returns the results by rank.  A collective waits for every rank and
checks that the ranks of each group issued the same one (op, group, dim, shape, dtype),
then each rank computes its result from its group's inputs in group order (the coordinate
along that mesh dim): a gather concatenates, a reduction sums in rank order, a
reduce-scatter keeps block ``coord`` of the sum along dim 0.  ``world.log[rank]`` lists
the collectives a rank issued (op ``all_reduce_``: the in-place one), ``world.gathered[rank]``
the buffers its all-gathers returned.

``data_bucket(mesh, specs)`` registers a local block bucket whose mesh dims are all data
axes, with random shards of its members for this rank (tests/unit/test_bucket_regather.py,
test_bucket_prefetch.py).

``locals_of(t, placements, sizes, gen)`` is the reference layout: the local tensor of each
rank (by coordinates) of a global tensor ``t`` placed ``placements`` on that mesh, with
DTensor's meaning (mesh dims outer -> inner; ``Shard(d)``: block ``coord`` of
``chunk(size, d)``; ``Partial``: random integer parts that sum to the value, so any order
of summation is exact for integer-valued tensors).
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable, ClassVar, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor import Placement, Replicate, Shard


class SimWorld:
    def __init__(self, sizes: Sequence[int], groups: Sequence[str], timeout_s: float = 60.0):
        self.sizes = tuple(sizes)
        self.groups = list(groups)
        self.coords = list(itertools.product(*[range(n) for n in self.sizes]))
        self.world = len(self.coords)
        self._barrier = threading.Barrier(self.world, timeout=timeout_s)
        self._box: list = [None] * self.world
        self._tls = threading.local()
        self.log: list[list[tuple]] = [[] for _ in range(self.world)]
        self.gathered: list[list[Tensor]] = [[] for _ in range(self.world)]  # all-gather results

    def members(self, rank: int, i: int) -> list[int]:
        """The ranks of ``rank``'s group over mesh dim i, in the order of coordinate i."""
        c = self.coords[rank]
        return [self.coords.index(c[:i] + (k,) + c[i + 1 :]) for k in range(self.sizes[i])]

    def _exchange(self, op: str, group: str, t: Tensor, extra: tuple = ()) -> tuple[list[Tensor], int, int]:
        r = self._tls.rank
        sig = (op, group, extra, tuple(t.shape), t.dtype)
        self.log[r].append(sig)
        self._box[r] = (sig, t)
        self._barrier.wait()
        try:
            i = self.groups.index(group)
            mine = [self._box[q] for q in self.members(r, i)]
            bad = [s for s, _ in mine if s != sig]
            if bad:
                raise AssertionError(f"rank {r} issued {sig}, its group {bad[0]}")
            ts = [x.detach().clone() for _, x in mine]
        finally:
            self._barrier.wait()  # every rank has read the inputs before any writes its result
        return ts, self.coords[r][i], self.sizes[i]

    @staticmethod
    def _sum(ts: list[Tensor]) -> Tensor:
        acc = ts[0].clone()
        for x in ts[1:]:
            acc += x
        return acc

    def all_gather(self, t: Tensor, dim: int, group: str) -> Tensor:
        ts, _c, _n = self._exchange("all_gather", group, t, (dim,))
        out = torch.cat(ts, dim)
        self.gathered[self._tls.rank].append(out)
        return out

    def reduce_scatter(self, t: Tensor, op: str, dim: int, group: str) -> Tensor:
        ts, c, n = self._exchange("reduce_scatter", group, t, (op, dim))
        assert op == "sum", op
        return self._sum(ts).chunk(n, dim)[c].clone()

    def all_reduce(self, t: Tensor, op: str, group: str) -> Tensor:
        ts, _c, _n = self._exchange("all_reduce", group, t, (op,))
        assert op == "sum", op
        return self._sum(ts)

    def all_reduce_inplace(self, t: Tensor, group: str, wait: bool) -> Tensor:
        ts, _c, _n = self._exchange("all_reduce_", group, t, ("sum",))
        return t.copy_(self._sum(ts))

    def patch(self, monkeypatch) -> None:
        _patch(monkeypatch, self.all_gather, self.reduce_scatter, self.all_reduce, self.all_reduce_inplace)

    def run(self, fn: Callable[[int, tuple], object]) -> list:
        out: list = [None] * self.world
        errors: list = []

        def body(r: int) -> None:
            self._tls.rank = r
            try:
                out[r] = fn(r, self.coords[r])
            except BaseException as e:  # noqa: BLE001 - reported below, with the rank
                errors.append((r, e))
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            first = next((e for e in errors if not isinstance(e[1], threading.BrokenBarrierError)), errors[0])
            raise AssertionError(f"rank {first[0]} failed: {first[1]!r}") from first[1]
        return out


def fake_mesh(sizes: "Sequence[int] | Mapping[str, int]", rank: int = 0):
    """A DeviceMesh on a fake process group in which this process is ``rank`` (a fresh group
    each call): for DTensor metadata; its collectives do nothing.  ``sizes``: the dims'
    sizes (named ``d0, d1, ...``), or a meshlm mesh shape (``{"dp": 2, "tp": 2}``: the mesh
    ``meshlm.make_mesh`` makes, its axes in meshlm's order)."""
    import math

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshlm.layout.mesh import init_fake, make_mesh

    named = isinstance(sizes, Mapping)
    if dist.is_initialized():
        dist.destroy_process_group()
    init_fake(math.prod(sizes.values() if named else sizes), rank=rank)
    if named:
        return make_mesh(dict(sizes), fake=True)
    return init_device_mesh("cpu", tuple(sizes), mesh_dim_names=tuple(f"d{i}" for i in range(len(sizes))))


def locals_of(
    t: Tensor, placements: Sequence[Placement], sizes: Sequence[int], gen: torch.Generator, _i: int = 0
) -> dict[tuple, Tensor]:
    """Coordinates -> the local tensor of ``t`` placed ``placements`` (see the module docstring)."""
    if _i == len(sizes):
        return {(): t}
    p, n = placements[_i], sizes[_i]
    if isinstance(p, Shard):
        assert t.shape[p.dim] % n == 0, (tuple(t.shape), p, n)
        pieces = list(t.chunk(n, p.dim))
    elif isinstance(p, Replicate):
        pieces = [t] * n
    else:
        assert p.is_partial(), p
        pieces = [torch.randint(-4, 5, t.shape, generator=gen).to(t.dtype) for _ in range(n - 1)]
        pieces.append(t - sum(pieces) if pieces else t)
    return {
        (c,) + rest: v
        for c, piece in enumerate(pieces)
        for rest, v in locals_of(piece, placements, sizes, gen, _i + 1).items()
    }


def shares_storage(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of one storage (no copy between them)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def patch_replicas(monkeypatch) -> None:
    """Make this process stand for every rank of its (fake) process group, each holding
    what this one holds: a collective returns what it would if every rank of its group had
    sent this rank's tensor (a sum is the tensor times the group's size, a gather repeats it,
    a reduce-scatter keeps this rank's block of the sum).  The collectives patched are those
    ``SimWorld.patch`` patches.  DTensor's own collectives stay the fake group's no-ops, so
    a result that needed one is wrong, and shows."""
    from meshlm import _torch_compat as compat

    def size(group: str) -> int:
        return compat.resolve_process_group(group).size()

    def coord(group: str) -> int:
        return compat.resolve_process_group(group).rank()

    def all_gather(t: Tensor, dim: int, group: str) -> Tensor:
        return torch.cat([t] * size(group), dim)

    def reduce_scatter(t: Tensor, op: str, dim: int, group: str) -> Tensor:
        assert op == "sum", op
        return (t * size(group)).chunk(size(group), dim)[coord(group)].clone()

    def all_reduce(t: Tensor, op: str, group: str) -> Tensor:
        assert op == "sum", op
        return t * size(group)

    _patch(monkeypatch, all_gather, reduce_scatter, all_reduce, lambda t, group, wait: t.mul_(size(group)))


def _patch(monkeypatch, all_gather, reduce_scatter, all_reduce, all_reduce_inplace) -> None:
    """Replace the collectives ``meshlm.runtime.bucket`` and ``BatchReduce`` call (``all_gather_single``,
    ``reduce_scatter_single`` and ``all_reduce`` of ``meshlm._torch_compat``,
    ``bucket.flat.all_reduce_inplace``)."""
    from meshlm import _torch_compat as compat
    from meshlm.runtime.bucket import flat

    monkeypatch.setattr(compat, "all_gather_single", all_gather)
    monkeypatch.setattr(compat, "reduce_scatter_single", reduce_scatter)
    monkeypatch.setattr(flat, "all_reduce_inplace", all_reduce_inplace)
    monkeypatch.setattr(compat, "all_reduce", all_reduce)


def data_bucket(mesh, specs, *, overlap: bool = False, seed: int = 0):
    """A local block bucket on ``mesh`` whose every dim is a data axis, of float32 members
    ``specs`` ((storage, compute, grads, global shape) each), registered while ``mesh`` lives; and this rank's
    stored shards of them, random (seeded), each its global shape divided by the mesh dims
    that shard it.  Returns (key, bucket, shards)."""
    from meshlm.runtime import bucket

    sizes = tuple(mesh.shape)
    dims = tuple(range(len(sizes)))
    members = tuple(bucket.member(s, c, g, shape, torch.float32, dims) for s, c, g, shape in specs)
    b = bucket.Bucket(
        mesh=mesh,
        groups=tuple(mesh.get_group(i).group_name for i in dims),
        sizes=sizes,
        data_dims=dims,
        members=members,
        compute_dtype=None,
        reduce_dtype=None,
        local=True,
        overlap=overlap,
    )
    gen = torch.Generator().manual_seed(seed)
    shards = []
    for m in members:
        local = list(m.shape)
        for i, pl in enumerate(m.storage):
            if isinstance(pl, Shard):
                local[pl.dim] //= sizes[i]
        shards.append(torch.randn(local, generator=gen))
    return bucket.register(b, mesh), b, shards


def make_periodic(model, plans, sizes) -> None:
    """Make every parameter of ``model`` the same on each rank's shard (its storage blocks
    repeat, ``plans``: the planner's, on mesh ``sizes``), so that gathering this rank's
    shard from every rank of a replica world (``patch_replicas``) gives it whole."""
    import math

    with torch.no_grad():
        for n, p in model.named_parameters():
            for d, axes in enumerate(plans[n].storage):
                k = math.prod(sizes[a] for a in axes)
                if k > 1:
                    p.copy_(torch.cat([p.narrow(d, 0, p.shape[d] // k)] * k, d))


class Gain(nn.Module):
    """A test module with one parameter over the ``embed`` axis, applied elementwise (a
    norm's weight): whole in compute under every shipped layout, gathered only where storage
    shards ``embed``.  The shard, block and local-root unit tests subclass it to name its
    role."""

    param_axes: ClassVar = {"gain": ("embed",)}

    def __init__(self, width: int, device=None):
        super().__init__()
        self.gain = nn.Parameter(torch.empty(width, device=device))

    def init_weights(self, gen):
        nn.init.uniform_(self.gain, 0.5, 1.5, generator=gen)

    def forward(self, x):
        return x * self.gain
