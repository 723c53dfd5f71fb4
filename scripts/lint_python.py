#!/usr/bin/env python3
"""Fails on what pyflakes finds in the repository's Python files (undefined names, unused
imports and variables, ...), except on lines marked `# noqa`.

Usage: lint_python.py [REPO_ROOT]. Prints "file:line:col: message" per finding and exits 1 if
there is any; exits 0 with a one-line summary otherwise. Needs pyflakes (Debian's
python3-pyflakes, installed by scripts/setup.sh).
"""

import os
import subprocess
import sys

from pyflakes import api, reporter


class Findings(reporter.Reporter):
    """Collects pyflakes' messages, dropping those on a line with `# noqa`."""

    def __init__(self, lines_of):
        super().__init__(sys.stdout, sys.stderr)
        self.lines_of = lines_of
        self.found = []

    def flake(self, message):
        lines = self.lines_of(message.filename)
        text = lines[message.lineno - 1] if 0 < message.lineno <= len(lines) else ""
        if "# noqa" not in text:
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text):  # noqa: N802 (pyflakes' name)
        self.found.append(f"{filename}:{lineno}:{offset or 0}: syntax error: {msg}")

    def unexpectedError(self, filename, msg):  # noqa: N802
        self.found.append(f"{filename}: {msg}")


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), ".."))
    files = subprocess.run(["git", "-C", root, "ls-files", "--cached", "--others",
                            "--exclude-standard", "*.py"], check=True, capture_output=True,
                           text=True).stdout.split()
    files = [f for f in files if os.path.isfile(os.path.join(root, f))]
    cache = {}

    def lines_of(name):
        if name not in cache:
            with open(os.path.join(root, name), encoding="utf-8") as f:
                cache[name] = f.read().splitlines()
        return cache[name]

    findings = Findings(lines_of)
    for f in files:
        with open(os.path.join(root, f), encoding="utf-8") as fh:
            api.check(fh.read(), f, findings)
    for line in findings.found:
        print(line)
    if findings.found:
        print(f"lint_python: {len(findings.found)} finding(s) in {len(files)} files", file=sys.stderr)
        return 1
    print(f"lint_python: {len(files)} Python files, nothing found")
    return 0


if __name__ == "__main__":
    sys.exit(main())
