"""The `needs_vllm` marker (tests/conftest.py): without vLLM a marked test is skipped, or fails
where KVSIM_REQUIRE_VLLM=1 (CI, `.ci/run`), so a broken vLLM install cannot pass CI as skips."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsim.sim.conform import vllm_setup

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parent / "conftest.py"
MISSING = "vllm is not installed; install vLLM 0.33.0 (CPU only): `bash .ci/install_vllm_cpu.sh`"


def _run(pytester: pytest.Pytester) -> pytest.RunResult:
    """One marked and one unmarked test, in a session with kvsim's conftest."""
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_it="""
        import pytest

        @pytest.mark.needs_vllm
        def test_against_vllm():
            pass

        def test_plain():
            pass
    """)
    return pytester.runpytest("-rsE", "-p", "no:cacheprovider")


def test_without_vllm_a_marked_test_is_skipped(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(vllm_setup, "vllm_available", lambda: MISSING)
    monkeypatch.delenv("KVSIM_REQUIRE_VLLM", raising=False)
    r = _run(pytester)
    r.assert_outcomes(passed=1, skipped=1)
    r.stdout.fnmatch_lines([f"SKIPPED [[]1[]] conftest.py:*: {MISSING}"])


def test_without_vllm_a_marked_test_fails_where_vllm_is_required(pytester: pytest.Pytester,
                                                                  monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(vllm_setup, "vllm_available", lambda: MISSING)
    monkeypatch.setenv("KVSIM_REQUIRE_VLLM", "1")
    r = _run(pytester)
    r.assert_outcomes(passed=1, errors=1)
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    r.stdout.fnmatch_lines(["*_ ERROR at setup of test_against_vllm _*", f"KVSIM_REQUIRE_VLLM=1: {MISSING}"])


def test_with_vllm_a_marked_test_runs(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(vllm_setup, "vllm_available", lambda: None)
    monkeypatch.setenv("KVSIM_REQUIRE_VLLM", "1")
    _run(pytester).assert_outcomes(passed=2)


def test_ci_requires_vllm_around_the_readme_command():
    # .ci/run exports the variable, then runs exactly the README's test command
    root = Path(__file__).resolve().parents[1]
    command = ('pip install torch==2.13.0 && pip install -e ".[dev,gpu,ray]" && '
               "bash .ci/install_vllm_cpu.sh && python -m pytest")
    assert f"```bash\n{command}\n```" in (root / "README.md").read_text()
    lines = (root / ".ci" / "run").read_text().splitlines()
    at = lines.index(f"{command} || exit 1")
    assert "export KVSIM_REQUIRE_VLLM=1" in lines[:at]
