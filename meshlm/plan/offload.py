"""Offload in the plan (docs/plan.md, "Offload"): the tier each kind of state is planned
on, the bytes each tier holds per rank, and the traffic between the device and the tiers
in a step.

NOTE [planned offload]
    A plan's ``memory`` is always what the *device* holds per rank (the figure
    ``layout=auto`` compares with the limit); what an ``offload.<kind>=host|disk`` moves
    off it is in ``Plan.offload["kinds"][kind]`` and summed per tier in ``Plan.tiers``
    (``device``, ``host``, ``disk``).  ``host`` is counted on ``host`` even where the device
    is host memory (the ``cpu`` profile, where the runtime moves nothing for ``host``:
    NOTE [swapped storage] in meshlm/runtime/offload/store.py), so that the same plan is right for a
    GPU; the report says so.

    - ``optimizer`` (NOTE [offloaded step] in meshlm/runtime/offload/optimizer.py): every master that
      is a tensor of its own and AdamW's ``exp_avg`` and ``exp_avg_sq`` move
      (``OptimizerOffload.nbytes``); the 0-dim ``step`` counters stay on the device.  On
      ``disk`` each step reads them in and writes them out once, chunk by chunk (in = out =
      the bytes).  On ``host`` the step runs on the host (NOTE [host step] in
      meshlm/runtime/offload/host_step.py), which holds as well a copy of each master that is no
      tensor of its own and a gradient buffer per master; per step the masters' gradients
      go down (out) and their new values come up in the parameters' dtype (in)
      (``host_step.planned``).
      The one chunk in memory during the step is not added to the device figure: it is
      there while the step runs, after backward has freed the activations (the measured
      planner runs the chunked step and counts it where it is).
    - ``activations`` (NOTE [offloaded activations] in meshlm/runtime/offload/activations.py): by
      formula, everything the plan counts as saved for backward (``activations`` and the
      ``gathered`` at-use copies) moves, written in forward and read in backward once per
      micro-batch; the device keeps what one unit needs while it runs: one block's saved
      tensors (and its share of the at-use copies) or the head's (final norm, logits'
      log-softmax, the head's at-use copies), whichever is larger.  The formula does not
      split tensors by size, so the few under 64 KiB that the runtime keeps are counted as
      moved, and reads each tensor back once.  The measured planner runs the step under hooks
      that drop each saved tensor the runtime would move and make a new one when backward
      unpacks it, so it measures what the device holds (the tensors under 64 KiB and views
      of parameters stay) and what moves: a tensor saved by several ops (the input of the
      q, k and v projections) is written once and read back by each.
    - ``params`` (NOTE [offloaded parameters] in meshlm/runtime/offload/params.py): every block's
      stored parameters move; the device keeps the parameters outside blocks and two
      blocks' (the one running and the one read ahead).  Per step each block's come in for
      its forward and its backward in every micro-batch and for its chunk of the step
      (in = the blocks' bytes x (2 x micro-batches + 1)) and are written once, after the
      step changed them (out = the blocks' bytes).  Layouts whose optimizer keeps copies of
      the parameters are refused, as by the runtime.
    - ``grads`` (NOTE [offloaded gradients] in meshlm/runtime/offload/grads.py): every gradient as
      accumulated, and the masters' gradients that are buffers of their own (ZeRO-1's
      shards), move; the device keeps two of the largest parameter's (the one autograd just
      made and the one it is added to).  Per step each micro-batch writes the parameters'
      gradients and every micro-batch after the first reads them back to add to them; the
      step (ZeRO-1: the reduce-scatter) reads them once more and ZeRO-1's shards are written
      and read once (in = out = the accumulated bytes x micro-batches + the masters').  With
      clipping the norm reads them once more (clipping itself and the loss scaler's unscale
      write nothing: their factors are deferred); not counted, as the plan does not know
      ``train.grad_clip``.  Main gradients (bf16 storage
      under ZeRO-1/2) are refused, as by the runtime.
"""

from __future__ import annotations

import weakref
from typing import Any, Mapping, Optional

from meshlm.layout.offload import KINDS, TIERS, OffloadSpec, resolve_offload

MiB = 2**20


def offload_spec_for(layout, offload: "OffloadSpec | Mapping[str, Any] | None" = None) -> OffloadSpec:
    """The tiers a plan of ``layout`` (a meshlm Layout) uses, checked: ``offload`` as is (an
    OffloadSpec), or the run's ``offload.*`` settings (a mapping, None: not set) over the
    layout's own ``offload`` section, or None: the layout's section (else every kind on the
    device).  Raises ConfigError naming the key for a tier that is not one."""
    if isinstance(offload, OffloadSpec):
        return offload
    given = {k: v for k, v in dict(offload or {}).items() if k in (*KINDS, "dir")}
    return resolve_offload(getattr(layout, "offload", None), given)


def kind_entry(tier: str, nbytes: int, in_bytes: int, out_bytes: int, **extra) -> dict[str, Any]:
    """One offloaded kind's figures per rank: ``bytes`` on ``tier`` at once, ``in_bytes``
    read back to the device and ``out_bytes`` written to the tier per step."""
    return {"tier": tier, "bytes": int(nbytes), "in_bytes": int(in_bytes), "out_bytes": int(out_bytes), **extra}


def finish(p, spec: OffloadSpec, kinds: Mapping[str, dict], device_is_host: bool = False):
    """Fill ``p.offload`` and ``p.tiers`` (NOTE [planned offload]); ``p.memory`` must be the
    device's already.  Returns ``p``."""
    tiers = dict.fromkeys(TIERS, 0)
    tiers["device"] = int(p.memory["total"])
    for k in kinds.values():
        tiers[k["tier"]] += k["bytes"]
    p.tiers = tiers
    p.offload = {
        **{k: getattr(spec, k) for k in KINDS},
        "kinds": {k: dict(v) for k, v in kinds.items()},
        "device_is_host": bool(device_is_host),
    }
    return p


def analytic(
    spec: OffloadSpec,
    memory: dict[str, int],
    optimizer_moved: int,
    act: Mapping[str, Any],
    gathered_blocks: int,
    grad_accum: int,
    block_params: tuple[int, int] = (0, 0),
    grad_bytes: tuple[int, int, int] = (0, 0, 0),
    host_step: tuple[int, int, int] = (0, 0, 0),
) -> dict[str, dict]:
    """The formula's offload (NOTE [planned offload]): moves the offloaded kinds' bytes out of
    ``memory`` (the device's; updated, ``total`` too) and returns their figures by kind.
    ``optimizer_moved``: the bytes of the masters of their own and AdamW's two states;
    ``act``: ``activation_bytes``'s dict; ``gathered_blocks``: the at-use copies the blocks
    keep (the rest of ``memory["gathered"]`` is the head's); ``block_params``: (the stored
    bytes of every block's parameters, of the largest block's); ``grad_bytes``: (the
    parameters' gradients as accumulated, the masters' gradients that are buffers of their
    own, the largest parameter's gradient); ``host_step``: the optimizer on ``host`` steps
    there (NOTE [host step]): (the host bytes beyond ``optimizer_moved``, the bytes a step
    moves up, down)."""
    kinds: dict[str, dict] = {}
    if spec.grads != "device":
        acc, masters, one = grad_bytes
        kept = min(acc + masters, 2 * one)  # the gradient autograd just made and the one it is added to
        memory["grads"] = kept
        kinds["grads"] = kind_entry(
            spec.grads, acc + masters, acc * grad_accum + masters, acc * grad_accum + masters, kept_on_device=kept
        )
    if spec.params != "device":
        moved, one = block_params
        kept = min(moved, 2 * one)  # the block running and the one read ahead
        memory["params"] -= moved - kept
        kinds["params"] = kind_entry(
            spec.params, moved, moved * (2 * grad_accum + 1), moved, kept_on_device=kept, blocks=True
        )
    if spec.optimizer != "device":
        memory["optimizer"] -= optimizer_moved
        if spec.optimizer == "host":  # stepped on the host: gradients down, parameters up
            extra, up, down = host_step
            kinds["optimizer"] = kind_entry("host", optimizer_moved + extra, up, down)
        else:
            kinds["optimizer"] = kind_entry(spec.optimizer, optimizer_moved, optimizer_moved, optimizer_moved)
    if spec.activations != "device":
        saved = memory["activations"] + memory["gathered"]
        layers = max(int(act["layers"]), 1)
        block = act["per_layer"] + gathered_blocks / layers
        head = act["outside_blocks"] + (memory["gathered"] - gathered_blocks)
        kept = int(min(saved, max(block, head)))
        memory["activations"], memory["gathered"] = kept, 0
        kinds["activations"] = kind_entry(
            spec.activations, saved, saved * grad_accum, saved * grad_accum, kept_on_device=kept
        )
    memory["total"] = sum(v for k, v in memory.items() if k != "total")
    return kinds


def size(n: float) -> str:
    """``0.41 MiB`` below a GiB, else ``3.20 GiB``."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / MiB:.2f} MiB"


def lines(p) -> list[str]:
    """The report's offload lines (none where every kind is on the device)."""
    off = getattr(p, "offload", None) or {}
    kinds = off.get("kinds") or {}
    if not kinds:
        return []
    out = []
    for kind, k in kinds.items():
        line = (
            f"offload: {kind}={k['tier']}: {size(k['bytes'])} on {k['tier']}, {size(k['in_bytes'])} in + "
            f"{size(k['out_bytes'])} out per step"
        )
        if kind == "optimizer" and k["tier"] == "host":
            line += (
                " (stepped on the host: exp_avg, exp_avg_sq, a master and a gradient buffer per parameter there; "
                "gradients out, new parameters in)"
            )
        elif kind == "optimizer":
            line += " (masters of their own, exp_avg, exp_avg_sq; the step counters stay)"
        elif kind == "grads":
            line += (
                f" (each gradient as autograd stores it, each micro-batch; the device keeps two of the largest, "
                f"{size(k['kept_on_device'])})"
                if "kept_on_device" in k
                else " (each gradient as autograd stores it, each micro-batch)"
            )
        elif kind == "params":
            line += " (each block's, in for its forward and backward and its step, written after the step"
            if "kept_on_device" in k:  # the formula's; the measured figures hold it in the peak
                line += f"; the device keeps the rest and two blocks', {size(k['kept_on_device'])}"
            line += ")"
        elif "kept_on_device" in k:
            line += (
                f" (every saved tensor, each micro-batch; the device keeps one block's or the head's, "
                f"{size(k['kept_on_device'])}, while it runs)"
            )
        else:
            line += " (saved tensors of 64 KiB or more that are not parameters, each micro-batch)"
        out.append(line)
    t = p.tiers
    out.append(f"on each tier per rank: device {size(t['device'])}, host {size(t['host'])}, disk {size(t['disk'])}")
    if off.get("device_is_host") and any(k["tier"] == "host" for k in kinds.values()):
        out.append(
            "  (on this profile the device is host memory: there offload=host moves nothing; the plan counts it "
            "on host, as on a GPU)"
        )
    return out


def offload_seconds(p, hw) -> float:
    """Seconds a step spends moving offloaded state (not overlapped with compute): each
    kind's in + out bytes over the profile's host or disk bandwidth."""
    t = 0.0
    for k in ((getattr(p, "offload", None) or {}).get("kinds") or {}).values():
        bw = hw.host_bw if k["tier"] == "host" else hw.disk_bw
        t += (k["in_bytes"] + k["out_bytes"]) / bw
    return t


def optimizer_host(overrides: Optional[Mapping[str, Any]]) -> Optional[dict[str, Any]]:
    """The run's offload settings with ``optimizer=host``, for ``layout=auto`` when nothing
    fits on the device alone; None where the run set ``offload.optimizer`` itself."""
    given = dict(overrides or {})
    if given.get("optimizer") is not None:
        return None
    return {**given, "optimizer": "host"}


# --------------------------------------------------------------------------- measured
class FakeTier:
    """A ``meshlm.runtime.offload.store.Swapper`` for fake tensors (NOTE [fake measurement] in
    measure.py): swapping out frees the storage (``resize_(0)``) and swapping in makes it
    again, with no bytes to copy, whatever the tier; ``bytes_in``/``bytes_out`` count as the
    real one's."""

    def __init__(self, tier: str):
        self.tier, self.disk = tier, None
        self._out: dict[int, int] = {}
        self._written: set[int] = set()
        self.bytes_in = self.bytes_out = 0

    def is_out(self, t) -> bool:
        return id(t) in self._out

    def swap_out(self, t, clean: bool = False) -> None:
        from meshlm.runtime.offload.store import owns_storage

        if self.is_out(t) or not owns_storage(t):
            return
        st = t.untyped_storage()
        self._out[id(t)] = st.nbytes()
        if not (clean and id(t) in self._written):  # as Swapper.swap_out: nothing written when clean
            self.bytes_out += st.nbytes()
            self._written.add(id(t))
        st.resize_(0)

    def forget(self, t) -> None:
        self._out.pop(id(t), None)
        self._written.discard(id(t))

    def swap_in_async(self, t, pool) -> bool:
        return False  # no read ahead: the peak counts the block read ahead by formula

    def swap_in(self, t) -> None:
        n = self._out.pop(id(t), None)
        if n is not None:
            t.untyped_storage().resize_(n)
            self.bytes_in += n


class FakeActivations:
    """Saved-tensor hooks that do to fake tensors what ``ActivationOffload`` does to real
    ones (NOTE [offloaded activations]): a saved tensor it would move is dropped when forward
    saves it (the device no longer holds it) and made anew, empty, when backward unpacks it;
    the rest is kept.  ``out_bytes``/``in_bytes``: bytes packed and unpacked."""

    def __init__(self):
        from meshlm.runtime.offload.activations import MIN_BYTES

        self.min_bytes = MIN_BYTES
        self.out_bytes = self.in_bytes = 0
        self._seen: dict = {}  # id(tensor) -> weakref to it: saved before

    def context(self):
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t):
        from torch.distributed.tensor import DTensor

        from meshlm.runtime.memory import local_data
        from meshlm.runtime.offload.activations import stays

        local = local_data(t)
        nbytes = local.numel() * local.element_size()
        if stays(t, local, self.min_bytes):  # as ActivationOffload.pack
            return ("kept", t)
        if not (id(local) in self._seen and self._seen[id(local)]() is local):  # saved again: one copy written
            self._seen[id(local)] = weakref.ref(local)
            self.out_bytes += nbytes
        spec = (t.device_mesh, tuple(t.placements), t.shape, t.stride()) if isinstance(t, DTensor) else None
        return ("moved", local.shape, local.dtype, local.device, spec, t.requires_grad, nbytes)

    def unpack(self, packed):
        import torch

        from meshlm.runtime.offload.activations import rebuild

        if packed[0] == "kept":
            return packed[1]
        _k, shape, dtype, device, spec, rg, nbytes = packed
        self.in_bytes += nbytes
        return rebuild(torch.empty(shape, dtype=dtype, device=device), spec, rg)
