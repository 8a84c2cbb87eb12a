"""The total of .ci/run's pytest runs, from their JUnit XML reports, as one
line: "N passed, M failed" and ", K skipped" when there are any.

    python3 .ci/pytest_total.py REPORT.xml...

A report that is missing or unreadable stands for a run that stopped before
it could report: it counts as one failure. Exits 1 when anything failed.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def total(paths: list[str]) -> tuple[int, int, int]:
    """Counts tests, not the suites' totals: a test failing in its call and
    again in its teardown is one failure (pytest writes it twice)."""
    passed = failed = skipped = 0
    for path in paths:
        try:
            cases = ET.parse(path).getroot().iter("testcase")
        except (OSError, ET.ParseError):
            print(f"no pytest report at {path}: counted as one failure", file=sys.stderr)
            failed += 1
            continue
        outcomes: dict[tuple[str | None, str | None], set[str]] = {}
        for case in cases:
            tags = outcomes.setdefault((case.get("classname"), case.get("name")), set())
            tags.update(child.tag for child in case)
        for tags in outcomes.values():
            if tags & {"failure", "error"}:
                failed += 1
            elif "skipped" in tags:
                skipped += 1
            else:
                passed += 1
    return passed, failed, skipped


if __name__ == "__main__":
    passed, failed, skipped = total(sys.argv[1:])
    print(f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    sys.exit(1 if failed else 0)
