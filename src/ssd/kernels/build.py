"""Build (once, cached) and load the C++ kernels with PyTorch's JIT extension loader.

The first call compiles `qgemm.cpp`, `attention.cpp` and `fused.cpp` (about a minute on 2 cores); later processes load the cached
shared object. The cache lives under the model cache (`$SSD_CACHE_DIR` or ~/.cache/ssd), in a
folder named after the source's hash and the torch version, so an edit or a torch upgrade
rebuilds. `make` builds it up front (scripts/build_kernels.py). One process at a time builds or
loads a folder (an flock, see _sole_builder); a build killed midway does not block the next one.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(n) for n in ("qgemm.cpp", "attention.cpp", "fused.cpp")]
_HEADERS = [Path(__file__).with_name("common.h")]
_LOCK = threading.Lock()
_MODULE = None
TORCH_LOCK = "lock"              # torch's own lock file in the build folder (torch.utils.file_baton)
BUILDER_LOCK = "builder.lock"    # ours, flocked: see _sole_builder
LOCK_TIMEOUT_S = 600.0           # the longest wait for another process's build ($SSD_KERNEL_LOCK_TIMEOUT_S)
ISA_NAMES = {0: "portable", 1: "avx2", 2: "avx512-vnni"}


class KernelBuildError(RuntimeError):
    pass


def _build_dir() -> Path:
    import torch

    from ssd.models.registry import cache_dir

    # the sources' folder is part of the key: torch's build file names the sources by absolute path, so
    # two checkouts sharing one build folder would rebuild it each time the other one loads it
    key = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES + _HEADERS) + torch.__version__.encode()
                         + str(_SOURCES[0].parent.resolve()).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"qgemm-{key}"


def load_qgemm():
    """The compiled module (`qgemm`, `best_isa`, `paged_attention_rows`, `set_prefetch`). Raises
    KernelBuildError. SSD_QGEMM_PREFETCH sets the GEMM's prefetch distance in bytes (0: off)."""
    global _MODULE
    if _MODULE is not None:
        return _MODULE
    with _LOCK:
        if _MODULE is not None:
            return _MODULE
        from torch.utils import cpp_extension

        _ninja_on_path()
        build = _build_dir()
        build.mkdir(parents=True, exist_ok=True)
        with _sole_builder(build, float(os.environ.get("SSD_KERNEL_LOCK_TIMEOUT_S", LOCK_TIMEOUT_S))):
            if not any(build.glob("*.so")):
                log.info("compiling the low-bit CPU kernels into %s (once; about a minute)", build)
            try:
                _MODULE = cpp_extension.load(
                    name="ssd_qgemm", sources=[str(p) for p in _SOURCES], build_directory=str(build),
                    extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp", "-std=c++17"],
                    verbose=os.environ.get("SSD_KERNEL_VERBOSE") == "1")
            except Exception as e:  # compiler missing, headers missing, ...
                raise KernelBuildError(
                    f"could not build the low-bit CPU kernels ({type(e).__name__}: {e}); they need g++ and the "
                    "Python headers. Load the model with dtype='float16' or 'bfloat16' instead.") from e
            pf = os.environ.get("SSD_QGEMM_PREFETCH", "").strip()
            if pf:       # bytes of codes the GEMM prefetches ahead (qgemm.cpp; 0 = off), to tune another CPU
                try:
                    _MODULE.set_prefetch(int(pf))
                except ValueError:
                    raise ValueError(f"SSD_QGEMM_PREFETCH={pf!r}: give a byte count such as 1024 (0 = off)") from None
        return _MODULE


@contextlib.contextmanager
def _sole_builder(build: Path, timeout_s: float):
    """Be the only ssd process in torch's loader for `build`, waiting at most timeout_s for another.

    torch's loader takes the file `lock` in the build folder (torch.utils.file_baton: created with
    O_EXCL, removed when the build ends) and, when it exists, waits without a bound for it to go. A
    build killed midway leaves it behind and every later load hangs. So loads first take an flock on
    `builder.lock`, which the OS releases when its holder dies, however it dies: once held, no other
    ssd load is in torch's loader and a `lock` still there is stale, and is removed."""
    path = build / BUILDER_LOCK
    with open(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+") as f:
        deadline, told = time.monotonic() + timeout_s, False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "?"
                if time.monotonic() > deadline:
                    raise KernelBuildError(
                        f"process {holder} has held the kernel build lock {path} for over {timeout_s:.0f}s: it is "
                        "still building, or hung. Wait for it, or stop it (the lock goes with it); if it waits on "
                        f"torch's lock {build / TORCH_LOCK} and no build is running, delete that file. "
                        "$SSD_KERNEL_LOCK_TIMEOUT_S sets this bound") from None
                if not told:
                    log.info("waiting for process %s, which is building the low-bit CPU kernels in %s", holder, build)
                    told = True
                time.sleep(0.2)
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        stale = build / TORCH_LOCK
        if stale.exists():
            log.warning("removing the stale kernel build lock %s: the build that took it did not finish (killed?)",
                        stale)
            stale.unlink(missing_ok=True)
        yield


def _ninja_on_path() -> None:
    """torch's loader runs `ninja` from PATH; the pip package (a dependency) puts it next to the
    venv's python, which is not on PATH when the venv is not activated."""
    import shutil
    import sys

    if shutil.which("ninja"):
        return
    dirs = [str(Path(sys.executable).parent)]
    try:
        import ninja

        dirs.append(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    os.environ["PATH"] = os.pathsep.join(dirs + [os.environ.get("PATH", "")])


def forced_isa() -> int:
    """SSD_QGEMM_ISA=portable|avx2|avx512 forces a code path (tests, machines with broken flags);
    -1 = the best the CPU has."""
    v = os.environ.get("SSD_QGEMM_ISA", "").strip().lower()
    if not v:
        return -1
    table = {"portable": 0, "avx2": 1, "avx512": 2, "avx512-vnni": 2}
    if v not in table:
        raise ValueError(f"SSD_QGEMM_ISA={v!r}: use portable, avx2 or avx512")
    return table[v]


if __name__ == "__main__":      # `python -m ssd.kernels.build`: compile now (make test / make demo do)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mod = load_qgemm()
    log.info("low-bit kernels ready in %s (best path on this CPU: %s)", _build_dir(), ISA_NAMES[mod.best_isa()])
