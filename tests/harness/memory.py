"""The tensor-memory tracker the memory tests and benchmarks use: :mod:`meshlm.runtime.memory`
(``meshlm train`` measures each run's memory by kind with it)."""

from meshlm.runtime.memory import PeakStorage, local_data, storage_bytes

__all__ = ["PeakStorage", "local_data", "storage_bytes"]
