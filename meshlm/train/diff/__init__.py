"""Where two configurations of one training step first disagree: the library of ``meshlm diff``.

Every tensor of a sharded model has logical axes, so the same tensor under two layouts can be
gathered to its full value and compared element by element, each against a tolerance derived
for what may legitimately differ (the order of float32 additions, bf16 rounding, another
implementation: meshlm/train/tolerances.py).  A side runs one step and records it; two
records are compared; the report names the first tensor, in execution order, beyond its
tolerance.

    record.py     Record, Capture: a side's tensors, whole, in order (plain data)
    capture.py    Recorder: a forward's block outputs and constrained activations (NOTE [diff capture])
    step.py       capture_step: one training step of a sharded model, recorded
    calibrate.py  the bf16 rounding of every tensor, measured on one device
    compare.py    compare: two captures, tensor by tensor (NOTE [diff tolerances]); Report
    table.py      the report as text

Why here, in ``meshlm.train``: capturing needs the runtime (the lowering's state, the
sharded optimizer), the tolerances are about a training step, and the step is the one
``meshlm.train.step`` runs; the command that spells two configurations, launches their
processes and prints the report is the application's (meshlm/app/diff.py), so that the
library neither parses configs nor starts processes.
"""

from meshlm.train.diff.calibrate import calibrate
from meshlm.train.diff.capture import Recorder
from meshlm.train.diff.compare import Report, Row, compare
from meshlm.train.diff.record import Capture, Record
from meshlm.train.diff.step import capture_step
from meshlm.train.diff.table import format_report

__all__ = ["Capture", "Record", "Recorder", "Report", "Row", "calibrate", "capture_step", "compare", "format_report"]
