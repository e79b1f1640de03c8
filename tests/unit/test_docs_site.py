"""The documentation site (mkdocs.yml, docs/) builds with ``mkdocs build --strict``: a broken
link or anchor, a page left out of the navigation, a docstring cross-reference to nothing or a
docstring that renders with a warning fails the build, and so this test. The API reference
documents every public name of ``meshlm`` as the object ``meshlm`` gives; the README's links
into docs/ land on a page and an anchor the site has; dated run logs live on one page."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of a config into ``site``, meshlm's sources first on the path."""
    env = dict(
        os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    r = build(REPO / "mkdocs.yml", out)
    warnings = [ln for ln in r.stderr.splitlines() if "WARNING" in ln or "ERROR" in ln]
    assert r.returncode == 0 and not warnings, "mkdocs build --strict failed:\n" + (r.stdout + r.stderr)[-6000:]
    return out


def _config() -> dict:
    # mkdocs.yml may hold !!python tags, which safe_load refuses; this one holds none
    return yaml.safe_load((REPO / "mkdocs.yml").read_text())


def _nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in _nav_pages(v)]
    return [p for item in nav for p in _nav_pages(item)]


def test_site_builds_without_a_warning(site):
    assert (site / "index.html").is_file() and (site / "api" / "meshlm" / "index.html").is_file()


def test_the_site_loads_nothing_from_the_network(site):
    """No page pulls a script, stylesheet, font or image from another host (Material's web
    fonts are off in mkdocs.yml): the site builds and reads offline."""
    remote = re.compile(r"<(?:script|link|img)\b[^>]*\b(?:src|href)=\"(?:https?:)?//", re.I)
    pages = [p for p in site.rglob("*.html") if remote.search(p.read_text())]
    assert not pages, f"pages that load from the network: {[str(p.relative_to(site)) for p in pages][:5]}"


def test_every_page_is_in_the_nav():
    config = _config()
    excluded = set(config.get("exclude_docs", "").split())
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")} - excluded
    assert sorted(pages) == sorted(_nav_pages(config["nav"]))


def _reference() -> dict[str, str]:
    """Each `::: identifier` of the API reference pages, by its last name."""
    out = {}
    for page in sorted((DOCS / "api").glob("*.md")):
        for ident in re.findall(r"^::: (\S+)$", page.read_text(), re.M):
            out.setdefault(ident.rsplit(".", 1)[1], ident)
    return out


def _resolve(ident: str):
    module, _, name = ident.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_api_reference_documents_every_public_name_of_meshlm():
    import meshlm

    ref = _reference()
    missing = sorted(n for n in meshlm.__all__ if n != "nn" and n not in ref)
    assert not missing, f"docs/api/meshlm.md documents no {missing}: add a `::: <home module>.<name>` line"
    for name in meshlm.__all__:
        if name != "nn":
            assert _resolve(ref[name]) is getattr(meshlm, name), f"{ref[name]} is not the object meshlm.{name} is"
    assert "meshlm.nn" in (DOCS / "api" / "nn.md").read_text()


def test_api_reference_documents_the_public_names_of_nn_infer_and_plan():
    import meshlm.infer
    import meshlm.nn
    import meshlm.plan

    ref = _reference()
    for module in (meshlm.nn, meshlm.infer, meshlm.plan):
        # constants (HARDWARE, GiB, PREFERENCE, SCHEMA_VERSION) are data the pages describe, not API
        names = [n for n in module.__all__ if not n.isupper() and n != "GiB"]
        missing = sorted(n for n in names if n not in ref)
        assert not missing, f"the API reference documents no {module.__name__}.{missing}"
        for n in names:
            assert _resolve(ref[n]) is getattr(module, n), f"{ref[n]} is not {module.__name__}.{n}"


def test_readme_links_land_on_the_site(site):
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(docs/([\w/]+)\.md(?:#([\w-]+))?\)", readme)
    assert len(links) > 10
    for page, anchor in links:
        html = site / page / "index.html"
        assert html.is_file(), f"README links to docs/{page}.md, which the site does not have"
        if anchor:
            assert f'id="{anchor}"' in html.read_text(), f"README links to docs/{page}.md#{anchor}: no such anchor"


def test_dated_run_logs_only_in_benchmarks():
    """Run logs with their dates go to docs/benchmarks.md; every other page says what is true
    now (a measurement with its machine and versions, never its date)."""
    date = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
    dated = [
        f"{p.relative_to(REPO)}:{i + 1}"
        for p in [REPO / "README.md", *DOCS.rglob("*.md")]
        if p.name != "benchmarks.md"
        for i, ln in enumerate(p.read_text().splitlines())
        if date.search(ln)
    ]
    assert not dated, f"dates outside docs/benchmarks.md (move the run log there, or drop its date): {dated}"


def test_a_broken_cross_reference_fails_the_build(tmp_path):
    """The build is strict about mkdocstrings too: a page pointing at a name that does not
    exist fails it (a copy of the site with one such reference)."""
    docs = tmp_path / "docs"
    (docs / "api").mkdir(parents=True)
    (docs / "index.md").write_text("# x\n\nSee [shard][meshlm.runtime.lowering.shard.no_such_name].\n")
    (docs / "api" / "shard.md").write_text("# shard\n\n::: meshlm.runtime.lowering.shard.shard\n")
    config = _config()
    config.update(docs_dir=str(docs), nav=[{"Home": "index.md"}, {"API": "api/shard.md"}])
    config.pop("exclude_docs", None)
    config["plugins"][1]["mkdocstrings"]["handlers"]["python"]["paths"] = [str(REPO)]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    r = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert r.returncode != 0 and "no_such_name" in r.stdout + r.stderr
