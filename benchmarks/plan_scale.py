"""Planner scale benchmark (not a test): python benchmarks/plan_scale.py

Times meshlm.plan.plan for Llama 3 8B on 1,024 ranks (dp 8 x fsdp 16 x tp 8) and Llama 3
405B on 16,384 ranks (dp 16 x fsdp 128 x tp 8), cold (first call: builds the one-layer meta
model, NOTE [one layer] in meshlm/plan/state.py) and warm (per-parameter plans cached), and
meshlm.app.plan.choose_layout for Llama 3 70B on 256 devices (every shipped layout x every
factorisation of 256 into dp, fsdp, tp).
"""

import io
import time

from meshlm.app.plan import choose_layout
from meshlm.plan import format_plan, plan
from meshlm.plan.state import _MODELS, _PLAN_CACHE

CASES = [
    ("llama3_8b", "fsdp_tp", {"dp": 8, "fsdp": 16, "tp": 8}, 1024, 8192),
    ("llama3_405b", "fsdp_tp_sp", {"dp": 16, "fsdp": 128, "tp": 8}, 2048, 8192),
]

if __name__ == "__main__":
    for model, layout, mesh, gb, seq in CASES:
        _PLAN_CACHE.clear()
        _MODELS.clear()
        t0 = time.perf_counter()
        p = plan(
            model,
            layout,
            mesh,
            global_batch=gb,
            seq=seq,
            activation_checkpointing="full",
            param_dtype="bfloat16",
            master_dtype="float32",
        )
        t1 = time.perf_counter()
        plan(
            model,
            layout,
            mesh,
            global_batch=gb,
            seq=seq,
            activation_checkpointing="full",
            param_dtype="bfloat16",
            master_dtype="float32",
        )
        t2 = time.perf_counter()
        print(
            f"plan {model} {layout} {mesh} ({p.world_size} ranks): cold {t1 - t0:.2f} s, warm {t2 - t1:.3f} s, "
            f"total {p.memory['total'] / 2**30:.2f} GiB/rank"
        )
    _PLAN_CACHE.clear()
    _MODELS.clear()
    t0 = time.perf_counter()
    best = choose_layout(
        model="llama3_70b",
        devices=256,
        max_memory="80GiB",
        global_batch=256,
        seq=8192,
        activation_checkpointing="full",
        param_dtype="bfloat16",
        master_dtype="float32",
        hardware="h100_nvlink_ib",
        out=io.StringIO(),
    )
    print(f"choose_layout llama3_70b on 256 devices: {time.perf_counter() - t0:.2f} s -> {best}")
    print()
    print(format_plan(p))
