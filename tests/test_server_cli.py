"""`ssd serve` as a real process: binds loopback, checks the API key, serves, stops on Ctrl-C."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SRC = str(Path(__file__).resolve().parents[1] / "src")
# Only the serve sub-command's parser: the test does not depend on the other sub-commands' imports.
RUN_SERVE = ("import argparse, sys; from ssd import cli; p = argparse.ArgumentParser(prog='ssd'); "
             "cli.add_serve_parser(p.add_subparsers(dest='command', required=True)); "
             "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command(tiny_pair):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "SSD_TEST_THREADS": "1", "OMP_NUM_THREADS": "1"}
    env.pop("SSD_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-c", RUN_SERVE, "serve", "--model", str(tiny_pair[0]), "--dtype",
                             "float32", "--threads", "1", "--port", str(port), "--api-key", "k3y",
                             "--served-model-name", "tiny"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, proc.stdout.read()
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.2)
            assert http.get("/v1/models").status_code == 401
            auth = {"Authorization": "Bearer k3y"}
            assert http.get("/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"
            r = http.post("/v1/completions", headers=auth, json={"model": "tiny", "prompt": "hi", "max_tokens": 3,
                                                                 "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "model 'tiny' (ar) on http://127.0.0.1" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
