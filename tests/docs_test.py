"""The documentation: the site builds strictly, README.md stays short, and links resolve.

The site (``mkdocs.yml``, ``docs/``) is built with ``mkdocs build --strict``, which fails
on a broken link, a bad docstring in the API reference or a benchmark marker naming no
result file. README.md is what CI reads first (``.ci/run`` runs the line after
``# 2. The tests``), so its top keeps a fixed shape, and its headline table quotes only
numbers found in the result files it links.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_BYTES = 9000

_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCED = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.DOTALL)


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _relative_links(path: Path) -> list[str]:
    """The relative link targets of a Markdown file, outside code blocks and code spans."""
    text = _CODE_SPAN.sub("", _FENCED.sub("", path.read_text(encoding="utf-8")))
    links = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue
        links.append(target)
    return links


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed")
def test_the_site_builds_strictly(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for page in ("index.html", "benchmarks/index.html", "api/loss-scaling/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    # the benchmark tables are generated from the committed result files
    benchmarks = (tmp_path / "site" / "benchmarks" / "index.html").read_text(encoding="utf-8")
    assert "results:" not in benchmarks and "AMD EPYC" in benchmarks


_NAMESPACES = ("jaxamp", "jaxamp.linen", "jaxamp.nnx", "jaxamp.optim", "jaxamp.debug")
_NAMESPACES += ("jaxamp.ops", "jaxamp.models")


def _resolve(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_every_public_name_has_one_place_in_the_api_pages():
    """The API pages are grouped by task: each public object (whichever namespace also
    re-exports it) is documented once, and each page opens with prose, not a constant."""
    import types

    documented = {}
    for page in sorted((DOCS / "api").glob("*.md")):
        text = page.read_text(encoding="utf-8")
        first_block = text.split("\n## ", 1)[0]
        assert ":::" not in first_block, f"{page.name} opens with an object, not prose"
        for path in re.findall(r"^::: (\S+)$", text, re.MULTILINE):
            assert id(_resolve(path)) not in documented, f"{path} documented twice"
            documented[id(_resolve(path))] = path
    for namespace in _NAMESPACES:
        module = importlib.import_module(namespace)
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, types.ModuleType):
                continue
            assert id(value) in documented, f"{namespace}.{name} is on no API page"


def test_readme_is_short():
    size = len(README.read_bytes())
    assert size <= MAX_README_BYTES, f"README.md is {size} bytes; move prose into docs/"


def test_readme_starts_with_the_two_set_up_commands():
    """Title, one paragraph, then a bash block of two commands, each after its comment."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("# ") and lines[1] == ""
    fence = lines.index("```bash")
    paragraph = lines[2 : fence - 1]
    assert paragraph and all(line.strip() for line in paragraph) and lines[fence - 1] == ""
    block = lines[fence + 1 : lines.index("```", fence + 1)]
    assert len(block) == 4, block
    assert block[0].startswith("# 1. ") and block[2] == "# 2. The tests"
    assert not block[1].startswith("#") and not block[3].startswith("#")


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files(path):
    missing = [
        target
        for target in _relative_links(path)
        if not (path.parent / target.partition("#")[0]).exists()
    ]
    assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"


def _headline_rows() -> list[list[str]]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Headline results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[2:]]


def test_readme_headline_numbers_are_in_the_result_files_they_link():
    rows = _headline_rows()
    assert rows
    for what, figure, files, machine in rows:
        linked = [README.parent / target for target in _LINK.findall(files)]
        assert linked and all("benchmarks/results/" in str(p) for p in linked), what
        texts = [p.read_text(encoding="utf-8") for p in linked]
        for number in re.findall(r"(?<![\w.])\d+\.\d+", figure):
            assert any(number in text for text in texts), (what, number)
        for path in linked:
            twin = path.with_suffix(".json")
            env = json.loads(twin.read_text(encoding="utf-8"))["environment"]
            named = env.get("cpu_model") if env.get("backend") == "cpu" else env.get("device")
            assert named and named in machine, (what, named, machine)
