"""Every reference a reader may follow resolves: ``jaxamp.X.Y`` names in docstrings, guides
and the README, and the guides that messages and docstrings cite, as links a pip user can
open (a repository path such as ``guides/fp8.md`` opens nothing in an installed package)."""

import ast
import importlib
import re
from pathlib import Path

import pytest

from jaxamp._src.errors import DOCS_URL, guide

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "jaxamp").rglob("*.py"))
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *SOURCES]
_NAME = re.compile(r"\bjaxamp(?:\.[A-Za-z_]\w*)+")
# A path in the repository, as a pip user would read it in a message or a docstring.
_PATH = re.compile(
    r"(?<![\w/.-])(?:docs/|\.\./)?(?:guides|docs|tests|benchmarks)/[\w./-]+\.(?:md|py)\b"
)


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_jaxamp_name_resolves(path):
    text = path.read_text(encoding="utf-8")
    names = {m.group(0).rstrip(".") for m in _NAME.finditer(text)}
    missing = sorted(n for n in names if not _resolves(n))
    assert not missing, f"{path.relative_to(ROOT)} names what does not exist: {missing}"


def _messages(path: Path):
    """``(line, text)`` of each string literal in a module but its docstrings: the
    messages of errors and warnings, and the constants they are made of."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            docstrings.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):  # noqa: SIM102
            if id(node) not in docstrings:  # a docstring may name a repository path
                yield node.lineno, node.value


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_messages_cite_guides_by_links_a_user_can_open(path):
    """The library's messages cite a guide through ``errors.guide`` (a link), never by a
    path in the repository; docstrings (read in the source tree and on the docs site)
    and comments may."""
    found = [
        f"line {line}: {m.group(0)}"
        for line, text in _messages(path)
        for m in _PATH.finditer(text)
        if DOCS_URL not in text[max(0, m.start() - len(DOCS_URL) - 1) : m.start() + 1]
    ]
    assert not found, f"{path.relative_to(ROOT)} cites repository paths: {found}"


def test_every_guide_link_names_a_page_and_section_that_exist():
    """``guide(page, section)`` links only to pages in docs/guides and to headings in
    them (the anchors mkdocs makes: lower case, spaces to hyphens)."""
    cited = set()
    for path in SOURCES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "guide":
                args = [a.value for a in node.args if isinstance(a, ast.Constant)]
                cited.add((path.name, *args))
    assert cited, "no guide() call found: the scan is vacuous"
    for where, page, *section in cited:
        target = ROOT / "docs" / "guides" / page
        assert target.exists(), (where, page)
        if section:
            headings = re.findall(r"^#+ (.+)$", target.read_text(encoding="utf-8"), re.M)
            anchors = {
                re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings
            }
            assert section[0] in anchors, (where, page, section[0], sorted(anchors))


def test_guide_builds_the_link():
    assert guide("fp8.md") == f"{DOCS_URL}/guides/fp8.md"
    assert guide("fp8.md", "limits") == f"{DOCS_URL}/guides/fp8.md#limits"
