"""The flags a vLLM user types (issue 14): each is honoured, none accepted and ignored.

Parsing is checked in-process; what a flag does is checked on a real ``streamkv serve``
subprocess: one started from ``--config FILE.yaml`` (tokenizer, root path, request log,
a command-line flag over the file's), one with ``--chat-template``, ``--disable-log-stats``
and HTTPS."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import httpx
import pytest

from streamkv import __version__
from streamkv.engine.watchdog import STEP_TIMEOUT_S
from streamkv.entrypoints.cli.common import load_chat_template
from streamkv.entrypoints.cli.main import build_parser, main, parse_args
from tests.entrypoints.conftest import run_server

CHAT = {"messages": [{"role": "user", "content": "hello"}]}


def _parse(*argv: str):
    return parse_args(build_parser(), list(argv))


# -- parsing --------------------------------------------------------------------------------
def test_version_prints_and_exits(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"streamkv {__version__}"


def test_log_level_before_or_after_the_command():
    assert _parse("serve").log_level == "INFO"
    assert _parse("--log-level", "debug", "serve").log_level == "DEBUG"
    assert _parse("serve", "--log-level", "warning").log_level == "WARNING"
    assert (
        _parse("--log-level", "debug", "generate", "hi", "--log-level", "error").log_level
        == "ERROR"
    )
    with pytest.raises(SystemExit):
        _parse("serve", "--log-level", "loud")


def test_serve_help_is_grouped_and_shows_defaults():
    text = build_parser().commands["serve"].format_help()
    for group in (
        "server:",
        "logging:",
        "security and limits:",
        "common:",
        "model config:",
        "cache config",
        "scheduler config",
    ):
        assert f"\n{group}" in text, group
    flat = " ".join(text.split())
    assert "TCP port to listen on (default: 8000)" in flat
    assert "tokens per KV block (default: 16)" in flat
    assert "seconds between stats lines (default: 5.0)" in flat
    assert "(default: None)" not in flat  # a None default is explained by the help text instead


def test_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(
        "port: 9001\nserved_model_name: from-file\nmax-model-len: 512\n"
        "enable-prefix-caching: false\nallowed-origins: [http://a.example, http://b.example]\n"
        "model: /models/x\nenable-log-requests: true\n"
    )
    args = _parse(
        "serve", "--config", str(path), "--port", "9002", "--allowed-origins", "http://c.example"
    )
    assert (args.port, args.served_model_name, args.max_model_len) == (9002, ["from-file"], 512)
    assert args.enable_prefix_caching is False and args.enable_log_requests is True
    assert args.allowed_origins == [
        "http://c.example"
    ]  # the command line's list replaces the file's
    assert args.model == "/models/x"
    assert _parse("serve", "/models/y", "--config", str(path)).model == "/models/y"


def test_log_level_before_the_command_wins_over_the_config_file(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("log-level: debug\nport: 9001\n")
    assert _parse("serve", "--config", str(path)).log_level == "DEBUG"
    assert _parse("--log-level", "warning", "serve", "--config", str(path)).log_level == "WARNING"
    assert _parse("serve", "--config", str(path), "--log-level", "error").log_level == "ERROR"


@pytest.mark.parametrize(
    "text, message",
    [
        ("prot: 8000\n", "unknown key 'prot' (did you mean port"),
        ("enable-prefix-caching: maybe\n", "takes true or false"),
        ("port: [1, 2]\n", "takes one value"),
        ("- port\n", "must be a mapping"),
        ("port: [\n", "not valid YAML"),
    ],
)
def test_config_file_errors_name_the_problem(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit):
        _parse("serve", "--config", str(path))
    assert message in capsys.readouterr().err


def test_chat_template_from_a_file_inline_or_refused(tmp_path):
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert load_chat_template(str(path)) == template
    assert load_chat_template(template) == template
    with pytest.raises(ValueError, match="neither a file nor an inline"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="line 1"):
        load_chat_template("{% for m in messages %}")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ssl-keyfile", "k.pem"], "--ssl-keyfile needs --ssl-certfile"),
        (["--ssl-certfile", "/nonexistent/cert.pem"], "no such file"),
        (["--root-path", "proxy"], "--root-path must start with '/'"),
        (["--log-stats-interval", "0"], "--log-stats-interval must be > 0"),
        (["--tokenizer", "/nonexistent/dir"], "tokenizer must be a local directory"),
        (["--engine-step-timeout", "0"], "--engine-step-timeout must be > 0"),
        (["--engine-step-timeout", "nan"], "--engine-step-timeout must be > 0"),
    ],
)
def test_serve_refuses_bad_flags_before_listening(argv, message):
    args = _parse("serve", *argv)
    with pytest.raises(SystemExit, match=message):
        args.func(args)


class _Wired(Exception):
    """Raised by the stand-in build_app: what serve built, without loading a model."""


@pytest.mark.parametrize(
    "argv, timeout, kv_view",
    [
        ([], STEP_TIMEOUT_S, None),  # None: the view is on only when listening on loopback alone
        (["--engine-step-timeout", "2.5", "--enable-kv-view"], 2.5, True),
        (["--no-enable-kv-view"], STEP_TIMEOUT_S, False),
    ],
)
def test_watchdog_and_kv_view_flags_reach_the_engine_and_the_app(
    monkeypatch, argv, timeout, kv_view
):
    import streamkv.engine.async_engine as async_engine
    import streamkv.entrypoints.server.app as server

    built = {}

    class Engine:
        def __init__(self, build, **kwargs):
            built.update(kwargs)

    def build_app(engine, config):
        raise _Wired(config)

    monkeypatch.setattr(async_engine, "AsyncEngine", Engine)
    monkeypatch.setattr(server, "build_app", build_app)
    args = _parse("serve", "--port", "0", *argv)
    with pytest.raises(_Wired) as e:
        args.func(args)
    assert built["step_timeout_s"] == timeout
    assert e.value.args[0].kv_view is kv_view


# -- served -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The embedded model's tokenizer with a chat template of our own, to tell it apart."""
    from streamkv.models.loader import resolve_model_dir

    src, out = resolve_model_dir(None), tmp_path_factory.mktemp("tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").write_text(
        "TOKDIR{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    )
    return out


def _rendered(url: str, **kw) -> str:
    ids = httpx.post(
        f"{url}/tokenize", json={**CHAT, "add_special_tokens": False}, timeout=30, **kw
    ).json()["tokens"]
    return httpx.post(f"{url}/detokenize", json={"tokens": ids}, timeout=30, **kw).json()["prompt"]


@pytest.mark.slow
def test_config_file_server(tmp_path, tokenizer_dir):
    path = tmp_path / "serve.yaml"
    path.write_text(
        f"served-model-name: from-file\ntokenizer: {tokenizer_dir}\nroot-path: /proxy\n"
        "enable-log-requests: true\nlog-level: ERROR\n"
    )
    # --log-level before the command is the command line's: it wins over the file's.
    with run_server(
        "--config", str(path), "--served-model-name", "from-cli", log_level="INFO"
    ) as server:
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["from-cli"]  # the command line over the file
        assert _rendered(server.url) == "TOKDIR<hello>"  # --tokenizer from the file
        # --root-path: a proxy routes /proxy/... here without the prefix (uvicorn's meaning,
        # and vLLM's); the API document tells clients to call it under the prefix.
        assert httpx.get(f"{server.url}/openapi.json", timeout=10).json()["servers"] == [
            {"url": "/proxy"}
        ]
        r = httpx.post(
            f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=120
        )
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        deadline = time.monotonic() + 10
        while f"request {rid}: " not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        line = next(ln for ln in server.log().splitlines() if f"request {rid}: " in ln)
        assert (
            "prompt tokens" in line and "max_tokens=1" in line and "'Hi'" not in line
        )  # no text at INFO
        assert (
            "ready: http://127.0.0.1:" in server.log() and "/proxy (model from-cli" in server.log()
        )


def _self_signed(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate for the HTTPS check")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return key, cert


@pytest.mark.slow
def test_chat_template_https_and_no_stats_line(tmp_path):
    key, cert = _self_signed(tmp_path)
    template = "INLINE{% for m in messages %}({{ m['content'] }}){% endfor %}"
    with run_server(
        "--chat-template",
        template,
        "--disable-log-stats",
        "--log-stats-interval",
        "0.2",
        "--log-level",
        "INFO",
        "--ssl-keyfile",
        str(key),
        "--ssl-certfile",
        str(cert),
        scheme="https",
    ) as server:
        assert server.url.startswith("https://")
        assert _rendered(server.url, verify=False) == "INLINE(hello)"
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": "Hi", "max_tokens": 2},
            timeout=120,
            verify=False,
        )
        assert r.status_code == 200, r.text
        time.sleep(1.0)  # five stats intervals
        log = server.log()
        assert "ready: https://127.0.0.1:" in log
        assert "streamkv.stats" not in log, log
