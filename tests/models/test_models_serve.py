"""``streamkv serve DIR`` serves a user's Hugging Face directory: a tiny model with a
word-level tokenizer, queried over HTTP by text and by token ids, answers what
transformers' greedy decoding does."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch
from hf_tiny import save_tiny
from test_models_loading import TINY, save_word_tokenizer
from transformers import LlamaConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(tmp_path):
    model_dir = tmp_path / "tiny-llama"
    hf = save_tiny(LlamaConfig(**TINY), model_dir)
    save_word_tokenizer(model_dir)
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    cmd = [
        sys.executable,
        "-m",
        "streamkv.entrypoints.cli",
        "--log-level",
        "WARNING",
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "64",
        "--num-swap-blocks",
        "0",
        "--no-access-log",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        yield url, hf
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.mark.slow
def test_serve_accepts_a_hugging_face_directory(served):
    url, hf = served
    models = httpx.get(f"{url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny-llama"]
    want = hf.generate(torch.tensor([[10, 11, 12]]), do_sample=False, max_new_tokens=5)[
        0, 3:
    ].tolist()
    for prompt in ("w10 w11 w12", [10, 11, 12]):
        body = {
            "model": "tiny-llama",
            "prompt": prompt,
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].split() == [f"w{i}" for i in want]
