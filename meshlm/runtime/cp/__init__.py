"""Context parallelism: attention over a sequence sharded on the ``cp`` mesh axis (NOTE [cp
attention] in meshlm/runtime/cp/ring.py).

    ring.py      cp_attention (autograd), cp_attention_forward / _backward: the ring and
                 all-gather variants on local tensors
    schedule.py  which chunks a rank holds (local_positions) and the blocks it computes
    kernels.py   one block forward and backward (torch's CPU flash attention), the lse merge
    refuse.py    the error for an attention call cp cannot run, naming the module that made it
"""

from meshlm.runtime.cp.ring import VARIANTS, cp_attention, cp_attention_backward, cp_attention_forward
from meshlm.runtime.cp.schedule import local_positions

__all__ = ["VARIANTS", "cp_attention", "cp_attention_backward", "cp_attention_forward", "local_positions"]
