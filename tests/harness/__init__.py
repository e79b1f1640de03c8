"""Test helpers: the multi-process gloo harness (`harness.dist`)."""

from harness.dist import DistPool, WorkerError, dist_pool_fixture, run_distributed

__all__ = ["DistPool", "WorkerError", "dist_pool_fixture", "run_distributed"]
