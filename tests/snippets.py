"""The ```python blocks of the README and the documentation pages, and the objects their text presumes."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def pages() -> list[Path]:
    """The README and every Markdown page of the documentation site, in a stable order."""
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(page: Path) -> list[str]:
    """The ```python blocks of one page, in order."""
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)
