"""The public surface: ``seco_lab``'s names stay what they are, the README's API example runs as written,
and every module says what it exports (``__all__``)."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import seco_lab

ROOT = Path(__file__).resolve().parents[1]

PUBLIC_NAMES = [
    "ChainBasis", "ChunkModel", "ChunkOutput", "Expectation", "GradDict", "HopStrata", "SCHEME_NAMES", "Sampler",
    "Scheme", "TinyConfig", "TinyTransformer", "accumulate_grads", "chain_basis", "dense_grad",
    "enumerate_expectation", "flatten", "forward_loss", "get_scheme", "hop_strata", "make_scheme", "seco_grad",
    "seco_step", "spaco_grad", "truncated_grad", "unflatten",
]


def test_the_package_exports_exactly_its_documented_names():
    assert sorted(seco_lab.__all__) == sorted(PUBLIC_NAMES)
    for name in PUBLIC_NAMES:
        assert getattr(seco_lab, name) is not None
    public = {n for n in vars(seco_lab) if not n.startswith("_")}
    submodules = {n for n in public if type(getattr(seco_lab, n)).__name__ == "module"}
    assert public - submodules == set(PUBLIC_NAMES)


def test_the_readme_api_example_runs():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Python API"):]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "relative bias" in out.stdout and "||g(p)||" in out.stdout


def test_every_module_declares_all():
    missing = []
    for path in sorted((ROOT / "seco_lab").rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                 if isinstance(t, ast.Name)}
        names |= {node.target.id for node in tree.body if isinstance(node, ast.AnnAssign)
                  and isinstance(node.target, ast.Name)}
        if path.name != "__main__.py" and "__all__" not in names:
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"modules without __all__: {missing}"


def test_lazy_package_fronts_export_every_name_of_their_all_and_refuse_unknown_ones():
    """The study packages' fronts import their modules on first use (seco_lab._lazy): every name of __all__
    resolves to the object of the module it comes from, dir() lists it, an unknown name is an AttributeError,
    and a name exported by two modules is refused when the table is built."""
    import importlib

    import pytest

    from seco_lab._lazy import lazy_exports

    for name in ("seco_lab.studies.bias", "seco_lab.studies.audit", "seco_lab.studies.train"):
        pkg = importlib.import_module(name)
        for export in pkg.__all__:
            assert export in dir(pkg)
            assert getattr(pkg, export) is not None
        with pytest.raises(AttributeError, match="no attribute 'nope'"):
            _ = pkg.nope
    from seco_lab.studies.audit import run_audit
    from seco_lab.studies.audit.driver import run_audit as from_driver

    assert run_audit is from_driver
    with pytest.raises(ValueError, match="'x' is exported by both .a and .b"):
        lazy_exports("pkg", {".a": ["x"], ".b": ["x", "y"]})
