"""Render README.md from nbs/index.ipynb without Quarto (which nbdev_readme needs but this machine lacks).

Hidden cells are dropped, nbdev directives stripped, code cells become ```python blocks with their
text outputs below. Run with --check to fail when README.md is out of date."""
import sys
from pathlib import Path

from execnb.nbio import read_nb
from nbdev.process import extract_directives

root = Path(__file__).resolve().parent.parent


def render(nb_path: Path) -> str:
    parts = []
    for cell in read_nb(nb_path).cells:
        src = cell.source
        if cell.cell_type == "markdown":
            parts.append(src.strip())
            continue
        if cell.cell_type != "code":
            continue
        directives = extract_directives(cell, remove=True)
        if {"hide", "default_exp", "exporti"} & set(directives) or "export" in directives:
            continue
        code = cell.source.strip()
        if code:
            parts.append(f"```python\n{code}\n```")
        for out in cell.get("outputs", []):
            text = out.get("text") or out.get("data", {}).get("text/plain")
            if text:
                text = "".join(text) if isinstance(text, list) else text
                parts.append(f"    {text.rstrip()}".replace("\n", "\n    "))
    return "<!-- Generated from nbs/index.ipynb by scripts/render_readme.py: edit the notebook. -->\n\n" + "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    text = render(root / "nbs" / "index.ipynb")
    readme = root / "README.md"
    if "--check" in sys.argv:
        if not readme.exists() or readme.read_text() != text:
            sys.exit("README.md is out of date with nbs/index.ipynb: run `python scripts/render_readme.py`")
    else:
        readme.write_text(text)
