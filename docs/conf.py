"""Sphinx configuration of the documentation site: Markdown pages (MyST), the API from the docstrings.

Build: ``python -m sphinx -W --keep-going -n -b html docs docs/_build/html``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # document this checkout's package, installed or not

import monitored_optim  # noqa: E402

project = "monitored_optim"
author = "monitored_optim contributors"
release = version = monitored_optim.__version__

extensions = [
    "myst_parser",  # Markdown pages
    "sphinx.ext.autodoc",  # the API from the docstrings
    "sphinx.ext.napoleon",  # Google-style Args:/Returns:/Raises: sections
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links resolve, checked by the build
myst_enable_extensions = ["dollarmath"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_default_options = {"members": True, "undoc-members": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # a class's Attributes: section as fields, not as second descriptions of its members

# Names the docstrings and annotations use from packages whose docs this offline build does not
# load (no intersphinx: the build must work without a network): torch's and the standard library's.
nitpick_ignore_regex = [
    ("py:.*", r"(torch|numpy|np|matplotlib|rich|wandb|tensorboardX)(\..*)?"),
    ("py:.*", r"(collections\.abc|typing|types|os|pathlib)\..*"),
    ("py:class", r"(Tensor|Path|Mapping|Sequence|Callable|Iterable|Iterator|Any|RenderableType)"),
    ("py:class", r"monitored_optim\.monitored\.O"),  # the TypeVar of Monitored(cls) -> cls
    ("py:class", r"monitored_optim\.attach\.T"),  # the TypeVar of attach(obj) -> obj
    ("py:class", r"DTensor"),  # torch.distributed.tensor.DTensor, named in a TypeGuard
]

html_theme = "furo"
html_title = f"monitored_optim {release}"
html_static_path: list[str] = []


def _untyped_first_line(app, what, name, obj, options, lines):
    """Undo napoleon's reading of a prose lead-in ("Optimizer steps completed: ...") as a type.

    Napoleon takes the text before the first colon of an attribute's docstring, and of a Returns
    section, as its type; in these docstrings that text is the start of a sentence.
    """
    for i, line in enumerate(lines):
        for field in (":type: ", ":rtype: "):
            if line.startswith(field) and " " in line[len(field):].strip():
                lead = line[len(field):].strip()
                del lines[i]
                target = ":returns: " if field == ":rtype: " else ""
                for j, other in enumerate(lines):
                    if other.startswith(target):
                        lines[j] = f"{target}{lead}: {other[len(target):]}" if target else f"{lead}: {other}"
                        break
                return _untyped_first_line(app, what, name, obj, options, lines)


def setup(app):
    app.connect("autodoc-process-docstring", _untyped_first_line, priority=600)  # after napoleon (500)
