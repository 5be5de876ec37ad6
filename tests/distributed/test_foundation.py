"""The distributed harness runs real megatron-core on gloo: TP=2 and PP=2 equal TP=1."""
import pytest
import torch

from megatron_rl.distributed.launch import run_distributed
from tests.distributed import foundation_bodies


@pytest.fixture(scope="module")
def results():
    return run_distributed(foundation_bodies.tp_and_pp_equivalence, world_size=2)


def test_tp2_per_token_losses_equal_tp1(results):
    for r in results:
        assert r["tp_losses"].shape == r["ref_losses"].shape
        torch.testing.assert_close(r["tp_losses"], r["ref_losses"], atol=1e-5, rtol=0)
        assert r["tp_grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)


def test_pp2_loss_and_grad_norm_equal_pp1(results):
    last = [r for r in results if r["pp_stage"] == 1][0]
    torch.testing.assert_close(last["pp_losses"], last["ref_losses"], atol=1e-5, rtol=0)
    for r in results:
        assert r["pp_grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)


def test_harness_reports_rank_failure():
    with pytest.raises(RuntimeError, match="rank 1"):
        run_distributed(foundation_bodies.fail_on_rank_one, world_size=2, timeout=120)


def test_ranks_fork_from_one_preloaded_server_with_the_callers_environment(monkeypatch, tmp_path):
    """The ranks are forks of one fork server per caller that has imported megatron-core (launch.py), yet each
    launch sees what a spawned process would: the caller's environment and working directory at the time of the
    call, and a fresh address space (nothing a previous rank set). The server is the launcher's own, not
    multiprocessing's process-wide one, which another user (the verifier pool) may have started first with its own
    preload. MEGATRON_RL_LAUNCH=spawn gives fresh interpreters, children of the caller."""
    import multiprocessing
    import os
    from multiprocessing import forkserver

    monkeypatch.delenv("MEGATRON_RL_LAUNCH", raising=False)  # the default
    other = multiprocessing.get_context("forkserver").Process(target=os.getpid)  # the process-wide server, first
    other.start()
    other.join()
    monkeypatch.setenv("MRL_LAUNCH_PROBE", "first")
    first = run_distributed(foundation_bodies.process_facts, world_size=2, args=("MRL_LAUNCH_PROBE",))
    monkeypatch.setenv("MRL_LAUNCH_PROBE", "second")
    monkeypatch.chdir(tmp_path)
    second = run_distributed(foundation_bodies.process_facts, world_size=2, args=("MRL_LAUNCH_PROBE",))
    ranks = first + second
    assert len({r["ppid"] for r in ranks}) == 1 and ranks[0]["ppid"] != os.getpid(), ranks  # one server
    assert ranks[0]["ppid"] != forkserver._forkserver._forkserver_pid  # ... and not the process-wide one
    assert [r["env"] for r in ranks] == ["first"] * 2 + ["second"] * 2
    assert [r["cwd"] for r in second] == [str(tmp_path)] * 2
    assert [r["mark"] for r in ranks] == [None] * 4
    assert all(r["megatron_preloaded"] for r in ranks)
    assert [r["threads"] for r in ranks] == [max(1, (os.cpu_count() or 1) // 2)] * 4

    monkeypatch.setenv("MEGATRON_RL_LAUNCH", "spawn")
    [spawned] = run_distributed(foundation_bodies.process_facts, world_size=1, args=("MRL_LAUNCH_PROBE",))
    assert spawned["ppid"] == os.getpid() and not spawned["megatron_preloaded"] and spawned["env"] == "second"
    monkeypatch.setenv("MEGATRON_RL_LAUNCH", "fork")
    with pytest.raises(ValueError, match="MEGATRON_RL_LAUNCH='fork'"):
        run_distributed(foundation_bodies.process_facts, world_size=1, args=("MRL_LAUNCH_PROBE",))


def test_a_taken_rendezvous_port_is_retried_on_another(monkeypatch):
    """Another process binds the port picked for the rendezvous before rank 0 does (CI: a Ray cluster starting in the
    other pytest worker): the launch is repeated on a new port instead of failing."""
    import socket

    from megatron_rl.distributed import launch

    held = socket.socket()
    held.bind(("0.0.0.0", 0))
    held.listen()
    picked = [held.getsockname()[1]]
    real = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda: picked.pop() if picked else real())
    try:
        ranks = run_distributed(foundation_bodies.process_facts, world_size=2, args=("MRL_LAUNCH_PROBE",))
    finally:
        held.close()
    assert len(ranks) == 2 and not picked  # the held port was tried first
