#!/usr/bin/env python3
"""Fails when an #include climbs the floors of the tree or the folders' include graph has a cycle.

Every `#include "..."` of a C++/CUDA source is spelled from the repository root (or, for public
headers, as "zeroshard/..."), so the path names the room it comes from. The floors, lowest first
(docs/DESIGN.md, "Layout of the repository"):

  public    include/zeroshard/   may include only itself
  base      base/                may include public
  kernels   kernels/             may include base, public
  offload   offload/             may include kernels, base, public (not the engine)
  engine    src/                 may include offload, kernels, base, public
  clients   apps/, python_bindings/
                                 may include only "zeroshard/..." and files of their own folder
                                 tree (apps/... from apps/, python_bindings/... from there)
  tests/, benchmarks/            may include anything

Besides the floors, the graph whose nodes are rooms and whose edges are includes between them
must have no cycle, within a floor as well. A room is a folder two levels deep with everything
below it (src/comm holds src/comm/mpi and src/comm/nccl), or a shallower file's own folder (src,
base, offload): so src/comm/nccl -> src/cuda -> src/comm is a cycle of src/comm and src/cuda.

Usage: check_floors.py [REPO_ROOT]. Prints one line per violation, "file:line: ...", and exits 1
if there is any; exits 0 with a one-line summary otherwise.
"""

import os
import re
import subprocess
import sys

SOURCE_EXT = (".hpp", ".cpp", ".h", ".cc", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')

# Known violations being removed elsewhere, each with the reason it is tolerated for now. Keep
# this empty: an entry is a debt with a named owner, never a way to silence the check.
ALLOWED: dict = {}

# Floors by rank; a file may include files of its own floor or lower ones (clients are special).
RANK = {"public": 0, "base": 1, "kernels": 2, "offload": 3, "engine": 4}


def floor_of(path):
    """The floor of a repository-relative path, or None for files the check does not cover."""
    if path.startswith("include/zeroshard/"):
        return "public"
    if path.startswith("base/"):
        return "base"
    if path.startswith("kernels/"):
        return "kernels"
    if path.startswith("offload/"):
        return "offload"
    if path.startswith("src/"):
        return "engine"
    if path.startswith("apps/") or path.startswith("python_bindings/"):
        return "client"
    if path.startswith("tests/") or path.startswith("benchmarks/"):
        return "free"
    return None


def room_of(path):
    """The room of a repository-relative file: its first two folders, or its folder if shallower."""
    parts = path.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else os.path.dirname(path)


def resolve(inc):
    """The repository-relative path an include names."""
    return "include/" + inc if inc.startswith("zeroshard/") else inc


def tracked_sources(root):
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "--cached", "--others",
                              "--exclude-standard"], check=True, capture_output=True, text=True)
        files = out.stdout.split()
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, _, names in os.walk(root):
            if "/." in d or "/build" in d:
                continue
            files += [os.path.relpath(os.path.join(d, n), root) for n in names]
    return sorted(f for f in files if f.endswith(SOURCE_EXT) and os.path.isfile(os.path.join(root, f)))


def rule_violation(src, target):
    """Why `src` may not include `target`, or None if it may."""
    fs, ft = floor_of(src), floor_of(target)
    if fs in (None, "free"):
        return None
    if ft is None:
        return f'includes "{target}", which is outside every floor'
    if ft == "free":
        return f"includes {ft} code ({target}): library and clients never include tests/benchmarks"
    if fs == "client":
        own = src.split("/", 1)[0] + "/"
        if ft == "public" or target.startswith(own):
            return None
        return (f'includes private "{target}": {own} is a client of the installed public API and '
                f'may include only "zeroshard/..." and {own} files')
    if ft == "client":
        return f'includes client code "{target}" from the {fs} floor'
    if RANK[ft] > RANK[fs]:
        return (f'includes "{target}" of the {ft} floor from the lower {fs} floor '
                f"(floors, lowest first: public, base, kernels, offload, engine)")
    return None


def find_cycle(edges):
    """One cycle of the room graph as a list of nodes, or None."""
    color, stack = {}, []

    def visit(n):
        color[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if color.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if color.get(m) is None:
                c = visit(m)
                if c:
                    return c
        stack.pop()
        color[n] = 2
        return None

    for n in sorted(edges):
        if color.get(n) is None:
            c = visit(n)
            if c:
                return c
    return None


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), ".."))
    errors, edges, where, count = [], {}, {}, 0
    for src in tracked_sources(root):
        with open(os.path.join(root, src), encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                m = INCLUDE.match(line)
                if not m:
                    continue
                count += 1
                target = resolve(m.group(1))
                if not os.path.exists(os.path.join(root, target)):
                    # Spelled from another root (or generated): the path must name the room.
                    if floor_of(src) not in (None, "free"):
                        errors.append(f'{src}:{lineno}: includes "{m.group(1)}", which is not a '
                                      f"path from the repository root (or zeroshard/...)")
                    continue
                why = rule_violation(src, target)
                if why and (src, target) not in ALLOWED:
                    errors.append(f"{src}:{lineno}: {why}")
                a, b = room_of(src), room_of(target)
                if a != b and floor_of(src) not in (None, "free"):
                    edges.setdefault(a, set()).add(b)
                    where.setdefault((a, b), f"{src}:{lineno}")
    cycle = find_cycle(edges)
    if cycle:
        steps = ", ".join(f"{a} -> {b} ({where[(a, b)]})" for a, b in zip(cycle, cycle[1:]))
        errors.append(f"include cycle between rooms: {' -> '.join(cycle)}: {steps}")
    for (src, target), reason in sorted(ALLOWED.items()):
        print(f"check_floors: tolerated for now: {src} includes {target}: {reason}")
    for e in errors:
        print(e, flush=True)
    if errors:
        print(f"check_floors: {len(errors)} violation(s) in {count} includes", file=sys.stderr)
        return 1
    print(f"check_floors: {count} includes, {len(edges)} rooms with outgoing includes, "
          f"no upward include, no cycle between rooms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
