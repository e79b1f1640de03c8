"""The runtime: what turns an annotated model, a layout and a mesh into a sharded model that
trains (lowering, per-block buckets, main gradients, the sharded optimizer, offload, the
pipeline schedule, activation checkpointing and compilation of blocks), the one interface
through which all of them attach to a user's modules (hooks.py), and ``unshard``.

This file imports nothing, so the app's config can read the constants below without torch."""

#: ``compile_blocks(comms=...)`` (compile.py, NOTE [compiled body]): a local block's data-parallel
#: collectives compiled with the block (graph) or run eagerly around its compiled math (eager)
COMPILE_COMMS = ("graph", "eager")
