"""SSD with data-parallel drafts (num_draft_workers = M > 1): assignment and placement (pure), greedy
identity with AR at batch 1 and 8, one worker failing mid-run (in-process stand-ins and real worker
processes killed with SIGKILL): every request finishes, identical to AR, in bounded time. The
statistical check at temperature > 0 is in test_joint_distribution.py (2 workers, one failing)."""
from __future__ import annotations

import os
import signal
import time

import pytest

from ssd import LLM, SamplingParams
from ssd.speculation.worker.assign import Assignment, pick_worker
from ssd.speculation.worker.placement import local_cores, per_worker_cores, split_hosts

from ssd_local import local_ssd

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = ["hello world", "abc", "def f(x):\n    return", "abab abab abab", "The quick brown fox",
           "0123456789", "zzz", "import os\nimport"]


@pytest.fixture(scope="module")
def ar_ref(tiny_pair):
    llm = LLM(str(tiny_pair[0]), dtype="float32", progress=False)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


# ---------------------------------------------------------------- pure: assignment and placement


def test_pick_worker_is_least_loaded_live_lowest_index():
    assert pick_worker([0, 0, 0], [True] * 3) == 0
    assert pick_worker([2, 1, 1], [True] * 3) == 1
    assert pick_worker([2, 1, 0], [True, True, False]) == 1
    assert pick_worker([0, 0], [False, False]) is None


def test_assignment_balances_keeps_sequences_and_moves_a_failed_workers_sequences():
    a = Assignment(2)
    assert [a.place(s) for s in range(5)] == [0, 1, 0, 1, 0] and a.loads == [3, 2]
    assert a.place(3) == 1                          # a sequence stays with its worker
    a.drop(0)
    a.drop(2)                                       # worker 0 now holds only 4
    assert a.loads == [1, 2] and a.place(10) == 0 and a.place(11) == 0 and a.loads == [3, 2]
    assert sorted(a.fail(0)) == [4, 10, 11] and a.loads == [0, 2] and a.num_live() == 1
    assert [a.place(s) for s in (4, 10, 11)] == [1, 1, 1] and a.loads == [0, 5]
    a.fail(1)
    assert a.place(12) is None and a.num_live() == 0
    with pytest.raises(ValueError):
        Assignment(0)


def test_placement_defaults_and_clear_errors():
    assert local_cores(range(8), 1) == [[7]]
    assert local_cores(range(8), 3) == [[5], [6], [7]]            # the last M cores; the target keeps 0-4
    assert local_cores([0], 1) == [None]                          # one core: shared, as before
    assert local_cores([0, 1], 2, [[0], [1]]) == [[0], [1]]       # explicit: may share with the target
    assert per_worker_cores([2, 3], 1) == [[2, 3]]
    with pytest.raises(ValueError, match="need 3 CPU cores.*--draft-workers"):
        local_cores([0, 1], 2)
    with pytest.raises(ValueError, match="one list per worker"):
        per_worker_cores([1, 2], 2)
    with pytest.raises(ValueError, match="must not share a core"):
        per_worker_cores([[1], [1, 2]], 2)
    with pytest.raises(ValueError, match="may not use"):
        local_cores([0, 1], 1, [5])
    assert split_hosts("10.0.0.2:1, 10.0.0.3:1") == ["10.0.0.2:1", "10.0.0.3:1"]
    with pytest.raises(ValueError, match="not HOST:PORT"):
        split_hosts(["10.0.0.2"])
    with pytest.raises(ValueError, match="twice"):
        split_hosts("h:1,h:1")


def test_config_checks_worker_count_against_hosts_and_mode():
    from ssd.config import EngineConfig

    assert EngineConfig(model="t", draft="d", mode="ssd", draft_host=["a:1", "b:2"]).num_draft_workers == 2
    assert EngineConfig(model="t", draft="d", mode="ssd").num_draft_workers == 1
    with pytest.raises(ValueError, match="one HOST:PORT per worker"):
        EngineConfig(model="t", draft="d", mode="ssd", draft_host="a:1", num_draft_workers=2)
    with pytest.raises(ValueError, match="applies to mode 'ssd'"):
        EngineConfig(model="t", draft="d", mode="sd", num_draft_workers=2)


def test_cpu_split_with_several_workers(monkeypatch):
    """The target decodes on the cores the workers leave; too few cores fail before any model loads."""
    from ssd.config import EngineConfig

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    cfg = EngineConfig(model="t", draft="d", mode="ssd", num_draft_workers=2)
    LLM._ssd_cpu_split(cfg)
    assert (cfg.threads, cfg.prefill_threads) == (2, 4)
    cfg = EngineConfig(model="t", draft="d", mode="ssd", num_draft_workers=2, draft_cores=[[1, 2], [3]])
    LLM._ssd_cpu_split(cfg)
    assert cfg.threads == 1
    with pytest.raises(ValueError, match="4 local draft workers need 5 CPU cores"):
        LLM(model="t", draft="d", mode="ssd", num_draft_workers=4)


# ---------------------------------------------------------------- the proposer over fake workers


class FakeWorker:
    """Holds sequence ids; answers one CACHE token per sequence; refuses a Speculate for a sequence it
    was never given (what a real worker would fail on); can die on the add of a given sequence."""

    def __init__(self, die_on_add_of: int | None = None):
        self.held, self.dead, self.die_on_add_of, self.asked = set(), False, die_on_add_of, []

    def _alive(self):
        if self.dead:
            raise ConnectionError("dead")

    def add(self, msg):
        self._alive()
        if msg.seq_id == self.die_on_add_of:
            self.dead = True
            raise ConnectionError("died while adding")
        self.held.add(msg.seq_id)

    def free(self, ids):
        self._alive()
        self.held -= set(ids)

    def post_speculate(self, reqs, verify_s=0.0):
        self._alive()
        assert {r.seq_id for r in reqs} <= self.held, "asked for a sequence it was never given"
        self.asked = [r.seq_id for r in reqs]
        return type("Sent", (), {"wait": lambda self: None})()

    def recv_speculation(self):
        from ssd.speculation.worker import messages as m

        self._alive()
        return m.Speculation([m.Reply(i, m.Source.CACHE, [7]) for i in self.asked])

    def abandon(self):
        self.dead = True


def fake_seqs(n: int):
    from types import SimpleNamespace

    from ssd.engine.sequence import SpecState

    params = SimpleNamespace(seed=1, temperature=0.0, top_k=0, top_p=1.0)
    return [SimpleNamespace(seq_id=i, params=params, all_token_ids=[1, 2, 3], output_token_ids=[3],
                            spec_state=SpecState()) for i in range(n)]


def test_a_worker_dying_during_a_hand_over_moves_everything_it_had_taken():
    """Four detached sequences handed back at once; worker 0 takes seq 0, then dies on seq 2. Seq 0
    must be added again, to worker 1, before worker 1 is asked for it."""
    from ssd.speculation.worker.proposer import WorkerProposer

    workers = [FakeWorker(die_on_add_of=2), FakeWorker()]
    prop = WorkerProposer(workers)
    seqs = fake_seqs(4)
    for s in seqs:
        s.spec_state.detached = True
    out = prop.propose(seqs, [1] * 4)
    assert out.tokens == [[7]] * 4 and workers[1].held == {0, 1, 2, 3}
    assert prop.counters.worker_failures == 1 and prop.counters.seqs_moved == 2     # seq 0, and seq 2 itself
    assert prop.assign.loads == [0, 4]


class Recording(FakeWorker):
    """A fake worker with a block size that records what it is sent."""

    def __init__(self, block_size: int):
        from types import SimpleNamespace

        super().__init__()
        self.config, self.adds = SimpleNamespace(block_size=block_size), []

    def add(self, msg):
        super().add(msg)
        self.adds.append((msg.seq_id, list(msg.tokens)))


class GrowingSeq:
    def __init__(self, seq_id: int, n: int):
        from types import SimpleNamespace

        from ssd.engine.sequence import SpecState

        self.seq_id, self.params, self.spec_state = seq_id, SimpleNamespace(seed=1, temperature=0.0, top_k=0,
                                                                            top_p=1.0), SpecState()
        self.all_token_ids = list(range(100 * seq_id, 100 * seq_id + n))

    @property
    def output_token_ids(self):
        return self.all_token_ids[-1:]

    def grow(self, n: int) -> None:
        self.all_token_ids += [7] * n

    def __len__(self):
        return len(self.all_token_ids)


def test_keeping_a_worker_in_step_sends_each_new_whole_block_once_and_drops_it_again():
    """Local stints in which the worker's cores would idle: a sequence it dropped is added again with its
    whole blocks of context once one more is complete, and dropped again (it holds nothing it would
    pre-draft for), so handing the sequence back prefills at most the last partial block. The control:
    a sequence that did not grow a block is not sent, and its hand-over prefills all it committed."""
    from ssd.speculation.step import retake_tokens
    from ssd.speculation.worker.proposer import WorkerProposer

    w = Recording(block_size=4)
    prop = WorkerProposer([w])
    seqs = [GrowingSeq(0, 6), GrowingSeq(1, 6)]
    prop.prefill(seqs)
    prop.after_prefill(seqs)
    assert prop.keep_in_step(seqs) == 0 and len(w.adds) == 2        # held by the worker: nothing to send
    prop.skip(seqs)                     # a local stint: dropped, holding 5 tokens (one whole block of 4)
    assert w.held == set() and [s.spec_state.worker_held for s in seqs] == [5, 5]
    assert prop.keep_in_step(seqs) == 0
    seqs[0].grow(4)                     # 10 tokens: blocks 0-1 whole, besides the last token
    assert prop.keep_in_step(seqs) == 4
    assert w.adds[-1] == (0, seqs[0].all_token_ids[:8]) and w.held == set()
    assert prop.keep_in_step(seqs) == 0                 # sent once
    seqs[0].grow(9)
    seqs[1].grow(9)
    assert prop.keep_in_step(seqs) == 8 + 8             # seq 0: 8 -> 16; seq 1: 4 -> 12
    assert [s.spec_state.worker_held for s in seqs] == [16, 12] and w.held == set()
    assert retake_tokens(seqs[:1]) == 19 - 16 and retake_tokens(seqs[1:]) == 15 - 12
    seqs[1].grow(1)                     # the control: no new whole block (16 tokens, the last not counted)
    assert prop.keep_in_step(seqs[1:]) == 0 and retake_tokens(seqs[1:]) == 16 - 12
    out = prop.propose(seqs, [1, 1])    # the hand-over: both added again with all but their last token
    assert out.tokens == [[7], [7]]
    assert w.adds[-2:] == [(0, seqs[0].all_token_ids[:-1]), (1, seqs[1].all_token_ids[:-1])]


def test_the_workers_prefill_price_is_their_reported_prefill_time_over_tokens():
    """Each worker reports its cumulative prefill (tokens computed by adds, seconds) with every answer; the
    proposer's price per token pools the workers, and says nothing before enough tokens were measured."""
    from ssd.speculation.worker import messages as m
    from ssd.speculation.worker.proposer import WorkerProposer

    class Reporting(FakeWorker):
        def __init__(self, tokens, seconds):
            super().__init__()
            self.report = (tokens, seconds)

        def recv_speculation(self):
            return m.Speculation([m.Reply(i, m.Source.CACHE, [7]) for i in self.asked],
                                 prefill_tokens=self.report[0], prefill_s=self.report[1])

    workers = [Reporting(30, 0.3), Reporting(20, 0.1)]
    prop = WorkerProposer(workers)
    seqs = fake_seqs(2)
    assert prop.prefill_s_per_token() is None
    prop.propose(seqs, [1, 1])
    assert prop.prefill_s_per_token() is None                       # 50 tokens: too few to say
    workers[0].report, workers[1].report = (100, 0.5), (60, 0.3)
    prop.propose(seqs, [1, 1])
    assert prop.prefill_s_per_token() == pytest.approx(0.8 / 160)


def test_workers_failing_in_every_phase_end_in_proposer_failed():
    from ssd.speculation.proposer import ProposerFailed
    from ssd.speculation.worker.proposer import WorkerProposer

    workers = [FakeWorker(), FakeWorker()]
    prop = WorkerProposer(workers)
    seqs = fake_seqs(4)
    prop.prefill(seqs)
    prop.after_prefill(seqs)
    assert [w.held for w in workers] == [{0, 2}, {1, 3}]
    workers[0].dead = True                          # silent death: noticed when asked
    out = prop.propose(seqs, [1] * 4)
    assert out.tokens == [[], [7], [], [7]]         # its sequences: no draft this round
    assert [s.spec_state.detached for s in seqs] == [True, False, True, False]
    out = prop.propose(seqs, [1] * 4)               # ... and handed to worker 1 the next
    assert out.tokens == [[7]] * 4 and workers[1].held == {0, 1, 2, 3}
    prop.release(seqs[3])
    assert workers[1].held == {0, 1, 2} and prop.assign.loads == [0, 3]
    workers[1].dead = True
    with pytest.raises(ProposerFailed, match="the last one"):
        prop.propose(seqs[:3], [1] * 3)


# ---------------------------------------------------------------- in-process workers


@pytest.fixture(scope="module")
def two_local(tiny_pair):
    with pytest.MonkeyPatch.context() as mp:
        llm, clients = local_ssd(mp, tiny_pair[0], tiny_pair[1], workers=2)
    return llm, clients


def test_two_workers_greedy_equals_ar_at_batch_1_and_8(two_local, ar_ref):
    """Also: each round asks both workers before it waits for either (they draft at the same time)."""
    llm, clients = two_local
    seen, events = [set(), set()], []

    def spy(w, c):
        send, recv = c.post_speculate, c.recv_speculation

        def post_speculate(reqs, *a):
            seen[w].update(r.seq_id for r in reqs)
            events.append(("send", w))
            return send(reqs, *a)

        def recv_speculation():
            events.append(("recv", w))
            return recv()
        c.post_speculate, c.recv_speculation = post_speculate, recv_speculation

    for w, c in enumerate(clients):
        spy(w, c)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_ref          # batch of 8
        assert len(seen[0]) == len(seen[1]) == 4 and not seen[0] & seen[1]            # 4 each, disjoint
        rounds = len(events) // 4
        assert rounds > 2 and events == [("send", 0), ("send", 1), ("recv", 0), ("recv", 1)] * rounds
        assert llm.generate(PROMPTS[2], GREEDY)[0].token_ids == ar_ref[2]              # batch of 1
    finally:
        for c in clients:
            del c.post_speculate, c.recv_speculation
    m = llm.engine.spec_metrics()
    assert m.draft_workers == 2 and m.worker_failures == 0 and m.rounds > 0
    assert not clients[0].worker.seqs and not clients[1].worker.seqs               # all released
    assert m.to_dict()["draft_workers"] == 2


def test_one_in_process_worker_failing_moves_only_its_sequences(monkeypatch, tiny_pair, ar_ref, caplog):
    llm, clients = local_ssd(monkeypatch, tiny_pair[0], tiny_pair[1], workers=2)
    clients[0].fail_at_round = 3                    # dies while answering its third round
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ar_ref
    m = llm.engine.spec_metrics()
    assert llm.engine.degraded_from is None and llm.engine.mode == "ssd"
    assert m.worker_failures == 1 and m.seqs_moved == 4 and m.seqs_to_local == 0
    assert clients[1].rounds > clients[0].rounds and "move to the 1 other worker" in caplog.text
    clients[1].fail_at_round = clients[1].rounds + 2     # the last one fails too: local AR, still exact
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_ref
    m = llm.engine.spec_metrics()
    assert llm.engine.degraded_from == "ssd" and m.worker_failures == 2 and m.seqs_to_local == len(PROMPTS)


# ---------------------------------------------------------------- real worker processes


def test_two_worker_processes_one_killed_mid_run(tiny_pair, ar_ref):
    """Two local worker processes (one per core of this 2-core machine, explicitly placed). Greedy
    equals AR; SIGKILL one of them mid-generation: every request finishes with AR's tokens, within a
    bounded time, and only the dead worker's sequences moved."""
    target, draft = tiny_pair
    llm = LLM(str(target), draft=str(draft), mode="ssd", k=3, dtype="float32", progress=False, kv_cache_gb=0.05,
              worker_timeout_s=60, num_draft_workers=2, draft_cores=[[0], [1]], threads=1)   # (start-up on a busy box)
    try:
        pids = [c.pid for c in llm._clients]
        assert len(set(pids)) == 2
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_ref
        eng = llm.engine
        got = {f"r{i}": [] for i in range(4)}
        for rid, p in zip(got, PROMPTS):
            eng.add_request(rid, llm.encode(p), GREEDY)
        done, steps, t0 = set(), 0, time.monotonic()
        while len(done) < len(got):
            for out in eng.step():
                got[out.seq.request_id] += out.new_token_ids
                if out.seq.finished:
                    done.add(out.seq.request_id)
            steps += 1
            if steps == 3:              # prefill, one round, then worker 0 dies
                os.kill(pids[0], signal.SIGKILL)
            assert time.monotonic() - t0 < 30, "requests did not finish after a worker died"
        assert list(got.values()) == ar_ref[:4]
        m = llm.engine.spec_metrics()
        assert llm.engine.degraded_from is None and m.worker_failures == 1 and m.seqs_moved == 2
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_ref    # later requests: worker 1
        assert llm.engine.spec_metrics().worker_failures == 1
    finally:
        t0 = time.monotonic()
        llm.close()
        assert time.monotonic() - t0 < 20


def test_a_silent_worker_process_times_out_and_only_its_sequences_move(tiny_pair, ar_ref):
    """SIGSTOP (alive, silent): the engine's wait for that worker ends after worker_timeout_s, the
    worker is killed, its sequences finish on the other worker, identical to AR. (worker_timeout_s also
    bounds start-up, hence 10 s rather than less on a shared machine.)"""
    target, draft = tiny_pair
    llm = LLM(str(target), draft=str(draft), mode="ssd", k=3, dtype="float32", progress=False, kv_cache_gb=0.05,
              worker_timeout_s=10, num_draft_workers=2, draft_cores=[[0], [1]], threads=1)
    pid = llm._clients[1].pid
    try:
        eng = llm.engine
        for i, p in enumerate(PROMPTS[:4]):
            eng.add_request(f"r{i}", llm.encode(p), GREEDY)
        eng.step()                                  # prefill: two sequences on each worker
        os.kill(pid, signal.SIGSTOP)
        got, t0 = {rid: list(s.output_token_ids) for rid, s in eng.seqs.items()}, time.monotonic()
        while eng.has_unfinished():
            for out in eng.step():
                got[out.seq.request_id] += out.new_token_ids
            assert time.monotonic() - t0 < 60, "requests did not finish after a worker went silent"
        assert list(got.values()) == ar_ref[:4]
        m = eng.spec_metrics()
        assert eng.degraded_from is None and m.worker_failures == 1 and m.seqs_moved == 2
        assert llm._clients[1].proc.wait(5) is not None        # killed, not left stopped
    finally:
        llm.close()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("verb", ["generate", "chat", "serve", "bench"])
def test_cli_draft_workers_flags(verb):
    from ssd.cli import _llm, build_parser, parse_cores

    args = build_parser().parse_args([verb, "--mode", "ssd", "--draft", "d", "--draft-workers", "2",
                                      "--draft-cores", "2,3/4", "--draft-host", "10.0.0.1:1,10.0.0.1:2"])
    assert args.draft_workers == 2 and parse_cores(args.draft_cores) == [[2, 3], [4]]
    if verb == "generate":
        import ssd

        seen = {}
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ssd, "LLM", lambda model, **kw: seen.update(kw))
            _llm(args)
        assert seen["num_draft_workers"] == 2 and seen["draft_cores"] == [[2, 3], [4]]
        assert seen["draft_host"] == "10.0.0.1:1,10.0.0.1:2"
    assert parse_cores("1") == [1]
    with pytest.raises(SystemExit, match="--draft-cores"):
        parse_cores("a,b")


def test_channel_post_does_not_wait_for_the_peer():
    """A gloo send completes only once the peer receives; post() returns at once (and rings the
    doorbell), so a round can ask every worker before waiting for any."""
    import threading

    from ssd.speculation.worker import messages as m
    from ssd.speculation.worker.transport import Channel, free_port

    port, peer = free_port(), {}
    t = threading.Thread(target=lambda: peer.update(c=Channel("127.0.0.1", port, 1, 10)))
    t.start()
    eng = Channel("127.0.0.1", port, 0, 10)
    t.join(10)
    try:
        t0 = time.monotonic()
        handle = eng.post(m.Free([1, 2]))
        assert time.monotonic() - t0 < 0.5 and peer["c"].pending()
        time.sleep(0.2)
        assert peer["c"].recv().seq_ids == [1, 2]
        handle.wait()
    finally:
        eng.close()
        peer["c"].close()


def test_prometheus_worker_gauges_and_counters():
    from ssd.server.metrics import ServerMetrics
    from ssd.speculation.stats import SpecSnapshot

    sm = ServerMetrics("ssd", "m", 3)
    get = sm.registry.get_sample_value
    sm.ssd_state(SpecSnapshot(draft_workers=2), True)
    assert get("ssd_draft_workers_up") == 2
    sm.ssd_state(SpecSnapshot(draft_workers=2, worker_failures=1, seqs_moved=3), True)
    sm.ssd_state(SpecSnapshot(draft_workers=2), True)         # a delta with nothing new
    assert get("ssd_draft_workers_up") == 1 and get("ssd_draft_worker_failures_total") == 1
    assert get("ssd_spec_seqs_moved_total", {"to": "worker"}) == 3
    sm.ssd_state(SpecSnapshot(draft_workers=2, worker_failures=1, seqs_to_local=2), False)
    assert get("ssd_draft_workers_up") == 0 and get("ssd_draft_worker_failures_total") == 2
    assert get("ssd_spec_seqs_moved_total", {"to": "local"}) == 2
