"""The README's two commands and .ci/run must stay in agreement."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("```sh") + 1
    end = lines.index("```", start)
    return lines[start:end]


def test_readme_starts_with_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[0].startswith("# ") and lines[2] == "```sh"
    run, test = readme_commands()
    assert "kvpage serve" in run and "pytest" in test


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci


def test_kv_and_core_never_import_torch():
    for pkg in ("kv", "core", "sim"):
        for f in (ROOT / "src" / "kvpage" / pkg).glob("*.py") if (ROOT / "src" / "kvpage" / pkg).exists() else []:
            text = f.read_text()
            assert "import torch" not in text, f"{f} imports torch"


def test_readme_python_examples_run():
    import re

    for block in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        exec(compile(block, "README.md", "exec"), {})


def test_public_names_import_from_the_package_and_kv_stays_torch_free():
    import subprocess
    import sys

    code = ("import sys, kvpage.kv, kvpage.core.scheduler; assert 'torch' not in sys.modules, 'torch imported'; "
            "from kvpage import LLM, SamplingParams, RequestOutput, CompletionOutput, LLMEngine, EngineArgs; "
            "assert SamplingParams().n == 1 and LLM.__name__ == 'LLM'")
    subprocess.run([sys.executable, "-c", code], check=True)
