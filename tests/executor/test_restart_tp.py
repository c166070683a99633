"""Issue 13 at TP > 1: when one rank is SIGKILLed mid-stream, every rank is restarted
together and the running requests resume by recompute, their streams continuing with the
tokens a fault-free run gives. On one host, and with the killed rank on another "host"
(its launcher joins the restarted engine by itself)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from streamkv import SamplingParams
from streamkv.engine.async_engine import AsyncEngine
from streamkv.engine.llm_engine import LLMEngine
from streamkv.entrypoints.llm import LLM, engine_config
from tests.executor.conftest import free_port, tiny_prompts, tokens

KW = {
    "device": "cpu",
    "dtype": "float32",
    "num_kv_blocks": 64,
    "num_swap_blocks": 0,
    "max_model_len": 128,
}
LONG = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def want(tiny4_dir):
    ref = LLM(str(tiny4_dir), **KW)
    out = tokens(ref.generate(None, LONG, prompt_token_ids=tiny_prompts()))
    ref.shutdown()
    return out


def children(pid: int, marker: bytes = b"streamkv.executor.rank") -> list[int]:
    pids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            pids += [int(p) for p in f.read().split()]
    found = []
    for p in pids:
        try:
            if marker in Path(f"/proc/{p}/cmdline").read_bytes():
                found.append(p)
        except FileNotFoundError:
            pass
    return found


async def stream_and_kill(
    config,
    victim,
    after: int = 4,
    fault: signal.Signals = signal.SIGKILL,
) -> tuple[list[list[int]], list[list[int | None]]]:
    """Stream every prompt at once; after ``after`` outputs of the first, send ``fault`` to
    ``victim()``.
    The final token ids of each, and the executor's pids before and after."""
    engine = AsyncEngine(lambda: LLMEngine(config))
    engine.start()
    await engine.wait_ready()
    before = engine.engine.executor.pids
    try:
        streams = [await engine.add_request(str(i), p, LONG) for i, p in enumerate(tiny_prompts())]

        async def collect(i, stream):
            outs = []
            async for out in stream:
                outs.append(out)
                if i == 0 and len(outs) == after:
                    os.kill(victim(), fault)
            assert outs[-1].finished and outs[-1].error is None, outs[-1]
            # Cumulative outputs only ever grow: nothing streamed is taken back or repeated.
            seen = [list(o.outputs[0].token_ids) for o in outs]
            assert all(b[: len(a)] == a for a, b in zip(seen, seen[1:], strict=False))
            return seen[-1]

        got = await asyncio.gather(*(collect(i, s) for i, s in enumerate(streams)))
        return got, [before, engine.engine.executor.pids]
    finally:
        await engine.stop()


@pytest.mark.slow
def test_tp2_restarts_every_rank_and_resumes(tiny4_dir, want):
    config = engine_config(str(tiny4_dir), **KW, tensor_parallel_size=2)

    # The pids are known once the engine is up: look them up from the engine's children.
    def victim_lookup() -> int:
        ranks = children(os.getpid())
        assert len(ranks) == 2, ranks
        return max(ranks)

    got, (before, after) = asyncio.run(
        asyncio.wait_for(stream_and_kill(config, victim_lookup), 300)
    )
    assert got == want
    assert len(after) == 2 and not set(before) & set(after)  # both ranks are new processes


@pytest.mark.slow
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_rank_on_another_host_killed_or_frozen_mid_stream_rejoins_and_resumes(
    tiny4_dir, want, fault, monkeypatch, tmp_path
):
    """SIGSTOP: the engine drops the silent rank's heartbeat connection, its launcher kills it."""
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    config = engine_config(str(tiny4_dir), **KW, tensor_parallel_size=2)
    with open(tmp_path / "launcher.log", "w") as log:
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "streamkv.executor.launcher",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "--ranks",
                "1",
                "--wait",
                "60",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:

            def victim() -> int:
                (rank,) = children(launcher.pid)
                return rank

            got, (before, after) = asyncio.run(
                asyncio.wait_for(stream_and_kill(config, victim, fault=fault), 300)
            )
            assert got == want
            assert before[1] is None and after[1] is None and before[0] != after[0]
        finally:
            launcher.terminate()
            launcher.wait(30)
    text = (tmp_path / "launcher.log").read_text()
    assert text.count("rank 1 started") == 2, text  # it joined the restarted engine by itself
    if fault == signal.SIGSTOP:
        assert "outlived its engine connection" in text  # the launcher killed the frozen rank
