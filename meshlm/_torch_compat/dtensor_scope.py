"""Which DTensor work is meshlm's: the meshes meshlm made or sharded onto (part of the adapter
in ``meshlm/_torch_compat/dtensor_ops.py``; NOTE [private torch] there).

NOTE [scoped patches]
    meshlm changes what DTensor does for some ops (the rules ``dtensor_ops.py`` lists) and
    lets plain tensors meet DTensors as replicated values (NOTE [implicit replication] in
    dtensor_replication.py).  Both hold only for DTensors on meshlm's meshes; any other
    DTensor in the process gets exactly what torch gives it, before and after meshlm ran.

    Scoped by the data, not by time.  A context around meshlm's calls (install on entry,
    restore on exit) cannot be exact:

    - meshlm's DTensors are computed on outside its calls: the loss a user takes of the
      logits the root returned, the optimizer, checkpoints, pipeline schedules, generation;
      a context would have to be opened around each of them and would still miss the
      user's own code;
    - backward runs after forward has returned, from wherever the user calls it, and on
      CUDA on the autograd engine's threads.  The engine sets each node's thread-local
      state to what ``backward()`` captured, so no node of meshlm's graph can switch the
      dispatcher flag on for the nodes after it; handlers installed by the first node and
      restored by a callback queued for the end of the pass would hold, meanwhile, for
      every other thread's DTensor work;
    - the handlers dict is process-wide: while a context is open every other thread's
      DTensor code sees meshlm's rules.

    Ownership is a property of the op's arguments, so it holds wherever and whenever the op
    runs: each patched entry point looks at the mesh of the op's first DTensor argument (the
    mesh DTensor computes the op on) and runs meshlm's rule only where it is meshlm's.

    meshlm's meshes: those ``make_mesh`` built (``meshlm/layout/mesh.py``) and those
    ``shard`` sharded onto (a user's own DeviceMesh given to ``shard`` becomes meshlm's),
    and the submeshes sliced from either.  They are compared by value (``DeviceMesh``'s
    equality: ranks, layout, dim names, device type) and held weakly.  Not by identity:
    DTensor does not tell equal meshes apart (its sharding cache hands an op's output the
    mesh object of the first equal mesh it computed that op on), so an identity test
    would flip with the cache's history.  So a DTensor on a mesh equal to one of meshlm's
    counts as meshlm's, as it does for DTensor itself.

    What stays process-wide, from the first ``shard`` on, and why: the patches themselves,
    inert on other meshes: one entry in DTensor's custom handlers per op meshlm has a rule
    for (the CPU flash attention rule among them, put in DTensor's sharding propagator only
    for the call on meshlm's mesh); torch's loss-parallel switch, so that ``loss_parallel()``
    puts its handlers under ours and ours survive its exit; the dispatcher's
    implicit-replication method and flag property.  They cannot be scoped further because
    the tables they sit in are the process's.  The per-thread C++ flag stays on in a thread
    that ran a sharded forward (NOTE [implicit replication]).

    Exact except: a mesh equal to one of meshlm's (above); a mixed Tensor/DTensor op
    refused on another mesh raises torch's error from its Python path ("aten.add.Tensor:
    got mixed ...") where a process without meshlm raises it from the C++ one (the same
    words, a colon and a docs link apart); and torch's C++ composites that switch implicit
    replication on for one inner op (``F.one_hot`` of a DTensor) raise that error on other
    meshes in a thread that ran a sharded forward (NOTE [implicit replication]).
"""

from __future__ import annotations

import weakref

from torch.distributed.tensor import DTensor

# id -> weak reference, one per claimed mesh object.  Not a WeakSet: a set keeps the first
# of two equal meshes and drops the second's ``add``, so when the first is collected the
# entry goes while the second, equal and alive, is still meshlm's.
_MESHES: "dict[int, weakref.ref]" = {}


def claim(mesh) -> None:
    """Make ``mesh`` (and meshes equal to it, and their submeshes) meshlm's while it lives."""
    key = id(mesh)
    held = _MESHES.get(key)
    if held is not None and held() is mesh:
        return

    def gone(ref, key=key):
        if _MESHES.get(key) is ref:
            del _MESHES[key]

    _MESHES[key] = weakref.ref(mesh, gone)


def _claimed(mesh) -> bool:
    held = _MESHES.get(id(mesh))
    if held is not None and held() is mesh:
        return True
    return any(m is not None and m == mesh for m in (r() for r in list(_MESHES.values())))


def owns(mesh) -> bool:
    """Whether ``mesh`` is meshlm's: claimed, equal to a live claimed mesh, or sliced from one."""
    if mesh is None:
        return False
    if _claimed(mesh):
        return True
    root = getattr(mesh, "_get_root_mesh", None)  # DeviceMesh slices know their root (torch 2.11-2.13)
    if root is None:
        return False
    r = root()
    return r is not mesh and _claimed(r)


def first_mesh(args, kwargs):
    """The mesh of the first DTensor among an op's arguments (as DTensor picks the mesh an
    op runs on), looking one level into lists and tuples; None if there is none."""
    for a in args:
        if isinstance(a, DTensor):
            return a.device_mesh
        if isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, DTensor):
                    return x.device_mesh
    for v in kwargs.values():
        if isinstance(v, DTensor):
            return v.device_mesh
    return None


def owned(args, kwargs) -> bool:
    """Whether an op with these arguments runs on one of meshlm's meshes."""
    return owns(first_mesh(args, kwargs))
