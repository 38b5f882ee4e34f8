"""junit.xml: one <testcase> per (case, check) so CI test tabs show which check failed where.

xml.etree escapes markup; characters XML 1.0 cannot carry at all (most C0 controls, which a raised
error message may contain) are replaced first, or the file would not parse."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from swa_bench.report import tables
from swa_bench.results import CaseResult, CheckResult, RunResults

_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_text(value: object) -> str:
    return _NOT_XML.sub("\ufffd", str(value))


def _seconds(case: CaseResult) -> str:
    """The case's measured replay median; JUnit time is informative only."""
    timing = case.timing
    stats = timing.replay or timing.reference if timing else None
    return f"{stats.median_ms / 1000:.6f}" if stats else "0"


def _failure_text(check: CheckResult) -> str:
    lines = [check.message] if check.message else []
    if check.mode != "bitwise" and (check.rtol is not None or check.atol is not None):
        lines.append(f"mode {check.mode}, rtol {check.rtol}, atol {check.atol}")
    else:
        lines.append(f"mode {check.mode}")
    lines += [tables.describe_diagnostic(d) for d in check.diagnostics]
    return "\n".join(lines)


def _testcase(parent: ET.Element, classname: str, name: str, time: str) -> ET.Element:
    return ET.SubElement(parent, "testcase",
                         {"classname": xml_text(classname), "name": xml_text(name), "time": time})


def render_junit(results: RunResults) -> str:
    counts = results.counts()
    errors = sum(case.status == "error" for case in results.cases)
    tests = counts["checks"] + errors
    suite_name = f"swa_bench.{results.scenario_name}"
    root = ET.Element("testsuites", {"name": "swa_bench", "tests": str(tests),
                                     "failures": str(counts["checks_failed"]),
                                     "errors": str(errors), "skipped": str(counts["checks_info"])})
    suite = ET.SubElement(root, "testsuite", {
        "name": xml_text(suite_name), "tests": str(tests),
        "failures": str(counts["checks_failed"]), "errors": str(errors),
        "skipped": str(counts["checks_info"]),
        "timestamp": xml_text(results.started_at),
        "hostname": xml_text(results.environment.get("hostname") or "unknown"),
    })
    properties = ET.SubElement(suite, "properties")
    for key, value in tables.environment_rows(results):
        ET.SubElement(properties, "property", {"name": xml_text(key), "value": xml_text(value)})
    implausible = tables.implausible(results)
    for line in implausible:  # figures not to believe: a property and the suite's output
        ET.SubElement(properties, "property", {"name": "warning", "value": xml_text(line)})

    for case in results.cases:
        classname = f"{suite_name}.{case.label}"
        for check in case.checks:
            testcase = _testcase(suite, classname, f"{check.id} {check.name}", _seconds(case))
            if check.mode == "info":  # measured, not judged: neither a pass nor a failure
                skipped = ET.SubElement(testcase, "skipped", {
                    "message": xml_text(tables.one_line("info (no bound set): "
                                                        + tables.describe_check(check)))})
                skipped.text = xml_text(_failure_text(check))
            elif not check.passed:
                worst = check.worst_diagnostic()
                message = "; ".join(
                    part for part in (check.message,
                                      tables.describe_diagnostic(worst) if worst else "") if part)
                failure = ET.SubElement(testcase, "failure", {
                    "message": xml_text(message or f"{check.id} failed"),
                    "type": xml_text(check.mode)})
                failure.text = xml_text(_failure_text(check))
        if case.status == "error":
            testcase = _testcase(suite, classname, "run", "0")
            error_text = case.error or "the case raised"
            error = ET.SubElement(testcase, "error", {
                "message": xml_text(tables.one_line(error_text.splitlines()[0] if error_text
                                                    else "")),
                "type": "error"})
            error.text = xml_text(error_text)
    if implausible:
        ET.SubElement(suite, "system-out").text = xml_text(
            "\n".join(f"warning: {line}" for line in implausible))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
