"""A pytest plugin of dtlab's GPU check (``-p dtlab.gpucheck.pytest_plugin``): the selected tests,
each with the first paragraph of its docstring and its outcome (with a skip's reason), written as
JSON to the file ``$DTLAB_GPUCHECK_TESTS`` names, after the collection and after every test (a run
stopped by a timeout still leaves what it did)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

TESTS_ENV = "DTLAB_GPUCHECK_TESTS"
_tests: dict[str, dict[str, Any]] = {}


def summary_of(doc: str | None, name: str) -> str:
    """A test's docstring's first paragraph on one line; without a docstring, its name in words."""
    text = (doc or "").strip()
    if not text:
        return re.sub(r"^test_", "", name.split("[")[0]).replace("_", " ")
    return " ".join(text.split("\n\n")[0].split())


def _write() -> None:
    path = os.environ.get(TESTS_ENV)
    if path:
        Path(path).write_text(json.dumps(list(_tests.values()), indent=1) + "\n", encoding="utf-8")


def pytest_collection_finish(session: Any) -> None:
    for item in session.items:  # after -m's deselection: the tests that will run
        doc = getattr(getattr(item, "obj", None), "__doc__", None)
        _tests[item.nodeid] = {
            "id": item.nodeid, "doc": summary_of(doc, item.name), "outcome": None, "reason": "",
        }  # fmt: skip
    _write()


def pytest_runtest_logreport(report: Any) -> None:
    test = _tests.get(report.nodeid)
    if test is None:
        return
    if report.skipped:
        test["outcome"] = "skipped"
        longrepr = report.longrepr
        # A skip's longrepr is (file, line, "Skipped: reason").
        if isinstance(longrepr, tuple) and len(longrepr) == 3:
            test["reason"] = str(longrepr[2]).removeprefix("Skipped: ")
    elif report.failed:
        test["outcome"] = "failed" if report.when == "call" else "error"
        test["reason"] = f"{report.when}: " + str(report.longrepr).strip().splitlines()[-1][:300]
    elif report.when == "call":
        test["outcome"] = "passed"
    _write()
