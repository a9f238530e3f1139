"""Every relative link, image and file path in the READMEs outside the docs site resolves (the
site's own pages are checked by ``mkdocs build --strict`` in CI)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`([\w./-]+\.(?:py|json|md|yaml|txt|png))`")
WRITTEN_BY_RUNS = ("runs/", "site/")  # outputs a command writes, not files of the project


def referenced_files(page: Path) -> list[str]:
    """Markdown link targets (not URLs or anchors) and file paths written in backticks."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks are commands
    links = [t.split("#")[0] for t in LINK.findall(text) if not re.match(r"[a-z]+:|#", t)]
    return links + [p for p in CODE_PATH.findall(text) if not p.startswith(WRITTEN_BY_RUNS)]


def resolves(page: Path, target: str) -> bool:
    return (page.parent / target).exists() or ("/" in target and (ROOT / target).exists()) \
        or any(ROOT.glob(f"configs/**/{target}"))


@pytest.mark.parametrize("page", ["README.md", "benchmarks/README.md"])
def test_every_link_and_file_path_resolves(page):
    path = ROOT / page
    targets = referenced_files(path)
    assert len(targets) >= 5, f"{page}: only {targets} found (the patterns are broken)"
    missing = [t for t in targets if not resolves(path, t)]
    assert not missing, f"{page}: refers to missing files: {missing}"


def test_every_make_target_srpo_names_exists():
    """An error message or doc that says `make X` names a target of the Makefile."""
    import re

    root = Path(__file__).resolve().parents[2]
    targets = set(re.findall(r"^([A-Za-z][\w.-]*):", (root / "Makefile").read_text(), re.M))
    named = set()
    for path in [*root.glob("srpo/**/*.py"), *root.glob("docs/*.md"), root / "README.md"]:
        named |= set(re.findall(r"`make ([A-Za-z][\w.-]*)", path.read_text()))
    assert named and named <= targets, sorted(named - targets)
