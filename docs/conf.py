"""Sphinx configuration of the jaxlp API reference (built by ``sphinx-build -W docs docs/_build``)."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "jaxlp"
author = "jaxlp developers"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_typehints = "none"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
exclude_patterns = ["_build"]
html_theme = "alabaster"
napoleon_use_ivar = True
