"""docs/ARCHITECTURE.md names only what exists: every path it mentions is in the tree, and
every module, class, function or attribute it names in backticks (or in the layout block) is
defined somewhere in paged_jax/, models/ or pallas_kernels/.

The doc describes the code as it is (../shared/DESIGN.md); a rename that forgets the doc,
or a paragraph about a seam that was never built, fails here.
"""

import ast
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "ARCHITECTURE.md"
CODE_DIRS = ("paged_jax", "models", "pallas_kernels", "cpu_kernels")
PATH = re.compile(r"\b((?:paged_jax|models|pallas_kernels|tests|scripts|docs)/[\w./-]*\w)")
BACKTICKED = re.compile(r"`([^`\n]+)`")
IDENTIFIER = re.compile(r"^[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*")
# Class-like words in the layout block (the code fence that maps files to what they hold).
CLASS_LIKE = re.compile(r"\b[A-Z]\w*(?:Config|Manager|Pool|Builder|Spec|Coordinator|Inputs|Metadata|Output|Engine|"
                        r"Client|Runner|Family|Queue|Block|Attention|Tier|Codec|Log)\b")


def _defined_names() -> set[str]:
    """Every name the code defines: modules, classes, functions and methods, their
    parameters, assignment targets (module constants, self.attributes, class fields)."""
    names = set()
    for directory in CODE_DIRS:
        for path in (REPO / directory).rglob("*.py"):
            names.add(path.stem)
            names.update(path.relative_to(REPO).parent.parts)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    args = node.args
                    names.update(a.arg for a in args.args + args.kwonlyargs + args.posonlyargs)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names.add(node.target.id)
                elif isinstance(node, ast.alias):
                    names.add(node.asname or node.name.split(".")[-1])
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                    names.add(node.value)  # names the code accepts as strings ("triton", "full_attention")
    return names


def _checked_text(text: str) -> str:
    """The doc without the "adds" column of its planned-features table (what a feature will
    add does not exist yet); what a feature touches must."""
    lines, in_plan = [], False
    for line in text.splitlines():
        if line.startswith("## "):
            in_plan = line.startswith("## Where each planned feature goes")
        if in_plan and line.startswith("|"):
            cells = line.split(" | ")
            if len(cells) == 3:
                line = " | ".join([cells[0], "", cells[2]])
        lines.append(line)
    return "\n".join(lines)


def _layout_block(text: str) -> list[str]:
    """The lines of the first code fence (the file -> contents map)."""
    fence = text.split("```")[1]
    return fence.splitlines()


def _layout_paths(lines: list[str]) -> list[str]:
    """Paths in the layout block: full ones, and bare file names under the last directory."""
    paths, directory = [], None
    for line in lines:
        match = re.match(r"^(\S+)", line)
        if match and "/" in match.group(1):
            first = match.group(1).rstrip(",")
            paths.append(first)
            directory = first if first.endswith("/") else None
        elif directory and (bare := re.match(r"^  (\w+\.py)\b", line)):
            paths.append(directory + bare.group(1))
    return [p for p in paths if PATH.match(p)]


def test_every_path_exists():
    text = _checked_text(DOC.read_text())
    paths = set(PATH.findall(text)) | set(_layout_paths(_layout_block(text)))
    missing = sorted(p for p in paths if not (REPO / p.rstrip(".")).exists())
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_every_named_symbol_is_defined():
    text = _checked_text(DOC.read_text())
    defined = _defined_names()
    named = set()
    for token in BACKTICKED.findall(text):
        if token.startswith(("-", "$", "'", '"')) or "/" in token or " " in token.split("(")[0]:
            continue  # a flag, an env var, a value, a path (checked above) or a phrase
        match = IDENTIFIER.match(token)
        if match:
            named.update(match.group(0).split("."))
    for line in _layout_block(text):
        named.update(CLASS_LIKE.findall(line))
    # Names of the outside world the doc may mention in backticks.
    outside = {"jax", "jnp", "lax", "scan", "shard_map", "jit", "Mesh", "PartitionSpec", "P", "NamedSharding",
               "vllm", "nnx", "safetensors", "config", "json", "py", "md", "None", "True", "False", "self",
               "x", "q", "k", "v", "R", "T", "S", "W", "G", "tp",
               "general", "ggml",  # GGUF metadata keys
               "mosaic_gpu"}  # the implementation the attention table leaves room for (not built)
    missing = sorted(n for n in named - outside if n not in defined and not n.isdigit())
    assert not missing, f"docs/ARCHITECTURE.md names symbols the code does not define: {missing}"


def test_the_check_can_fail():
    defined = _defined_names()
    assert "KVCacheCoordinator" in defined and "FullAttentionManager" in defined
    assert "SlidingWindowKVCacheThing" not in defined
    with pytest.raises(IndexError):
        _layout_block("no fence here")
    plan = "## Where each planned feature goes\n| x (issue 1) | `NewThing` | `OldThing` |\n## Next\n| a | `B` | `C` |"
    checked = _checked_text(plan)
    assert "NewThing" not in checked and "OldThing" in checked and "`B`" in checked
