"""What the repository holds: experiments live in git history rather than as patch files,
bench/results keeps only the current records, the records the performance log cites from
that folder are there, and nothing sends a reader to a file outside the repository."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("bench", "cmake", "csrc", "docs", "include", "python", "tests", "tools")
RESULTS = ROOT / "bench" / "results"
MAX_RESULT_FILES = 40


def _tracked():
    """The files git tracks, or None outside a git checkout (a copy of the tree, such as the
    GPU machine's, may hold files the checkout has since removed)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                                check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return {ROOT / name for name in listed.decode().split("\0") if name}


TRACKED = _tracked()
needs_git = pytest.mark.skipif(TRACKED is None, reason="needs the git checkout")


def _files(*dirs):
    for d in dirs:
        yield from (p for p in (ROOT / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                    and (TRACKED is None or p in TRACKED))


@needs_git
def test_no_patch_files():
    # An experiment is a commit and its revert (docs/experiments.md), not a patch that rots.
    patches = [str(p.relative_to(ROOT)) for p in _files(*SOURCE_DIRS) if p.suffix == ".patch"]
    assert not patches, patches


@needs_git
def test_bench_results_holds_the_current_records_only():
    files = list(_files("bench/results"))
    assert len(files) <= MAX_RESULT_FILES, f"{len(files)} files in bench/results"
    # The layer records and the log at the top, the training-step records in train/.
    folders = {p.parent.relative_to(RESULTS) for p in files}
    assert folders <= {Path("."), Path("train")}, f"records in sub-folders: {sorted(folders)}"


def test_records_cited_from_this_folder_exist():
    log = (RESULTS / "PERFLOG.md").read_text()
    assert re.findall(r"^## (.+)$", log, flags=re.M)[0] == "Current state"
    # A cited record name without a `REV:` prefix is a file of bench/results.
    cited = set(re.findall(r"`((?:h100|h200|h200x2)-[\w.{},*-]+)`", log))
    assert cited, "the log cites no record of this folder"
    for name in cited:
        for expanded in _expand(name):
            matches = list(RESULTS.glob(expanded))
            assert matches, f"PERFLOG.md cites {expanded}, not in bench/results"


def _expand(pattern):
    m = re.search(r"\{([^}]*)\}", pattern)
    if not m:
        return [pattern]
    return [e for option in m.group(1).split(",")
            for e in _expand(pattern[:m.start()] + option + pattern[m.end():])]


def test_no_reference_outside_the_repository():
    for path in [ROOT / "README.md", ROOT / "include" / "megamoe" / "megamoe.h",
                 *_files("docs", "python", "csrc", "tests", "tools")]:
        if path.suffix not in (".md", ".h", ".py", ".cpp", ".cu", ".cuh", ".sh"):
            continue
        if path.name == "test_tree.py":
            continue
        text = path.read_text(errors="replace")
        for bad in ("DESIGN.md", "/work/shared", "shared folder"):
            assert bad not in text, f"{path.relative_to(ROOT)} refers to {bad!r}"
