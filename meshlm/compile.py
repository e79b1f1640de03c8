"""torch.compile policy: compile each block (``@meshlm.block`` module) on its own.

Per-block (regional) compilation compiles one graph per block class and reuses it for
every layer (the lowering gives all instances of a class one sharded subclass), keeps
compile time flat in depth, and leaves the embedding and loss, whose DTensor handlers are
plain Python, in eager mode.  ``fullgraph=True``: a graph break inside a block is an error.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from meshlm.annotate import is_block


def compile_blocks(model: nn.Module, backend: str = "inductor", *, fullgraph: bool = True,
                   mode: Optional[str] = None) -> int:
    """Compile every block of ``model`` in place; return how many were compiled."""
    n = 0
    for m in model.modules():
        if is_block(m):
            m.compile(backend=backend, fullgraph=fullgraph, mode=mode)
            n += 1
    if n == 0:
        raise ValueError(f"{type(model).__name__} has no @meshlm.block modules to compile")
    # Every layer of a model shares one compiled graph per block class; allow a few
    # recompiles per block for the first calls (grad mode, shapes) without warnings.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
    return n
