"""meshlm's exceptions.  Every message says what is wrong, where (parameter FQN, logical
axis, layout file and key, config key) and how to fix it."""


class MeshlmError(Exception):
    """Base class of every error meshlm raises on bad input."""


class AxisError(MeshlmError):
    """An unknown logical or mesh axis name."""


class LayoutError(MeshlmError):
    """A layout file that is malformed or cannot be applied to a tensor on a mesh."""


class AnnotationError(MeshlmError):
    """A parameter without logical axes, or axes that do not match its shape."""


class MeshError(MeshlmError):
    """A mesh that cannot be built (bad shape, wrong world size)."""


class ConfigError(MeshlmError):
    """A bad configuration value."""


class CheckpointError(MeshlmError):
    """A checkpoint that is missing, incomplete, corrupted or of another model."""


def is_model_code(filename: str) -> bool:
    """Whether a frame's file is the user's code: outside torch and meshlm, and not
    generated (``<string>``, ``<eval_with_key>``); what an error names as the model's line."""
    from pathlib import Path

    import torch

    library = (str(Path(torch.__file__).parent), str(Path(__file__).resolve().parents[1]))
    return not filename.startswith(library) and not filename.startswith("<")
