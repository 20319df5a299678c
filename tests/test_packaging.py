"""The distribution: ``python -m build`` makes an sdist and a wheel that install and run."""

import importlib.metadata
import os
import pathlib
import subprocess
import sys
import sysconfig
import tomllib
import zipfile

import pytest

import cannjax

ROOT = pathlib.Path(__file__).resolve().parent.parent

SMOKE = """
import pathlib, sys
import jax, jax.numpy as jnp, numpy as np
import cannjax
x = jnp.linspace(-3.0, 3.0, 7)
np.testing.assert_allclose(cannjax.ops.gelu(x), jax.nn.gelu(x), rtol=1e-6, atol=1e-7)
g = jax.grad(lambda x: cannjax.ops.gelu(x).sum())(x)
# rtol 1e-4: jax.nn's float32 slope is 2e-5 off at x = -3 (cannjax's: 3e-7).
np.testing.assert_allclose(g, jax.grad(lambda x: jax.nn.gelu(x).sum())(x), rtol=1e-4)
here = pathlib.Path(cannjax.__file__).parent
assert (here / "py.typed").is_file(), here
print(here, cannjax.__version__)
"""


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r.stdout + r.stderr


def test_metadata_and_version():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = meta["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression (PEP 639), not a table
    assert project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert project["scripts"]["cannjax"] == "cannjax._src.cli:main"
    assert "Typing :: Typed" in project["classifiers"]
    assert (ROOT / "cannjax" / "py.typed").is_file()
    assert cannjax.__version__ == importlib.metadata.version("cannjax")


@pytest.mark.slow
def test_sdist_and_wheel_install_into_a_fresh_venv_and_run(tmp_path):
    # sdist first, then the wheel built from the unpacked sdist (build's default), so the
    # wheel also proves that the sdist is complete. --no-isolation: the build requirements
    # come from this environment, nothing is downloaded.
    dist = tmp_path / "dist"
    log = _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)])
    assert "project.license" not in log and "deprecated" not in log.lower(), log
    version = cannjax.__version__
    wheel = dist / f"cannjax-{version}-py3-none-any.whl"
    assert wheel.is_file() and (dist / f"cannjax-{version}.tar.gz").is_file(), os.listdir(dist)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert f"cannjax-{version}.dist-info/licenses/LICENSE" in names, names
    assert "cannjax/py.typed" in names

    # A fresh venv without pip that sees this environment's dependencies (jax, optax...)
    # through a .pth line (a plain path: the editable install's finder is not run there).
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    fresh_site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    fresh_site = pathlib.Path(fresh_site.strip())
    (fresh_site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    log = _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps"]
        # --ignore-installed: the fresh venv sees this environment's editable cannjax
        # through the .pth line, and pip would take it as installed already.
        + ["--no-index", "--ignore-installed", "--disable-pip-version-check", str(wheel)]
    )
    assert "license" not in log.lower() and "deprecat" not in log.lower(), log

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = _run([str(python), "-c", SMOKE], cwd=tmp_path, env=env)
    assert out.startswith(str(fresh_site / "cannjax")) and out.strip().endswith(version), out
    script = venv / "bin" / "cannjax"
    assert f"cannjax {version}" in _run([str(script), "--version"], cwd=tmp_path, env=env)
    help_text = _run([str(script), "--help"], cwd=tmp_path, env=env)
    assert "demo" in help_text and "bench" in help_text and "``" not in help_text
