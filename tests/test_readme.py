"""The README: its test command is the one CI runs, its first snippet runs as written, it speaks to users."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert "pytest" in ci_command
    assert f"```bash\n{ci_command}\n```" in readme


def test_the_quickstart_snippet_runs_as_written():
    """The README's first Python block, executed from the repository root on the committed models."""
    readme = (ROOT / "README.md").read_text()
    quickstart = readme[readme.index("## Quickstart"):]
    code = quickstart[quickstart.index("```python\n") + len("```python\n"):]
    code = code[: code.index("```")]
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), "the snippet prints its statistics and text"


@pytest.mark.parametrize("document", ["README.md", "benchmarks/RESULTS.md"])
def test_readme_speaks_to_users(document):
    readme = (ROOT / document).read_text().lower()
    for phrase in ("see the issue", "the engine issue", "the eagle issue", "was lent", "no gpu was", "our machines",
                   "this session", "these sessions"):
        assert phrase not in readme, phrase


def test_links_into_the_measurements_name_their_sections():
    """Every `benchmarks/RESULTS.md#section` link of the README and of RESULTS.md's contents names a heading there."""
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    anchors = {re.sub(r"[^\w\- ]", "", line[3:].strip().lower()).replace(" ", "-")
               for line in results.splitlines() if line.startswith("## ")}
    links = re.findall(r"RESULTS\.md#([\w-]+)", (ROOT / "README.md").read_text())
    links += re.findall(r"\]\(#([\w-]+)\)", results)
    assert links and set(links) <= anchors, set(links) - anchors
