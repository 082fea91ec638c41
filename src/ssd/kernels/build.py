"""Build (once, cached) and load the C++ kernels with PyTorch's JIT extension loader.

The first call compiles `qgemm.cpp`, `attention.cpp` and `fused.cpp` (about a minute on 2 cores); later processes load the cached
shared object. The cache lives under the model cache (`$SSD_CACHE_DIR` or ~/.cache/ssd), in a
folder named after the source's hash and the torch version, so an edit or a torch upgrade
rebuilds. `make` builds it up front (scripts/build_kernels.py).
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(n) for n in ("qgemm.cpp", "attention.cpp", "fused.cpp")]
_HEADERS = [Path(__file__).with_name("common.h")]
_LOCK = threading.Lock()
_MODULE = None
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
    """The compiled module (`qgemm`, `best_isa`, `paged_attention_rows`). Raises KernelBuildError."""
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
        fresh = not any(build.glob("*.so"))
        if fresh:
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
        return _MODULE


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
