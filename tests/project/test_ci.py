"""The project's own plumbing: CI still runs every suite it ran, and the Makefile's test targets
select what they say."""

import re

from helpers import ROOT

CI = (ROOT / ".ci" / "run").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()


def _recipe(target: str) -> str:
    match = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)+)", MAKEFILE, re.M)
    assert match, f"no {target} target in the Makefile"
    return match.group(1)


def test_ci_runs_the_test_suite_the_docs_the_vllm_suite_and_the_wheel_check():
    stages = re.findall(r'^stage "[^"]+" (make [\w-]+)\s*$', CI, re.M)
    assert stages == ["make test", "make docs", "make test-vllm", "make wheel-check"], stages
    assert "set -euo pipefail" in CI  # a failing stage fails CI


def test_make_test_runs_the_whole_suite_and_make_test_vllm_the_engine_tests():
    test = _recipe("test")
    assert "-m pytest" in test and not re.search(r"pytest.* -m | -k |--deselect|--ignore", test), test  # nothing left out
    assert "tests/rollout/test_vllm.py" in _recipe("test-vllm")
    assert '-m "not slow"' in _recipe("test-fast")


def test_every_test_file_lives_in_a_package_folder_and_helpers_are_apart():
    tests = ROOT / "tests"
    assert not list(tests.glob("test_*.py")), "test files belong in tests/<package>/"
    for path in tests.rglob("*.py"):
        relative = path.relative_to(tests)
        if relative.parts[0] == "helpers" or relative.name == "conftest.py":
            continue
        assert relative.name.startswith("test_") and len(relative.parts) == 2, relative


def test_python_dash_m_srpo_is_the_command():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "srpo", "models", "list"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "smollm2-135m" in out.stdout, out.stderr[-1000:]
