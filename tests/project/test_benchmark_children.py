"""The benchmarks measure in child processes one way (benchmarks/_child.py)."""

import re
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from _child import run_child  # noqa: E402

sys.path.remove(str(BENCHMARKS))


def test_every_benchmark_with_a_child_uses_the_one_protocol():
    with_children = [p for p in BENCHMARKS.glob("bench_*.py") if '"--child"' in p.read_text()]
    assert len(with_children) >= 7
    for path in with_children:
        text = path.read_text()
        assert "from _child import" in text, f"{path.name} runs a child without benchmarks/_child.py"
        assert not re.search(r'"RESULT |splitlines\(\)\[-1\]', text), f"{path.name} parses a child's output itself"


def test_run_child_returns_the_last_report_and_names_a_failure(tmp_path):
    child = tmp_path / "child.py"
    child.write_text("import sys\nsys.path.insert(0, %r)\nfrom _child import report\n"
                     "print('noise')\nreport({'a': 1})\nreport({'a': int(sys.argv[1])})\n" % str(BENCHMARKS))
    assert run_child([child, 7]) == {"a": 7}
    with pytest.raises(SystemExit, match=r"(?s)the x side failed \(exit 1\):\n.*ValueError"):
        run_child([child, "seven"], what="the x side")
    silent = tmp_path / "silent.py"
    silent.write_text("print('no result')\n")
    with pytest.raises(SystemExit, match=r"silent failed \(no RESULT line\)"):
        run_child([silent], what="silent")
