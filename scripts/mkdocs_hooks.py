"""mkdocs hooks for the docs site (mkdocs.yml).

- ``benchmarks/RESULTS.md``, the one home of dated figures, becomes the page ``results.md``, with the
  plots it shows, so that the site links to it without a copy in ``docs/``.
- The docstrings use Sphinx roles (``:func:`name```); mkdocstrings renders them as the role's text
  before a code span, which is dropped here, leaving the code span.
"""

import pathlib
import re

from mkdocs.structure.files import File

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_RESULTS = _ROOT / "benchmarks" / "RESULTS.md"
_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):(?=<code)")


def on_files(files, config):
    files.append(File.generated(config, "results.md", abs_src_path=str(_RESULTS)))
    for plot in re.findall(r"!\[[^\]]*\]\(([^)/]+\.png)\)", _RESULTS.read_text()):
        files.append(File.generated(config, plot, abs_src_path=str(_RESULTS.parent / plot)))
    return files


def on_page_content(html, page, config, files):
    return _ROLE.sub("", html)
