"""The multi-process gloo harness (harness.dist): results, tensors, failures, hangs.

One module-scoped pool per world size, as every test module that uses the harness should.
Tests that break a pool on purpose check that the next run still works.
"""

import gc
import os
import time

import pytest
import torch
import torch.distributed as dist

from harness.dist import (
    DistPool,
    WorkerError,
    _Failure,
    _worker_error,
    dist_pool_fixture,
    run_distributed,
)

# Gloo timeout of the pools here. A collective on a few floats takes milliseconds, so 3 s is
# ample even on a loaded machine, and it bounds the deadlock tests, which wait it out.
TIMEOUT_S = 3.0
# How late past TIMEOUT_S (or error_grace_s) a hang may be reported: reaping the workers and
# the parent's polling, with margin for a busy 2-core CI machine.
SLACK_S = 10.0

pool4 = dist_pool_fixture(4, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def pool2():
    with DistPool(2, timeout_s=TIMEOUT_S, env={"MESHLM_HARNESS_PROBE": "42"}) as pool:
        yield pool


@pytest.fixture
def tunable_pool2(pool2):
    """pool2, with any attribute a test changes put back."""
    saved = (pool2.job_timeout_s, pool2.error_grace_s)
    yield pool2
    pool2.job_timeout_s, pool2.error_grace_s = saved


# --- functions that run on the workers: module level, so they pickle by reference ---


def _all_reduce_rank() -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _rank_times_10() -> int:
    return dist.get_rank() * 10


def _tensors(x: torch.Tensor, *, offset: float) -> dict:
    rank = dist.get_rank()
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, x + rank + offset)
    w = torch.ones(3, requires_grad=True)
    return {
        "gathered": gathered,
        "view": torch.arange(100.0)[rank::10],  # a strided view into a bigger storage
        "nonleaf": (w * 2.0,),  # requires grad: pickles only once detached
        "bf16": x.to(torch.bfloat16) * rank,
    }


def _raise_on_rank1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("bad value on rank 1")
    return dist.get_rank()


def _raise_on_rank1_while_rank0_waits() -> float:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gave up before the all_reduce")
    t = torch.ones(1)
    dist.all_reduce(t)  # never matched: rank 1 raised
    return t.item()


def _all_reduce_on_rank0_only() -> str:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    return "done"


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _exit_on_rank1() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(60)  # blocked: the harness must not wait for this


def _worker_env() -> tuple:
    return (
        os.environ.get("MESHLM_TEST_WORKER"),
        os.environ.get("MESHLM_HARNESS_PROBE"),
        torch.get_num_threads(),
        dist.get_world_size(),
    )


def _mutmut_hit_in_worker(name: "str | None", mode: "str | None") -> int:
    """Record a hit as mutmut's trampolines do in stats mode, under MUTANT_UNDER_TEST=mode."""
    from mutmut.state import state

    if mode is None:
        os.environ.pop("MUTANT_UNDER_TEST", None)
    else:
        os.environ["MUTANT_UNDER_TEST"] = mode
    if name is not None:
        state()._stats.add(name)
    return dist.get_rank()


# --- results ---


@pytest.mark.parametrize("pool_name, world_size", [("pool2", 2), ("pool4", 4)])
def test_all_reduce_of_ranks_is_their_sum(request, pool_name, world_size):
    pool = request.getfixturevalue(pool_name)
    expected = float(sum(range(world_size)))
    assert pool.run(_all_reduce_rank) == [expected] * world_size
    assert pool.run(_all_reduce_rank) == [expected] * world_size  # the same group, reused


def test_results_are_indexed_by_rank(pool4):
    assert pool4.run(_rank_times_10) == [0, 10, 20, 30]
    assert pool4.run(dist.get_rank) == [0, 1, 2, 3]


def test_tensors_round_trip(pool4):
    x = torch.tensor([1.0, 2.5, -3.0])
    results = pool4.run(_tensors, x, offset=0.5)
    for rank, out in enumerate(results):
        for src, t in enumerate(out["gathered"]):
            torch.testing.assert_close(t, x + src + 0.5, rtol=0, atol=0)
        torch.testing.assert_close(out["view"], torch.arange(100.0)[rank::10], rtol=0, atol=0)
        # The view came back compacted, not with the 100-element storage behind it.
        assert out["view"].untyped_storage().nbytes() == 10 * 4
        (nonleaf,) = out["nonleaf"]
        assert not nonleaf.requires_grad
        torch.testing.assert_close(nonleaf, torch.full((3,), 2.0), rtol=0, atol=0)
        assert out["bf16"].dtype == torch.bfloat16
        torch.testing.assert_close(out["bf16"], x.to(torch.bfloat16) * rank, rtol=0, atol=0)


def test_workers_see_their_environment(pool2):
    assert pool2.run(_worker_env) == [("1", "42", 1, 2)] * 2
    assert os.environ.get("MESHLM_TEST_WORKER") is None  # the parent is untouched


# --- failures ---


def test_exception_on_one_rank_names_it_and_keeps_the_pool(pool2):
    with pytest.raises(RuntimeError, match="rank 1") as info:
        pool2.run(_raise_on_rank1)
    message = str(info.value)
    assert "ValueError" in message and "bad value on rank 1" in message
    assert "_raise_on_rank1" in message  # the remote traceback
    assert isinstance(info.value, WorkerError)
    assert (info.value.ranks, info.value.rank, info.value.exc_type) == ([1], 1, "ValueError")
    assert not pool2.broken
    assert pool2.run(_rank_times_10) == [0, 10]


def test_exception_while_other_ranks_wait_fails_fast(tunable_pool2):
    pool = tunable_pool2
    pool.error_grace_s = 1.0
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1") as info:
        pool.run(_raise_on_rank1_while_rank0_waits)
    assert time.monotonic() - start < pool.error_grace_s + SLACK_S  # not TIMEOUT_S
    assert (info.value.ranks, info.value.exc_type) == ([1], "ValueError")
    assert "rank 1 gave up" in str(info.value) and "Ranks [0] had not answered" in str(info.value)
    assert pool.broken  # rank 0 was stuck in C++, so the workers were killed
    assert pool.run(_rank_times_10) == [0, 10]  # respawned
    assert not pool.broken


def test_root_cause_wins_over_the_gloo_timeouts_it_causes(tunable_pool2):
    pool = tunable_pool2
    pool.error_grace_s = TIMEOUT_S + SLACK_S  # let rank 0 run into the gloo timeout
    pids = pool.run(os.getpid)
    with pytest.raises(WorkerError) as info:
        pool.run(_raise_on_rank1_while_rank0_waits)
    assert info.value.ranks == [0, 1]
    assert (info.value.rank, info.value.exc_type) == (1, "ValueError")
    message = str(info.value)
    assert message.index("Root cause: rank 1: ValueError") < message.index("Then: rank 0: RuntimeError")
    assert message.count("--- remote traceback") == 1
    # A fresh process group in the same workers: the old one's collectives are out of step.
    assert pool.run(_all_reduce_rank) == [1.0, 1.0]
    assert pool.run(os.getpid) == pids


def test_root_cause_is_the_earliest_non_communication_error():
    def failure(rank, when, is_comm):
        exc_type = "RuntimeError" if is_comm else "KeyError"
        return _Failure(rank, exc_type, f"r{rank}", f"tb{rank}", when, is_comm)

    failures = [failure(0, 1.0, True), failure(3, 3.0, False), failure(2, 2.0, False), failure(1, 0.5, True)]
    error = _worker_error("fn", failures)
    assert (error.ranks, error.rank, error.remote_traceback) == ([0, 1, 2, 3], 2, "tb2")


def test_deadlock_fails_within_the_timeout(pool2):
    pids = pool2.run(os.getpid)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 0") as info:
        pool2.run(_all_reduce_on_rank0_only)
    assert TIMEOUT_S * 0.9 < time.monotonic() - start < TIMEOUT_S + SLACK_S
    assert info.value.ranks == [0] and "Timed out" in str(info.value)
    assert "Ranks [1] returned normally: did they skip a collective" in str(info.value)
    assert pool2.run(_all_reduce_rank) == [1.0, 1.0]
    assert pool2.run(os.getpid) == pids  # recovered without a respawn


def test_job_timeout_kills_the_workers(tunable_pool2):
    pool = tunable_pool2
    pool.job_timeout_s = 0.5
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not finish within job_timeout_s=0.5 s on ranks \[0, 1\]"):
        pool.run(_sleep, 60.0)
    assert time.monotonic() - start < pool.job_timeout_s + SLACK_S
    assert pool.broken
    pool.job_timeout_s = 60.0
    assert pool.run(_rank_times_10) == [0, 10]


def test_dead_worker_is_reported(pool2):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 died \(exit code 3\)"):
        pool2.run(_exit_on_rank1)
    assert time.monotonic() - start < SLACK_S  # rank 0's sleep(60) was not waited for
    assert pool2.broken
    assert pool2.run(_rank_times_10) == [0, 10]


def test_unpicklable_fn_fails_in_the_parent(pool2):
    with pytest.raises(TypeError, match="module-level function"):
        pool2.run(lambda: 0)
    assert not pool2.broken


# --- lifecycle ---


def test_close_ends_the_workers():
    with DistPool(2, timeout_s=TIMEOUT_S) as pool:
        pids = pool.run(os.getpid)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="after close"):
        pool.run(_rank_times_10)


def test_forgotten_pool_is_killed_when_collected():
    pool = DistPool(1, timeout_s=TIMEOUT_S)
    (pid,) = pool.run(os.getpid)
    del pool
    gc.collect()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped, not left as an orphan


def test_a_shared_pool_asked_with_another_timeout_keeps_its_workers():
    """NOTE [shared pools]: a module asking for the shared pool with another gloo timeout
    gets the same workers, in a group formed again with its timeout (a deadlock then fails
    after it, not after the first module's)."""
    from harness.dist import _shared_pool

    env = {"MESHLM_HARNESS_PROBE": "shared"}  # a pool of this test's own (the env is in the key)
    pool = _shared_pool(2, 60.0, env)
    try:
        pids = pool.run(os.getpid)
        assert _shared_pool(2, TIMEOUT_S, env) is pool and pool.timeout_s == TIMEOUT_S
        assert pool.run(os.getpid) == pids  # not respawned
        start = time.monotonic()
        with pytest.raises(WorkerError, match="Timed out"):
            pool.run(_all_reduce_on_rank0_only)
        assert TIMEOUT_S * 0.9 < time.monotonic() - start < TIMEOUT_S + SLACK_S  # not 60 s
        assert pool.run(_all_reduce_rank) == [1.0, 1.0]
    finally:
        pool.close()


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _leave_meshes_behind(n: int) -> int:
    """Make ``n`` 2-D meshes (each a new gloo group per dim), redistribute on each, so that
    DTensor's caches see them, and lower a model on each (its buckets hold the mesh); drop
    them all; return this process's thread count."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import meshlm
    from meshlm.models import Llama, llama_config

    for _ in range(n):
        mesh = meshlm.make_mesh("fsdp=2,tp=2")
        t = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Shard(1)])
        t.redistribute(mesh, [Replicate(), Replicate()]).to_local()
        meshlm.shard(Llama(llama_config("llama_tiny"), device="meta"), "fsdp_tp", mesh, seed=0)
    return _threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_between_modules_the_groups_of_the_modules_meshes_end(pool4):
    """NOTE [shared pools]: what a module's meshes made (a gloo group per mesh dim, each
    with threads that keep polling) ends with the module, even where DTensor's caches
    or meshlm's bucket table held the meshes; a leak made every idle worker of the suite
    busy (620 threads each)."""
    from harness.dist import _between_modules

    pool = pool4  # the module's shared pool: what _between_modules is for
    base = pool.run(_threads)
    busy = pool.run(_leave_meshes_behind, 6)
    assert all(b >= t + 12 for b, t in zip(busy, base)), (base, busy)  # the test sees groups
    _between_modules(pool)
    after = pool.run(_threads)
    assert all(a <= t + 3 for a, t in zip(after, base)), (base, busy, after)  # one new group's


def test_run_distributed_is_a_one_shot_pool():
    assert run_distributed(_all_reduce_rank, 2, timeout_s=TIMEOUT_S) == [1.0, 1.0]


def test_mutmut_stats_hits_come_back_from_the_workers(pool2, monkeypatch):
    """docs/mutation.md: under mutmut's stats, what a job ran counts for the running test."""
    mutmut_state = pytest.importorskip("mutmut.state").state()
    hit, ignored = "meshlm.x_probe_hit", "meshlm.x_probe_ignored"
    try:
        monkeypatch.setenv("MUTANT_UNDER_TEST", "stats")
        assert pool2.run(_mutmut_hit_in_worker, hit, "stats") == [0, 1]
        assert hit in mutmut_state._stats
        monkeypatch.delenv("MUTANT_UNDER_TEST")  # not mutmut's stats: the parent records nothing
        pool2.run(_mutmut_hit_in_worker, ignored, "stats")
        assert ignored not in mutmut_state._stats
    finally:
        pool2.run(_mutmut_hit_in_worker, None, None)
        mutmut_state._stats -= {hit, ignored}
