"""``meshlm.nn``: torch's ``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm`` and
``nn.Dropout`` with their logical axes as an argument (``meshlm.nn.Linear(d, f, axes=("mlp",
"embed"))``).  The public namespace of the annotated layers defined in ``meshlm.core.nn``."""

from meshlm.core.nn import Dropout, Embedding, LayerNorm, Linear, RMSNorm

__all__ = ["Dropout", "Embedding", "LayerNorm", "Linear", "RMSNorm"]
