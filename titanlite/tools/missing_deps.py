"""Which of titanlite's requirements does this interpreter lack?
`python -m titanlite.tools.missing_deps PYPROJECT [EXTRA ...]`

Prints the missing (or too old) requirements of the `[project] dependencies` in PYPROJECT (and of
the optional-dependency groups named, e.g. dev) on one line and exits 1, or prints nothing and
exits 0. run_train.sh and run_tests.sh install from this answer.

Standard library only (it runs before anything is installed) and independent of the folder it is
run from: the packages are looked up in the interpreter's installed metadata, with the caller's
folder taken off `sys.path`, so a checkout being the working directory does not count as installed.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys


def _requirement_parser():
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip carries its own copy; an interpreter that can install has pip
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def missing(dependencies: list[str], version_of=metadata.version) -> list[str]:
    """The requirements among `dependencies` (PEP 508 strings) that apply here and are not met."""
    Requirement = _requirement_parser()
    out = []
    for text in dependencies:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = version_of(req.name)
        except metadata.PackageNotFoundError:
            out.append(req.name)
            continue
        if not req.specifier.contains(version, prereleases=True):
            out.append(f"{req.name}{req.specifier} (found {version})")
    return out


def main(pyproject: str, extras: list[str]) -> int:
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]  # the caller's folder: a package lying there is not installed
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            print("tomli")  # needed to read the requirements at all: installing titanlite brings it
            return 1
    try:
        _requirement_parser()
    except ImportError:
        print("pip")
        return 1
    with open(pyproject, "rb") as fh:
        project = tomllib.load(fh)["project"]
    dependencies = project["dependencies"] + [d for e in extras for d in project["optional-dependencies"][e]]
    lacking = missing(dependencies)
    if lacking:
        print(" ".join(lacking))
    return 1 if lacking else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
