"""The dependency audit (.ci/audit.py): the runtime closure it audits, OSV range semantics, and a known
vulnerability in an installed runtime dependency failing it (checked offline against a made-up snapshot)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from helpers.paths import REPO_ROOT

spec = importlib.util.spec_from_file_location("ci_audit", REPO_ROOT / ".ci" / "audit.py")
audit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(audit)


def test_the_closure_is_the_runtime_requirements_and_their_own_without_extras():
    deps = audit.runtime_closure()
    assert {"torch", "numpy", "onnx", "onnxruntime", "pyzmq", "msgpack", "mcap"} <= set(deps)
    assert "pytest" not in deps and "hypothesis" not in deps and "transformers" not in deps  # the dev extra


def advisory(package: str, events: list[dict], versions=()) -> dict:
    return {"id": f"TEST-{package}", "package": package, "ranges": [events], "versions": list(versions)}


def test_osv_ranges():
    fixed = advisory("x", [{"introduced": "1.0"}, {"fixed": "1.5"}])
    assert audit.affected("1.0", fixed) and audit.affected("1.4.9", fixed)
    assert not audit.affected("0.9", fixed) and not audit.affected("1.5", fixed)
    assert audit.affected("7.0", advisory("x", [{"introduced": "0"}]))  # never fixed
    assert audit.affected("2.0", advisory("x", [{"introduced": "1.0"}, {"last_affected": "2.0"}]))
    assert not audit.affected("2.0.1", advisory("x", [{"introduced": "1.0"}, {"last_affected": "2.0"}]))
    assert audit.affected("0.3", advisory("x", [], versions=["0.3"]))


def snapshot(tmp_path: Path, advisories: list[dict], **fields) -> Path:
    path = tmp_path / "advisories.json"
    vendored = json.loads(audit.ADVISORIES.read_text())
    path.write_text(json.dumps({"source": "test", "commit": "0" * 40, "date": "today", "packages": vendored["packages"],
                                "advisory_packages": vendored["advisory_packages"], "advisories": advisories,
                                **fields}))
    return path


def test_a_known_vulnerability_in_a_runtime_dependency_fails_the_audit(tmp_path, capsys):
    numpy_version = audit.runtime_closure()["numpy"]
    hit = advisory("numpy", [{"introduced": "0"}, {"fixed": "99999"}])
    assert audit.main(["--offline", "--advisories", str(snapshot(tmp_path, [hit]))]) == 1
    out = capsys.readouterr().out
    assert f"numpy                  {numpy_version}" in out and "TEST-numpy" in out and "audit: FAILED" in out
    old = advisory("numpy", [{"introduced": "0"}, {"fixed": "1.0"}])
    dev_only = advisory("pytest", [{"introduced": "0"}])  # not a runtime dependency: not audited here
    assert audit.main(["--offline", "--advisories", str(snapshot(tmp_path, [old, dev_only]))]) == 0


def test_a_dependency_whose_records_were_not_copied_fails_the_audit(tmp_path, capsys):
    """The snapshot copies the records of the packages it names; a runtime dependency the database has records
    for but the snapshot did not copy cannot be audited offline: refresh the snapshot."""
    assert audit.main(["--offline", "--advisories", str(snapshot(tmp_path, [], packages=["torch"],
                                                                 advisory_packages=["numpy", "torch"]))]) == 1
    assert "advisories for ['numpy'], not copied" in capsys.readouterr().err


def test_the_vendored_snapshot_holds_the_records_of_every_runtime_dependency_that_has_any():
    vendored = json.loads(audit.ADVISORIES.read_text())
    copied = {audit.normalize(p) for p in vendored["packages"]}
    assert {d for d in audit.runtime_closure() if d in vendored["advisory_packages"]} <= copied
