"""A module imported on a background thread, so that its first user does not wait for it.

xgrammar takes ~3.5 s to import on the CPU box (mostly triton): imported when the engine
starts, while the model loads, the first structured request no longer pays it. A caller
that needs the module before the thread is done waits for the thread (``get``), so the
module is imported once, by one thread, and never seen half-initialised.

The thread is not a daemon: a process that ends while the import runs (a short benchmark, a
CLI call) waits for it at exit. A daemon thread is stopped in the middle of the import when
the interpreter finalises, and inside xgrammar's native extensions that aborted the process
("terminate called without an active exception", on the H200 host).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading
from types import ModuleType

logger = logging.getLogger(__name__)


class BackgroundImport:
    """Starts importing ``name`` at construction if it is installed; ``get()`` returns it."""

    __slots__ = ("name", "_thread", "_module")

    def __init__(self, name: str) -> None:
        self.name = name
        self._module: ModuleType | None = None
        self._thread: threading.Thread | None = None
        if importlib.util.find_spec(name) is not None:
            self._thread = threading.Thread(target=self._load, name=f"import-{name}", daemon=False)
            self._thread.start()

    def _load(self) -> None:
        try:
            self._module = importlib.import_module(self.name)
        except Exception as e:  # reported where it is used: get() imports again and raises there
            logger.debug("background import of %s failed: %s", self.name, e)

    @property
    def started(self) -> bool:
        return self._thread is not None

    def get(self) -> ModuleType:
        """The module, once the background import is done; a module that is not installed,
        or whose import failed, raises its ImportError (or other error) here, in the caller."""
        if self._thread is not None:
            self._thread.join()
        if self._module is None:
            self._module = importlib.import_module(self.name)
        return self._module
