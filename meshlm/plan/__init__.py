"""``meshlm plan``: per-rank memory and communication of a model under a layout and mesh,
without the hardware, and automatic layout choice under a memory limit.

Two planners share the report, the search and the cost model:

- measured (any model): one training step run on fake tensors under the fake process
  group (NOTE [fake measurement] in measure.py); what ``meshlm plan`` uses for a model
  built by ``meshlm.app.plan.build_model``;
- analytic (our Llama): the figures below, from the lowering's plans and formulas.

The analytic planner computes everything from the per-parameter plans of
``meshlm.runtime.lowering.plan_params`` on a meta-device model (no tracing, no process group), so
Llama 3 405B on 16,384 ranks plans in seconds.  Each figure sits beside its textbook
formula (docs/layouts.md, shipped layouts): ZeRO model-state memory, DDP/ZeRO/Megatron communication volume,
and the activation formula re-derived for our Llama block (docs/plan.md).

NOTE [plan = lowering]
    The predictions mirror what ``meshlm.shard`` + ``ShardedOptimizer`` do, parameter by
    parameter: storage/grads/optimizer placements give the memory; the difference between
    storage and compute placements gives the at-use all-gathers (again in backward for a
    block whose parameters are gathered over a data axis: NOTE [re-gather in backward] in
    meshlm/runtime/lowering); the data axes that split the batch give the gradient reductions (a
    reduce-scatter where the grads placement shards over the axis, else an all-reduce, in
    mesh order).  tests/dist/test_plan_exact.py holds the two to equality on real gloo runs.

Modules, each importing only those above it (and the layers below the planner, never the app):

    offload     the tiers of a plan: what offload moves off the device, traffic (NOTE [planned offload])
    report      Plan, CommEntry, the text report, dtype and size helpers
    hardware    hardware profiles
    state       model-state memory from the lowering's per-parameter plans; ZeRO formula
    activations the activation formula for our Llama block
    comm_model  the collectives predicted per parameter; textbook volumes
    analytic    plan(): the analytic planner for our Llama
    where       where a fake step stopped, in the model's terms (NOTE [unmeasurable step])
    measure     measure(): one fake training step of any model, measured
    measured    plan_model(): a Plan from a measurement
    plot        the memory picture of the candidates
    search      candidates, cost model, choose_layout (layout=auto)

``meshlm plan`` over a run config (the model builder, the winner's train command) is the
app's: meshlm/app/plan.py.
"""

from meshlm.plan.activations import activation_bytes
from meshlm.plan.analytic import plan
from meshlm.plan.hardware import HARDWARE, Hardware
from meshlm.plan.measure import Measured, measure
from meshlm.plan.measured import plan_model
from meshlm.plan.report import SCHEMA_VERSION, CommEntry, GiB, Plan, format_plan
from meshlm.plan.search import (
    PREFERENCE,
    Candidate,
    Choice,
    NothingFits,
    candidates,
    factorisations,
    format_candidates,
    nothing_fits,
    parse_memory,
    step_time,
)
from meshlm.plan.state import model_config

__all__ = [
    "CommEntry",
    "Candidate",
    "Choice",
    "GiB",
    "HARDWARE",
    "Hardware",
    "Measured",
    "NothingFits",
    "PREFERENCE",
    "Plan",
    "SCHEMA_VERSION",
    "activation_bytes",
    "candidates",
    "factorisations",
    "format_candidates",
    "format_plan",
    "measure",
    "model_config",
    "nothing_fits",
    "parse_memory",
    "plan",
    "plan_model",
    "step_time",
]
