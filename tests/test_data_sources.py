"""Which files the built-in arms read (python-stdlib, docstrings, prose): exactly the files that the
first listing, one pathlib rglob per pattern, named, in the same order. A source's fingerprint and
its token cache key on this list, and a resumed run's batches on its order, so the faster listing
must change nothing of it: not on this machine's trees, and not on a tree made of the cases that
tell two listings apart (symlinked folders and files, dangling links, hidden names, a folder with a
file's name, a site-packages inside the stdlib)."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest

from andrea_core.data import sources
from andrea_core.data.policy import ArmSpec

PROSE = ("*.md", "*.rst", "*.txt", "METADATA")


def rglob_listing(arm: ArmSpec) -> list[Path]:
    """The listing as first written (the oracle): an rglob per pattern. Less one thing: docstrings
    took a folder named *.py for a file, and failed reading it; neither listing names one now."""
    if arm.kind == "python-stdlib":
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        return sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    if arm.kind == "docstrings":
        files = []
        for pkg in arm.packages or sources.DEFAULT_DOCSTRING_PACKAGES:
            root = sources._package_dir(pkg)
            if root is not None:
                files.extend(sorted(p for p in root.rglob("*.py") if p.is_file()))
        return files
    roots = [Path(p) for p in arm.paths] if arm.paths else sources._site_packages()
    files = []
    for root in roots:
        if root.is_file():
            files.append(root)
        elif root.is_dir():
            for pattern in PROSE:
                files.extend(root.rglob(pattern))
    return sorted({f for f in files if f.is_file() and f.stat().st_size > 200})


@pytest.mark.parametrize(
    "arm",
    [
        ArmSpec(name="code", kind="python-stdlib"),
        ArmSpec(name="docs", kind="docstrings"),  # the default packages: torch, numpy, prefect, ...
        ArmSpec(name="docs", kind="docstrings", packages=["fsspec", "_pytest"]),  # tiny-mix's
        ArmSpec(name="prose", kind="prose"),  # all of site-packages
    ],
    ids=["stdlib", "docstrings-default", "docstrings-tiny-mix", "prose-site-packages"],
)
def test_each_arm_lists_exactly_the_files_rglob_listed_on_this_machine(arm):
    listed = sources._files_for(arm)
    assert len(listed) > 20  # a real tree, not an empty one that any listing matches
    assert listed == rglob_listing(arm)


def _make_tree(root: Path) -> None:
    text = "x" * 300  # over prose's 200-byte floor
    (root / "docs" / "deep" / "deeper").mkdir(parents=True)
    for rel in ("a.md", "docs/b.rst", "docs/deep/c.txt", "docs/deep/deeper/METADATA", ".hidden.md",
                "docs/.d.txt", "README.MD", "notes.md.bak", "docs/deep/x.py"):  # fmt: skip
        (root / rel).write_text(text)
    (root / "small.md").write_text("short")  # under the floor: never read
    (root / "folder.md").mkdir()  # a folder with a file's name
    (root / "folder.md" / "inner.rst").write_text(text)
    outside = root.parent / f"{root.name}-outside"
    (outside / "linked").mkdir(parents=True)
    (outside / "linked" / "far.md").write_text(text)
    (outside / "file.txt").write_text(text)
    os.symlink(outside / "linked", root / "docs" / "linked-folder")  # rglob does not descend into it
    os.symlink(outside / "linked", root / "linked.md")  # a folder link with a matching name
    os.symlink(outside / "file.txt", root / "docs" / "link-to-file.txt")  # read, as rglob did
    os.symlink(root / "missing.md", root / "dangling.md")
    os.symlink(root / "docs", root / "docs" / "deep" / "loop")  # a cycle neither listing follows
    (root / "site-packages" / "pkg").mkdir(parents=True)
    (root / "site-packages" / "pkg" / "inside.md").write_text(text)


def test_a_prose_tree_of_every_case_that_tells_listings_apart_lists_as_rglob_did(tmp_path):
    root = tmp_path / "tree"
    root.mkdir()
    _make_tree(root)
    arm = ArmSpec(name="prose", kind="prose", paths=[str(root), str(root / "a.md")])
    listed = sources._files_for(arm)
    assert listed == rglob_listing(arm)
    names = sorted(p.relative_to(root).as_posix() for p in listed)
    assert names == [".hidden.md", "a.md", "docs/.d.txt", "docs/b.rst",
                     "docs/deep/c.txt", "docs/deep/deeper/METADATA", "docs/link-to-file.txt",
                     "folder.md/inner.rst", "site-packages/pkg/inside.md"]  # fmt: skip


def test_the_stdlib_listing_skips_site_packages_at_any_depth(tmp_path, monkeypatch):
    stdlib = tmp_path / "lib"
    for rel in ("os.py", "json/__init__.py", "site-packages/third.py", "x/site-packages/deep.py"):
        (stdlib / rel).parent.mkdir(parents=True, exist_ok=True)
        (stdlib / rel).write_text("'''doc'''\n")
    (stdlib / "dir.py").mkdir()
    os.symlink(stdlib / "json", stdlib / "json-link")
    paths = {**sysconfig.get_paths(), "stdlib": str(stdlib)}
    monkeypatch.setattr(sources.sysconfig, "get_paths", lambda: paths)
    arm = ArmSpec(name="code", kind="python-stdlib")
    listed = sources._files_for(arm)
    assert listed == rglob_listing(arm)
    assert [p.relative_to(stdlib).as_posix() for p in listed] == ["json/__init__.py", "os.py"]
