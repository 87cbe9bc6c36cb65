"""The documentation site as a reader sees it: built from nbs/ into a temporary folder (once a session, with
tests/test_docs.py's check notebook: `docs_site` in tests/conftest.py), served on a
loopback port, opened in headless Chromium (Debian's, installed by scripts/setup_browser.sh; driven
by Playwright, whose own browser download is never used).

Every page is visited once and what the browser saw is checked: titles and headings, images that
loaded, the search page, internal links and anchors, no path of the build machine, no request
off the machine, no page wider than the window. Without Chromium the tests skip, or fail under CI."""
import functools
import http.server
import json
import os
import re
import shutil
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WIDTH, HEIGHT = 1280, 800
# Where the site was built must not show on it: anywhere on a page, an absolute path under these
# folders, into a virtual environment or installed packages, or the repository's own path...
MACHINE_PATHS = [r"(?<![\w.~-])/(?:root|work|home)/", r"/\.venv\b", r"site-packages", re.escape(str(ROOT))]
# ...and in what a cell printed also a temporary folder (source code may name a demo path in /tmp)
OUTPUT_PATHS = [r"(?<![\w.~-])/tmp/", r"\.venv/"]


def _chromium() -> str | None:
    for c in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
              shutil.which("chromium-browser")):
        if c and os.access(c, os.X_OK): return c
    return None


def _no_browser(why: str):
    why += " (scripts/setup_browser.sh installs Debian's chromium)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"): pytest.fail(why)
    pytest.skip(why)


def _page_name(nb: Path) -> str:
    return re.sub(r"^\d+[a-zA-Z0-9]*_", "", nb.stem.lower())


def _norm(text: str) -> str:
    "Heading text without markup, link targets, spaces or pilcrows: lower-case letters and digits."
    text = re.sub(r"\[((?:`[^`]*`|[^\]])*)\]\([^)]*\)", r"\1", text)
    return "".join(re.findall(r"[a-z0-9]+", text.lower()))


def _shown_cells(nb: Path):
    "The notebook's cells that the site shows (not `#| hide`, `#| include: false`)."
    for c in json.loads(nb.read_text())["cells"]:
        src = "".join(c["source"])
        if c["cell_type"] == "code" and re.search(r"^#\s*\|\s*(hide\b|include:\s*false)", src, re.M): continue
        yield c, src


def _expected(nb: Path):
    "(title, headings under it, number of images) a notebook's page must show."
    headings, n_img, fence = [], 0, False
    for c, src in _shown_cells(nb):
        if c["cell_type"] == "markdown":
            for line in src.splitlines():
                if line.lstrip().startswith(("```", "~~~")): fence = not fence
                elif not fence and (m := re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)): headings.append((len(m[1]), m[2]))
        elif not re.search(r"^#\s*\|\s*output:\s*false", src, re.M):
            n_img += sum(1 for o in c.get("outputs", []) for k in o.get("data", {}) if k.startswith("image/"))
    title = next((h for lvl, h in headings if lvl == 1), None)
    return title, [h for lvl, h in headings if lvl > 1], n_img


@pytest.fixture(scope="module")
def notebooks(docs_site):
    "The notebooks the site was built from (a copy of nbs/ and tests/test_docs.py's check notebook)."
    return sorted(p for p in docs_site[0][0].parent.glob("*.ipynb") if not p.name.startswith(("_", ".")))


@pytest.fixture(scope="module")
def site(docs_site):
    "The site, built once a session (tests/conftest.py, never into docs/) and served on a free loopback port."
    out = docs_site[1]

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args): pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(out)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield out, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    "Headless Chromium with a fresh profile, at a 1280x800 viewport."
    exe = _chromium()
    if exe is None: _no_browser("no Chromium on this machine")
    try: from playwright.sync_api import sync_playwright
    except ImportError: _no_browser("the playwright package is not installed in .venv")
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=exe, headless=True, args=FLAGS,
            viewport={"width": WIDTH, "height": HEIGHT})
        yield ctx
        ctx.close()


COLLECT = r"""async () => {
  const imgs = Array.from(document.images);
  imgs.forEach(i => { i.loading = 'eager'; });
  await Promise.all(imgs.map(i => i.complete ? null : new Promise(r => { i.onload = i.onerror = r; })));
  const el = document.documentElement;
  return {
    title: document.title,
    h1: Array.from(document.querySelectorAll('article h1')).map(h => h.innerText),
    headings: Array.from(document.querySelectorAll('article h2, article h3, article h4, article h5, article h6')).map(h => h.innerText),
    images: imgs.map(i => ({src: i.getAttribute('src'), width: i.naturalWidth})),
    links: Array.from(document.querySelectorAll('a[href], link[href]')).map(a => a.href),
    ids: Array.from(document.querySelectorAll('[id], a[name]')).map(e => e.id || e.getAttribute('name')),
    sidebar: Array.from(document.querySelectorAll('.sidebar-tree a')).map(a => [a.getAttribute('href'), a.innerText]),
    text: document.body.innerText,
    outputs: Array.from(document.querySelectorAll('.cell_output')).map(e => e.innerText).join('\n'),
    scrollWidth: el.scrollWidth, clientWidth: el.clientWidth,
  };
}"""


@pytest.fixture(scope="module")
def seen(site, browser):
    "Every HTML page of the site as the browser saw it, and every URL the browser requested."
    out, base = site
    page = browser.new_page()
    requests = []
    page.on("request", lambda r: requests.append((page.url, r.url)))
    pages = {}
    for f in sorted(out.glob("*.html")):
        page.goto(base + f.name, wait_until="load")
        pages[f.name] = {**page.evaluate(COLLECT), "html": page.content()}
    yield pages, requests, page
    page.close()


def test_every_page_has_its_title_and_headings(seen, notebooks):
    pages = seen[0]
    for nb in notebooks:
        name = f"{_page_name(nb)}.html"
        assert name in pages, f"{nb.name} did not become {name}"
        p, (title, headings, _) = pages[name], _expected(nb)
        assert len(p["h1"]) == 1, f"{name}: {len(p['h1'])} h1 headings"
        if title:
            assert _norm(p["h1"][0]) == _norm(title), f"{name}: h1 {p['h1'][0]!r}, notebook title {title!r}"
            assert _norm(p["title"]).startswith(_norm(title)), f"{name}: <title> {p['title']!r}"
        shown = {_norm(h) for h in p["headings"]}
        missing = [h for h in headings if _norm(h) not in shown]
        assert not missing, f"{name}: headings not on the page: {missing}"


def test_sidebar_lists_home_then_numbered_chapters(seen, notebooks):
    pages = seen[0]
    chapters = [nb for nb in notebooks if nb.stem != "index"]
    for name in ("index.html", f"{_page_name(chapters[0])}.html"):
        entries = pages[name]["sidebar"]
        assert entries and entries[0][1].strip() == "Home", f"{name}: the sidebar does not start at Home: {entries[:2]}"
        listed = [(Path(h.split("#")[0] or name).stem, t.strip()) for h, t in entries[1:]]
        want = []
        for nb in chapters:
            num, title = re.match(r"^(\d+[a-z]?)_", nb.name), _expected(nb)[0]
            label = re.sub(r"[`*]", "", title or _page_name(nb)).strip()
            want.append((_page_name(nb), f"{num[1]} · {label}" if num else label))
        assert listed == want, f"{name}: sidebar {listed}"


def test_images_load_and_stored_figures_are_shown(seen, notebooks):
    pages = seen[0]
    broken = [(n, i["src"]) for n, p in pages.items() for i in p["images"] if not i["width"]]
    assert not broken, f"images that did not load: {broken}"
    for nb in notebooks:
        name, want = f"{_page_name(nb)}.html", _expected(nb)[2]
        assert len(pages[name]["images"]) >= want, f"{name}: {len(pages[name]['images'])} images, the notebook stores {want}"


def test_search_finds_prefilladder(site, seen):
    page = seen[2]
    page.goto(site[1] + "search.html?q=PrefillAdder", wait_until="load")
    page.wait_for_selector("#search-results ul.search li a", timeout=20_000)
    hrefs = page.eval_on_selector_all("#search-results ul.search li a", "as => as.map(a => a.getAttribute('href'))")
    assert any(Path(urlsplit(h).path).name == "scheduler.html" for h in hrefs), hrefs


def test_internal_links_and_anchors_resolve(site, seen):
    out, base = site
    pages = seen[0]
    bad, anchors = [], 0
    for name, p in pages.items():
        for url in p["links"]:
            if not url.startswith(base): continue
            anchors += "#" in url
            parts = urlsplit(url)
            rel = unquote(parts.path)[len(urlsplit(base).path):] or "index.html"
            if rel.endswith("/"): rel += "index.html"
            if not (out / rel).is_file(): bad.append(f"{name} -> {url} (no file {rel})")
            elif parts.fragment and rel.endswith(".html"):
                ids = pages[rel]["ids"] if rel in pages else []
                if unquote(parts.fragment) not in ids: bad.append(f"{name} -> {url} (no id {parts.fragment!r} on {rel})")
    assert anchors, "no page links to an anchor: the check saw no links"
    assert not bad, f"{len(bad)} broken internal links:\n" + "\n".join(sorted(set(bad))[:40])


def test_no_path_of_the_build_machine(seen):
    anywhere, in_outputs = re.compile("|".join(MACHINE_PATHS)), re.compile("|".join(MACHINE_PATHS + OUTPUT_PATHS))
    found = []
    for name, p in seen[0].items():
        for where, pat in (("text", anywhere), ("html", anywhere), ("outputs", in_outputs)):
            s = p[where]
            found += sorted({f"{name} ({where}): ...{s[max(0, m.start() - 50):m.end() + 40]!r}..."
                             for m in pat.finditer(s)})[:5]
    assert not found, "paths of the build machine on the site:\n" + "\n".join(found)


def test_nothing_is_loaded_from_the_network(site, seen):
    base, requests = site[1], seen[1]
    assert requests, "the browser recorded no request at all"
    off = sorted({f"{url} (from {Path(urlsplit(at).path).name})" for at, url in requests
                  if not url.startswith(base) and not url.startswith(("data:", "blob:", "about:"))})
    assert not off, "requests off this machine:\n" + "\n".join(off)


def test_no_page_is_wider_than_the_window(seen):
    wide = [(n, p["scrollWidth"], p["clientWidth"]) for n, p in seen[0].items() if p["scrollWidth"] > p["clientWidth"]]
    assert not wide, f"pages wider than a {WIDTH}px window (a wide cell should scroll inside itself): {wide}"
