#!/usr/bin/env python3
"""Fails when the documentation has gone stale:

- a code excerpt marked `<!-- excerpt-of: PAGE BLOCK -->` (the README's C++ and Python
  excerpts) is no longer a part of the tested example it was cut from: every line of it, but
  lines holding "...", must appear in that order in PAGE's `<!-- BLOCK:begin -->` block (leading
  and trailing spaces aside);
- a relative link in README.md or docs/*.md names a file that does not exist;
- docs/configuration.md's field table differs from what scripts/gen_config_doc.py makes from
  the library's field table (given the built `zeroshard` tool as the argument).

Usage: check_docs.py [ZEROSHARD_TOOL]. One line per problem; exit 1 if any.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
EXCERPT = re.compile(r"<!-- excerpt-of: (\S+) (\S+) -->\s*```\w*\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def block(page, name):
    """The lines of PAGE's <!-- NAME:begin --> ... <!-- NAME:end --> block, fences dropped."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = f.read()
    m = re.search(rf"<!-- {re.escape(name)}:begin -->\s*```\w*\n(.*?)```\s*<!-- {re.escape(name)}:end -->",
                  text, re.S)
    return None if m is None else m.group(1).splitlines()


def check_excerpts(md, text, problems):
    for page, name, body in EXCERPT.findall(text):
        source = block(page, name)
        if source is None:
            problems.append(f"{md}: excerpt of {page} block '{name}', which does not exist")
            continue
        src = [l.strip() for l in source]
        pos = 0
        for line in body.splitlines():
            want = line.strip()
            if not want or "..." in want:
                continue
            try:
                pos = src.index(want, pos) + 1
            except ValueError:
                problems.append(f"{md}: excerpt of {page} '{name}': line not found there (in "
                                f"order): {want}")
                break


def check_links(md, text, problems):
    base = os.path.dirname(os.path.join(ROOT, md))
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor of the same page
        path = target.split("#", 1)[0]
        if not os.path.exists(os.path.join(base, path)):
            problems.append(f"{md}: link to {target}, which does not exist")


def main():
    problems = []
    pages = ["README.md"] + sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(ROOT, "docs"))
                                   if n.endswith(".md"))
    for md in pages:
        with open(os.path.join(ROOT, md), encoding="utf-8") as f:
            text = f.read()
        check_excerpts(md, text, problems)
        check_links(md, text, problems)
    if len(sys.argv) > 1:
        r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_config_doc.py"),
                            "--check", sys.argv[1]], capture_output=True, text=True)
        if r.returncode != 0:
            problems.append((r.stdout + r.stderr).strip())
    for p in problems:
        print(p)
    if problems:
        return 1
    print(f"check_docs: {len(pages)} pages, excerpts and links current"
          + (", configuration page current" if len(sys.argv) > 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
