"""Pipeline parallelism: the ``pp`` mesh axis as one more layout of the same model.

A layout that maps the stack of blocks to pp (``layers: pp``) cuts the model at block
boundaries into stages, one (or, interleaved, several) per pp rank, and runs them with
torch's ``torch.distributed.pipelining`` schedules; FSDP, ZeRO and tensor parallelism
inside a stage are the layout's other rules, on the mesh without pp.  No model code
changes: every stage runs the model's own forward, with what other stages hold as
``Absent`` tensors (NOTE [absent values] in meshlm/runtime/absent.py).

Dependency direction (each file imports only the files below it):

    pipe.py       Pipeline, build_pipeline, pipeline_mesh: the stages, the schedule, a step
    stage.py      StageModule and the block calls: one stage's forward (NOTE [stage forward])
    schedule.py   the schedules by name and what each needs (NOTE [schedules])
    cut.py        the probe of the forward and the cut into stages (NOTE [pipeline cut])
"""

from meshlm.runtime.pipeline.cut import Cut, Probe, cut, probe
from meshlm.runtime.pipeline.pipe import Pipeline, build_pipeline, deferred, is_pipelined, pipeline_mesh
from meshlm.runtime.pipeline.schedule import SCHEDULES, bubble, schedule_spec

__all__ = [
    "Cut",
    "Pipeline",
    "Probe",
    "SCHEDULES",
    "bubble",
    "build_pipeline",
    "cut",
    "deferred",
    "is_pipelined",
    "pipeline_mesh",
    "probe",
    "schedule_spec",
]
