#!/usr/bin/env python3
"""What a passing ctest run hides, printed after it (scripts/test.sh): why each skipped test was
skipped (the first line of its output) and the Python suite's own count with its skip reasons.
Usage: test_summary.py CTEST_OUTPUT LAST_TEST_LOG"""
import re
import sys


def outputs(log_text):
    """Each test's output in ctest's LastTest.log, by test name."""
    found = {}
    for m in re.finditer(r'^"(?P<name>[^"]+)" start time:.*?\nOutput:\n-+\n(?P<out>.*?)<end of output>', log_text,
                         re.S | re.M):
        found[m.group("name")] = m.group("out")
    return found


def main():
    ctest_out, log = sys.argv[1], sys.argv[2]
    with open(ctest_out, errors="replace") as f:
        skipped = re.findall(r"^\s*\d+ - (\S+) \(Skipped\)", f.read(), re.M)
    try:
        with open(log, errors="replace") as f:
            text = f.read()
    except OSError:
        return
    out = outputs(text)
    for name in skipped:
        lines = [line for line in out.get(name, "").splitlines() if line.strip()]
        # A pytest entry's reason is its first SKIPPED line (-rs), not its progress dots.
        first = next((line for line in lines if line.startswith("SKIPPED")), lines[0] if lines else "(no output)")
        print(f"skipped: {name}: {first}")
    py = out.get("python_tests", "")
    counts = re.findall(r"^=*\s*(\d+ passed.*?) in [\d.]+s", py, re.M)
    if counts:
        print(f"python_tests: {counts[-1]}")
    for line in py.splitlines():
        if line.startswith("SKIPPED"):
            print(f"  {line}")


if __name__ == "__main__":
    main()
