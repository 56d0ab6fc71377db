"""Write ggnchunk's generated tables into the docs (run by ``make tables``).

The supported-layers table on ``docs/supported.md`` is generated from the rule registry
(:func:`ggnchunk.supported_layers_table`) between the ``supported-layers`` markers.
``--check`` exits non-zero if the page is out of date (CI runs it).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import ggnchunk

PAGE = Path(__file__).resolve().parent.parent / "docs" / "supported.md"
START, END = "<!-- supported-layers -->", "<!-- /supported-layers -->"


def render(text: str) -> str:
    """Return ``text`` with the supported-layers table regenerated between the markers."""
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"{PAGE.name} has no {START} ... {END} markers")
    table = ggnchunk.supported_layers_table()
    return pattern.sub(lambda _: f"{START}\n{table}\n{END}", text)


if __name__ == "__main__":
    new = render(PAGE.read_text())
    if "--check" in sys.argv:
        sys.exit(0 if new == PAGE.read_text() else f"{PAGE} is out of date: make tables")
    PAGE.write_text(new)
