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
