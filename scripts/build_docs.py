#!/usr/bin/env python
"""Build the documentation site (static HTML) from the notebooks, without Quarto.

`nbdev_docs` renders with Quarto, which is not available everywhere, so this script keeps nbdev's
part of the job and hands the rendering to Sphinx + myst-nb + the furo theme:

1. every notebook in `nbs/` goes through nbdev's own doc processors (`FilterDefaults`, what
   `nbdev_proc_nbs` runs): directives are cleaned, `#| hide` cells dropped, `show_doc` cells added
   and executed, backticked names such as `PrefillAdder` turned into links via `NbdevLookup`;
2. the few Quarto-only conventions left in the result are translated for myst-nb (the front matter
   becomes the page title, `#| echo: false` / `#| output: asis` become hidden input / markdown,
   links into the site become links between pages), and a Sphinx project is written with the
   index notebook as the home page and the chapters in file-name order;
3. `sphinx-build` renders it (myst-nb execution is off: the outputs are the ones stored in the
   notebooks) and the HTML replaces the contents of the output folder (`docs/` by default).

Usage: `.venv/bin/python scripts/build_docs.py [--out docs] [--work _proc/sphinx] [--nbs nbs]`.
Run from anywhere; it works offline and rebuilds from scratch each time (same input, same output).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
ASSET_EXTS = {".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp", ".pdf", ".csv", ".txt"}

CSS = """
/* nbdev's show_doc blocks: a signature box under each API heading */
div.sig-block div.highlight, div.sig-block pre {
  border-left: 3px solid var(--color-brand-primary);
  background: var(--color-background-secondary);
}
div.sig-block pre { white-space: pre-wrap; }
p.showdoc-source { text-align: right; font-size: 0.8em; margin: -2.6em 0 0.6em 0; }
/* the one-line summary under a chapter's title */
p.lead { font-size: 1.15em; color: var(--color-foreground-secondary); margin-top: -0.5em; }
/* notebook cells: keep code and output visually attached, outputs a little quieter */
div.cell div.cell_output { margin-top: -0.4em; }
div.cell_output div.output pre { border-left: 3px solid var(--color-background-border); }
div.cell_output img { max-width: 100%; height: auto; }
table.docutils td, table.docutils th { vertical-align: top; }
/* a wide code cell, output or table scrolls sideways inside itself; the page keeps its width */
div.cell div.highlight pre, div.cell_output pre, div.cell_output div.output { overflow-x: auto; }
div.cell, div.cell_output, div.cell_input { max-width: 100%; min-width: 0; }
div.cell_output div.text_html, div.cell_output div.text_markdown table { display: block; overflow-x: auto; }
/* math is shown as its TeX source (MathJax would come from a CDN) */
span.math, div.math { font-family: var(--font-stack--monospace); font-size: 0.9em; }
div.math { overflow-x: auto; white-space: pre; margin: 0.8em 0; }
"""


def _slugify(text: str) -> str:
    try: from myst_parser.slugs import github_slugify
    except ImportError: from myst_parser.mdit_to_docutils.base import default_slugify as github_slugify
    return github_slugify(text)


def _src(cell) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def _text(data) -> str:
    return "".join(data) if isinstance(data, list) else str(data)


_re_directive = re.compile(r"^\s*#\s*\|\s*([\w-]+)\s*:?\s*(.*?)\s*$")


def _split_directives(source: str):
    "Quarto/nbdev `#| key: value` lines at the top of a code cell -> (dict, remaining source)."
    lines, dirs = source.splitlines(), {}
    i = 0
    while i < len(lines) and (not lines[i].strip() or _re_directive.match(lines[i])):
        m = _re_directive.match(lines[i])
        if m: dirs[m.group(1).lower()] = m.group(2).strip().strip('"\'').lower()
        i += 1
    return dirs, "\n".join(lines[i:]).strip("\n")


def _false(v): return v in ("false", "no", "0")


def _showdoc_md(md: str) -> str:
    "nbdev's show_doc markdown, made to read well in Sphinx: no leading rule, a styled signature."
    md = re.sub(r"\A\s*---\s*\n", "", md)
    md = re.sub(r"(<[\w.]+ object) at 0x[0-9a-fA-F]+>", r"\1>", md)  # default values' reprs: same every build
    # `[source](url){target=... style=...}` (pandoc attributes) above the heading -> a small link
    # under the heading, at the right
    md = re.sub(r"^\[source\]\((\S+?)\)\{[^}\n]*\}\s*\n+(#{1,6} [^\n]*)\n",
                r"\2\n\n{.showdoc-source}\n[source](\1)\n", md, flags=re.M)
    md = re.sub(r"^\[source\]\((\S+?)\)\{[^}\n]*\}", r"{.showdoc-source}\n[source](\1)", md, flags=re.M)
    return re.sub(r"^```python\n", "```{code-block} python\n:class: sig-block\n\n", md, count=1, flags=re.M)


def _quarto_md(md: str) -> str:
    "Translate Quarto callouts (`::: {.callout-note}`) into MyST admonitions."
    return re.sub(r"^(:::+)\s*\{\.callout-(note|tip|warning|important|caution)[^}]*\}", r"\1{\2}", md,
                  flags=re.M)


def _headings(md: str):
    fence = False
    for line in md.splitlines():
        if line.lstrip().startswith(("```", "~~~")): fence = not fence
        elif not fence:
            m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
            if m: yield len(m.group(1)), m.group(2)


def use_repo_modidx(cfg):
    """Make nbdev's `NbdevLookup` (backticks -> links) read this checkout's `_modidx.py`.

    nbdev finds symbol indexes through installed packages' `nbdev` entry points; the docs should
    link this repository's symbols whether or not (and wherever) minisgl is installed."""
    import types
    import nbdev.doclinks as dl
    idx = ROOT / cfg.lib_path.name / "_modidx.py"
    if not idx.exists(): return
    ns = {}
    exec(compile(idx.read_text(), str(idx), "exec"), ns)
    ours = types.SimpleNamespace(name=cfg.lib_name, dist=types.SimpleNamespace(name=cfg.lib_name),
                                 load=lambda: ns["d"])
    real = dl.entry_points

    def entry_points(group=None, **kw):
        eps = [e for e in real(group=group, **kw) if e.name != cfg.lib_name] if group else real(**kw)
        return [*eps, ours] if group == "nbdev" else eps
    dl.entry_points = entry_points
    dl._build_lookup_table.cache_clear()


CELL_TIMEOUT = 120  # seconds; a cell nbdev runs for the API docs should not take long


def _imports_only(cell):
    """nbdev runs every cell that imports something while it renders API docs, even one that also
    starts a server or uses a name from a demo cell (it warns: "Found cells containing imports and
    other code"). Here such a cell contributes only its top-level imports; None means: run as nbdev does."""
    import ast
    if cell.cell_type != "code" or set(cell.directives_) & {"export", "exports", "exporti", "exec_doc"}: return None
    try: trees = cell.parsed_()
    except Exception: return None
    imp = (ast.Import, ast.ImportFrom)
    if not trees or all(isinstance(t, imp) for t in trees): return None
    if any(isinstance(t, ast.Expr) and getattr(getattr(t.value, "func", None), "id", None) == "show_doc" for t in trees):
        return None
    if not any(isinstance(n, imp) for t in trees for n in ast.walk(t)): return None
    return "\n".join(ast.unparse(t) for t in trees if isinstance(t, imp))


def process_notebook(path: Path):
    "Run nbdev's doc processors on one notebook; return (page name, title, cells, warnings)."
    from execnb.nbio import read_nb
    from nbdev.doclinks import _nbpath2html
    from nbdev.processors import FilterDefaults, NBProcessor, exec_show_docs

    warnings = []

    class exec_show_docs_tolerant(exec_show_docs):
        "nbdev's `exec_show_docs`, but one failing cell costs only that cell, not the page's API docs."
        def begin(self):
            super().begin()
            if getattr(self, "k", None) is not None: self.k.timeout = CELL_TIMEOUT

        def __call__(self, cell):
            try:
                imports = _imports_only(cell)
                if imports is None: super().__call__(cell)
                elif hasattr(self, "k") and self.nb.has_docs_:
                    self.k.run(imports)
                    if self.k.exc: raise Exception("import failed") from self.k.exc
            except Exception as e:
                if getattr(self, "k", None) is not None: self.k.exc = None
                why = e.__cause__ or e
                first = next((l for l in cell.source.splitlines() if l.strip() and not l.startswith("#|")), "")
                warnings.append(f"{path.name}: a cell nbdev runs for the API docs failed "
                                f"({type(why).__name__}: {why}); cell starts {first[:70]!r}")

    procs = [exec_show_docs_tolerant if p is exec_show_docs else p for p in FilterDefaults().procs()]
    os.environ["IN_TEST"] = "1"  # as nbdev's serve_drv does while processing docs
    try:
        nb = read_nb(path)
        NBProcessor(nb=nb, procs=procs).process()
    except Exception as e:  # e.g. a show_doc cell that cannot run here: render the rest anyway
        why = e.__cause__ or e
        warnings.append(f"{path.name}: show_doc cells not executed, the page has no API docs "
                        f"({str(e).splitlines()[0] if str(e) else ''} {type(why).__name__}: {why})")
        nb = read_nb(path)
        NBProcessor(nb=nb, procs=[p for p in procs if p is not exec_show_docs_tolerant]).process()
    finally:
        os.environ.pop("IN_TEST", None)

    page = _nbpath2html(Path(path.name)).stem
    title, desc, cells = None, None, []
    for cell in nb.cells:
        src, ctype = _src(cell), cell.cell_type
        if ctype == "raw" and src.strip().startswith("---") and title is None:
            fm = yaml.safe_load(src.strip().strip("-").strip()) or {}
            title, desc = fm.get("title"), fm.get("description")
            if fm.get("output-file"): page = Path(fm["output-file"]).stem
            continue
        if ctype == "raw": continue
        if ctype == "markdown":
            s = src.strip()
            if s.startswith("<!-- WARNING: THIS FILE WAS AUTOGENERATED"): continue
            if re.match(r"\A---\s*\njupyter:", s): continue  # a stray jupytext header
            cells.append({"cell_type": "markdown", "metadata": {}, "source": _quarto_md(src)})
            continue
        dirs, code = _split_directives(src)
        outputs = list(cell.get("outputs", []))
        if _false(dirs.get("include", "")): continue
        if dirs.get("output") == "asis":  # show_doc and friends: their markdown is the content
            mds = [_text(o["data"]["text/markdown"]) if "data" in o and "text/markdown" in o["data"] else
                   _text(o["text"]) for o in outputs
                   if ("data" in o and "text/markdown" in o["data"]) or o.get("name") == "stdout"]
            if mds: cells.append({"cell_type": "markdown", "metadata": {"showdoc": True},
                                  "source": _showdoc_md("\n\n".join(mds))})
            continue
        tags = []
        if _false(dirs.get("echo", "")) or not code.strip():
            if not outputs: continue
            tags.append("remove-input")
        if _false(dirs.get("output", "")):
            if "remove-input" in tags: continue
            tags.append("remove-output")
        for o in outputs:  # links inside markdown outputs get the same treatment as cells
            if "data" in o and "text/markdown" in o["data"]: o["data"]["text/markdown"] = _text(o["data"]["text/markdown"])
        cells.append({"cell_type": "code", "metadata": {"tags": tags} if tags else {}, "source": code,
                      "outputs": outputs, "execution_count": cell.get("execution_count")})
    if title is None:
        first = next((h for c in cells if c["cell_type"] == "markdown" for lvl, h in _headings(c["source"]) if lvl == 1), None)
        if first is None: title = page
    head = (f"# {title}\n\n" if title else "") + (f"```{{rst-class}} lead\n```\n{desc}\n" if desc else "")
    if head: cells.insert(0, {"cell_type": "markdown", "metadata": {}, "source": head})
    return page, title, cells, warnings


def run_notebook(src: Path, dst: Path, skip_flags: list[str]):
    """Execute a notebook as `nbdev_test` does (cells flagged with `skip_flags` are skipped) and
    save it, outputs included, to `dst`; errors become error outputs instead of stopping it."""
    from execnb.nbio import write_nb
    from execnb.shell import CaptureShell
    from fastcore.xtras import working_directory
    from nbdev.process import NBProcessor
    os.environ["IN_TEST"] = "1"
    nb = NBProcessor(src, procs=[], rm_directives=False).nb

    def no_eval(cell):
        if cell.cell_type != "code" or "nbdev_export" + "(" in cell.source: return True
        d = getattr(cell, "directives_", {}) or {}
        return d.get("eval:", [""])[0].lower() == "false" or bool(set(skip_flags) & d.keys())
    with working_directory(src.parent):
        CaptureShell(src).run_all(nb, exc_stop=False, preproc=no_eval)
    dst.parent.mkdir(parents=True, exist_ok=True)
    write_nb(nb, dst)


def execute_all(paths, nbs: Path, dest: Path, timeout: int):
    "Run each notebook in its own process (one at a time); return the executed copies."
    from nbdev.config import get_config
    flags = get_config().get("tst_flags", "").split()
    try:
        import torch
        if torch.cuda.is_available(): flags = [f for f in flags if f != "gpu"]
    except ImportError: pass
    out = []
    for p in paths:
        d = dest / p.relative_to(nbs)
        print(f"[docs] executing {p.relative_to(nbs)}", flush=True)
        try:
            r = subprocess.run([sys.executable, __file__, "--run-notebook", str(p), str(d), *flags],
                               timeout=timeout, cwd=ROOT)
            ok = r.returncode == 0 and d.exists()
        except subprocess.TimeoutExpired: ok = False
        if not ok: print(f"[docs] WARNING {p.name}: could not be executed, its stored outputs are used", file=sys.stderr)
        out.append(d if ok else p)
    return out


def page_anchors(cells) -> dict[str, str]:
    """Heading slug (as GitHub/MyST computes it from the heading's text) -> the unique anchor MyST
    gives that heading on the page; an API (show_doc) heading wins over a section of the same name."""
    seen, res = [], {}
    for c in cells:
        if c["cell_type"] != "markdown": continue
        for _, text in _headings(c["source"]):
            text = re.sub(r"\[((?:`[^`]*`|[^\]])*)\]\([^)]*\)", r"\1", text)  # links -> their text
            base = _slugify(text)
            uniq, i = base, 1
            while uniq in seen: uniq, i = f"{base}-{i}", i + 1
            seen.append(uniq)
            if base not in res or c["metadata"].get("showdoc"): res[base] = uniq
    return res


_re_link = re.compile(r"(?<!!)\[((?:`[^`]*`|[^\]\n])*)\]\(([^)\s]+)\)")


def fix_links(md: str, prefix: str, slugs: dict[str, dict[str, str]], src: Path | None = None) -> str:
    """Links into this site (nbdev writes them as doc_host URLs) -> MyST links between pages;
    relative links that lead nowhere here (e.g. in an inherited docstring) -> plain text."""
    def sub(m):
        text, url = m.group(1), m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", url, re.I) and not url.startswith(prefix): return m.group(0)
        if not url.startswith(prefix):
            if url.startswith("#"): return m.group(0)
            target, _, anchor = url.partition("#")
            if target.endswith((".ipynb", ".html")):  # another chapter, by notebook or page name
                from nbdev.doclinks import _nbpath2html
                pg = _nbpath2html(Path(target)).stem
                if pg not in slugs: return text
                slug = slugs[pg].get(_slugify(anchor)) if anchor else None
                if anchor and not slug: return text
                return f"[{text}]({pg}.ipynb" + (f"#{slug}" if slug else "") + ")"
            return m.group(0) if src is None or (src / target).exists() else text
        rel = url[len(prefix):]
        pg, _, anchor = rel.partition("#")
        pg = Path(pg).stem if pg else "index"
        if pg not in slugs: return text  # that chapter is not (yet) part of the site
        if not anchor: return f"[{text}]({pg}.ipynb)"
        slug = slugs[pg].get(_slugify(anchor))
        return f"[{text}]({pg}.ipynb#{slug})" if slug else text
    lines, fence = md.splitlines(keepends=True), False
    for i, line in enumerate(lines):  # leave code blocks alone
        if line.lstrip().startswith(("```", "~~~")): fence = not fence
        elif not fence: lines[i] = _re_link.sub(sub, line)
    return "".join(lines)


CONF = """\
# Generated by scripts/build_docs.py -- edit that script, not this file.
project = {project!r}
author = {author!r}
copyright = {copyright!r}
extensions = ["myst_nb"]
root_doc = "index"
exclude_patterns = ["**.ipynb_checkpoints"]
nb_execution_mode = "off"            # render the outputs stored in the notebooks
nb_render_markdown_format = "myst"   # markdown outputs (e.g. show_doc) may hold MyST links
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist", "strikethrough", "attrs_block"]
myst_heading_anchors = 4             # `page.ipynb#slug` links to API headings
suppress_warnings = ["myst.header", "myst.strikethrough", "mystnb.unknown_mime_type"]
html_theme = "furo"
html_title = {project!r}
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_copy_source = False
html_show_sourcelink = False
html_last_updated_fmt = None
html_theme_options = {{"top_of_page_buttons": []}}
# Nothing from a CDN: no ipywidgets/require.js bundle, and math as TeX text instead of MathJax.
nb_ipywidgets_js = {{}}
html_math_renderer = "tex"


def _math(tag):
    from docutils import nodes

    def visit(self, node):
        self.body.append(self.starttag(node, tag, "", CLASS="math notranslate") + self.encode(node.astext()) + f"</{{tag}}>")
        raise nodes.SkipNode
    return visit, None


def setup(app):
    app.add_html_math_renderer("tex", _math("span"), _math("div"))
"""


def chapter_number(nb: Path) -> str | None:
    "The number a chapter's file name starts with: 01_kvcache.ipynb -> '01', 04b_triton.ipynb -> '04b'."
    m = re.match(r"^(\d+[a-z]?)_", nb.name)
    return m.group(1) if m else None


def page_title(title, cells) -> str:
    "A page's title as plain text: its front matter title, else its first level-1 heading."
    if title is None:
        title = next((h for c in cells if c["cell_type"] == "markdown" for lvl, h in _headings(c["source"]) if lvl == 1), "")
    title = re.sub(r"\[((?:`[^`]*`|[^\]])*)\]\([^)]*\)", r"\1", str(title))  # links -> their text
    return re.sub(r"[`*]", "", title).strip()


def _toc_label(page, number) -> str:
    "A chapter's entry in the sidebar: '04b · Attention in Triton'."
    label = page_title(page[1], page[2]) or page[0]
    label = re.sub(r"\s+", " ", label)
    return f"{number} · {label}" if number else label


def write_project(src: Path, pages: list, cfg, nbs: Path, numbers: dict[str, str] | None = None):
    numbers = numbers or {}
    prefix = f"{cfg.doc_host.rstrip('/')}{('/' + cfg.doc_baseurl.strip('/')) if cfg.doc_baseurl.strip('/') else ''}/"
    slugs = {page: page_anchors(cells) for page, _, cells, _ in pages}
    names = [p[0] for p in pages]
    if "index" not in names:  # no index notebook: a plain home page
        pages.insert(0, ("index", cfg.title, [{"cell_type": "markdown", "metadata": {},
                                                 "source": f"# {cfg.title}\n\n{cfg.description}\n"}], []))
        slugs["index"] = page_anchors(pages[0][2])
    # the sidebar: the home page, then each chapter as "01 · The KV cache: ..." (the number from
    # its notebook's file name); a page's own <title> and heading keep the plain title
    entries = ["Home <self>"]
    entries += [f"{_toc_label(p, numbers.get(p[0]))} <{p[0]}>" for p in pages if p[0] != "index"]
    toc = "```{toctree}\n:hidden:\n:maxdepth: 2\n:caption: Contents\n\n" + "\n".join(entries) + "\n```\n"
    meta = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python", "pygments_lexer": "ipython3"}}
    for f in sorted(nbs.rglob("*")):  # images and other files the notebooks refer to
        rel = f.relative_to(nbs)
        if f.is_file() and f.suffix.lower() in ASSET_EXTS and not any(p.startswith(("_", ".")) for p in rel.parts):
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, src / rel)
    for page, title, cells, _ in pages:
        cells = [dict(c) for c in cells]
        if page == "index": cells.append({"cell_type": "markdown", "metadata": {}, "source": toc})
        for i, c in enumerate(cells):
            c["id"] = f"c{i}"
            if c["cell_type"] == "markdown": c["source"] = fix_links(c["source"], prefix, slugs, src)
            else:
                for o in c["outputs"]:
                    if "data" in o and "text/markdown" in o["data"]:
                        o["data"]["text/markdown"] = fix_links(o["data"]["text/markdown"], prefix, slugs, src)
        nb = {"cells": cells, "metadata": meta, "nbformat": 4, "nbformat_minor": 5}
        (src / f"{page}.ipynb").write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    (src / "_static").mkdir(exist_ok=True)
    (src / "_static" / "custom.css").write_text(CSS.lstrip())
    (src / "conf.py").write_text(CONF.format(project=cfg.title, author=cfg.author, copyright=cfg.copyright))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nbs", help="notebook folder (default: nbs_path from settings.ini)")
    ap.add_argument("--out", default="docs", help="where the HTML goes (its contents are replaced)")
    ap.add_argument("--work", default="_proc/sphinx", help="scratch folder for the processed notebooks")
    ap.add_argument("--strict", action="store_true", help="fail on any processing or Sphinx warning")
    ap.add_argument("--execute", action="store_true",
                    help="run the notebooks first (as nbdev_test does; nbs/ is not modified) and render "
                         "those outputs instead of the stored ones")
    ap.add_argument("--execute-timeout", type=int, default=900, help="seconds per notebook with --execute")
    ap.add_argument("--run-notebook", nargs="+", help=argparse.SUPPRESS)  # internal: SRC DST [FLAG...]
    args = ap.parse_args(argv)
    if args.run_notebook:
        os.chdir(ROOT)
        sys.path.insert(0, str(ROOT))
        return run_notebook(Path(args.run_notebook[0]), Path(args.run_notebook[1]), args.run_notebook[2:])
    os.chdir(ROOT)  # nbdev finds settings.ini from the working directory
    from nbdev.config import get_config
    from nbdev.doclinks import nbglob
    cfg = get_config()
    if str(ROOT) not in sys.path: sys.path.insert(0, str(ROOT))  # show_doc cells import the package
    use_repo_modidx(cfg)
    nbs = Path(args.nbs).resolve() if args.nbs else Path(cfg.nbs_path)
    out, work = Path(args.out).resolve(), Path(args.work).resolve()
    if out.exists() and any(out.iterdir()) and not (out / ".nojekyll").exists():
        sys.exit(f"refusing to replace {out}: it is not empty and holds no previous build (.nojekyll)")

    paths = sorted(nbglob(nbs, as_path=True), key=lambda p: (p.stem != "index", str(p.relative_to(nbs))))
    if not paths: sys.exit(f"no notebooks in {nbs}")
    sources = execute_all(paths, nbs, work.with_name(work.name + "-executed"), args.execute_timeout) \
        if args.execute else paths
    pages, warnings, numbers = [], [], {}
    for p, s in zip(paths, sources):
        print(f"[docs] processing {p.relative_to(nbs)}", flush=True)
        try: res = process_notebook(s)
        except Exception:
            traceback.print_exc()
            sys.exit(f"[docs] could not process {p}")
        pages.append(res); warnings += res[3]
        if chapter_number(p): numbers[res[0]] = chapter_number(p)
    dup = {p[0] for p in pages if [q[0] for q in pages].count(p[0]) > 1}
    if dup: sys.exit(f"two notebooks would make the same page: {sorted(dup)}")

    if work.exists(): shutil.rmtree(work)
    src, html = work / "src", work / "html"
    src.mkdir(parents=True)
    write_project(src, pages, cfg, nbs, numbers)
    print(f"[docs] rendering {len(pages)} pages with Sphinx", flush=True)
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-E", "-q", "-j", "1", "-d", str(work / "doctrees"),
           str(src), str(html)]
    if args.strict: cmd.insert(3, "-W")
    r = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(r.stderr)
    if r.returncode: sys.exit(f"[docs] sphinx-build failed ({r.returncode})")
    sphinx_warnings = [l for l in r.stderr.splitlines() if "WARNING" in l or "ERROR" in l]

    for junk in (".buildinfo", ".buildinfo.bak", ".doctrees", "_sources"):
        j = html / junk
        if j.is_dir(): shutil.rmtree(j)
        elif j.exists(): j.unlink()
    (html / ".nojekyll").touch()
    out.mkdir(parents=True, exist_ok=True)
    for o in out.iterdir():  # replace the previous build
        shutil.rmtree(o) if o.is_dir() and not o.is_symlink() else o.unlink()
    for o in html.iterdir(): shutil.move(str(o), out / o.name)
    for w in warnings: print(f"[docs] WARNING {w}", file=sys.stderr)
    print(f"[docs] {len(pages)} pages -> {out}/index.html ({len(warnings)} processing warnings, "
          f"{len(sphinx_warnings)} Sphinx warnings)")
    if args.strict and warnings: sys.exit(1)


if __name__ == "__main__":
    main()
