"""`ssd chat`: the interactive multi-turn REPL on the tiny model, fed lines on a fake stdin."""
from __future__ import annotations

import argparse
import io
import os
import signal
import sys

import pytest

from ssd import LLM, SamplingParams, cli


def chat_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ssd")
    cli.add_chat_parser(p.add_subparsers(dest="command", required=True))
    return p


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_pair):
    return LLM(str(tiny_pair[0]), dtype="float32", progress=False)


def test_chat_command_multi_turn_with_metrics(tiny_pair, llm, monkeypatch, capsys):
    args = chat_parser().parse_args(["chat", "--model", str(tiny_pair[0]), "--dtype", "float32", "--temperature",
                                     "0", "--max-tokens", "8", "--ignore-eos", "--metrics", "--system", "be brief"])
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n\nhow are you?\n/exit\nnever read\n"))
    assert args.func(args) == 0
    out, err = capsys.readouterr()

    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    first = llm.chat(conv, greedy(8))[0].text
    conv += [{"role": "assistant", "content": first}, {"role": "user", "content": "how are you?"}]
    second = llm.chat(conv, greedy(8))[0].text          # the answer depends on the whole history
    assert out == f"{first}\n{second}\n"
    assert err.count("[ar] 8 tokens | ") == 2 and err.count("TTFT") == 2 and err.count("cache hit rate n/a") == 2


class InterruptOnce(io.StringIO):
    """A terminal whose user presses Ctrl-C (a real SIGINT) while the first answer is streaming."""

    def __init__(self, at_write: int):
        super().__init__()
        self.writes, self.at = 0, at_write

    def write(self, s: str) -> int:
        self.writes += 1
        if self.writes == self.at:
            os.kill(os.getpid(), signal.SIGINT)
        return super().write(s)


def test_ctrl_c_stops_the_answer_not_the_session(llm):
    out, err = InterruptOnce(at_write=2), io.StringIO()
    rc = cli.chat_repl(llm, greedy(60), io.StringIO("tell me a long story\nand now?\n"), out, err)
    assert rc == 0                                          # end of input quits cleanly
    first, rest = out.getvalue().split("\n[stopped]\n")
    assert 0 < len(first) < 60
    conv = [{"role": "user", "content": "tell me a long story"}, {"role": "assistant", "content": first},
            {"role": "user", "content": "and now?"}]
    assert rest == llm.chat(conv, greedy(60))[0].text + "\n"
    assert not llm.engine.has_unfinished()                  # the stopped request was aborted
    bm = llm.engine.target.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_reset_and_context_overflow(llm):
    out, err = io.StringIO(), io.StringIO()
    lines = "hi\n/reset\nhi\n" + "z" * 300 + "\nhi\n/quit\n"
    assert cli.chat_repl(llm, greedy(4), io.StringIO(lines), out, err) == 0
    answers = out.getvalue().split("\n")[:-1]
    assert len(answers) == 3 and answers[0] == answers[1]                 # /reset forgot the first turn
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answers[1]},
            {"role": "user", "content": "hi"}]
    assert answers[2] == llm.chat(conv, greedy(4))[0].text                # the failed turn left no trace
    assert "history cleared" in err.getvalue() and "max_model_len" in err.getvalue()


def test_generate_metrics_explain_auto(tiny_pair, capsys):
    """`ssd generate --mode auto --metrics` names the chooser's decisions and predicted vs measured tok/s."""
    from ssd.cli import main

    rc = main(["generate", "--model", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--mode", "auto", "--k", "3",
               "--dtype", "float32", "--temperature", "0", "--max-tokens", "12", "--ignore-eos", "--metrics",
               "--prompt", "def f(x):"])
    assert rc == 0
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("[auto]")][0]
    assert "auto: plain rounds" in line and "draft length per row" in line and "predicted" in line, line
