"""Offload: training state in host memory or on disk (docs/offload.md).

NOTE [offload tiers]
    Each kind of state (``optimizer``: optimizer state and master weights; ``grads``;
    ``params``; ``activations``) lives on a tier: ``device`` (where the model runs; the
    default), ``host`` (host memory, pinned where there is an accelerator) or ``disk``
    (files under a directory of this run's own).  A layout's ``offload`` section sets
    them and the run's ``offload.*`` settings override it (meshlm/layout/offload.py).  On a
    CPU-only machine the device is host memory, so ``host`` moves nothing there and only
    ``disk`` frees memory.  What moves and how: NOTE [swapped storage] (store.py),
    NOTE [offloaded step] in optimizer.py, NOTE [offloaded gradients] in grads.py,
    NOTE [offloaded parameters] in params.py, NOTE [offloaded activations] in activations.py.
"""

# Only the torch-free spec here: layouts and configs read it in the launcher, which imports
# no torch (tests/unit/test_startup.py).  The tiers themselves: meshlm.runtime.offload.store,
# meshlm.runtime.offload.optimizer, meshlm.runtime.offload.activations.
from meshlm.layout.offload import KINDS, TIERS, OffloadSpec, parse_offload, resolve_offload

__all__ = ["KINDS", "TIERS", "OffloadSpec", "parse_offload", "resolve_offload"]
