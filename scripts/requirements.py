"""The requirement lists of pyproject.toml, for scripts/setup_env.sh and scripts/format.sh, so that
the pins live in one place.

    python scripts/requirements.py [--missing] [--exclude EXTRA]... GROUP...

GROUP is "dependencies", "build" (build-system.requires) or an extra of [project.optional-dependencies];
an extra that names fp8dp itself ("fp8dp[demo,format]") brings in those extras, except the excluded
ones. Prints one requirement per line; with --missing, only those the running interpreter does not
satisfy (not installed, or outside the pin: ==, >= or <). Standard library only: it runs before anything
is installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
_REQ = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?\s*(?:(==|>=|<)\s*([^\s;,]+))?\s*$")


def _load() -> dict:
    text = PYPROJECT.read_text()
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:  # Python 3.10: the three flat lists this file uses
        return _load_flat(text)
    return tomllib.loads(text)


def _load_flat(text: str) -> dict:
    def strings(body: str) -> list:
        return re.findall(r'"([^"]*)"', body)

    data: dict = {"project": {"optional-dependencies": {}}, "build-system": {}}
    section = None
    for m in re.finditer(r"^\[([^\]]+)\]|^([A-Za-z0-9_-]+)\s*=\s*\[(.*?)\]\s*$", text, re.M | re.S):
        if m.group(1):
            section = m.group(1)
        elif section == "project" and m.group(2) == "dependencies":
            data["project"]["dependencies"] = strings(m.group(3))
        elif section == "project.optional-dependencies":
            data["project"]["optional-dependencies"][m.group(2)] = strings(m.group(3))
        elif section == "build-system" and m.group(2) == "requires":
            data["build-system"]["requires"] = strings(m.group(3))
    return data


def requirements(groups: list, exclude: set) -> list:
    data = _load()
    project = data["project"]
    extras = project.get("optional-dependencies", {})
    out: list = []

    def add(group: str) -> None:
        if group in exclude:
            return
        if group == "dependencies":
            reqs = project.get("dependencies", [])
        elif group == "build":
            reqs = data["build-system"]["requires"]
        elif group in extras:
            reqs = extras[group]
        else:
            raise SystemExit(f"requirements.py: no group {group!r} in {PYPROJECT}")
        for r in reqs:
            m = _REQ.match(r)
            if m is None:
                raise SystemExit(f"requirements.py: cannot read requirement {r!r} of {group!r}")
            if m.group(1) == project["name"]:
                for extra in (m.group(2) or "").split(","):
                    if extra.strip():
                        add(extra.strip())
            elif r not in out:
                out.append(r)

    for g in groups:
        add(g)
    return out


def satisfied(req: str) -> bool:
    name, _, op, want = _REQ.match(req).groups()
    try:
        have = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    if op is None:
        return True
    if op == "==":
        return have == want
    have_v = [int(p) if p.isdigit() else 0 for p in re.split(r"[.+]", have)[:3]]
    want_v = [int(p) for p in want.split(".")[:3]]
    if op == ">=":
        return have_v >= want_v
    # op "<": "<9.2" takes 9.1.1, not 9.2.0 (compared over the fields given)
    return have_v[: len(want_v)] < want_v


def main(argv: list) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("groups", nargs="+")
    p.add_argument("--missing", action="store_true", help="only what is not installed as pinned")
    p.add_argument("--exclude", action="append", default=[], help="leave out this extra")
    args = p.parse_args(argv)
    for r in requirements(args.groups, set(args.exclude)):
        if not args.missing or not satisfied(r):
            print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
