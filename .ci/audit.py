#!/usr/bin/env python3
"""Dependency audit: exit 1 when a runtime dependency of vla-node (the closure of its requirements, without
extras, as installed in this environment) has a known vulnerability.

First pip-audit against its online service (PyPI's vulnerability data). A dependency it could not audit (no
network, or an index that does not answer for it) is then checked against the advisories in
.ci/advisories.json: the PyPA advisory database's records for these packages at the commit it names (refresh
it from that repository; it says its date, and so does this audit; `advisory_packages` lists every package
the database has records for, so a dependency outside it has none there). Every dependency ends up audited one
way or the other, and the report says which.

    .venv/bin/python .ci/audit.py [--offline] [--advisories FILE]
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

ADVISORIES = Path(__file__).with_name("advisories.json")
ROOT = "vla-node"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_closure(root: str = ROOT) -> dict[str, str]:
    """{normalized name: installed version} of `root` and everything its requirements need (extras excluded)."""
    found: dict[str, str] = {}
    todo = [root]
    while todo:
        name = todo.pop()
        key = normalize(name)
        if key in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            if key == normalize(root):
                raise SystemExit(f"audit: {root} is not installed in this environment ({sys.executable})")
            continue  # a requirement whose marker holds but is not installed: pip check's business
        found[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    found.pop(normalize(root))
    return found


def affected(version: str, advisory: dict) -> bool:
    """OSV semantics: the version is listed, or lies in [introduced, fixed) / [introduced, last_affected]."""
    if version in advisory["versions"]:
        return True
    try:
        v = Version(version)
    except InvalidVersion:
        return False
    for events in advisory["ranges"]:
        low = None
        for event in events:
            if "introduced" in event:
                low = Version("0") if event["introduced"] == "0" else Version(event["introduced"])
            elif low is not None and "fixed" in event:
                if low <= v < Version(event["fixed"]):
                    return True
                low = None
            elif low is not None and "last_affected" in event:
                if low <= v <= Version(event["last_affected"]):
                    return True
                low = None
        if low is not None and v >= low:  # introduced and never fixed
            return True
    return False


def offline_findings(deps: dict[str, str], advisories: dict) -> dict[str, list[str]]:
    """{dependency: [advisory ids that affect its installed version]} from the snapshot."""
    findings: dict[str, list[str]] = {}
    for advisory in advisories["advisories"]:
        name = normalize(advisory["package"])
        if name in deps and affected(deps[name], advisory):
            findings.setdefault(name, []).append(advisory["id"])
    return findings


def online_audit() -> tuple[dict[str, list[str]], set[str], str]:
    """pip-audit over this environment: ({name: [vulnerability ids]}, names it audited, note)."""
    exe = shutil.which("pip-audit", path=str(Path(sys.executable).parent)) or shutil.which("pip-audit")
    if exe is None:
        return {}, set(), "pip-audit is not installed"
    try:
        out = subprocess.run([exe, "-f", "json", "--progress-spinner", "off"], capture_output=True, text=True,
                             timeout=600)
        report = json.loads(out.stdout or "{}")
    except (subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        return {}, set(), f"pip-audit gave no report ({type(e).__name__})"
    vulns, audited = {}, set()
    for dep in report.get("dependencies", []):
        if dep.get("skip_reason"):
            continue
        name = normalize(dep["name"])
        audited.add(name)
        if dep.get("vulns"):
            vulns[name] = [v["id"] for v in dep["vulns"]]
    note = f"pip-audit audited {len(audited)} packages" if audited else \
        "pip-audit could not audit any package (its vulnerability service is unreachable from here)"
    return vulns, audited, note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offline", action="store_true", help="only the advisory snapshot, no pip-audit")
    parser.add_argument("--advisories", type=Path, default=ADVISORIES, help="the snapshot (OSV records as JSON)")
    args = parser.parse_args(argv)
    deps = runtime_closure()
    vulns, audited, note = ({}, set(), "offline by request") if args.offline else online_audit()
    audited &= set(deps)
    snapshot = json.loads(args.advisories.read_text())
    rest = {name: version for name, version in deps.items() if name not in audited}
    # a dependency with records in the database that were not copied into the snapshot: refresh the snapshot
    vendored = {normalize(p) for p in snapshot["packages"]}
    uncovered = sorted(name for name in rest if name in snapshot["advisory_packages"] and name not in vendored)
    offline = offline_findings(rest, snapshot)
    print(f"audit: {len(deps)} runtime dependencies of {ROOT}; {note}")
    print(f"audit: {len(rest)} checked against the advisory snapshot {snapshot['source']} @ "
          f"{snapshot['commit'][:12]} ({snapshot['date']})")
    failed = False
    for name in sorted(deps):
        ids = vulns.get(name, []) if name in audited else offline.get(name, [])
        how = "pip-audit" if name in audited else "snapshot"
        print(f"  {name:22} {deps[name]:16} {how:9} {', '.join(ids) if ids else 'no known vulnerability'}")
        failed |= bool(ids)
    if uncovered:
        print(f"audit: the database has advisories for {uncovered}, not copied into the snapshot: refresh it",
              file=sys.stderr)
        failed = True
    print("audit: FAILED" if failed else "audit: ok")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
