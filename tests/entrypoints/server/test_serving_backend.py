"""Which executor ``streamkv serve`` picks when none is asked for."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from streamkv.entrypoints.cli import serve_args as server  # noqa: E402


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_gpu_serving_runs_the_model_in_worker_processes(device):
    assert server.serving_backend(device, None) == "mp"


def test_cpu_serving_stays_in_process():
    assert server.serving_backend("cpu", None) is None  # the config's default: inprocess


@pytest.mark.parametrize("cuda", [True, False])
def test_auto_device_follows_the_machine(monkeypatch, cuda):
    monkeypatch.setattr(server, "_cuda_available", lambda: cuda)
    assert server.serving_backend("auto", None) == ("mp" if cuda else None)


@pytest.mark.parametrize("backend", ["inprocess", "mp"])
def test_an_explicit_backend_wins(monkeypatch, backend):
    monkeypatch.setattr(server, "_cuda_available", lambda: True)
    for device in ("auto", "cuda", "cpu"):
        assert server.serving_backend(device, backend) == backend
