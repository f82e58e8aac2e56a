"""MkDocs hooks: benchmark tables generated from the committed result files, and links.

Markers a page may contain, each on a line of its own (paths from the repository root):

``<!-- results: benchmarks/results/cpu-transformers -->``
    the Markdown result files of that folder (or that one ``.md`` file), each under a
    heading that links to it and names the machine it was measured on;
``<!-- torch-comparison: benchmarks/results/cpu-transformers/benchmarks.json -->``
    jaxamp's step times against PyTorch's, computed from the suite's JSON records.

The machine is read from the result's JSON twin (``x.md`` beside ``x.json``,
``report.md`` beside ``report.json``), whose ``environment`` every benchmark writes;
else from the file's own ``Hardware:`` or ``Machine:`` line. A result file that names
no machine fails the build, so no table reaches the site without one.

Pages link to repository files the way GitHub resolves them (``../benchmarks/...``
from ``docs/``). Files under ``benchmarks/results/`` are added to the site and the
links kept; links to other files outside ``docs/`` go to the repository on GitHub.
A link to a file that does not exist is a warning (an error under ``--strict``).
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.jaxamp")

RESULTS = "benchmarks/results"
_MARKER = re.compile(
    r"^<!--\s*(?P<kind>results|torch-comparison):\s*(?P<path>\S+)(?P<options>[^>]*?)\s*-->\s*$",
    re.MULTILINE,
)
# [text](target) and ![alt](target); the target ends at whitespace or ")"
_LINK = re.compile(
    r"(?P<bang>!?)\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)"
)
_FENCE = re.compile(r"^(```|~~~)", re.MULTILINE)

_root: Path = Path.cwd()
_repo: str = ""  # the repository's URL on GitHub, from mkdocs.yml's repo_url


def on_config(config: Any) -> Any:
    global _root, _repo
    _root = Path(config.config_file_path).resolve().parent
    _repo = (config.repo_url or "").rstrip("/")
    return config


def on_files(files: Files, config: Any) -> Files:
    """Adds every committed result file to the site, so pages can link and embed them."""
    results = _root / RESULTS
    for path in sorted(results.rglob("*")):
        if path.is_file() and not path.name.startswith("."):
            uri = path.relative_to(_root).as_posix()
            files.append(
                File(
                    uri,
                    src_dir=str(_root),
                    dest_dir=config.site_dir,
                    use_directory_urls=config.use_directory_urls,
                )
            )
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    markdown = _MARKER.sub(lambda m: _expand(m, page), markdown)
    return _rewrite_links(markdown, page, files)


# --- markers -------------------------------------------------------------------------


def _expand(match: re.Match, page: Any) -> str:
    kind, path, options = match["kind"], match["path"], match["options"]
    target = (_root / path).resolve()
    if not target.exists() or _root not in target.parents:
        raise PluginError(f"{page.file.src_uri}: {kind} marker names {path!r}: no such file")
    if kind == "torch-comparison":
        return _torch_comparison(target, page)
    level = int(re.search(r"level=(\d)", options)[1]) if "level=" in options else 3
    sources = sorted(target.glob("*.md")) if target.is_dir() else [target]
    if not sources:
        raise PluginError(f"{page.file.src_uri}: no .md result files in {path!r}")
    return "\n\n".join(_embed(source, level, page) for source in sources)


def _embed(source: Path, level: int, page: Any) -> str:
    text = source.read_text(encoding="utf-8")
    title, body = _split_title(text)
    uri = source.relative_to(_root).as_posix()
    machine, where = _machine(source, text)
    links = f"[`{uri}`]({_relative(page, uri)})"
    twin = _json_twin(source)
    if twin is not None:
        twin_uri = twin.relative_to(_root).as_posix()
        links += f" (records: [`{twin.name}`]({_relative(page, twin_uri)}))"
    short = uri.removeprefix(RESULTS + "/")
    header = [
        f"{'#' * level} {title} (`{short}`)",
        "",
        f"Result file {links}. Machine ({where}): {machine}.",
        "",
    ]
    return "\n".join(header) + "\n" + _demote(body, level)


def _split_title(text: str) -> tuple[str, str]:
    lines = text.strip().splitlines()
    if lines and lines[0].startswith("# "):
        return lines[0][2:].strip(), "\n".join(lines[1:]).strip() + "\n"
    return "Results", "\n".join(lines) + "\n"


def _demote(body: str, level: int) -> str:
    """Headings inside an embedded file go below the heading it is embedded under."""
    out, fenced = [], False
    for line in body.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        if not fenced and re.match(r"#{1,5} ", line):
            line = "#" * level + line
        out.append(line)
    return "\n".join(out) + "\n"


def _json_twin(source: Path) -> Path | None:
    twin = source.with_suffix(".json")
    return twin if twin.is_file() else None


def _machine(source: Path, text: str) -> tuple[str, str]:
    """The machine a result was measured on, and which file says so."""
    twin = _json_twin(source)
    if twin is not None:
        env = json.loads(twin.read_text(encoding="utf-8")).get("environment")
        if env:
            return describe_environment(env), f"from `{twin.name}`"
    found = re.search(r"^(?:-\s*)?(?:Hardware|Machine):\s*(.+?)\s*$", text, re.MULTILINE)
    if found:
        return found[1].rstrip("."), f"from `{source.name}`"
    raise PluginError(
        f"{source.relative_to(_root)} names no machine: add a 'Hardware:' line or a JSON "
        "twin with an 'environment'"
    )


def describe_environment(env: dict[str, Any]) -> str:
    """One line for a result's ``environment``: hardware, backend, versions and date."""
    if env.get("backend") == "cpu":
        cores = env.get("cpu_count") or env.get("cpu_threads")
        flags = [
            *(env.get("cpu_bf16_features") or env.get("cpu_bf16_flags") or ()),
            *(env.get("cpu_fp16_features") or env.get("cpu_fp16_flags") or ()),
        ]
        units = ", ".join(flags) if flags else "no bf16/fp16 flags"
        hardware = f"CPU {env.get('cpu_model')} ({cores} cores; {units})"
    else:
        count = env.get("device_count")
        hardware = f"{env.get('device')}" + (f" x{count}" if count and count > 1 else "")
        if env.get("compute_capability"):
            hardware += f" (compute capability {env['compute_capability']})"
    versions = ", ".join(
        f"{name} {env[name]}" for name in ("jax", "flax", "optax", "torch") if env.get(name)
    )
    parts = [hardware, f"backend {env.get('backend')}", versions, env.get("date")]
    return "; ".join(str(part) for part in parts if part)


def _torch_comparison(path: Path, page: Any) -> str:
    """jaxamp against PyTorch eager, per model, from the suite's records."""
    data = json.loads(path.read_text(encoding="utf-8"))
    records = data["records"]
    step = {
        (r["model"], r["framework"], r["variant"]): r
        for r in records
        if r.get("step_time_median_s") is not None
    }
    models = list(dict.fromkeys(r["model"] for r in records))

    def ms(model: str, framework: str, variant: str) -> float | None:
        record = step.get((model, framework, variant))
        return None if record is None else 1e3 * record["step_time_median_s"]

    def activations(model: str, framework: str, variant: str) -> float | None:
        record = step.get((model, framework, variant))
        return None if record is None else record.get("activation_bytes")

    def ratio(a: float | None, b: float | None, times: bool = False) -> str:
        if a is None or b is None or not b:
            return "-"
        text = f"{a / b:.2f}"
        return f"{text} ({a:.0f} / {b:.0f} ms)" if times else text

    rows = [
        (
            "jaxamp bf16 step / jaxamp fp32 step",
            lambda m: ratio(ms(m, "jaxamp", "bf16"), ms(m, "jaxamp", "fp32"), True),
        ),
        (
            "PyTorch AMP bf16 step / PyTorch fp32 step",
            lambda m: ratio(ms(m, "torch", "bf16"), ms(m, "torch", "fp32"), True),
        ),
        (
            "jaxamp bf16 step / PyTorch AMP bf16 step",
            lambda m: ratio(ms(m, "jaxamp", "bf16"), ms(m, "torch", "bf16")),
        ),
        (
            "jaxamp fp32 step / PyTorch fp32 step",
            lambda m: ratio(ms(m, "jaxamp", "fp32"), ms(m, "torch", "fp32")),
        ),
        (
            "hand-written Flax `dtype=bfloat16` step / jaxamp fp32 step",
            lambda m: ratio(ms(m, "flax", "bf16"), ms(m, "jaxamp", "fp32")),
        ),
        (
            "activations saved, jaxamp bf16 / fp32",
            lambda m: ratio(activations(m, "jaxamp", "bf16"), activations(m, "jaxamp", "fp32")),
        ),
        (
            "activations saved, PyTorch AMP bf16 / fp32",
            lambda m: ratio(activations(m, "torch", "bf16"), activations(m, "torch", "fp32")),
        ),
    ]
    batch = {r["model"]: r.get("batch_size") for r in records}
    header = "| figure | " + " | ".join(f"`{m}`, batch {batch[m]}" for m in models) + " |"
    lines = [header, "|---" * (len(models) + 1) + "|"]
    for name, cell in rows:
        lines.append(f"| {name} | " + " | ".join(cell(m) for m in models) + " |")
    uri = path.relative_to(_root).as_posix()
    machine = describe_environment(data.get("environment") or {})
    note = (
        f"\nComputed from [`{uri}`]({_relative(page, uri)}) when this page was built "
        f"(medians of step times measured side by side in one process). Machine: {machine}.\n"
    )
    return "\n".join(lines) + "\n" + note


# --- links ---------------------------------------------------------------------------


def _relative(page: Any, uri: str) -> str:
    """A link from ``page`` to the site file ``uri`` (a path from the site's root)."""
    return posixpath.relpath(uri, posixpath.dirname(page.file.src_uri) or ".")


def _rewrite_links(markdown: str, page: Any, files: Files) -> str:
    source_dir = Path(page.file.abs_src_path).resolve().parent
    docs_dir = Path(page.file.src_dir).resolve()
    in_docs = docs_dir == (_root / "docs").resolve()

    def rewrite(match: re.Match) -> str:
        target = match["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith(("#", "/")):
            return match[0]
        path, _, anchor = target.partition("#")
        if not path:
            return match[0]
        resolved = Path(os.path.normpath(source_dir / path))
        if in_docs and docs_dir in resolved.parents:
            return match[0]  # a docs page: MkDocs checks it
        if not resolved.exists() or _root not in resolved.parents:
            log.warning("%s links to %r, which does not exist", page.file.src_uri, target)
            return match[0]
        uri = resolved.relative_to(_root).as_posix()
        if files.get_file_from_path(uri) is not None:
            new = _relative(page, uri)
        elif _repo:
            new = f"{_repo}/{'tree' if resolved.is_dir() else 'blob'}/main/{uri}"
        else:
            log.warning("%s links outside docs/ to %r: set repo_url", page.file.src_uri, target)
            return match[0]
        if anchor:
            new += "#" + anchor
        return f"{match['bang']}[{match['text']}]({new}{match['title'] or ''})"

    parts = _FENCE.split(markdown)
    # split keeps the fence markers: text, fence, code, fence, text, ...
    out, fenced = [], False
    for part in parts:
        if part in ("```", "~~~"):
            fenced = not fenced
            out.append(part)
        elif fenced:
            out.append(part)
        else:
            out.append(_LINK.sub(rewrite, part))
    return "".join(out)
