"""The manual: a short README that maps an mkdocs site in docs/, every page in the nav, every
relative link pointing at a file that exists, and a strict build that passes."""

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import ROOT

DOCS = ROOT / "docs"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")   # [text](target) and ![alt](target)


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _outside_code(markdown: str) -> str:
    """The text with fenced blocks and `code` spans removed: links are not read inside them."""
    markdown = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", markdown)


def _nav_pages(nav) -> list[str]:
    """Every page the mkdocs nav names, nested sections included."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in _nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in _nav_pages(value)]
    raise AssertionError(f"unexpected nav entry {nav!r}")


def _mkdocs_config() -> dict:
    class Loader(yaml.SafeLoader):
        pass
    # mkdocs' own tags (!relative, !ENV) carry paths, not structure: read them as plain values
    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)


def test_readme_is_short():
    # `grep -c '' README.md`: the measure, a last line without a newline included
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; the manual belongs in docs/"


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    nav = _nav_pages(_mkdocs_config()["nav"])
    pages = [p.relative_to(DOCS).as_posix() for p in _pages()]
    assert len(pages) > 20 and "architecture.md" in pages and "reference/configuration.md" in pages
    assert sorted(set(pages) - set(nav)) == [], "docs pages missing from mkdocs.yml's nav"
    assert sorted(set(nav) - set(pages)) == [], "nav entries with no page in docs/"
    assert len(nav) == len(set(nav)), "a page is in the nav twice"


def _broken_links(page: Path, root: Path) -> list[str]:
    """Relative links of `page` whose file does not exist or lies outside `root`."""
    broken = []
    for target in LINK.findall(_outside_code(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue   # a URL (https:, mailto:) or an anchor on the same page (mkdocs checks anchors)
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists() or not path.is_relative_to(root.resolve()):
            broken.append(target)
    return broken


def test_relative_links_point_at_existing_files():
    readme = ROOT / "README.md"
    assert len(LINK.findall(readme.read_text())) > 20   # the map of the docs is links
    assert _broken_links(readme, ROOT) == []
    for page in _pages():
        assert _broken_links(page, DOCS) == [], page.relative_to(ROOT)


def test_link_checker_finds_a_broken_link(tmp_path):
    # the check above can fail: a link to a missing page, or out of the docs, is reported
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("x")
    page = tmp_path / "docs" / "page.md"
    page.write_text("[ok](here.md) [gone](missing.md#a) [out](../README.md) [web](https://x.org) "
                    "`[code](nothing.md)`")
    (tmp_path / "README.md").write_text("x")
    assert _broken_links(page, tmp_path / "docs") == ["missing.md#a", "../README.md"]


def test_docs_point_at_no_file_outside_the_repository():
    for page in _pages():
        outside = re.findall(r"/work/[\w./-]+|/home/[\w./-]+", page.read_text())
        assert outside == [], (page.relative_to(ROOT), outside)


def test_mkdocs_build_strict(tmp_path):
    """The site builds with --strict: a broken link or anchor, a page outside the nav or a missing
    included file fails it (mkdocs.yml's validation settings)."""
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                        str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    for page in _pages():
        rel = page.relative_to(DOCS).with_suffix("")
        html = site / ("index.html" if rel.as_posix() == "index" else f"{rel.as_posix()}/index.html")
        assert html.exists(), html
    # the changelog page is CHANGELOG.md itself, included when the site is built
    first = next(line for line in (ROOT / "CHANGELOG.md").read_text().splitlines() if line.startswith("## "))
    assert first[3:].split(":")[0] in (site / "changelog" / "index.html").read_text()
