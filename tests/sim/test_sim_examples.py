"""The planner's documented examples work from a fresh clone: the traces they name are in the repository."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "tests" / "data" / "traces"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def documented_trace_paths() -> list[tuple[str, str]]:
    """(doc, path) for each trace a ``kvprefix simulate`` command names by a path. A bare name such as
    ``trace.jsonl`` stands for the reader's own file and is left out."""
    found = []
    for doc in DOCS:
        for m in re.finditer(r"kvprefix simulate (\S+\.jsonl)", doc.read_text(encoding="utf-8")):
            if "/" in m.group(1):
                found.append((doc.name, m.group(1)))
    return found


def test_the_docs_show_commands_on_real_traces():
    assert {doc for doc, _ in documented_trace_paths()} >= {"README.md", "planner.md"}


@pytest.mark.parametrize("doc, trace", documented_trace_paths())
def test_a_documented_trace_is_a_file_inside_the_repository(doc, trace):
    path = (ROOT / trace).resolve()
    assert path.is_relative_to(ROOT) and path.is_file(), f"{doc} names {trace}, which a fresh clone does not have"


def test_every_kept_trace_has_a_row_with_its_source_and_license():
    rows = {}
    for line in (TRACES / "README.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells
    for trace in sorted(TRACES.glob("*.jsonl")):
        assert trace.name in rows and all(rows[trace.name][1:3]), trace.name  # source, license
