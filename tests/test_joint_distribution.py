"""Joint law of the first M generated tokens, SD and SSD against the exact target law.

The statistical tests in test_ssd.py look at the second token only (max_tokens=3): SSD then never
serves a speculation from its cache, and SD never verifies a draft token at position >= 2 nor draws
the bonus after a full accept. Here every mode generates M = 6 tokens at temperature 0.8 with top-k
and top-p (both warps active), and the joint law of the whole 6-token sequence is compared with the
exact target law, computed by enumerating every prefix of the support with the HF transformers
model (float32; the engine's fp32 target equals it to ~1e-6, far below the warps' decision margins,
which `exact_joint_law` asserts). The comparison is a chi-square goodness-of-fit over the joint cells
(cells with expected count < 5 pooled; a sequence outside the support fails outright).

Requests are seeded (`seed=s`), so every test here is deterministic: the real code gives the same
p-value on every run, and every negative control fails the same way on every run.

- SD, K = 3: most sequences reach a full accept (the bonus comes from p_{K+1}) and a verification of
  the third draft token; asserted with a counting hook on `verify`. Two negative controls break
  exactly those two places and nothing else, so the test demonstrably reaches them.
- SD with a reduced draft head (layers/reduced_head.py) that keeps every other token of the target's
  support: the target's other tokens come only from the residual. Control: the draft samples from the
  cut distribution but reports the whole head's q.
- SSD, K = 2, Saguaro C = 0.3, fixed fan-out budget, the draft worker in-process and pre-drafting
  fully: a large share of rounds is served from the speculation cache, inside the first M tokens
  (asserted). The negative control ships the plain warped q instead of Saguaro's q' on cache hits
  only, the pitfall of saguaro.py. The same with two draft workers (data-parallel drafts), the first
  dying mid-batch so that its sequences move to the other: real test and negative control.

Observed (deterministic; each test prints its p-value and counts, shown with -s):
SD real p = 0.65; SD controls p = 9e-76 (third token against the wrong q), 1e-18 (full-accept bonus);
SSD real p = 0.40; SSD control p = 6e-25; two workers, one failing: real p = 0.65, control p = 7e-20.
SD with a reduced draft head keeping half of the target's support (no token drafted outside it, 6808
of 12288 emitted tokens outside it): real p = 0.42; control (sampled from the cut head, the whole
head's q reported) p = 0 (underflow).

Runtime: the tiny models are fast, but on a shared 2-core machine two OpenMP threads per tiny op are
10-40x slower than one (thread hand-off under contention), so the engines here run with threads=1;
the torch thread count is restored after each test.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from ssd import LLM, SamplingParams
from ssd.layers.sampler import inverse_cdf_sample, logits_to_probs
from ssd.speculation import verify as V

from conftest import perturbed_copy
from ssd_local import local_ssd, random_chooser, random_regime

TEMPERATURE, TOP_K, TOP_P = 0.8, 3, 0.8
M = 6                     # tokens whose joint law is tested
PROMPT = "hello"
SD_K, SD_N = 3, 4096
SSD_K, SSD_N, SSD_C, SSD_BUDGET = 2, 1536, 0.3, 3
P_PASS, P_FAIL = 1e-3, 1e-5


# ---------------------------------------------------------------- the exact law and the test


def _warp(logits: torch.Tensor) -> torch.Tensor:
    n = logits.shape[0]
    return logits_to_probs(logits, torch.full((n,), TEMPERATURE), torch.full((n,), TOP_K),
                           torch.full((n,), TOP_P)).double()


def exact_joint_law(target_dir, prompt_ids: list[int], m: int, min_margin: float = 1e-4) -> dict[tuple, float]:
    """P(first m generated tokens = x) for every x of positive probability under the target model at
    (TEMPERATURE, TOP_K, TOP_P), by enumeration: one batched HF forward per depth over all prefixes
    of the support (top-k 3 keeps the tree small: ~100 leaves for m = 6 here).

    Checks that the law is well posed for the engine: at every prefix, the top-k cut (gap between the
    k-th and (k+1)-th probability) and the top-p cut (distance of every kept token's mass-before to
    top_p) are at least `min_margin` away from a tie, so a ~1e-6 difference between HF and the engine
    cannot change the support; and that both warps matter (top-k removes tokens top-p alone would keep
    somewhere, top-p removes tokens top-k keeps somewhere)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    law: dict[tuple, float] = {(): 1.0}
    margin, top_k_binds, top_p_binds = 1.0, 0, 0
    with torch.no_grad():
        for _ in range(m):
            prefixes = list(law)
            logits = hf(torch.tensor([prompt_ids + list(x) for x in prefixes])).logits[:, -1].float()
            probs = _warp(logits)
            plain = torch.softmax(logits / TEMPERATURE, dim=-1).double().sort(dim=-1, descending=True).values
            top = plain[:, :TOP_K] / plain[:, :TOP_K].sum(-1, keepdim=True)
            margin = min(margin, float((plain[:, TOP_K - 1] - plain[:, TOP_K]).min()),
                         float(((top.cumsum(-1) - top) - TOP_P).abs().min()))
            top_k_binds += int((((plain.cumsum(-1) - plain) < TOP_P).sum(-1) > TOP_K).sum())
            top_p_binds += int(((probs > 0).sum(-1) < TOP_K).sum())
            law = {x + (t,): law[x] * float(row[t]) for x, row in zip(prefixes, probs)
                   for t in row.nonzero().flatten().tolist()}
    assert margin > min_margin, f"a top-k/top-p decision is within {margin:.1e} of a tie: pick another prompt"
    assert top_k_binds > 0 and top_p_binds > 0, (top_k_binds, top_p_binds)
    assert abs(sum(law.values()) - 1) < 1e-6
    return law


def joint_pvalue(law: dict[tuple, float], samples: list[tuple]) -> tuple[float, str]:
    """Chi-square goodness-of-fit of the observed sequences to `law` -> (p-value, summary).

    Cells are the sequences of the support; the cells of smallest expected count are pooled into one
    until every cell (the pool too) expects >= 5. A sample outside the support is impossible under
    the target: p = 0."""
    n = len(samples)
    counts = Counter(samples)
    impossible = sum(c for x, c in counts.items() if x not in law)
    if impossible:
        return 0.0, f"{impossible} of {n} samples outside the support, e.g. {next(x for x in counts if x not in law)}"
    cells = sorted(law, key=law.get)                 # ascending expected count
    obs, exp = [], []
    pool_o = pool_e = 0.0
    for x in cells:
        e, o = law[x] * n, counts.get(x, 0)
        if e < 5 or pool_e and pool_e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
        else:
            obs.append(o)
            exp.append(e)
    if pool_e:
        if pool_e < 5 and exp:                        # fold a small pool into the smallest cell
            obs[0], exp[0] = obs[0] + pool_o, exp[0] + pool_e
        else:
            obs.append(pool_o)
            exp.append(pool_e)
    exp = [e * n / sum(exp) for e in exp]            # the law sums to 1 up to float32 rounding
    p = float(chisquare(obs, exp).pvalue)
    return p, f"p={p:.3g}, {len(obs)} cells over {len(law)} sequences, n={n}"


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread while these tests run (see the module docstring), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def close_draft(tiny_pair, tmp_path_factory):
    """The target with every weight perturbed by 0.05 of its std: per-token acceptance ~0.5 under
    top-k 3 / top-p 0.8, so full accepts of K = 3 are common. (test_ssd's near_draft, 0.5 std,
    accepts ~3% here: its supports barely overlap the target's.)"""
    return perturbed_copy(tiny_pair[0], tmp_path_factory.mktemp("close-draft"), 0.05, seed=5)


@pytest.fixture(scope="module")
def sd_llm(tiny_pair, close_draft):
    before = torch.get_num_threads()
    llm = LLM(str(tiny_pair[0]), draft=str(close_draft), mode="sd", k=SD_K, dtype="float32", progress=False,
              max_num_seqs=256, threads=1)
    torch.set_num_threads(before)
    return llm


@pytest.fixture(scope="module")
def target_law(tiny_pair, sd_llm):
    return exact_joint_law(tiny_pair[0], sd_llm.encode(PROMPT), M)


def first_m(llm, n: int, max_tokens: int) -> list[tuple]:
    params = [SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, seed=s, max_tokens=max_tokens,
                             ignore_eos=True) for s in range(n)]
    outs = llm.generate([PROMPT] * n, params)
    assert all(len(o.token_ids) == max_tokens for o in outs)
    return [tuple(o.token_ids[:M]) for o in outs]


def hook_verify(monkeypatch, before=None, after=None) -> Counter:
    """Wrap `ssd.speculation.verify.verify` (what verify_with_generators calls, for SD and SSD alike):
    count, per verified row, the full accepts of K = SD_K tokens (bonus drawn from p_{K+1}) and the
    rows whose third draft token went through the ratio test (first two accepted); optionally alter
    the inputs (`before`) or the result (`after`) to plant a bug."""
    counts = Counter()
    real = V.verify

    def verify(target_probs, draft_probs, draft_tokens, accept_u, bonus_u, num_draft=None):
        k = target_probs.shape[1] - 1
        nd = torch.full((target_probs.shape[0],), k, dtype=torch.long) if num_draft is None else num_draft.long()
        if before is not None:
            target_probs, draft_probs = before(target_probs, draft_probs, nd, counts)
        res = real(target_probs, draft_probs, draft_tokens, accept_u, bonus_u, num_draft)
        if after is not None:
            res = after(target_probs, draft_probs, bonus_u, nd, res, counts)
        counts["rows"] += len(nd)
        counts["full_accepts"] += int(((res.accepted_len == nd) & (nd == SD_K)).sum())
        counts["third_token_verified"] += int(((res.accepted_len >= 2) & (nd >= 3)).sum())
        return res

    monkeypatch.setattr(V, "verify", verify)
    return counts


# ---------------------------------------------------------------- SD


def test_sd_k3_joint_law_of_first_m_tokens_matches_target(monkeypatch, sd_llm, target_law):
    """SD with K = 3, max_tokens = M (so every round lies inside the tested window): the joint law of
    all 6 tokens equals the target's. The window covers the prefill token, rounds proposing 3, 2 and
    1 tokens, full accepts whose bonus is the 5th or the 6th token, and verifications of the third
    draft token, each in a large share of the sequences (asserted)."""
    counts = hook_verify(monkeypatch)
    p, info = joint_pvalue(target_law, first_m(sd_llm, SD_N, M))
    print(f"SD real: {info}; {dict(counts)}")
    assert counts["full_accepts"] > 0.3 * SD_N and counts["third_token_verified"] > 0.4 * SD_N, counts
    assert p > P_PASS, info


def _third_token_against_second_q(target_probs, draft_probs, nd, counts):
    """Planted bug: positions >= 2 verified against the previous position's q (an off-by-one that
    positions 0 and 1 never show): ratio test and residual of the third draft token use q_2."""
    if draft_probs.shape[1] >= 3:
        draft_probs = draft_probs.clone()
        draft_probs[:, 2] = draft_probs[:, 1]
        counts["planted"] += int((nd >= 3).sum())     # rows proposing a third token
    return target_probs, draft_probs


def _full_accept_bonus_from_residual(target_probs, draft_probs, bonus_u, nd, res, counts):
    """Planted bug: the `rejected` mask forgotten, so the bonus after a full accept is drawn from
    residual(p_{K+1}, q_K) instead of p_{K+1} (same uniform; rejections are untouched)."""
    full = (res.accepted_len == nd) & (nd == SD_K)
    if not bool(full.any()):
        return res
    bonus = res.bonus_token.clone()
    bonus[full] = inverse_cdf_sample(V.residual(target_probs[full, SD_K], draft_probs[full, SD_K - 1]),
                                     bonus_u[full])
    counts["planted"] += int((bonus != res.bonus_token).sum())     # bonus tokens changed
    return V.VerifyResult(res.accepted_len, bonus)


@pytest.mark.parametrize("bug", ["third_token_against_second_q", "full_accept_bonus_from_residual"])
def test_sd_k3_joint_law_catches_bugs_only_deep_positions_reach(monkeypatch, sd_llm, target_law, bug):
    """Negative controls for the SD test: a bug that only a verification of the third draft token
    reaches, and one that only the bonus after a full accept reaches, each make the same test fail
    decisively (p < 1e-5). Neither can show in a second-token test."""
    if bug == "third_token_against_second_q":
        counts = hook_verify(monkeypatch, before=_third_token_against_second_q)
    else:
        counts = hook_verify(monkeypatch, after=_full_accept_bonus_from_residual)
    p, info = joint_pvalue(target_law, first_m(sd_llm, SD_N, M))
    print(f"SD control {bug}: {info}; {dict(counts)}")
    assert counts["planted"] > 0.03 * SD_N, counts          # the planted bug was hit that often
    assert p < P_FAIL, info


# ---------------------------------------------------------------- SD with a reduced draft head


def _half_support(law: dict[tuple, float]) -> list[int]:
    """Every other token of the target law's support (ascending) plus the special ids 0-2: a draft
    head that can propose only these meets target tokens outside it at every depth."""
    support = sorted({t for x in law for t in x})
    return sorted(set(support[::2]) | {0, 1, 2})


def _reduced_llm(monkeypatch, tiny_pair, close_draft, base: list[int] | None):
    """SD, K = SD_K, whose draft scores only `base` (None: the whole vocabulary), no fed tokens added."""
    import ssd.layers.reduced_head as RH

    if base is not None:
        monkeypatch.setattr(RH, "base_ids", lambda tok, rows, vocab: (base, "the test's"))
        monkeypatch.setattr(RH, "MAX_EXTRA", 0)
    before = torch.get_num_threads()
    llm = LLM(str(tiny_pair[0]), draft=str(close_draft), mode="sd", k=SD_K, dtype="float32", progress=False,
              max_num_seqs=256, threads=1, draft_vocab=0 if base is None else len(base))
    torch.set_num_threads(before)
    assert (llm.engine.draft.head is None) == (base is None)
    return llm


def test_sd_reduced_draft_head_keeps_the_joint_law(monkeypatch, tiny_pair, close_draft, target_law):
    """A draft head that scores only half of the target's support (layers/reduced_head.py): the draft
    proposes only those tokens (asserted on every verified row), the target's other tokens come from
    the residual (they are in the samples), and the joint law of the first M tokens is the target's."""
    base = _half_support(target_law)
    llm = _reduced_llm(monkeypatch, tiny_pair, close_draft, base)
    kept = set(base)
    outside = Counter()
    counts = hook_verify(monkeypatch)
    real = V.verify

    def spy(target_probs, draft_probs, draft_tokens, accept_u, bonus_u, num_draft=None):
        for row, n in zip(draft_tokens.tolist(), (num_draft.tolist() if num_draft is not None
                                                  else [draft_tokens.shape[1]] * draft_tokens.shape[0])):
            outside["drafted_outside"] += sum(t not in kept for t in row[:n])
            outside["drafted"] += n
        return real(target_probs, draft_probs, draft_tokens, accept_u, bonus_u, num_draft)

    monkeypatch.setattr(V, "verify", spy)
    samples = first_m(llm, SD_N // 2, M)
    p, info = joint_pvalue(target_law, samples)
    emitted_outside = sum(t not in kept for x in samples for t in x)
    print(f"SD reduced head: {info}; {dict(counts)} {dict(outside)}; emitted outside the head {emitted_outside}")
    assert outside["drafted"] > SD_N and outside["drafted_outside"] == 0, outside
    assert emitted_outside > 0.2 * SD_N, emitted_outside
    assert p > P_PASS, info


def test_sd_reduced_head_sampled_but_full_q_reported_is_caught(monkeypatch, tiny_pair, close_draft, target_law):
    """Negative control for the reduced-head test: the draft samples from its distribution cut to the
    same half of the support but reports the whole head's q to the verifier (the pitfall of cutting the
    head in one place and not the other). The same test fails decisively."""
    import ssd.speculation.local_proposer as LP

    base = torch.tensor(_half_support(target_law))
    llm = _reduced_llm(monkeypatch, tiny_pair, close_draft, None)
    real_sample = LP.sample
    planted = Counter()

    def cut_sample(q, generators):
        cut = torch.zeros_like(q)
        cut[:, base] = q[:, base]
        mass = cut.sum(-1, keepdim=True)
        planted["rows"] += q.shape[0]
        return real_sample(torch.where(mass > 0, cut / mass.clamp_min(1e-30), q), generators)

    monkeypatch.setattr(LP, "sample", cut_sample)
    p, info = joint_pvalue(target_law, first_m(llm, SD_N // 2, M))
    print(f"SD reduced-head control: {info}; {dict(planted)}")
    assert planted["rows"] > SD_N, planted
    assert p < P_FAIL, info


# ---------------------------------------------------------------- SSD


def _plain_q(worker, reply) -> torch.Tensor:
    """The draft's top-k/top-p-warped distribution q at each position of the reply's chain (what the
    tokens would have been drawn from without Saguaro), from the worker's record of its plain softmax."""
    dists = worker.seqs[reply.seq_id].dists
    d = torch.stack([dists[j] for j in range(len(reply.tokens))])
    n = d.shape[0]
    return logits_to_probs(d.log(), torch.ones(n), torch.full((n,), TOP_K), torch.full((n,), TOP_P))


def _ssd(monkeypatch, tiny_pair, close_draft, law, ship_plain_q_on_hits: bool, workers: int = 1,
         fail_at_round: int | None = None):
    """Run SSD (in-process worker(s), full pre-drafting, neural backup, fixed budget: deterministic)
    with max_tokens = M + K, so every round that starts inside the window asks for K tokens and can
    be served from the cache. With workers > 1 the first one dies while answering round
    `fail_at_round` (its sequences move to the others). Returns (p-value, summary, hit counts)."""
    llm, clients = local_ssd(monkeypatch, tiny_pair[0], close_draft, k=SSD_K, llm_kw=dict(max_num_seqs=256, threads=1),
                             saguaro_c=SSD_C, fanout_budget=SSD_BUDGET, backup="neural",   # chain pool: 256 x 8
                             workers=workers)
    clients = clients if workers > 1 else [clients]
    clients[0].fail_at_round = fail_at_round
    prompt_len = len(llm.encode(PROMPT))
    seen = Counter()
    hit_seqs = set()

    def tamper(worker, reply):
        if not reply.hit:
            return reply
        # K tokens, or fewer in a request's last rounds (a longer pre-drafted chain, truncated)
        assert reply.probs is not None and 1 <= len(reply.tokens) == reply.probs.shape[0] <= SSD_K
        if len(worker.seqs[reply.seq_id].ctx) - prompt_len < M:    # the chain starts inside the window
            seen["hits_in_window"] += 1
            hit_seqs.add(reply.seq_id)
        q = _plain_q(worker, reply)
        seen["q_prime_differs"] += int((reply.probs - q).abs().max() > 1e-3)
        if ship_plain_q_on_hits:
            reply.probs = q
        return reply

    for client in clients:
        client.tamper = tamper
    before = llm.engine.spec_metrics()
    p, info = joint_pvalue(law, first_m(llm, SSD_N, M + SSD_K))
    m = llm.engine.spec_metrics().delta(before)
    seen["hits"], seen["misses"], seen["seqs_hit_in_window"] = m.hits, m.misses, len(hit_seqs)
    seen["partial_or_fast"] = m.partial_hits + m.fast_backups
    seen["moved"] = m.seqs_moved
    assert llm.engine.degraded_from is None          # no silent fall-back to AR
    assert m.worker_failures == (fail_at_round is not None)
    return p, info, seen


def _check_ssd_reach(seen):
    assert seen["hits"] > 0.3 * (seen["hits"] + seen["misses"]), seen           # the cache serves many rounds
    assert seen["seqs_hit_in_window"] > 0.6 * SSD_N, seen                        # inside the first M tokens
    assert seen["q_prime_differs"] > 0.5 * seen["hits"], seen                    # where q' != q
    assert seen["partial_or_fast"] == 0, seen


def test_ssd_cache_hits_with_saguaro_keep_the_joint_law(monkeypatch, tiny_pair, close_draft, target_law):
    """SSD with Saguaro sampling (C = 0.3) and a fan-out budget of 3 chains: more than 30% of the
    lookups hit and most sequences take part of their first M tokens from a pre-drafted chain, whose
    tokens were drawn from q' != q; the joint law of the first M tokens is still the target's."""
    p, info, seen = _ssd(monkeypatch, tiny_pair, close_draft, target_law, ship_plain_q_on_hits=False)
    print(f"SSD real: {info}; {dict(seen)}")
    _check_ssd_reach(seen)
    assert p > P_PASS, f"{info}; {dict(seen)}"


def test_ssd_shipping_plain_q_on_cache_hits_is_caught(monkeypatch, tiny_pair, close_draft, target_law):
    """Negative control: on cache hits only, the worker ships the plain warped q instead of the q'
    its chain was sampled from (the pitfall of saguaro.py: verifying a q'-sampled token against q).
    Misses are untouched, so this fails only because the test reaches cache hits: p < 1e-5."""
    p, info, seen = _ssd(monkeypatch, tiny_pair, close_draft, target_law, ship_plain_q_on_hits=True)
    print(f"SSD control plain q on hits: {info}; {dict(seen)}")
    _check_ssd_reach(seen)
    assert p < P_FAIL, f"{info}; {dict(seen)}"


@pytest.mark.parametrize("ship_plain_q_on_hits", [False, True])
def test_ssd_two_workers_one_failing_keep_the_joint_law(monkeypatch, tiny_pair, close_draft, target_law,
                                                         ship_plain_q_on_hits):
    """Data-parallel drafts: two workers share each batch of 256 sequences; the first dies while
    answering its 6th round (mid-batch), and its sequences move, with their whole context, to the
    other, which catches up and drafts them from then on. The joint law is still the target's; the
    negative control (plain q on cache hits) still fails, so the test reaches the cache through both
    workers."""
    p, info, seen = _ssd(monkeypatch, tiny_pair, close_draft, target_law, ship_plain_q_on_hits, workers=2,
                         fail_at_round=6)
    print(f"SSD 2 workers, one failing, plain q on hits={ship_plain_q_on_hits}: {info}; {dict(seen)}")
    _check_ssd_reach(seen)
    assert seen["moved"] > 50, seen                   # a real share of the sequences moved mid-flight
    if ship_plain_q_on_hits:
        assert p < P_FAIL, f"{info}; {dict(seen)}"
    else:
        assert p > P_PASS, f"{info}; {dict(seen)}"


# ---------------------------------------------------------------- auto (the chooser switches every round)


@pytest.mark.parametrize("bug", [None, "residual_is_p"])
def test_auto_switching_draft_lengths_every_round_keeps_the_joint_law(monkeypatch, tiny_pair, close_draft,
                                                                      target_law, bug):
    """mode="auto" with its chooser replaced by a pseudo-random one: every round each sequence gets 0..K
    draft tokens (0 = a plain target step), so one batch mixes AR rows and speculative rows of every
    length and each sequence switches many times. The joint law of the first M tokens is the target's;
    the classic bug (resampling from p after a rejection) makes the same test fail."""
    random_chooser(monkeypatch)
    if bug == "residual_is_p":
        monkeypatch.setattr(V, "residual", lambda p, q: p)
    before = torch.get_num_threads()
    llm = LLM(str(tiny_pair[0]), draft=str(close_draft), mode="auto", k=SD_K, dtype="float32", progress=False,
              max_num_seqs=256, threads=1)
    torch.set_num_threads(before)
    p, info = joint_pvalue(target_law, first_m(llm, SD_N // 2, M))
    rows = llm.engine.spec_metrics().rows_by_num_draft
    print(f"auto {bug}: {info}; rows by draft length {rows}")
    assert len(rows) == SD_K + 1 and min(rows) > 0.1 * sum(rows)      # every length, plain rows included
    if bug is None:
        assert p > P_PASS, info
    else:
        assert p < P_FAIL, info


@pytest.mark.parametrize("bug", [None, "worker_q_uniform"])
def test_auto_ssd_switching_regimes_keeps_the_joint_law(monkeypatch, tiny_pair, close_draft, target_law, bug):
    """auto_ssd with both decisions pseudo-random: the regime (draft worker or in-process draft)
    changes in about half the rounds and the chooser gives every local row 0..K tokens, so sequences
    move between the worker (re-added, prefix-cached) and the local draft (catching up) all the time,
    and some SSD rounds are served from the worker's cache. The joint law is the target's. The control
    breaks only SSD rounds: the verifier gets a uniform q instead of the q the worker sampled from
    (the draft's tokens then pass almost always). (Claiming one-hot q would not be a bug: conditional on the drawn token, a
    deterministic proposal verified exactly is exact.)"""
    from ssd.speculation.worker.proposer import WorkerProposer

    random_chooser(monkeypatch)
    random_regime(monkeypatch)
    if bug == "worker_q_uniform":
        real = WorkerProposer.propose

        def propose(self, seqs, num_draft, verify_s=0.0):
            prop = real(self, seqs, num_draft, verify_s)
            prop.probs = [None if q is None else torch.full_like(q, 1.0 / q.shape[-1]) for q in prop.probs]
            return prop
        monkeypatch.setattr(WorkerProposer, "propose", propose)
    before = torch.get_num_threads()
    llm = LLM(str(tiny_pair[0]), draft=str(close_draft), mode="auto", auto_ssd=True, k=SD_K, dtype="float32",
              progress=False, max_num_seqs=32, threads=1, worker_timeout_s=60)
    torch.set_num_threads(before)
    try:
        p, info = joint_pvalue(target_law, first_m(llm, SD_N // 4, M))
        m = llm.engine.spec_metrics()
    finally:
        llm.close()
    print(f"auto_ssd {bug}: {info}; worker rounds {m.worker_rounds}/{m.rounds}, hits {m.hits}, misses {m.misses}")
    assert m.worker_lost == 0 and 0.3 * m.rounds < m.worker_rounds < 0.7 * m.rounds
    assert m.regime_switches > 0.3 * m.rounds
    if bug is None:
        assert m.hits > 0                 # some SSD rounds come from the worker's cache
        assert p > P_PASS, info
    else:
        assert p < P_FAIL, info
