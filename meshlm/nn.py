"""``meshlm.nn``: torch's ``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm`` and
``nn.Dropout`` with their logical axes as an argument (``meshlm.nn.Linear(d, f, axes=("mlp",
"embed"))``), and ``MoE``, a mixture-of-experts feed-forward layer (NOTE [moe routing] in
meshlm/core/moe.py).  The public namespace of the annotated layers defined in
``meshlm.core.nn`` and ``meshlm.core.moe``."""

from meshlm.core.moe import MoE
from meshlm.core.nn import Dropout, Embedding, LayerNorm, Linear, RMSNorm

__all__ = ["Dropout", "Embedding", "LayerNorm", "Linear", "MoE", "RMSNorm"]
