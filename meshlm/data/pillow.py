"""Pillow, imported where an image is read or drawn (``data.format=images``, the shapes task):
it comes with the ``meshlm`` command's dependencies (pyproject's ``app`` extra), not with the
library, so no module imports it at load time."""

from __future__ import annotations

from types import ModuleType

from meshlm.core.errors import ConfigError


def pillow() -> ModuleType:
    """The ``PIL`` package with ``PIL.Image`` and ``PIL.ImageDraw`` loaded; a ConfigError saying
    how to install Pillow when it is absent."""
    try:
        import PIL.Image
        import PIL.ImageDraw
    except ModuleNotFoundError as e:
        if e.name != "PIL":
            raise
        raise ConfigError(
            "data.format=images reads and draws its images with Pillow, which is not installed: "
            "pip install 'meshlm[app]' (or pip install pillow)"
        ) from None
    return PIL
