"""Which streamkv files one streaming request runs through (issue 31), counted by a profile
hook rather than by hand: a real ``streamkv serve`` on the embedded model on the CPU (``mp``
executor, async scheduling), one warm-up streaming ``/v1/completions`` request, then every
streamkv/ file with a Python function called while a second one runs, in the server and in
the rank process, printed by package.

    .venv/bin/python benchmarks/trace_request_path.py --exclude-idle \\
        --json-out docs/gpu_runs/request_path_cpu.json

``--executor inprocess`` traces the one-process engine, ``--device cuda`` the GPU path (its
kernels and graphs). ``--exclude-idle`` also records an idle interval as long as the
request's and leaves out the functions called in it (the engine thread's idle probe, the
stats logger, the supervisor's heartbeat): a file then counts only if one of its functions
that idle never calls ran. ``--tree`` traces another checkout (an older commit through
``git worktree add``) with this script.

How the hook gets in without a line in streamkv/: a temporary directory holding a
``sitecustomize.py`` goes first on the server's PYTHONPATH, so every Python process it starts
(the rank too: it inherits the environment) imports it at startup. That file loads this
one and calls ``install(TRACE_DIR)``: ``sys.setprofile`` and ``threading.setprofile`` (every
thread, from the first), and a poller thread that watches ``TRACE_DIR/control``. ``PHASE on``
starts a fresh record and answers ``PHASE.PID.on``; ``PHASE off`` stops it and writes
``PHASE.PID.json``: the (thread, function) pairs of every Python call and generator
resumption seen in between. Each process imports the hook before streamkv, so it uses the
standard library only (this file imports nothing else at module level).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TRACE_ENV = "STREAMKV_TRACE_FILES"
REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "streamkv"
# The packages in the order a request meets them; "top level" is streamkv/*.py.
GROUPS = ("entrypoints", "engine", "core", "executor", "worker", "models", "layers", "kernels")
TOP = "top level"
POLL_S = 0.01
WARMUP_PROMPT = "The capital of France is"
TRACED_PROMPT = "A short story about a lighthouse keeper:"

SITECUSTOMIZE = """\
import os
if os.environ.get({env!r}):
    import importlib.util
    _spec = importlib.util.spec_from_file_location("_streamkv_trace_hook", {path!r})
    _hook = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_hook)
    _hook.install(os.environ[{env!r}])
"""


# -- the hook (runs inside the server and the rank) ---------------------------------------
class Recorder:
    """The (thread id, code object) pairs of the Python calls made while a phase is on."""

    def __init__(self, trace_dir: str) -> None:
        self.dir = Path(trace_dir)
        self.seen: set | None = None  # None: not recording
        self.names: dict[int, str] = {}  # thread id -> name, taken at its first recorded call
        self.phase = ""
        self.control = ""

    def profile(self, frame, event, arg) -> None:
        seen = self.seen
        if seen is not None and event == "call":
            ident = threading.get_ident()
            seen.add((ident, frame.f_code))
            if ident not in self.names:  # now: a short-lived thread is gone by the dump
                self.names[ident] = threading.current_thread().name

    def poll_once(self) -> None:
        try:
            text = (self.dir / "control").read_text().strip()
        except OSError:
            return
        if text == self.control:
            return
        self.control = text
        phase, _, state = text.rpartition(" ")
        if state == "on" and self.seen is None:
            self.phase, self.names, self.seen = phase, {}, set()
            _write(self.dir / f"{phase}.{os.getpid()}.on", "")
        elif state == "off" and self.seen is not None and phase == self.phase:
            seen, self.seen = self.seen, None
            calls = list(seen)  # one C-level copy: calls still landing in `seen` are lost
            record = {
                "pid": os.getpid(),
                "argv": list(getattr(sys, "orig_argv", sys.argv)),
                "threads": {str(i): self.names.get(i, "?") for i in {i for i, _ in calls}},
                "calls": sorted(
                    [str(i), c.co_filename, c.co_qualname, c.co_firstlineno] for i, c in calls
                ),
            }
            _write(self.dir / f"{phase}.{os.getpid()}.json", json.dumps(record))

    def run(self) -> None:
        while True:
            self.poll_once()
            time.sleep(POLL_S)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def install(trace_dir: str, at_fork: bool = True) -> Recorder:
    """Called by the sitecustomize.py the script writes, first thing in every process."""
    recorder = Recorder(trace_dir)
    info = {"pid": os.getpid(), "ppid": os.getppid(), "argv": list(sys.orig_argv)}
    _write(recorder.dir / f"proc.{os.getpid()}.json", json.dumps(info))
    # The poller starts before threading.setprofile so that its own calls are not profiled.
    threading.Thread(target=recorder.run, name="trace-poller", daemon=True).start()
    threading.setprofile(recorder.profile)
    sys.setprofile(recorder.profile)
    if at_fork:  # a forked child (no exec, no sitecustomize) has no poller: start its own
        os.register_at_fork(after_in_child=lambda: install(trace_dir, at_fork=False))
    return recorder


# -- pure parts: paths and groups -----------------------------------------------------------
def package_path(filename: str, package: Path = PACKAGE) -> str | None:
    """``/repo/streamkv/engine/llm_engine.py`` -> ``streamkv/engine/llm_engine.py``; None for
    a file outside the package (the standard library, torch, ``<frozen ...>``)."""
    if not filename.endswith(".py"):
        return None
    path = Path(os.path.realpath(filename))
    try:
        rel = path.relative_to(Path(os.path.realpath(package)))
    except ValueError:
        return None
    return "streamkv/" + rel.as_posix()


def group_of(path: str) -> str:
    """``streamkv/entrypoints/server/app.py`` -> ``entrypoints``; ``streamkv/config.py`` ->
    ``top level``; a package outside GROUPS (``bench``, ``baselines``) is its own group."""
    parts = path.split("/")[1:]
    return TOP if len(parts) == 1 else parts[0]


def short_name(path: str) -> str:
    """How docs/architecture.md names a file inside its group: ``server/app``, ``config``."""
    parts = path.removesuffix(".py").split("/")[1:]
    return "/".join(parts if len(parts) == 1 else parts[1:])


def group_files(paths) -> dict[str, list[str]]:
    """Sorted paths by group, GROUPS first in their order, then others, then top level."""
    out: dict[str, list[str]] = {}
    for path in sorted(set(paths)):
        out.setdefault(group_of(path), []).append(path)
    order = [*GROUPS, *sorted(g for g in out if g not in GROUPS and g != TOP), TOP]
    return {g: out[g] for g in order if g in out}


def functions_of(record: dict, package: Path = PACKAGE) -> dict[str, set[tuple[str, str]]]:
    """A process's dump -> {thread name: its (streamkv file, function) pairs}."""
    out: dict[str, set[tuple[str, str]]] = {}
    for ident, filename, qualname, _ in record["calls"]:
        path = package_path(filename, package)
        if path is not None:
            out.setdefault(record["threads"].get(ident, "?"), set()).add((path, qualname))
    return out


def process_entry(record: dict, idle: dict | None, package: Path = PACKAGE) -> dict:
    """One process's files, per thread and all together; with an idle record, also the files
    left when the functions the idle interval called are taken out (a file stays if any
    other function of it ran: the engine thread's idle probe calls LLMEngine.stats, never
    LLMEngine.step)."""
    threads = functions_of(record, package)
    functions = set().union(*threads.values())
    entry = {
        "role": role_of(record["argv"]),
        "pid": record["pid"],
        "argv": record["argv"],
        "files": sorted({f for f, _ in functions}),
        "threads": {t: sorted({f for f, _ in fs}) for t, fs in sorted(threads.items())},
        "functions": len(functions),
    }
    if idle is not None:
        idle_functions = set().union(*functions_of(idle, package).values())
        entry["idle_files"] = sorted({f for f, _ in idle_functions})
        entry["files_excluding_idle"] = sorted({f for f, _ in functions - idle_functions})
    return entry


def role_of(argv: list[str]) -> str:
    if "streamkv.executor.rank" in argv:
        return "rank"
    if "serve" in argv:
        return "server"
    return "other"


# -- the run ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.05)
    raise TimeoutError(f"no {what} after {timeout:.0f} s")


def healthy(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/health")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


def stream_completion(port: int, prompt: str, max_tokens: int, timeout: float) -> dict:
    """One streaming /v1/completions request, read to ``data: [DONE]``."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"/v1/completions answered {resp.status}: {resp.read()[:500]!r}")
        text, chunks = "", 0
        for line in resp:
            line = line.strip()
            if line == b"data: [DONE]":
                return {"prompt": prompt, "text": text, "chunks": chunks}
            if line.startswith(b"data: "):
                chunks += 1
                text += "".join(c.get("text", "") for c in json.loads(line[6:])["choices"])
        raise RuntimeError("the stream ended without data: [DONE]")
    finally:
        conn.close()


class Tracer:
    """The server's processes, as they registered in the trace directory."""

    def __init__(self, trace_dir: Path) -> None:
        self.dir = trace_dir

    def live(self) -> dict[int, dict]:
        out = {}
        for path in self.dir.glob("proc.*.json"):
            info = json.loads(path.read_text())
            if _alive(info["pid"]):
                out[info["pid"]] = info
        return out

    def phase(self, name: str, state: str, timeout: float) -> dict[int, dict]:
        """Turn ``name`` on or off in every live process; wait for each one's answer."""
        _write(self.dir / "control", f"{name} {state}")
        suffix = "on" if state == "on" else "json"

        def answered():
            pids = self.live()
            if pids and all((self.dir / f"{name}.{p}.{suffix}").exists() for p in pids):
                return pids
            return None

        pids = wait_for(answered, timeout, f"answer to '{name} {state}' from every process")
        if state == "on":
            return pids
        return {p: json.loads((self.dir / f"{name}.{p}.json").read_text()) for p in pids}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def server_command(args, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "streamkv.entrypoints.cli", "serve"]
    cmd += [args.model] if args.model else []
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--device", args.device]
    cmd += ["--distributed-executor-backend", args.executor]
    cmd += ["--async-scheduling" if args.async_scheduling else "--no-async-scheduling"]
    return cmd + args.server_arg


def trace(args, trace_dir: Path) -> dict:
    (trace_dir / "site").mkdir()
    (trace_dir / "site" / "sitecustomize.py").write_text(
        SITECUSTOMIZE.format(env=TRACE_ENV, path=str(Path(__file__).resolve()))
    )
    env = dict(os.environ)
    env[TRACE_ENV] = str(trace_dir)
    path = [str(trace_dir / "site"), str(args.tree), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    port = free_port()
    cmd = server_command(args, port)
    print("server:", " ".join(cmd), flush=True)
    log = open(trace_dir / "server.log", "wb")
    # A session of its own, so that the end can stop the server and every rank it started.
    proc = subprocess.Popen(
        cmd, cwd=args.tree, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    tracer = Tracer(trace_dir)
    try:
        wait_for(lambda: healthy(port), args.startup_timeout, "healthy server", proc)
        warmup = stream_completion(port, WARMUP_PROMPT, args.max_tokens, args.request_timeout)
        time.sleep(args.settle)
        tracer.phase("request", "on", 30)
        start = time.monotonic()
        traced = stream_completion(port, TRACED_PROMPT, args.max_tokens, args.request_timeout)
        time.sleep(args.settle)  # the step after the last token, the request's cleanup
        seconds = time.monotonic() - start
        request = tracer.phase("request", "off", 30)
        idle = None
        if args.exclude_idle:
            tracer.phase("idle", "on", 30)
            time.sleep(seconds)
            idle = tracer.phase("idle", "off", 30)
    except Exception:
        log.flush()
        tail = (trace_dir / "server.log").read_bytes()[-3000:].decode(errors="replace")
        print(f"--- server log (tail) ---\n{tail}", file=sys.stderr)
        raise
    finally:
        stop_server(proc)
        log.close()
    return summarize(args, cmd, request, idle, {"warmup": warmup, "traced": traced}, seconds)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    try:  # a rank that outlived its server (the server's session, nothing else)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def summarize(args, cmd, request: dict, idle: dict | None, requests: dict, seconds) -> dict:
    empty = {"calls": [], "threads": {}}
    processes = [
        process_entry(
            record, None if idle is None else idle.get(pid, empty), args.tree / "streamkv"
        )
        for pid, record in sorted(request.items())
    ]
    union = {f for p in processes for f in p["files"]}
    union_busy = {f for p in processes for f in p.get("files_excluding_idle", ())}
    return {
        "command": "python benchmarks/trace_request_path.py " + " ".join(args.argv),
        "server_command": cmd[2:],
        "commit": git_commit(args.tree),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "requests": requests,
        "max_tokens": args.max_tokens,
        "recorded_seconds": round(seconds, 3),
        "total_files": len(union),
        "groups": group_files(union),
        "processes": processes,
        **(
            {
                "total_excluding_idle": len(union_busy),
                "groups_excluding_idle": group_files(union_busy),
            }
            if idle is not None
            else {}
        ),
    }


def git_commit(tree: Path) -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "streamkv"],
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not head:
        return "unknown (not a git checkout)"
    return head + (" (streamkv/ modified)" if dirty else "")


def print_table(result: dict, exclude_idle: bool) -> None:
    key = "groups_excluding_idle" if exclude_idle else "groups"
    groups = result[key]
    procs = result["processes"]
    per_proc = [set(p["files_excluding_idle" if exclude_idle else "files"]) for p in procs]
    heads = [f"{p['role']} {p['pid']}" for p in procs]
    print(f"\n{'package':<12} {'files':>5}  " + "  ".join(f"{h:>12}" for h in heads))
    for group, files in groups.items():
        counts = [len(s & set(files)) for s in per_proc]
        print(f"{group:<12} {len(files):>5}  " + "  ".join(f"{c:>12}" for c in counts))
    total = sum(len(f) for f in groups.values())
    print(f"{'total':<12} {total:>5}  " + "  ".join(f"{len(s):>12}" for s in per_proc))
    print()
    for group, files in groups.items():
        print(f"{group} ({len(files)}): " + ", ".join(short_name(f) for f in files))
    if exclude_idle:
        every = {f for p in procs for f in p["files"]}
        dropped = sorted(every - {f for p in procs for f in p["files_excluding_idle"]})
        print(f"\nalso run while idle, left out ({len(dropped)}): " + ", ".join(dropped))
    line = f"\nstreamkv files on the path: {result['total_files']}"
    if exclude_idle:
        line += f", {total} leaving out the functions an idle interval calls"
    print(f"{line} ({result['commit']})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument(
        "--device",
        default="cpu",
        help="the server's --device (cuda: the GPU path, with its kernels and graphs)",
    )
    p.add_argument(
        "--executor",
        choices=("mp", "inprocess"),
        default="mp",
        help="--distributed-executor-backend: the model in a rank process, or in the server's",
    )
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-tokens", type=int, default=8, help="of each of the two requests")
    p.add_argument(
        "--exclude-idle",
        action="store_true",
        help="leave out the functions an idle interval of the same length calls",
    )
    p.add_argument(
        "--settle", type=float, default=0.5, help="seconds recorded after the stream's end"
    )
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--request-timeout", type=float, default=120)
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="one more argument for streamkv serve (repeat it: --server-arg=--block-size ...)",
    )
    p.add_argument(
        "--tree",
        type=Path,
        default=REPO,
        help="the checkout whose streamkv/ the server runs (default: this one), e.g. a "
        "`git worktree` of an older commit",
    )
    p.add_argument("--keep-trace-dir", default=None, help="keep the dumps and log here")
    p.add_argument("--json-out", default=None, help="write the files, per process and thread")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.tree = args.tree.resolve()
    if not (args.tree / "streamkv" / "__init__.py").exists():
        p.error(f"--tree {args.tree}: no streamkv/ package there")
    if args.keep_trace_dir:
        trace_dir = Path(args.keep_trace_dir).resolve()
        trace_dir.mkdir(parents=True, exist_ok=False)
        result = trace(args, trace_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="streamkv-trace-") as tmp:
            result = trace(args, Path(tmp))
    print_table(result, args.exclude_idle)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
        print("wrote", args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
