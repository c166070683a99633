"""A pip-installed streamkv has its demo page and CUDA sources (issue 14): a wheel built from
this tree holds ``streamkv/web`` and ``streamkv/kernels_cu``, the server finds the page in an
unpacked wheel and in the checkout, and the build says nothing deprecated."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # a wheel build: ~10 s of CPU


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, str]:
    """A wheel of a copy of the tree's packaging inputs (the build writes build/ and
    egg-info next to its sources: never into the shared checkout)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("streamkv", "web", "kernels_cu"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    code = f"from setuptools import build_meta; print(build_meta.build_wheel({str(out)!r}))"
    r = subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return out / r.stdout.strip().splitlines()[-1], r.stdout + r.stderr


def test_wheel_ships_the_page_the_kernels_and_the_presets(wheel):
    names = set(zipfile.ZipFile(wheel[0]).namelist())
    for page in ("index.html", "app.js", "style.css", "transport.js"):
        assert f"streamkv/web/{page}" in names, page
    assert {
        f"streamkv/kernels_cu/{p.name}"
        for p in (ROOT / "kernels_cu").iterdir()
        if p.suffix in (".cu", ".cuh")
    } <= names
    assert "streamkv/models/presets/llama3-8b/config.json" in names


def test_build_has_no_deprecation_warning_and_a_pep639_licence(wheel):
    path, log = wheel
    assert "Deprecat" not in log, log
    meta = zipfile.ZipFile(path).read(
        f"{path.name.split('-')[0]}-{path.name.split('-')[1]}.dist-info/METADATA"
    )
    assert b"License-Expression: Apache-2.0" in meta


def test_server_finds_the_page_installed_and_in_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel[0]).extractall(site)
    code = "from streamkv.entrypoints.server.pages import WEB_DIR; print(WEB_DIR)"
    # Run outside the checkout with the unpacked wheel first on the path: it must not need the repo.
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip().splitlines()[-1]) == site / "streamkv" / "web"
    from streamkv.entrypoints.server.pages import WEB_DIR

    assert WEB_DIR is not None and (WEB_DIR / "index.html").is_file()
