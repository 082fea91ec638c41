"""The engine's side of the link to a draft worker: start it (or wait for one started by hand on
another host), hand it its whole configuration, then send typed messages (docs/ARCHITECTURE.md 4).
One client per worker."""
from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import threading
import time
import weakref

from ssd.engine.childlog import LoggedChild
from ssd.speculation.worker import messages as m
from ssd.speculation.worker.transport import Channel, Posted, free_port

log = logging.getLogger(__name__)


class DraftWorkerError(RuntimeError):
    pass


class DraftClient:
    def __init__(self, config: m.WorkerConfig, *, threads: int | None = None, cores: list[int] | None = None,
                 device: str = "cpu", timeout_s: float = 60.0, listen: str | None = None,
                 start_timeout_s: float = 300.0):
        """timeout_s bounds every message exchange once the worker is up; start_timeout_s bounds its
        start-up (process start, rendezvous, loading the draft: minutes on a busy machine or a big draft)."""
        self.config = config
        self.proc = None
        self.abandoned = False
        self.chan: Channel | None = None
        self._posted: list[Posted] = []   # adds and frees not yet known to be received
        host, port = ("127.0.0.1", free_port()) if listen is None else _split(listen)
        self.address = f"{host}:{port}"
        # stop the worker and the link before the interpreter tears down torch: an LLM never closed
        # left gloo work holding tensors, and the exit aborted on a torch internal assert
        atexit.register(_close_at_exit(weakref.ref(self)))
        if listen is None:
            cmd = [sys.executable, "-m", "ssd.speculation.worker", "--connect", f"{host}:{port}",
                   "--device", device, "--timeout", str(timeout_s)]
            if threads:
                cmd += ["--threads", str(threads)]
            if cores:
                cmd += ["--cores", ",".join(map(str, cores))]
            self.proc = LoggedChild(cmd, "ssd.child.draft_worker", env=_child_env())
        start = start_timeout_s
        self._join(host, port, start, timeout_s)
        self.chan.vocab = config.target_vocab
        self.chan.send(config)
        msg = self._recv_start_up(host, port, start)
        if isinstance(msg, m.Error):
            self.close()
            raise DraftWorkerError(msg.text)
        if not isinstance(msg, m.Hello):
            self.close()
            raise DraftWorkerError(f"the draft worker at {host}:{port} answered {type(msg).__name__}, expected Hello")
        self.vocab, self.pid = msg.vocab, msg.pid
        log.info("draft worker %d is up (%s)", self.pid, "local process" if self.proc else f"remote, {host}:{port}")

    def _join(self, host: str, port: int, timeout_s: float, op_timeout_s: float) -> None:
        """Rendezvous without hanging on a worker that died before joining."""
        err: list[BaseException] = []

        def join():
            try:
                self.chan = Channel(host, port, 0, timeout_s, op_timeout_s)
            except BaseException as e:  # noqa: BLE001 - reported to the caller thread
                err.append(e)

        t = threading.Thread(target=join, daemon=True)
        t.start()
        deadline = time.monotonic() + timeout_s
        while t.is_alive():
            t.join(0.1)
            self._check_alive()
            if time.monotonic() > deadline:
                self.close()
                raise DraftWorkerError(f"no draft worker joined {host}:{port} within {timeout_s:.0f}s")
        if err:
            self.close()
            raise DraftWorkerError(f"could not set up the engine/worker link on {host}:{port}: {err[0]}")

    def _recv_start_up(self, host: str, port: int, timeout_s: float):
        """The worker's Hello (or Error), once it has loaded its draft: wait on the doorbell (it rings
        before the message is sent) while checking that a local worker is still alive."""
        deadline = time.monotonic() + timeout_s
        while not self.chan.pending():
            self._check_alive()
            if time.monotonic() > deadline:
                self.close()
                raise DraftWorkerError(f"the draft worker at {host}:{port} did not report ready within "
                                       f"{timeout_s:.0f}s (loading the draft); a slow machine or a big draft "
                                       "needs a larger worker start-up timeout")
            time.sleep(0.02)
        try:
            return self.chan.recv()
        except Exception as e:
            self._check_alive()
            self.close()
            raise DraftWorkerError(f"the draft worker at {host}:{port} did not report ready: {e}") from e

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = self.proc.tail()
            raise DraftWorkerError(f"the draft worker exited during start-up (code {self.proc.returncode}):\n{tail}")

    def add(self, msg: m.Add) -> None:
        """Posted, not waited for: the worker prefills each Add before it takes its next message, so
        waiting here held the engine's own prefill of a batch back by the worker's prefills of all but
        the last prompt (TTFT 20% above AR's at batch 4, 1+1 cores). A failed link surfaces at the
        next speculation request, which waits for everything posted before it."""
        self._post(msg)

    def free(self, seq_ids: list[int]) -> None:
        if seq_ids:
            self._post(m.Free(list(seq_ids)))

    def settle(self) -> None:
        """Wait until the worker has received everything posted (it takes messages between draft steps)."""
        posted, self._posted = self._posted, []
        for p in posted:
            p.wait()

    def _post(self, msg) -> None:
        self._posted = [p for p in self._posted if not p.done()]     # keep only sends still in flight
        self._posted.append(self.chan.post(msg))

    def speculate(self, requests: list[m.Request], verify_s: float = 0.0) -> m.Speculation:
        self.post_speculate(requests, verify_s).wait()
        return self.recv_speculation()

    def post_speculate(self, requests: list[m.Request], verify_s: float = 0.0) -> Posted:
        """Start asking for a round's speculation; wait() on the result returns once the worker has the
        request and every message posted before it (several workers are asked first and waited for
        after, so they draft at once)."""
        posted, self._posted = self._posted, []
        return Posted.joined(posted + [self.chan.post(m.Speculate(requests, verify_s))])

    def recv_speculation(self) -> m.Speculation:
        msg = self.chan.recv()
        if not isinstance(msg, m.Speculation):
            raise DraftWorkerError(f"unexpected reply {type(msg).__name__}")
        return msg

    def abandon(self) -> None:
        """Give up on the worker: kill it if it is our process; no more messages are sent to it."""
        self.abandoned = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        if self.chan is not None and not self.abandoned and not self.chan.closed:
            try:
                self.chan.send(m.Shutdown())        # received after everything posted before it
                if self.proc is not None:
                    self.proc.wait(2)
            except Exception:       # noqa: BLE001 - the worker may be gone already, or slow to exit
                pass
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.chan is not None:
            self.chan.close()


def _close_at_exit(ref):
    def close():
        client = ref()
        if client is not None:
            client.close()
    return close


def start_clients(wcfg, kwargs: list[dict]):
    """Start (or wait for) one draft worker per kwargs, all at once; on any failure close the others
    and raise the first error."""
    from concurrent.futures import ThreadPoolExecutor

    if len(kwargs) == 1:
        return [DraftClient(wcfg, **kwargs[0])]
    with ThreadPoolExecutor(len(kwargs)) as pool:
        futures = [pool.submit(DraftClient, wcfg, **kw) for kw in kwargs]
        results = []
        for f in futures:
            try:
                results.append(f.result())
            except Exception as e:      # noqa: BLE001 - re-raised below, after the others are closed
                results.append(e)
    errors = [r for r in results if isinstance(r, Exception)]
    if errors:
        for r in results:
            if not isinstance(r, Exception):
                r.close()
        raise errors[0]
    return results


def _split(hostport: str) -> tuple[str, int]:
    host, port = hostport.rsplit(":", 1)
    return host, int(port)


def _child_env() -> dict:
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
