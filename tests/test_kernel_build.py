"""The kernel build's locks: a build killed midway does not hang later loads, and waiting for
another process's build is bounded. torch's loader is faked (no compile); its lock is torch's own."""
from __future__ import annotations

import fcntl
import logging
import os
import re
import signal
import subprocess
import sys

import pytest

from ssd.kernels import build


@pytest.fixture
def fake_load(monkeypatch, tmp_path):
    """A temp kernel cache and a torch loader that takes torch's lock the way the real one does."""
    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton

    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_MODULE", None)
    calls = []

    def load(name, sources, build_directory, **kw):
        baton = FileBaton(os.path.join(build_directory, build.TORCH_LOCK))
        assert baton.try_acquire(), "torch's loader would wait on this lock forever"
        baton.release()
        calls.append(build_directory)
        return "module"
    monkeypatch.setattr(cpp_extension, "load", load)
    folder = build._build_dir()
    folder.mkdir(parents=True)
    return folder, calls


def test_a_build_killed_midway_leaves_no_lock_that_blocks_the_next_load(fake_load, caplog):
    folder, calls = fake_load
    # a builder that holds both locks and is killed before it releases them
    child = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"f = open({str(folder / build.BUILDER_LOCK)!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        f"os.close(os.open({str(folder / build.TORCH_LOCK)!r}, os.O_CREAT | os.O_EXCL))\n"
        "print('building', flush=True); time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "building\n"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert (folder / build.TORCH_LOCK).exists()
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.load_qgemm() == "module"
    assert calls == [str(folder)] and not (folder / build.TORCH_LOCK).exists()
    assert any("stale kernel build lock" in r.getMessage() and str(folder / build.TORCH_LOCK) in r.getMessage()
               for r in caplog.records)


def test_waiting_for_another_live_build_is_bounded_and_names_the_lock(fake_load, monkeypatch):
    folder, calls = fake_load
    monkeypatch.setenv("SSD_KERNEL_LOCK_TIMEOUT_S", "1")
    with open(folder / build.BUILDER_LOCK, "w") as other:      # another open file: another holder
        other.write("4242\n")
        other.flush()
        fcntl.flock(other, fcntl.LOCK_EX)
        with pytest.raises(build.KernelBuildError, match=r"process 4242 has held the kernel build lock "
                                                         rf"{re.escape(str(folder / build.BUILDER_LOCK))} for over 1s"):
            build.load_qgemm()
    assert calls == []
    assert build.load_qgemm() == "module"          # released: the next load goes ahead
