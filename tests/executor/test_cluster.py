"""Issue 17: ranks on more than one host. Two "hosts" on loopback: the engine runs the first
ranks, a launcher process (``streamkv worker``) the others; greedy outputs equal TP 1. The
engine's listener refuses joins with a wrong token, rank or world size, and names the
command to run when a rank never joins."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest

from streamkv.entrypoints.cli.main import build_parser
from streamkv.entrypoints.llm import LLM
from streamkv.executor.cluster import JoinTimeout, Placement, RankListener, RemoteRank
from streamkv.executor.launcher import JoinRefused, LaunchSpec, _join, parse_ranks
from tests.executor.conftest import GREEDY, free_port, tiny_prompts, tokens

KW = {
    "device": "cpu",
    "dtype": "float32",
    "num_kv_blocks": 64,
    "num_swap_blocks": 0,
    "max_model_len": 128,
}


def start_launcher(port: int, ranks: str, *extra: str, log=None) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "streamkv.executor.launcher",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--ranks",
        ranks,
        "--wait",
        "120",
        *extra,
    ]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def want(tiny4_dir):
    ref = LLM(str(tiny4_dir), **KW)
    out = tokens(ref.generate(None, GREEDY, prompt_token_ids=tiny_prompts()))
    ref.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "local"), [(2, 1), (4, 2)])
def test_ranks_on_two_hosts_match_tp1(tiny4_dir, want, tp, local, monkeypatch, tmp_path):
    port = free_port()
    # torchrun's variables on the engine's host: the rest of the ranks join from elsewhere.
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    with open(tmp_path / "launcher.log", "w") as log:
        launcher = start_launcher(port, f"{local}-{tp - 1}", "--once", log=log)
        try:
            llm = LLM(str(tiny4_dir), **KW, tensor_parallel_size=tp)
            executor = llm.engine.executor
            assert [p is None for p in executor.pids] == [r >= local for r in range(tp)]
            assert all(isinstance(p, RemoteRank) for p in executor._procs[local:])
            assert tokens(llm.generate(None, GREEDY, prompt_token_ids=tiny_prompts())) == want
            llm.engine.block_manager.check_no_leaks()
            llm.shutdown()
            assert launcher.wait(30) == 0  # --once: its ranks exited cleanly with the engine
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()


def test_joins_are_checked():
    port = free_port()
    listener = RankListener(
        Placement.checked("127.0.0.1", port, 1, 2, token="s3cret", join_timeout=30)
    )
    joined: dict = {}
    thread = threading.Thread(target=lambda: joined.update(listener.accept([1], 2)))
    thread.start()
    try:
        deadline = time.monotonic() + 20
        spec = LaunchSpec("127.0.0.1", port, (1,), token="wrong")
        with pytest.raises(JoinRefused, match="wrong cluster token"):
            _join(spec, 1, "control", deadline)
        spec = replace(spec, token="s3cret")
        with pytest.raises(
            JoinRefused, match="WORLD_SIZE 4 differs from the engine's tensor_parallel_size 2"
        ):
            _join(replace(spec, world_size=4), 1, "control", deadline)
        with pytest.raises(JoinRefused, match=r"rank 3 is not one of the remote ranks \[1\]"):
            _join(spec, 3, "control", deadline)
        control = _join(replace(spec, world_size=2), 1, "control", deadline)
        with pytest.raises(JoinRefused, match="rank 1 already joined"):
            _join(spec, 1, "control", deadline)
        beat = _join(spec, 1, "heartbeat", deadline)
        thread.join(10)
        conn, beat_sock, handle = joined[1]
        assert handle.rank == 1 and handle.pid is None and "worker rank 1 (on " in handle.describe()
        conn.close()
        beat_sock.close()
        control.close()
        beat.close()
    finally:
        thread.join(10)
        listener.close()


def test_a_rank_that_never_joins_names_the_command_to_run():
    port = free_port()
    listener = RankListener(Placement.checked("127.0.0.1", port, 2, 4, join_timeout=0.5))
    try:
        with pytest.raises(
            JoinTimeout,
            match=rf"worker rank\(s\) \[2, 3\] did not join 127.0.0.1:{port} within 0s: "
            rf"start `streamkv worker --master-addr 127.0.0.1 --master-port {port} "
            r"--ranks 2,3` on their host",
        ):
            listener.accept([2, 3], 4)
    finally:
        listener.close()


def test_a_busy_master_port_is_a_clear_error():
    port = free_port()
    first = RankListener(Placement.checked("127.0.0.1", port, 1, 2))
    try:
        with pytest.raises(
            OSError,
            match=rf"cannot listen for worker ranks at MASTER_ADDR:MASTER_PORT 127.0.0.1:{port}",
        ):
            RankListener(Placement.checked("127.0.0.1", port, 1, 2))
    finally:
        first.close()


def test_placement_and_ranks_are_validated():
    assert Placement.from_env({}, 2) is None
    p = Placement.from_env(
        {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "LOCAL_WORLD_SIZE": "4"}, 8
    )
    assert (p.master_addr, p.master_port, p.local_ranks) == ("10.0.0.1", 29500, 4)
    with pytest.raises(ValueError, match="must be set together"):
        Placement.from_env({"MASTER_ADDR": "10.0.0.1"}, 2)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE 0 must be 1..tensor_parallel_size"):
        Placement.from_env({"MASTER_ADDR": "a", "MASTER_PORT": "1", "LOCAL_WORLD_SIZE": "0"}, 2)
    assert parse_ranks("2,3") == (2, 3) and parse_ranks("4-7") == (4, 5, 6, 7)
    for bad in ("0,1", "2,2", ""):
        with pytest.raises(ValueError):
            parse_ranks(bad)
    args = build_parser().parse_args(
        ["worker", "--master-addr", "a", "--master-port", "5", "--ranks", "1"]
    )
    assert (args.master_addr, args.master_port, args.ranks, args.once) == ("a", 5, "1", False)
