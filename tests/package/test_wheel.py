"""The wheel as a user gets it: built from this checkout (``pip wheel --no-deps``), unpacked into a folder and used
from another folder, outside the checkout, with nothing of the checkout on the path. It must carry everything the
package reads at run time (the Hydra configs and topology presets as package data, the recipes as
``lightning_shard.recipes``), install nothing else at top level, and run the commands a new user types first."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the checkout without its build leftovers (setuptools reuses an existing ``build/``,
    which a fresh clone does not have), links kept as links."""
    source = tmp_path_factory.mktemp("source") / "lightning_shard"
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "site", "*.egg-info", "__pycache__", "outputs", "multirun", "bench"))
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(source)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (path,) = out.glob("lightning_shard-*.whl")
    return path


@pytest.fixture(scope="module")
def site(wheel, tmp_path_factory) -> Path:
    """The wheel unpacked: what ``pip install`` puts in site-packages."""
    root = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(root)
    return root


def _run(site: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """``python argv`` in ``cwd`` with the unpacked wheel first on the path (the checkout is not on it: the
    editable install's finder comes after the path, so it is never reached for ``lightning_shard``)."""
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_wheel_holds_the_package_its_configs_and_recipes_and_nothing_else(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"lightning_shard"}
    shipped = {n.removeprefix("lightning_shard/conf/") for n in names if n.startswith("lightning_shard/conf/")}
    assert shipped == {str(p.relative_to(ROOT / "conf")) for p in (ROOT / "conf").rglob("*.yaml")}
    recipes = {n.removeprefix("lightning_shard/recipes/") for n in names if n.startswith("lightning_shard/recipes/")}
    assert recipes == {p.name for p in (ROOT / "recipes").glob("*.py")}
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    version = {}
    exec((ROOT / "lightning_shard" / "version.py").read_text(), version)
    assert wheel.name.startswith(f"lightning_shard-{version['__version__']}-")


def test_installed_package_runs_outside_the_checkout(site, tmp_path):
    done = _run(site, tmp_path, "-c", "import lightning_shard, lightning_shard.recipes.gpt as g, "
                "lightning_shard.shipped as s; print(g.__file__); print(sorted(p.name for p in s.CONF_DIR.iterdir()))")
    assert done.returncode == 0, done.stderr
    recipe_file, conf = done.stdout.splitlines()
    assert Path(recipe_file).is_relative_to(site)
    assert "topology" in conf and "strategy" in conf
    topo = _run(site, tmp_path, "-m", "lightning_shard.cli", "topo", "--preset", "dgx1_v100")
    assert topo.returncode == 0 and "dgx1_v100" in topo.stdout, topo.stderr
    plan = _run(site, tmp_path, "-m", "lightning_shard.cli", "plan", "gpt_7b", "--preset", "h100_nvl_8",
                "--gpus", "8")
    assert plan.returncode == 0 and "recommend" in plan.stdout.lower(), plan.stdout + plan.stderr


def test_a_user_config_folder_composes_with_the_shipped_configs(site, tmp_path):
    mine = tmp_path / "my_conf" / "recipe"
    mine.mkdir(parents=True)
    (mine / "my_tiny.yaml").write_text("defaults:\n  - gpt_tiny\n  - _self_\nname: my_tiny\nmodel:\n  n_layer: 1\n")
    done = _run(site, tmp_path, "-m", "lightning_shard.train", f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]",
                "recipe=my_tiny", "strategy=zero3", "--cfg", "job")
    assert done.returncode == 0, done.stderr
    cfg = done.stdout
    assert "name: my_tiny" in cfg and "n_layer: 1" in cfg  # the user's file
    assert "n_embd: 128" in cfg  # inherited from the shipped gpt_tiny
    assert "Zero3Strategy" in cfg  # a shipped group beside it


def test_a_run_of_a_user_recipe_prints_a_resume_command_that_finds_it_again(site, tmp_path):
    """Trains 2 steps of a user's recipe from the installed package; the printed resume command (run as printed)
    composes the same job again, the user's config folder included, and resumes its checkpoint."""
    mine = tmp_path / "my_conf" / "recipe"
    mine.mkdir(parents=True)
    (mine / "mine.yaml").write_text("defaults:\n  - gpt_test\n  - _self_\nname: mine\n")
    first = _run(site, tmp_path, "-m", "lightning_shard.train", f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]",
                 "recipe=mine", "trainer=quiet", "trainer.max_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    (resume,) = [ln.split("resume:", 1)[1] for ln in first.stdout.splitlines() if ln.strip().startswith("resume:")]
    argv = shlex.split(resume.replace("<more>", "3"))
    assert any(a.startswith("hydra.searchpath=") for a in argv), resume
    again = _run(site, tmp_path, *argv[1:])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stdout + again.stderr and "final val loss (step 3)" in again.stdout
