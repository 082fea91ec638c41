"""Child processes whose stderr is read as it comes (draft workers, tensor-parallel ranks).

A pipe nobody reads fills up (64 KiB on Linux) and the child then blocks on its next write: a hang.
`LoggedChild` drains stderr in a daemon thread, forwards each line to a logger named after the child
and keeps the last few thousand characters for the error message when the child dies.
"""
from __future__ import annotations

import logging
import subprocess
import threading

_LINE = 8192          # longest piece read at once: a line without newlines is forwarded in pieces


class LoggedChild(subprocess.Popen):
    """A `subprocess.Popen` with stderr piped to `logging.getLogger(logger)` at `level`; `tail()`
    is the end of what it wrote (at most `keep` characters)."""

    def __init__(self, cmd, logger: str, *, level: int = logging.INFO, keep: int = 2000, **kwargs):
        super().__init__(cmd, stderr=subprocess.PIPE, **kwargs)
        self._log, self._level, self._keep = logging.getLogger(logger), level, keep
        self._tail = ""
        self._tail_lock = threading.Lock()
        self._reader = threading.Thread(target=self._drain, name=f"stderr of {logger}", daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        try:
            for raw in iter(lambda: self.stderr.readline(_LINE), b""):
                line = raw.decode(errors="replace")
                with self._tail_lock:
                    self._tail = (self._tail + line)[-self._keep:]
                self._log.log(self._level, "%s", line.rstrip("\n"))
        except (OSError, ValueError):     # the pipe was closed under us: nothing more to read
            pass

    def tail(self, wait_s: float = 2.0) -> str:
        """The last characters the child wrote to stderr; once it has exited, waits (bounded: a
        grandchild may hold the pipe open) for the reader to reach the end."""
        if self.poll() is not None:
            self._reader.join(wait_s)
        with self._tail_lock:
            return self._tail
