"""engine/background_import.py: a module imported on a thread from construction; a caller
that needs it earlier waits, and the module's code runs once."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from streamkv.engine.background_import import BackgroundImport
from streamkv.engine.structured import StructuredOutputManager

SLOW_MODULE = """
import pathlib, time
runs = pathlib.Path(__file__).with_suffix(".runs")
runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
time.sleep(0.3)
VALUE = 42
"""


def test_callers_wait_for_one_import(tmp_path, monkeypatch):
    name = "streamkv_slow_import_probe"
    (tmp_path / f"{name}.py").write_text(SLOW_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    loader = BackgroundImport(name)
    assert loader.started
    got = []
    others = [threading.Thread(target=lambda: got.append(loader.get())) for _ in range(3)]
    for t in others:
        t.start()
    got.append(loader.get())  # while the import sleeps: waits for it, never half-initialised
    for t in others:
        t.join()
    assert [m.VALUE for m in got] == [42] * 4 and len({id(m) for m in got}) == 1
    assert (tmp_path / f"{name}.runs").read_text() == "x"  # the module body ran once
    monkeypatch.delitem(sys.modules, name)


def test_a_missing_module_raises_where_it_is_used():
    loader = BackgroundImport("streamkv_no_such_module")
    assert not loader.started
    with pytest.raises(ModuleNotFoundError):
        loader.get()


def test_the_manager_imports_xgrammar_only_when_it_could_use_it():
    pytest.importorskip("xgrammar")
    assert (
        StructuredOutputManager(None, 1000, frozenset({2})).xgrammar is None
    )  # no tokenizer: no grammars
    manager = StructuredOutputManager(object(), 1000, frozenset({2}))
    assert manager.xgrammar.started and manager.xgrammar.get().__name__ == "xgrammar"


def test_a_process_that_exits_during_the_import_lets_it_finish(tmp_path):
    """The import thread is not stopped halfway at interpreter exit (native extensions abort
    the process then): the module's last line runs before the process ends."""
    (tmp_path / "streamkv_exit_probe.py").write_text(
        "import pathlib, "
        "time\ntime.sleep(0.5)\npathlib.Path(__file__).with_suffix('.done').write_text('ok')\n"
    )
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "from streamkv.engine.background_import import BackgroundImport; "
        "BackgroundImport('streamkv_exit_probe')"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], timeout=60)
    assert done.returncode == 0
    assert (tmp_path / "streamkv_exit_probe.done").read_text() == "ok"
