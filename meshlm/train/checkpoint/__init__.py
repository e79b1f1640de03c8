"""Sharded checkpoints that reshard on load and survive a SIGKILL at any moment.

A checkpoint is a directory ``<dir>/step_00000042/`` written with
``torch.distributed.checkpoint`` (DCP): every rank writes the shards it owns, and the
DCP metadata records each tensor's *global* shape and where its chunks lie.  Loading asks
DCP for the chunks the *loading* layout and mesh need, so a checkpoint saved under
``fsdp`` on 4 processes loads under ``fsdp_tp`` on 2x2, ``tp`` on 2 or a single process
with no conversion step.

What is saved (flat keys, so nothing depends on parameter order or rank count):

* ``model/<fqn>``: every parameter (DTensor, storage placements) and every persistent
  buffer (whole, the same on every rank: NOTE [buffers] in meshlm/runtime/lowering/buffers.py; the
  non-persistent ones are not saved, as ``state_dict`` leaves them out);
* ``master/<fqn>``: the optimizer's master copy when its dtype differs from the
  parameter's (bf16 ZeRO-1/2 under ``meshlm train``: the fp32 weights, which the bf16
  parameter rounds); a load takes the weights from it where saved (NOTE [checkpoint
  weights] in weights.py); same-dtype masters (fp32 ZeRO-1/2) are rebuilt from the
  parameter on load;
* ``optim/<fqn>/<key>``: each tensor of the torch optimizer's per-parameter state, keyed
  by parameter FQN, never by index (so it reshards and survives a reordering);
* ``meta.json`` (rank 0): step, model config, layout, mesh, world size, the caller's
  ``run_meta``, and a size and CRC-32 for every file of the checkpoint;
* ``extra.pt`` (rank 0): the caller's ``extra`` dict (step, data-loader position, LR
  schedule, ...), the optimizer's param-group hyperparameters and non-tensor state;
* ``rng/rank<r>.pt``: each rank's torch RNG states (restored when the world size is
  unchanged; ``meshlm train`` does not depend on them: it seeds every micro-batch from
  (train.seed, step, micro-batch), NOTE [checkpoint rng] in meshlm/core/rng.py).

NOTE [commit protocol]: ranks write into ``<dir>/.tmp_step_<N>/``; after a barrier rank 0
writes ``meta.json``, then the ``COMMIT`` marker, fsyncs, and renames the directory to
``step_<N>`` (atomic on POSIX), then fsyncs ``<dir>``.  ``resume='auto'`` only considers
``step_*`` directories that hold ``COMMIT``, so a process killed at any moment leaves
either a complete checkpoint or one that is ignored (and deleted by the next save).  Of
those it takes the newest whose files check out (NOTE [damaged checkpoints]); a save that
cannot write (a full disk) removes its partial directory and stops (NOTE [failed save]).
Reading a checkpoint runs no code from it (NOTE [trusted checkpoint files] in load.py).

NOTE [one writer per checkpoint directory] in lock.py: a Checkpointer holds
``<dir>/LOCK`` from ``resume()`` (or its first save) to ``close()``; a second run into the
directory stops with a CheckpointError naming the holder.

Every failure to load (missing or truncated file, CRC mismatch, a tensor of another
shape, a missing key) raises :class:`meshlm.core.errors.CheckpointError` on *every* rank, after
the ranks have agreed on it, so a bad checkpoint never hangs a job.

The package, each module importing only those above it:

    config.py        the ``checkpoint`` config section and its checks
    lock.py          one writer per directory (NOTE [one writer per checkpoint directory])
    runs.py          which run a directory's checkpoints belong to
    files.py         the files of a checkpoint, its step directories, the ranks' agreement
    weights.py       which tensor the weights load into (NOTE [checkpoint weights])
    load.py          verify and load (NOTE [trusted checkpoint files])
    save.py          write, commit, retire (NOTE [failed save])
    checkpointer.py  the Checkpointer: save every N steps, resume the newest valid one

The names below load on first use (PEP 562), so reading the config section imports no torch.
"""

from meshlm.core.lazy import lazy_names

# public name -> the module that defines it
_HOME = {
    **dict.fromkeys(("CheckpointConfig", "check_checkpoint_dir", "check_resume"), "meshlm.train.checkpoint.config"),
    **dict.fromkeys(("Checkpointer", "lock_dir"), "meshlm.train.checkpoint.checkpointer"),
    "save_checkpoint": "meshlm.train.checkpoint.save",
    **dict.fromkeys(("check_checkpoint", "load_checkpoint", "verify_checkpoint"), "meshlm.train.checkpoint.load"),
    **dict.fromkeys(
        (
            "COMMIT",
            "EXTRA",
            "FORMAT",
            "META",
            "is_complete",
            "latest_checkpoint",
            "list_checkpoints",
            "read_meta",
            "resolve_path",
        ),
        "meshlm.train.checkpoint.files",
    ),
}


__getattr__, __dir__ = lazy_names("meshlm.train.checkpoint", globals(), _HOME)


__all__ = sorted(_HOME)
