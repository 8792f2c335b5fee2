"""Sphinx configuration of the celery-semaphore documentation.

Why Sphinx (as Celery, kombu, redis-py and Dramatiq use): autodoc builds the API reference
from the docstrings the code already carries (they state each guarantee), so the reference
cannot drift from the code; MyST-Parser lets the pages be Markdown. Every code example is a
file under docs/examples/, shown with ``literalinclude`` and run by tests/test_docs.py, so an
example that stops working fails the test suite.

Build: ``make docs`` (warnings are errors), or
``sphinx-build -W --keep-going -b html docs docs/_build/html``.
"""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

import celery_semaphore  # noqa: E402

project = "celery-semaphore"
author = "celery-semaphore developers"
copyright = "the celery-semaphore developers"
release = celery_semaphore.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "examples", "README.md"]
root_doc = "index"

myst_enable_extensions = ["colon_fence", "deflist"]
# Headings up to ### get anchors, so pages can link to a section: [text](page.md#anchor).
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}

html_theme = "alabaster"
html_title = f"celery-semaphore {release}"
html_theme_options = {
    "description": "Cluster-wide named counting semaphores for Celery tasks",
    "fixed_sidebar": True,
    "page_width": "1180px",
    "sidebar_width": "260px",
}
html_sidebars = {"**": ["about.html", "navigation.html", "relations.html", "searchbox.html"]}
