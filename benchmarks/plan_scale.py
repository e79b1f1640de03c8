"""Planner scale benchmark (not a test): python benchmarks/plan_scale.py

Times meshlm.plan.plan for Llama 3 8B on 1,024 ranks (dp 8 x fsdp 16 x tp 8) and
Llama 3 405B on 16,384 ranks (dp 16 x fsdp 128 x tp 8), cold (first call, includes
building the meta model and planning every parameter) and warm (per-parameter plans cached).
"""

import time

from meshlm.plan import _PLAN_CACHE, format_plan, plan

CASES = [
    ("llama3_8b", "fsdp_tp", {"dp": 8, "fsdp": 16, "tp": 8}, 1024, 8192),
    ("llama3_405b", "fsdp_tp_sp", {"dp": 16, "fsdp": 128, "tp": 8}, 2048, 8192),
]

if __name__ == "__main__":
    for model, layout, mesh, gb, seq in CASES:
        _PLAN_CACHE.clear()
        t0 = time.perf_counter()
        p = plan(model, layout, mesh, global_batch=gb, seq=seq, activation_checkpointing="full")
        t1 = time.perf_counter()
        plan(model, layout, mesh, global_batch=gb, seq=seq, activation_checkpointing="full")
        t2 = time.perf_counter()
        print(f"{model} {layout} {mesh} ({p.world_size} ranks): cold {t1 - t0:.2f} s, warm {t2 - t1:.3f} s, "
              f"total {p.memory['total'] / 2**30:.2f} GiB/rank")
    print()
    print(format_plan(p))
