"""Sphinx configuration: the API reference is generated from the docstrings
(autodoc, Google/NumPy sections through napoleon); the guide pages are
Markdown (MyST).  ``tests/test_docs.py`` builds it with warnings as errors
(``-W -n``): a public name without a docstring, a broken cross-reference to
one of coordl's names, or a Markdown link to a missing page fails the build."""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "coordl"
author = "the coordl developers"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "alabaster"
myst_heading_anchors = 4

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": True, "show-inheritance": False}

# Every reference to one of coordl's own names must resolve; references to
# the libraries around it (no network access is assumed for intersphinx) are
# not checked.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|numpy|np|PIL|typing|collections|os|abc|concurrent|multiprocessing|subprocess|"
               r"psutil|enum|pathlib|dataclasses|io|types)(\..*)?"),
    (r"py:.*", r"(.*\._T_co|Any|Callable|Iterable|Iterator|Mapping|Sequence|TypeVar|T_co|T|optional|callable|"
               r"Tensor|Dataset|Sampler|Generator|PathLike|DataLoader\[.*\])"),
    (r"py:.*", r"coordl\.(.*\.)?_\w+"),      # private names are not in the reference
    (r"py:class", r"(int|float|str|bytes|bool|dict|list|tuple|set|frozenset|object|None|type|Exception)"),
]


def _undocumented(app, what, name, obj, options, lines):
    """A public name of the reference without a docstring is a warning (an
    error under -W)."""
    short = name.rsplit(".", 1)[-1]
    if short.startswith("_") or what in ("attribute", "data", "property"):
        return
    if not any(line.strip() for line in lines):
        from sphinx.util import logging

        logging.getLogger("coordl.docs").warning(f"{what} {name} is public but has no docstring",
                                                  type="coordl", subtype="docstring")


def setup(app):
    app.connect("autodoc-process-docstring", _undocumented)
