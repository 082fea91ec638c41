"""SSD draft workers on another host, for real: two network namespaces joined by a veth pair
(10.77.0.1/24 for the engine, 10.77.0.2/24 for the workers), no loopback between them, real TCP.
The workers are started exactly as on a second host (`python -m ssd.cli draft-worker --connect
ENGINE_IP:PORT`), the engine in the other namespace with draft_host. Checks: greedy output equals
AR with two remote workers, also when one of them is killed mid-run; a worker that never joins is
a clear error within bounded time, and the worker that did join is shut down. And a tensor-parallel
target whose rank 1 runs in the other namespace (`python -m ssd.cli tp-rank --connect ...`).

Why it needs the product's gloo address binding (transport.py): in a namespace the hostname still
resolves to 127.0.0.1, so gloo's default device would advertise an address the peer cannot reach
(without the binding the first test fails with "Connection refused, remote=[127.0.0.1]"); the TP
group binds the same way (distributed/group.py).

Needs root and `ip netns`; skipped otherwise. The namespaces are always deleted afterwards.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from ssd import LLM, SamplingParams
from ssd.speculation.worker.client import _child_env

ENGINE_IP, WORKER_IP = "10.77.0.1", "10.77.0.2"
GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["hello world", "abc", "def f(x):\n    return", "abab abab abab", "The quick brown fox"]

ENGINE_SCRIPT = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from ssd import LLM, SamplingParams
target, draft, hosts, timeout = sys.argv[1], sys.argv[2], sys.argv[3].split(","), float(sys.argv[4])
llm = LLM(target, draft=draft, mode="ssd", k=3, dtype="float32", progress=False, kv_cache_gb=0.05,
          worker_timeout_s=timeout, worker_start_timeout_s=timeout, draft_host=hosts, threads=1)
prompts, params = json.loads(sys.argv[5]), SamplingParams(**json.loads(sys.argv[6]))
kill_after = int(sys.argv[7])       # > 0: SIGKILL the first worker (pid from its Hello) after that many steps
eng, steps = llm.engine, 0
seqs = [eng.add_request(f"r{i}", llm.encode(p), params) for i, p in enumerate(prompts)]
while eng.has_unfinished():
    eng.step()
    steps += 1
    if steps == kill_after:
        import os, signal
        os.kill(llm._clients[0].pid, signal.SIGKILL)
m = eng.spec_metrics()
print(json.dumps({"tokens": [list(s.output_token_ids) for s in seqs], "rounds": m.rounds,
                  "workers": m.draft_workers, "failures": m.worker_failures, "moved": m.seqs_moved,
                  "degraded": eng.degraded_from}))
llm.close()
"""


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


@pytest.fixture(scope="module")
def netns():
    """(engine namespace, worker namespace), joined by a veth pair; deleted at the end."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    if shutil.which("ip") is None:
        pytest.skip("needs the `ip` tool (iproute2)")
    tag = f"{os.getpid() % 100000}"
    a, b = f"ssdmh{tag}e", f"ssdmh{tag}w"
    created = []
    try:
        for cmd in (["netns", "add", a], ["netns", "add", b],
                    ["link", "add", f"ve{tag}", "type", "veth", "peer", "name", f"vw{tag}"],
                    ["link", "set", f"ve{tag}", "netns", a], ["link", "set", f"vw{tag}", "netns", b],
                    ["-n", a, "addr", "add", f"{ENGINE_IP}/24", "dev", f"ve{tag}"],
                    ["-n", b, "addr", "add", f"{WORKER_IP}/24", "dev", f"vw{tag}"],
                    ["-n", a, "link", "set", f"ve{tag}", "up"], ["-n", b, "link", "set", f"vw{tag}", "up"],
                    ["-n", a, "link", "set", "lo", "up"], ["-n", b, "link", "set", "lo", "up"]):
            r = _ip(*cmd)
            if r.returncode != 0:
                pytest.skip(f"`ip {' '.join(cmd)}` failed: {r.stderr.strip()}")
            if cmd[:2] == ["netns", "add"]:
                created.append(cmd[2])
        yield a, b
    finally:
        for ns in created:          # deleting a namespace deletes its end of the veth pair (and the pair)
            _ip("netns", "del", ns)
        _ip("link", "del", f"ve{tag}")     # in case set-up failed before the pair moved (else: no such device)


def _in_ns(ns: str, argv: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=_child_env(), **kw)


def _worker(ns: str, port: int) -> subprocess.Popen:
    """What a user runs on the second host."""
    return _in_ns(ns, [sys.executable, "-m", "ssd.cli", "draft-worker", "--connect", f"{ENGINE_IP}:{port}",
                       "--timeout", "60", "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _engine(ns: str, tmp_path, tiny_pair, hosts: list[str], timeout_s: float, kill_after: int = 0) -> subprocess.Popen:
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    return _in_ns(ns, [sys.executable, str(script), str(tiny_pair[0]), str(tiny_pair[1]), ",".join(hosts),
                       str(timeout_s), json.dumps(PROMPTS), json.dumps(GREEDY), str(kill_after)],
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_namespaces_are_really_separate(netns):
    """No shortcut: the worker namespace cannot see the engine's address as its own."""
    r = _ip("-n", netns[1], "-o", "addr")
    assert WORKER_IP in r.stdout and ENGINE_IP not in r.stdout


@pytest.fixture(scope="module")
def ar_ref(tiny_pair):
    llm = LLM(str(tiny_pair[0]), dtype="float32", progress=False)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(**GREEDY))]


@pytest.mark.parametrize("kill", [False, True], ids=["both-up", "one-killed"])
def test_two_remote_workers_across_namespaces_equal_ar(netns, tiny_pair, tmp_path, ar_ref, kill):
    """Greedy = AR with two workers on the other 'host'; with `kill`, the engine SIGKILLs the first one
    after prefill and a round (the pid is the worker's own, from its Hello): its sequences finish on the
    second worker over the same real link, still = AR, in bounded time."""
    ens, wns = netns
    port = 29611 + 2 * kill
    workers = [_worker(wns, port), _worker(wns, port + 1)]
    t0 = time.monotonic()
    engine = _engine(ens, tmp_path, tiny_pair, [f"{ENGINE_IP}:{port}", f"{ENGINE_IP}:{port + 1}"], 60,
                     kill_after=3 if kill else 0)
    try:
        out, err = engine.communicate(timeout=240)
        assert engine.returncode == 0, err[-3000:] + "\nstdout: " + out[-800:]
        res = json.loads(out.strip().splitlines()[-1])
        assert res["tokens"] == ar_ref
        assert res["workers"] == 2 and res["degraded"] is None and res["rounds"] > 0
        assert time.monotonic() - t0 < 180
        if kill:
            assert res["failures"] == 1 and res["moved"] > 0, res
            assert workers[0].wait(10) == -9 and workers[1].wait(30) == 0
        else:
            assert res["failures"] == 0
            assert [w.wait(30) for w in workers] == [0, 0]      # the engine's shutdown ends both workers
    finally:
        _stop(engine, *workers)


def test_a_worker_that_never_joins_is_a_clear_error_in_bounded_time(netns, tiny_pair, tmp_path):
    ens, wns = netns
    joined = _worker(wns, 29621)                 # the second address never gets a worker
    t0 = time.monotonic()
    engine = _engine(ens, tmp_path, tiny_pair, [f"{ENGINE_IP}:29621", f"{ENGINE_IP}:29622"], 15)
    try:
        out, err = engine.communicate(timeout=120)
        assert engine.returncode != 0
        assert f"no draft worker joined {ENGINE_IP}:29622 within 15s" in err, err[-3000:]
        assert time.monotonic() - t0 < 90
        assert joined.wait(30) == 0                  # the worker that joined was shut down, not left waiting
    finally:
        _stop(engine, joined)


TP_ENGINE_SCRIPT = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from ssd import LLM, SamplingParams
target, host = sys.argv[1], sys.argv[2]
llm = LLM(target, dtype="float32", progress=False, kv_cache_gb=0.05, tensor_parallel_size=2, tp_host=host,
          tp_timeout_s=90, threads=1)
outs = llm.generate(json.loads(sys.argv[3]), SamplingParams(**json.loads(sys.argv[4])))
print(json.dumps({"tokens": [o.token_ids for o in outs], "stats": llm.tensor_parallel_stats()}))
llm.close()
"""


def test_tensor_parallel_rank_on_the_other_host(netns, tiny_pair, tmp_path, ar_ref):
    """A TP=2 target whose rank 1 runs in the other namespace, started as on a second host
    (`ssd tp-rank --connect ENGINE_IP:PORT`, with a /dev/shm of its own): greedy output equals the TP=1
    (AR) reference, over the real link (rank 1 reports its all-reduces; the engine's shared-memory offer
    is refused, so they ran over TCP), and rank 1 exits when the engine closes."""
    ens, wns = netns
    port = 29631
    script = tmp_path / "tp_engine.py"
    script.write_text(TP_ENGINE_SCRIPT)
    engine = _in_ns(ens, [sys.executable, str(script), str(tiny_pair[0]), f"{ENGINE_IP}:{port}", json.dumps(PROMPTS),
                          json.dumps(GREEDY)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # its own /dev/shm, as on another host: the shared-memory offer is refused, collectives go over TCP
    rank = _in_ns(wns, ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh",
                        sys.executable, "-m", "ssd.cli", "tp-rank", "--connect", f"{ENGINE_IP}:{port}", "--rank", "1",
                        "--world-size", "2", "--model", str(tiny_pair[0]), "--threads", "1"],
                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        out, err = engine.communicate(timeout=240)
        assert engine.returncode == 0, err[-3000:] + "\nstdout: " + out[-800:]
        res = json.loads(out.strip().splitlines()[-1])
        assert res["tokens"] == ar_ref
        ranks = {r["rank"]: r for r in res["stats"]["ranks"]}
        assert ranks[1]["allreduces"] > 0
        assert res["stats"]["transport"] == "gloo", "rank 1 has its own /dev/shm: the link must be TCP"
        assert "could not map the shared-memory segment" in err
        assert rank.wait(30) == 0
    finally:
        _stop(engine, rank)
