"""The python blocks of README.md and docs/*.md run as written.

Each page's blocks run in order in one namespace, on CPU (the Triton kernels under the interpreter,
as conftest sets up). A block that cannot run here is marked by the line ``<!-- notest: REASON -->``
just before it; every block is either run or marked with a reason.
"""

import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
_NOTEST = re.compile(r"<!--\s*notest:([^\n]*?)-->[ \t]*\n\Z")


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line, code, notest reason or None) for each python block of a markdown page."""
    blocks = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()]
        marker = _NOTEST.search(before[-500:])
        reason = marker.group(1).strip() if marker else None
        blocks.append((before.count("\n") + 2, match.group(1), reason))
    return blocks


def _id(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.interpreter
@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_page_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a block that writes a file writes it here
    torch.manual_seed(0)
    namespace = {"__name__": f"docs_{page.stem}"}
    for line, code, reason in python_blocks(page.read_text()):
        if reason is not None:
            assert reason, f"{_id(page)}:{line}: a notest marker needs its reason"
            continue
        exec(compile(code, f"{page}:{line}", "exec"), namespace)


def test_every_block_runs_or_says_why_not():
    seen, skipped = 0, []
    for page in PAGES:
        text = page.read_text()
        blocks = python_blocks(text)
        seen += len(blocks)
        skipped += [f"{_id(page)}:{line}: {reason}" for line, _, reason in blocks if reason is not None]
        for line, _, reason in blocks:
            assert reason != "", f"{_id(page)}:{line}: a notest marker needs its reason"
        markers = len(re.findall(r"^<!--\s*notest:.*-->[ \t]*$", text, flags=re.M))  # on a line of its own
        assert markers == len([b for b in blocks if b[2] is not None]), (
            f"{_id(page)}: a notest marker must stand on the line just before a python block"
        )
    assert seen >= 20, f"only {seen} python blocks found: is the fence pattern still right?"
    assert len(skipped) <= seen // 2, "most blocks are marked notest:\n" + "\n".join(skipped)


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_resolve():
    """The README is read on its own (not in the site, whose links mkdocs --strict checks): its relative
    links and images point to files that exist, and to headings that exist in them."""
    links = re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text())
    relative = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert len(relative) >= 10, relative
    for link in relative:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README.md links to {path}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", target.read_text(), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, f"README.md links to {link}: no such heading"


def test_custom_layer_example_runs():
    """The custom layer of docs/guides/custom-layers.md: its gradients match F.batch_norm on the joint batch."""
    page = ROOT / "docs" / "guides" / "custom-layers.md"
    (code,) = [code for _, code, _ in python_blocks(page.read_text()) if "class SharedStatsBatchNorm" in code]
    namespace = {}
    exec(compile(code, str(page), "exec"), namespace)  # asserts against F.batch_norm itself
    ya, yb = namespace["ya"], namespace["yb"]
    (ya.sum() + (yb * yb).sum()).backward()
    a, b = namespace["a"], namespace["b"]
    ref_a = a.detach().clone().requires_grad_()
    ref_b = b.detach().clone().requires_grad_()
    w = namespace["weight"].detach().clone().requires_grad_()
    bias = namespace["bias"].detach().clone().requires_grad_()
    ref = torch.nn.functional.batch_norm(torch.cat([ref_a, ref_b]), None, None, w, bias, training=True)
    ref_ya, ref_yb = ref.split([a.shape[0], b.shape[0]])
    (ref_ya.sum() + (ref_yb * ref_yb).sum()).backward()
    for got, want in [(a.grad, ref_a.grad), (b.grad, ref_b.grad), (namespace["weight"].grad, w.grad)]:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert yb.stride() == b.stride()
