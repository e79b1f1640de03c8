"""Faults for tests: a checkpoint save on a full disk.

``full_disk()`` is a context in which every write to a checkpoint's shard files
(``*.distcp``, through torch DCP's ``FileSystem``) fails with ``ENOSPC`` as on a full disk;
everything else (metadata, meshlm's own files) is written as usual, so the failure lands in
the middle of a save, where a real one would."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

from torch.distributed.checkpoint.filesystem import FileSystem


class _FullStream:
    """A stream whose writes fail as on a full disk."""

    def __init__(self, stream, path):
        self.stream, self.path = stream, str(path)

    def write(self, _data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def full_disk() -> Iterator[None]:
    """Within: writes to checkpoint shards fail with ENOSPC (module docstring)."""
    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            yield _FullStream(stream, path) if str(path).endswith(".distcp") else stream

    FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        FileSystem.create_stream = real
