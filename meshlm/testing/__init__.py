"""Test helpers: the multi-process gloo harness (`meshlm.testing.dist`)."""

from meshlm.testing.dist import DistPool, WorkerError, dist_pool_fixture, run_distributed

__all__ = ["DistPool", "WorkerError", "dist_pool_fixture", "run_distributed"]
