"""The structure of the package, as docs/architecture.md draws it, checked on the source: which package may
import which, no import loops between packages, the engine independent of the simulator, the bookkeeping
packages torch-free, the model reaching kernels only through kvpage.ops, and every switch in kvpage.envs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "kvpage"


def package_of(module: str) -> str:
    """kvpage.kv.manager -> kv; kvpage.config -> config (top-level modules count as their own package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports() -> dict[str, set[str]]:
    """Every kvpage module -> the kvpage modules it imports (at any depth in the file: lazy imports count)."""
    out: dict[str, set[str]] = {}
    for f in SRC.rglob("*.py"):
        rel = f.relative_to(SRC.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        found: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
        out[name] = {m for m in found if m == "kvpage" or m.startswith("kvpage.")} | {
            m for m in found if m.split(".")[0] in ("torch", "numpy")}
    return out


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for mod, deps in imports().items():
        src = package_of(mod)
        graph.setdefault(src, set())
        graph[src] |= {package_of(d) for d in deps if d.startswith("kvpage.") and package_of(d) != src}
    return graph


def test_no_import_loops_between_packages():
    graph = package_graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import loop: " + " -> ".join([*path[path.index(nxt):], nxt]))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for pkg in sorted(graph):
        if pkg not in state:
            visit(pkg, [pkg])


def test_engine_and_worker_never_import_the_simulator():
    for mod, deps in imports().items():
        if package_of(mod) in ("engine", "worker", "core", "kv", "model", "attention", "ops"):
            assert not any(package_of(d) == "sim" for d in deps), f"{mod} imports the simulator"


def test_bookkeeping_packages_are_torch_free():
    for mod, deps in imports().items():
        if package_of(mod) in ("kv", "core", "sim") or mod in ("kvpage.envs", "kvpage.config", "kvpage.dtypes",
                                                               "kvpage.errors", "kvpage.capacity"):
            assert not any(d.split(".")[0] in ("torch", "numpy") for d in deps), f"{mod} imports torch/numpy"


def test_model_reaches_kernels_through_ops_never_a_concrete_attention_backend():
    for mod, deps in imports().items():
        if package_of(mod) in ("model", "worker", "engine"):
            concrete = ("kvpage.attention.backends.cpu", "kvpage.attention.backends.reference")
            bad = {d for d in deps if d.startswith(concrete)}
            assert not bad, f"{mod} imports {bad}"
    assert not (SRC / "attention" / "csrc").exists(), "kernel sources live in kvpage/ops/csrc"


def test_environment_is_read_only_in_envs():
    """Only kvpage/envs.py reads KVPAGE_* variables (the server's key is read by the serve command through it)."""
    for f in SRC.rglob("*.py"):
        if f.name == "envs.py":
            continue
        text = f.read_text()
        assert not re.search(r"environ(\.get)?\s*[\[(]\s*['\"]KVPAGE_", text), f"{f} reads a KVPAGE_ variable"


def test_every_switch_is_documented():
    from kvpage.envs import VARIABLES

    doc = (ROOT / "docs" / "envs.md").read_text()
    for var in VARIABLES:
        assert f"`{var.name}`" in doc, f"{var.name} is missing from docs/envs.md"


def test_one_step_loop_for_the_engine_and_the_simulator():
    """Both drive core.engine_core.EngineCore; neither keeps a scheduling loop of its own."""
    deps = imports()
    for mod in ("kvpage.engine.llm_engine", "kvpage.sim.simulator"):
        assert "kvpage.core.engine_core" in deps[mod], f"{mod} does not run the shared step loop"
    for mod in ("engine/llm_engine.py", "sim/simulator.py"):
        assert ".schedule()" not in (SRC / mod).read_text(), f"{mod} schedules steps itself"


def test_one_table_of_dtypes_and_one_block_size_default():
    for f in SRC.rglob("*.py"):
        text = f.read_text()
        if f.name != "dtypes.py":
            assert not re.search(r"[\"']fp16[\"']\s*:", text), f"{f} keeps a dtype table of its own"
        assert not re.search(r"block_size(: int)? = 16\b|--block-size.*default=16\b", text), \
            f"{f} writes the default block size itself (kvpage.kv.DEFAULT_BLOCK_SIZE)"


def test_tests_mirror_the_packages():
    """tests/<package>/ holds a package's tests; shared helpers live in tests/helpers/; the root keeps the
    tests of top-level modules and of the repository itself."""
    tests = ROOT / "tests"
    for d in tests.iterdir():
        if d.is_dir() and d.name not in ("helpers", "__pycache__"):
            assert (SRC / d.name).is_dir(), f"tests/{d.name} mirrors no package of src/kvpage"
    for f in tests.rglob("*.py"):
        if f.name.startswith("test_") or f.name in ("conftest.py", "__init__.py") or "__pycache__" in f.parts:
            continue
        assert f.parent.name == "helpers", f"{f.relative_to(ROOT)}: helpers belong in tests/helpers/"


def test_benchmark_scripts_import_names_that_exist():
    """The benchmark scripts are run by hand, not by the suite: a renamed kvpage name would break one unseen.
    Every `from kvpage... import name` they hold (top level or inside functions) must resolve."""
    import importlib

    missing = []
    for f in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvpage"):
                mod = importlib.import_module(node.module)
                missing += [f"{f.name}: {node.module}.{a.name}" for a in node.names if not hasattr(mod, a.name)
                            and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
    assert not missing, missing


def test_vllm_side_benchmark_helpers_need_no_kvpage():
    """benchmarks/_vllm_attention.py runs in vLLM's interpreter, which has no kvpage (nor this checkout on its
    path), and loads benchmarks/_common.py there: that module imports only the standard library at its top."""
    import subprocess
    import sys

    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('c', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); assert m.median_seconds")
    # -I -S: no site-packages (so neither kvpage nor torch), no current directory on the path
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(ROOT / "benchmarks" / "_common.py")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_python_files_stay_small():
    """One concern per module: no Python file of the package, its tests, benchmarks or scripts runs much past
    400 lines (a file that grows past the limit is split by concern, not squeezed)."""
    limit = 430
    long = [f"{f.relative_to(ROOT)}: {n} lines" for d in ("src", "tests", "benchmarks", "scripts")
            for f in sorted((ROOT / d).rglob("*.py")) if (n := len(f.read_text().splitlines())) > limit]
    assert not long, long
