"""A non-editable install, used as a new user would: from another directory.

The wheel is built from this checkout and installed (without dependencies) into a fresh
virtual environment created *without* pip or system packages; the numerical stack (torch,
numpy, ...) is borrowed by a ``.pth`` line naming this environment's site-packages.  A
``.pth`` line only appends a directory to ``sys.path`` -- it does not run that directory's
own ``.pth`` files -- so the development environment's editable hook for ``seco_lab`` stays
inactive, and the fresh environment's own site-packages (holding the wheel) comes first:
the package under test is the wheel's, which the test asserts.
"""

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, cwd, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.slow
def test_wheel_runs_the_study_and_the_report_from_any_directory(tmp_path):
    wheels, env_dir, work, src = (tmp_path / n for n in ("wheels", "env", "work", "src"))
    work.mkdir()
    # build from a clean copy: a stale build/ folder in the checkout could smuggle deleted modules into the wheel
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "reports", "runs",
                                                             "__pycache__", "tests"))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, src],
         cwd=tmp_path)
    (wheel,) = wheels.glob("seco_lab-*.whl")
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=work).stdout.strip())
    (site / "borrowed_stack.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", wheel], cwd=tmp_path)

    where = _run([py, "-c", "import seco_lab, importlib.util as u; print(seco_lab.__file__); "
                  "print(u.find_spec('experiments'))"], cwd=work).stdout.split()
    assert Path(where[0]).is_relative_to(site), f"seco_lab imported from {where[0]}, not from the wheel"
    assert where[1] == "None", "the wheel must not install a top-level `experiments` package"

    cli = env_dir / "bin" / "seco-lab"
    _run([cli, "bias-study", "--quick", "--draws", "100", "--jobs", "1", "--no-progress"], cwd=work)
    results = work / "reports" / "_work" / "bias_study_quick"
    assert (results / "results.csv").is_file() and (results / "study.json").is_file()
    _run([cli, "report", "bias", "--results", results], cwd=work)
    report = work / "reports" / "bias_study.md"
    assert "seco-lab bias-study" in report.read_text()
    assert (work / "reports" / "figures" / "bias_study" / "weights.png").is_file()
    assert not list(site.glob("reports")), "nothing may be written into the installed package's folders"

    missing = subprocess.run([str(cli), "report", "bias"], cwd=tmp_path, capture_output=True, text=True)
    assert "seco-lab bias-study" in missing.stderr and "Traceback" not in missing.stderr

    _run([cli, "audit", "--quick", "--no-progress"], cwd=work, timeout=900)
    _check_quick_audit(work / "audit-quick")
    assert not list(site.rglob("audit-quick")), "nothing may be written into the installed package's folders"


def _check_quick_audit(out: Path) -> None:
    for name in ("strata.csv", "bias.csv", "mc.csv", "cost.csv", "data.csv", "equal_compute.csv", "audit.json",
                 "report.md"):
        assert (out / name).is_file(), name
    assert "Equal compute" in (out / "report.md").read_text()


@pytest.mark.slow
def test_quick_audit_runs_from_a_fresh_clone(tmp_path):
    """`seco-lab audit --quick` from a clone of the committed tree, run from another folder, writes only there."""
    clone, work = tmp_path / "clone", tmp_path / "work"
    work.mkdir()
    _run(["git", "clone", "-q", ROOT, clone], cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    env["PYTHONPATH"] = str(clone)
    proc = subprocess.run([sys.executable, "-m", "seco_lab.cli", "audit", "--quick", "--no-progress", "--out", "q"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    _check_quick_audit(work / "q")
    assert not (clone / "audit-quick").exists()


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_library_never_imports_the_experiments():
    """Recipes depend on the library, never the reverse; the entry points import only seco_lab of this project."""
    for path in (ROOT / "seco_lab").rglob("*.py"):
        assert "experiments" not in _imported_modules(path), f"{path.relative_to(ROOT)} imports experiments"
    for path in (ROOT / "experiments").glob("*.py"):
        assert "experiments" not in _imported_modules(path), f"{path.relative_to(ROOT)} imports experiments"
