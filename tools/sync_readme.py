"""Write ggnchunk's generated tables into README.md (run by ``make readme``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import ggnchunk

README = Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- supported-layers -->", "<!-- /supported-layers -->"


def render(text: str) -> str:
    """Return ``text`` with the supported-layers table regenerated between the markers."""
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"README.md has no {START} ... {END} markers")
    table = ggnchunk.supported_layers_table()
    return pattern.sub(lambda _: f"{START}\n{table}\n{END}", text)


if __name__ == "__main__":
    new = render(README.read_text())
    if "--check" in sys.argv:
        sys.exit(
            0 if new == README.read_text() else "README.md is out of date: make readme"
        )
    README.write_text(new)
