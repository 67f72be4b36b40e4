"""The documentation site (mkdocs.yml, docs/): the option reference is generated from the options list and shows
every option, an option added to the list appears without editing a page, every page is in the navigation, the
pages are reference and not diaries, and ``mkdocs build --strict`` fails on a broken link."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_shard import options as opts
from lightning_shard.options.fields import Fields, knob
from tests.optional import require

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def load_hook():
    """docs/hooks/knobs.py, as mkdocs loads it (a module from a file; its dataclasses need it in sys.modules)."""
    name = "docs_hooks_knobs"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, DOCS / "hooks" / "knobs.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_the_reference_shows_every_option_of_every_strategy():
    hook = load_hook()
    page = hook.render(opts)
    for cls in opts.OPTIONS:
        for f in dataclasses.fields(cls):
            if "group" in f.metadata:
                assert f"{{#group-{f.name}}}" in page, f.name
                for g in dataclasses.fields(f.metadata["group"]):
                    assert f"### `{f.name}.{g.name}` {{#{f.name}.{g.name}}}" in page, (f.name, g.name)
                    assert f"`strategy.{f.name}.{g.name}`" in page
            else:
                assert f"### `{f.name}` {{#{f.name}}}" in page, f.name
                assert hook.prose(f.metadata["doc"]) in page, f.name
    for name in opts.REGISTERED:
        assert f"| `{name}` |" in page, name  # the strategy names table, from the shipped configs


def test_an_option_added_to_the_list_appears_without_editing_a_page():
    @dataclasses.dataclass(kw_only=True)
    class Extra(Fields):
        """An extra group."""

        knob_in_a_group: int = knob(7, "A field nobody documented by hand.")

    @dataclasses.dataclass(kw_only=True)
    class WithNewKnob(opts.ZeroOptions):
        brand_new: str = knob("fast", "A flat option added to the list.", choices=("fast", "slow"))
        extra: Extra = dataclasses.field(default_factory=Extra, metadata={"doc": "Extras.", "group": Extra})

    page = load_hook().render(opts, [("zero2", opts.ZeroOptions, 2), ("zero9", WithNewKnob, 2)])
    assert "### `brand_new` {#brand_new}" in page
    assert ('- **zero9**: type `str`; default `"fast"`; choices `"fast"`, `"slow"`; Hydra `strategy.brand_new`'
            in page)
    assert "A flat option added to the list." in page
    assert "### `extra.knob_in_a_group` {#extra.knob_in_a_group}" in page
    assert "A field nobody documented by hand." in page and "`strategy.extra.knob_in_a_group`" in page


def test_the_reference_page_keeps_the_marker_the_hook_replaces():
    hook = load_hook()
    page = (DOCS / hook.PAGE).read_text()
    assert page.count(hook.MARKER) == 1
    assert "### " not in page  # nothing hand-written that the options list already says


def _nav_pages(nav) -> list[str]:
    out = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_every_page_is_in_the_navigation_and_every_nav_entry_exists():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages


DIARY = re.compile(r"\bissues? \d+|\bround \d+|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|"
                   r"tenth|eleventh|twelfth|thirteenth|\d+(?:st|nd|rd|th)) round\b|\bsessions?\b", re.IGNORECASE)


def test_the_pages_are_reference_not_diaries():
    """Dated results and their history belong on the benchmarks page only."""
    found = [f"{p.name}:{n}: {line.strip()}" for p in sorted(DOCS.glob("*.md")) if p.name != "benchmarks.md"
             for n, line in enumerate(p.read_text().splitlines(), 1) if DIARY.search(line)]
    assert not found, "\n".join(found)


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "--site-dir",
                           str(site)], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_site_builds_strict_and_a_broken_link_fails_it(tmp_path):
    require("mkdocs", extra="docs")
    require("mkdocstrings_handlers.python", extra="docs")
    done = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tuning.bucket_mb" in (tmp_path / "site" / "knobs" / "index.html").read_text()

    copy = tmp_path / "copy"  # the same site with one link broken on purpose
    shutil.copytree(DOCS, copy / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    (copy / "lightning_shard").symlink_to(ROOT / "lightning_shard")
    index = copy / "docs" / "index.md"
    index.write_text(index.read_text() + "\nSee [a page that is not there](no_such_page.md).\n")
    broken = _build(copy / "mkdocs.yml", tmp_path / "broken")
    assert broken.returncode != 0
    assert "no_such_page.md" in broken.stdout + broken.stderr
