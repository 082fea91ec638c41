"""Child processes' stderr is drained as it comes (no hang on a full pipe) and its tail is kept."""
from __future__ import annotations

import logging
import sys

import pytest

from ssd.engine.childlog import LoggedChild

LOUD = ("import sys\n"
        "for i in range(3000): sys.stderr.write(f'line {i} ' + 'x' * 70 + '\\n')\n"      # ~240 KiB
        "sys.stderr.write('y' * 50000)\n"                                                 # one long line
        "sys.stderr.write('\\nthe end\\n')\n")


def test_a_child_writing_more_than_the_pipe_holds_finishes_and_its_tail_is_kept(caplog):
    caplog.set_level(logging.DEBUG, logger="ssd.child.loud")
    p = LoggedChild([sys.executable, "-c", LOUD], "ssd.child.loud", level=logging.DEBUG)
    assert p.wait(timeout=30) == 0          # it would block forever on an unread pipe
    tail = p.tail()
    assert tail.endswith("y\nthe end\n") and len(tail) == 2000
    lines = [r.getMessage() for r in caplog.records if r.name == "ssd.child.loud"]
    assert lines[0] == "line 0 " + "x" * 70 and lines[2999].startswith("line 2999 ")
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "ssd.child.loud")
    assert lines[-1] == "the end" and sum(len(x) for x in lines[3000:-1]) == 50000   # long line in pieces


def test_a_draft_worker_dying_at_start_up_reports_its_stderr():
    from ssd.speculation.worker.client import DraftClient, DraftWorkerError

    # pinning to a core that does not exist kills the worker before it joins
    with pytest.raises(DraftWorkerError, match=r"exited during start-up \(code 1\):\n(.|\n)*Traceback"
                                               r"(.|\n)*sched_setaffinity"):
        DraftClient(None, cores=[4095], start_timeout_s=60)
