"""The documentation site (scripts/build_docs.py: nbdev's processors, then Sphinx + myst-nb + furo).

Builds into temporary folders, never into docs/: every notebook must become a page, a backticked
name must become a link to its API heading, and stored outputs (a figure, printed text) must be on
the page. The site is built once a session (`docs_site`, tests/conftest.py) and also opened in a browser by
tests/test_site_browser.py. A second, tiny build checks that rebuilding gives the same files."""
import base64
import html
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "scripts" / "build_docs.py"
MARK = "printed-by-the-docs-check-notebook"


def _png(w=12, h=8) -> bytes:
    "A small valid red PNG, made without any imaging library."
    def chunk(kind, data): return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = b"".join(b"\x00" + b"\xff\x00\x00" * w for _ in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def _page_name(nb: Path) -> str:
    return re.sub(r"^\d+[a-zA-Z0-9]*_", "", nb.stem.lower())


def _symbols():
    "Public top-level symbols of the package, from nbdev's index: (name, page, anchor)."
    ns = {}
    exec((ROOT / "minisgl" / "_modidx.py").read_text(), ns)
    for mod, syms in ns["d"]["syms"].items():
        for full, (url, _) in syms.items():
            name = full[len(mod) + 1:]
            page, _, anchor = url.partition("#")
            if not name.startswith("_") and "." not in name: yield name, Path(page).stem, anchor


def _check_notebook(symbols) -> dict:
    "A notebook that mentions package symbols in backticks and stores a figure and printed text."
    mention = ", ".join(f"`{n}`" for n, _, _ in symbols)
    md = lambda s: {"cell_type": "markdown", "metadata": {}, "source": s}
    return {"nbformat": 4, "nbformat_minor": 5,
            "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
            "cells": [md("# Docs check\n> A notebook written by tests/test_docs.py"),
                      md(f"## Links\n\nThe package defines {mention}."),
                      md("## Math\n\nInline $x_i^2$ and a block:\n\n$$\\sum_i x_i$$"),
                      {"cell_type": "code", "metadata": {}, "execution_count": 1,
                       "source": f"print('{MARK}')\nshow_a_red_square()",
                       "outputs": [{"output_type": "stream", "name": "stdout", "text": f"{MARK}\n"},
                                   {"output_type": "display_data", "metadata": {},
                                    "data": {"image/png": base64.b64encode(_png()).decode(),
                                             "text/plain": "<Figure size 12x8>"}}]}]}


def _build(nbs: Path, out: Path, work: Path):
    r = subprocess.run([sys.executable, str(BUILD), "--nbs", str(nbs), "--out", str(out), "--work", str(work)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert r.returncode == 0, f"build_docs.py failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r


def build_site(tmp: Path) -> tuple[list[Path], Path]:
    """A copy of nbs/ plus the check notebook, built into `tmp`/site: (the copied notebooks but the check one, the
    site). Built once a session (tests/conftest.py's `docs_site`), for this file and tests/test_site_browser.py."""
    nbs = tmp / "nbs"
    shutil.copytree(ROOT / "nbs", nbs, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "_proc"))
    notebooks = sorted(p for p in nbs.glob("*.ipynb") if not p.name.startswith(("_", ".")))
    assert notebooks, "no notebooks in nbs/"
    built = {_page_name(p) for p in notebooks}
    symbols = [s for s in _symbols() if s[1] in built]
    assert symbols, "nbdev's index (minisgl/_modidx.py) has no public symbol of any notebook"
    (nbs / "zz_docs_check.ipynb").write_text(json.dumps(_check_notebook(symbols)))
    _build(nbs, tmp / "site", tmp / "work")
    return notebooks, tmp / "site"


def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_site_from_the_notebooks(docs_site):
    notebooks, out = docs_site
    assert (out / ".nojekyll").exists() and (out / "index.html").exists()
    assert not (out / ".doctrees").exists() and not (out / ".buildinfo").exists()
    # every notebook is a page, under nbdev's name for it (04_kernels.ipynb -> kernels.html),
    # listed in the navigation in file order, index first
    index = (out / "index.html").read_text()
    nav = re.findall(r'class="reference internal" href="([\w.-]+)\.html"', index.split('class="sidebar-tree"')[1])
    for nb in notebooks:
        page = out / f"{_page_name(nb)}.html"
        assert page.exists(), f"{nb.name} did not become {page.name}"
        cells = json.loads(nb.read_text())["cells"]
        title = next((re.match(r"#\s+(.+)", "".join(c["source"]).strip()).group(1).strip() for c in cells
                      if c["cell_type"] == "markdown" and re.match(r"#\s", "".join(c["source"]).strip())), None)
        if title:
            title = html.escape(re.sub(r"[`*]", "", title), quote=False)
            assert f"<title>{title}" in page.read_text(), f"{page.name} lacks its title {title!r}"
        if nb.stem != "index": assert _page_name(nb) in nav, f"{page.name} is not in the navigation"
    chapters = [_page_name(nb) for nb in notebooks if nb.stem != "index"] + ["zz_docs_check"]
    assert [n for n in nav if n in chapters] == chapters, nav
    # the sidebar: Home first, then "01 · The KV cache: ..." (the number from the file name)
    labels = re.findall(r'<li class="toctree-l1[^"]*"><a class="[^"]*reference internal" href="([^"]*)">([^<]*)</a>',
                        index.split('class="sidebar-tree"')[1])
    assert labels and labels[0] == ("#", "Home"), labels[:2]
    for nb in notebooks:
        num = re.match(r"^(\d+[a-z]?)_", nb.name)
        if num:
            label = next((t for h, t in labels if h == f"{_page_name(nb)}.html"), None)
            assert label and label.startswith(f"{num[1]} · "), f"{nb.name}: sidebar entry {label!r}"

    check = (out / "zz_docs_check.html").read_text()
    # backticked names -> links to their show_doc heading on the chapter's page
    links = re.findall(r'<a class="reference internal" href="([\w-]+)\.html#([\w-]+)">(?:<span[^>]*>)?'
                       r'<code[^>]*><span class="pre">([\w.]+)</span>', check)
    assert links, "no backticked name became a link"
    for page, anchor, name in links:
        assert f'id="{anchor}"' in (out / f"{page}.html").read_text(), f"{name}: {page}.html#{anchor} is missing"
    # stored outputs: printed text and the figure (written out as an image file)
    assert MARK in check
    # math is shown as TeX, and no page loads anything from a CDN (MathJax, require.js, fonts)
    assert '<span class="math notranslate">x_i^2</span>' in check, "inline math is not on the page"
    for page in out.glob("*.html"):
        ext = re.findall(r'<(?:script|link|img)\b[^>]*\b(?:src|href)="((?:https?:)?//[^"]+)"', page.read_text())
        assert not ext, f"{page.name} loads {ext}"
    imgs = re.findall(r'<img[^>]+src="([^"]+)"', check)
    assert imgs and all((out / src).exists() for src in imgs), imgs
    # outputs stored in the real notebooks are on their pages too
    for nb in notebooks:
        n_img = sum(1 for c in json.loads(nb.read_text())["cells"] for o in c.get("outputs", [])
                    if "image/png" in o.get("data", {}))
        if n_img: assert "<img" in (out / f"{_page_name(nb)}.html").read_text(), f"{nb.name}: figure missing"


def test_rebuild_is_identical_and_guarded(tmp_path):
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    (nbs / "zz_docs_check.ipynb").write_text(json.dumps(_check_notebook([])))
    out = tmp_path / "site"
    _build(nbs, out, tmp_path / "work")
    first = _tree(out)
    (out / "stale.html").write_text("left over from an older build")
    _build(nbs, out, tmp_path / "work")
    assert _tree(out) == first  # same bytes, stale files gone
    # a folder that is not a previous build is never emptied
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    r = subprocess.run([sys.executable, str(BUILD), "--nbs", str(nbs), "--out", str(other),
                        "--work", str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and (other / "keep.txt").read_text() == "mine"
