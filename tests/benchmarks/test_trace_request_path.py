"""benchmarks/trace_request_path.py: its path and group rules, the hook's on/off protocol (in
this process and through a sitecustomize.py in a child), and, slow, one traced request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from benchmarks import trace_request_path as trp


def test_package_path_keeps_only_the_package_s_python_files(tmp_path):
    package = tmp_path / "repo" / "streamkv"
    (package / "engine").mkdir(parents=True)
    (package / "engine" / "llm_engine.py").write_text("")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "repo")
    assert trp.package_path(str(package / "engine" / "llm_engine.py"), package) == (
        "streamkv/engine/llm_engine.py"
    )
    assert trp.package_path(str(link / "streamkv" / "engine" / "llm_engine.py"), package) == (
        "streamkv/engine/llm_engine.py"
    )
    assert trp.package_path(str(package / "config.py"), package) == "streamkv/config.py"
    assert trp.package_path(str(tmp_path / "torch" / "nn" / "modules.py"), package) is None
    assert trp.package_path(str(tmp_path / "repo" / "streamkv_extra" / "x.py"), package) is None
    assert trp.package_path("<frozen importlib._bootstrap>", package) is None
    assert trp.package_path(str(package / "core" / "costs.json"), package) is None


def test_groups_follow_the_request_order_then_others_then_top_level():
    paths = [
        "streamkv/sequence.py",
        "streamkv/kernels/ops.py",
        "streamkv/entrypoints/server/app.py",
        "streamkv/baselines/contiguous.py",
        "streamkv/engine/llm_engine.py",
        "streamkv/engine/async_engine.py",
        "streamkv/engine/llm_engine.py",
    ]
    groups = trp.group_files(paths)
    assert list(groups) == ["entrypoints", "engine", "kernels", "baselines", "top level"]
    assert groups["engine"] == ["streamkv/engine/async_engine.py", "streamkv/engine/llm_engine.py"]
    assert trp.group_of("streamkv/config.py") == trp.TOP
    assert trp.short_name("streamkv/entrypoints/server/app.py") == "server/app"
    assert trp.short_name("streamkv/engine/llm_engine.py") == "llm_engine"
    assert trp.short_name("streamkv/config.py") == "config"


def test_role_of_names_the_server_and_the_rank():
    assert trp.role_of(["python", "-m", "streamkv.entrypoints.cli", "serve"]) == "server"
    assert trp.role_of(["python", "-m", "streamkv.executor.rank", "8"]) == "rank"
    assert trp.role_of(["python", "-c", "pass"]) == "other"


def _a_function():
    return 1


def test_recorder_records_only_between_on_and_off(tmp_path):
    recorder = trp.Recorder(str(tmp_path))
    here = sys._getframe()
    recorder.profile(here, "call", None)  # before "on": dropped
    trp._write(tmp_path / "control", "request on")
    recorder.poll_once()
    assert (tmp_path / f"request.{os.getpid()}.on").exists()
    recorder.profile(here, "return", None)  # not a call
    recorder.profile(here, "call", None)
    trp._write(tmp_path / "control", "request off")
    recorder.poll_once()
    recorder.profile(here, "call", None)  # after "off": dropped
    record = json.loads((tmp_path / f"request.{os.getpid()}.json").read_text())
    assert [c[1:3] for c in record["calls"]] == [[__file__, here.f_code.co_qualname]]
    assert record["threads"] == {str(threading.get_ident()): threading.current_thread().name}
    recorder.poll_once()  # the same control text again: nothing new
    trp._write(tmp_path / "control", "idle off")  # an "off" for a phase never on
    recorder.poll_once()
    assert not (tmp_path / f"idle.{os.getpid()}.json").exists()


def _record(calls, threads):
    return {"pid": 1, "argv": ["python", "-m", "streamkv.executor.rank", "8"], "calls": calls,
            "threads": threads}  # fmt: skip


def test_process_entry_subtracts_idle_functions_not_whole_files(tmp_path):
    package = tmp_path / "streamkv"
    engine = str(package / "engine" / "llm_engine.py")
    stats = str(package / "engine" / "stats.py")
    torch_file = str(tmp_path / "torch" / "module.py")
    request = _record(
        [
            ["1", engine, "LLMEngine.step", 10],
            ["1", engine, "LLMEngine.stats", 20],
            ["1", stats, "Stats.snapshot", 5],
            ["2", torch_file, "Module.__call__", 1],
            ["3", engine, "LLMEngine.add_request", 30],
        ],
        {"1": "streamkv-engine", "2": "MainThread"},
    )
    idle = _record(
        [["1", engine, "LLMEngine.stats", 20], ["1", stats, "Stats.snapshot", 5]],
        {"1": "streamkv-engine"},
    )
    entry = trp.process_entry(request, idle, package)
    assert entry["role"] == "rank" and entry["functions"] == 4
    assert entry["files"] == ["streamkv/engine/llm_engine.py", "streamkv/engine/stats.py"]
    assert entry["threads"] == {
        "?": ["streamkv/engine/llm_engine.py"],
        "streamkv-engine": ["streamkv/engine/llm_engine.py", "streamkv/engine/stats.py"],
    }
    assert entry["idle_files"] == entry["files"]
    assert entry["files_excluding_idle"] == ["streamkv/engine/llm_engine.py"]
    assert "idle_files" not in trp.process_entry(request, None, package)


CHILD = """
import os, sys, threading, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from streamkv.engine import thing

trace = Path(os.environ["STREAMKV_TRACE_FILES"])
def phase(text, answer):
    (trace / "control").write_text(text)
    while not (trace / answer).exists():
        time.sleep(0.005)
thing.before()
phase("request on", f"request.{os.getpid()}.on")
thing.on_main()
t = threading.Thread(target=thing.on_thread, name="worker-thread")
t.start()
t.join()
phase("request off", f"request.{os.getpid()}.json")
"""


def test_sitecustomize_hooks_a_child_process_and_its_threads(tmp_path):
    """The route the script takes into the server and its rank, on a two-file stand-in."""
    (tmp_path / "trace" / "site").mkdir(parents=True)
    site = tmp_path / "trace" / "site" / "sitecustomize.py"
    site.write_text(
        trp.SITECUSTOMIZE.format(env=trp.TRACE_ENV, path=str(Path(trp.__file__).resolve()))
    )
    package = tmp_path / "src" / "streamkv"
    (package / "engine").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "engine" / "__init__.py").write_text("")
    (package / "engine" / "thing.py").write_text(
        textwrap.dedent("""
        def before(): pass
        def on_main(): pass
        def on_thread(): pass
        """)
    )
    env = {
        **os.environ,
        trp.TRACE_ENV: str(tmp_path / "trace"),
        "PYTHONPATH": str(site.parent),
    }
    subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "src")], env=env, check=True, timeout=60
    )
    (dump,) = (tmp_path / "trace").glob("request.*.json")
    (proc,) = (tmp_path / "trace").glob("proc.*.json")
    assert json.loads(proc.read_text())["pid"] == int(dump.name.split(".")[1])
    functions = trp.functions_of(json.loads(dump.read_text()), package)
    thing = "streamkv/engine/thing.py"
    assert functions["MainThread"] >= {(thing, "on_main")}
    assert (thing, "before") not in functions["MainThread"]
    assert functions["worker-thread"] == {(thing, "on_thread")}


@pytest.mark.slow
def test_one_traced_request_on_the_cpu(tmp_path):
    out = tmp_path / "path.json"
    assert trp.main(["--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    files = {f for fs in result["groups"].values() for f in fs}
    assert result["total_files"] == len(files) > 20
    assert {
        "streamkv/entrypoints/openai/serving.py",
        "streamkv/engine/llm_engine.py",
        "streamkv/core/scheduler.py",
        "streamkv/worker/model_runner.py",
        "streamkv/models/llama.py",
    } <= files
    # Features a plain request does not ask for stay off its path (docs/architecture.md).
    unasked = {
        "streamkv/engine/structured.py",
        "streamkv/worker/prompt_logprobs.py",
        "streamkv/layers/token_mask.py",
    }
    assert not unasked & files
    roles = {p["role"]: p for p in result["processes"]}
    assert "streamkv/worker/model_runner.py" in roles["rank"]["files"]
    assert "streamkv/worker/model_runner.py" not in roles["server"]["files"]
    assert result["requests"]["traced"]["chunks"] >= 1
