#!/usr/bin/env python3
"""Removes each wait of the engine in turn and reports whether the suite on the asynchronous CPU
device catches it (docs/ARCHITECTURE.md, "What runs only on a GPU").

A wait is a statement in src/ that calls synchronize(), download(...), before_collective(),
hand_to_trainer(), sync_stream(...) or wait_event(...) on a Compute or StreamDevice (src/cuda and
NCCL's code aside: the asynchronous device does not run them). One at a time, the statement is
removed (a download becomes a copy on the compute stream, which does not wait), the library and
the tests are rebuilt, and the asynchronous device's unit tests (test_async_device) and the
multi-rank groups on the asynchronous device (ZEROSHARD_ASYNC_DEVICE=1) run, with collectives
ordered as NCCL orders them, except at 3 ranks, where they are staged as MPI's are
(ZEROSHARD_ASYNC_COMM, as ctest's async groups run them). A removal is caught when a test fails (or the run crashes or hangs
past its limit). Definitions and comments are not mutated; a wait whose removal no test notices
is listed as missed: either a test is missing or the wait is not needed.

Work happens in a copy of the tree (git worktree at HEAD plus the uncommitted changes), never in
the checkout itself.

Usage: mutate_waits.py [--groups Parity,Offload,...] [--np 2,3] [--only REGEX] [--list]
                       [--build-dir DIR] [--out FILE]
Prints one line per site and a summary "caught K of N"; --out writes the same as Markdown.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
WAIT = re.compile(r"(->|\.)(synchronize\(\)|download\(|before_collective\(\)|"
                  r"hand_to_trainer\(\)|sync_stream\(|wait_event\()"
                  # StreamCompute's own calls of its synchronize()
                  r"|^\s*(if \(.*\) )?synchronize\(\);")
# Files that define the waits rather than call them.
SKIP_FILES = ("src/compute/compute.hpp", "src/compute/stream_device.hpp",
              "src/compute/async_cpu_device.cpp", "src/planner/plan_memory.cpp",
              "src/planner/time_device.cpp")
GROUPS = ("Parity,Accumulation,Restore,Checkpoint,Reference,LossScale,Clipping,Offload,Order,Hybrid,"
          "Muon,Speculation")


def sites(root):
    """(file, first line, line count, statement) of every wait call in src/, in file order."""
    out = []
    for d, _, names in os.walk(os.path.join(root, "src")):
        for n in sorted(names):
            if not n.endswith((".cpp", ".hpp")):
                continue
            rel = os.path.relpath(os.path.join(d, n), root)
            if rel in SKIP_FILES or rel.startswith("src/cuda/") or rel.startswith("src/comm/nccl/"):
                continue
            with open(os.path.join(root, rel)) as f:
                lines = f.readlines()
            for i, line in enumerate(lines):
                code = line.split("//", 1)[0]
                if not WAIT.search(code) or "override" in code:
                    continue
                # The statement runs on to the line that ends with ';' (a call over several lines).
                end = i
                while end < len(lines) and not lines[end].split("//", 1)[0].rstrip().endswith(";"):
                    end += 1
                if end - i > 4 or end == len(lines):
                    continue  # not a statement (a declaration, a condition)
                text = " ".join(l.strip() for l in lines[i:end + 1])
                out.append((rel, i + 1, end - i + 1, text))
    return sorted(out)


def mutate(lines):
    """The statement's lines without its wait: a download becomes a copy on the compute stream
    (which does not wait); any other statement is dropped."""
    if "download(" in lines[0]:
        return [lines[0].replace("download(", "copy(", 1)] + lines[1:]
    indent = lines[0][: len(lines[0]) - len(lines[0].lstrip())]
    return [indent + "(void)0;  // mutated\n"] + ["\n"] * (len(lines) - 1)


def run(cmd, cwd, env=None, timeout=None):
    return subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout, capture_output=True, text=True,
                          errors="replace")  # a crashed test may print any bytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", default=GROUPS)
    ap.add_argument("--np", default="2,3")
    ap.add_argument("--only", default="", help="a regular expression the site must match")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--build-dir", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per mpirun")
    a = ap.parse_args()

    found = [s for s in sites(ROOT) if re.search(a.only, f"{s[0]}:{s[1]} {s[3]}")]
    if a.list:
        for f, n, _, text in found:
            print(f"{f}:{n}: {text}")
        print(f"{len(found)} sites")
        return 0

    tree = tempfile.mkdtemp(prefix="zs-mutate-")
    os.rmdir(tree)
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "-q", "--detach", tree, "HEAD"], check=True)
    try:
        diff = run(["git", "diff", "HEAD"], ROOT).stdout
        if diff:
            subprocess.run(["git", "apply", "-"], cwd=tree, input=diff, text=True, check=True)
        for f in run(["git", "ls-files", "--others", "--exclude-standard"], ROOT).stdout.split():
            os.makedirs(os.path.dirname(os.path.join(tree, f)) or tree, exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(tree, f))
        build = a.build_dir or os.path.join(tree, "build-mutate")
        cfg = ["cmake", "-S", tree, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
               "-DZEROSHARD_WITH_CUDA=OFF", "-DZEROSHARD_BUILD_BENCHMARKS=OFF"]
        subprocess.run(cfg, check=True, stdout=subprocess.DEVNULL)

        def build_ok():
            r = run(["cmake", "--build", build, "--target", "test_multirank", "test_async_device",
                     "-j", str(os.cpu_count() or 2)], tree)
            return r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]

        ok, log = build_ok()
        if not ok:
            print(log)
            sys.exit("mutate_waits: the unmutated tree does not build")
        env = dict(os.environ, ZEROSHARD_ASYNC_DEVICE="1", OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
                   OMPI_MCA_btl_vader_single_copy_mechanism="none", OMPI_MCA_mpi_yield_when_idle="1")
        filt = ":".join(f"{g}*:*/{g}.*" for g in a.groups.split(","))
        binary = os.path.join(build, "tests", "test_multirank")

        def suite():
            """None if every run passed, else what failed first."""
            try:
                r = run([os.path.join(build, "tests", "test_async_device"), "--gtest_color=no"],
                        tree, env, a.timeout)
            except subprocess.TimeoutExpired:
                return f"test_async_device: hung past {a.timeout} s"
            if r.returncode != 0:
                failed = re.findall(r"\[  FAILED  \] (\S+)", r.stdout)
                return "test_async_device: " + (failed[0] if failed else f"exit {r.returncode}")
            for np_ in a.np.split(","):
                try:
                    comm = "staged" if np_ == "3" else "nccl"
                    r = run(["mpirun", "-x", "ZEROSHARD_ASYNC_DEVICE", "-x", "ZEROSHARD_ASYNC_COMM",
                             "-np", np_, binary, f"--gtest_filter={filt}", "--gtest_color=no"],
                            tree, dict(env, ZEROSHARD_ASYNC_COMM=comm), a.timeout)
                except subprocess.TimeoutExpired:
                    return f"np{np_} ({comm}): hung past {a.timeout} s"
                if r.returncode != 0:
                    failed = re.findall(r"\[  FAILED  \] (\S+)", r.stdout)
                    return f"np{np_} ({comm}): " + (failed[0] if failed else f"exit {r.returncode}")
            return None

        base = suite()
        if base:
            sys.exit(f"mutate_waits: the unmutated suite fails on the asynchronous device: {base}")
        rows, caught = [], 0
        for f, n, count, text in found:
            path = os.path.join(tree, f)
            with open(path) as fh:
                lines = fh.readlines()
            original = lines[n - 1:n - 1 + count]
            lines[n - 1:n - 1 + count] = mutate(original)
            with open(path, "w") as fh:
                fh.writelines(lines)
            t0 = time.time()
            ok, log = build_ok()
            why = suite() if ok else None
            lines[n - 1:n - 1 + count] = original
            with open(path, "w") as fh:
                fh.writelines(lines)
            hit = why is not None
            caught += hit
            result = "caught" if hit else "MISSED" if ok else "n/a"
            if not ok:  # the wait's result is used: nothing to remove
                why = "does not build without it"
            row = (f, n, text, result, why or "", time.time() - t0)
            rows.append(row)
            print(f"{row[3]:7} {f}:{n}: {text}  [{row[4]}] ({row[5]:.0f} s)", flush=True)
        ok, _ = build_ok()  # leave the build as the tree is
        tried = [r for r in rows if r[3] != "n/a"]
        print(f"mutate_waits: caught {caught} of {len(tried)} removed waits")
        if a.out:
            with open(a.out, "w") as fh:
                fh.write(f"caught {caught} of {len(tried)} removed waits "
                         f"(groups {a.groups}; ranks {a.np})\n\n| result | site | statement | "
                         f"first failure |\n|---|---|---|---|\n")
                for f, n, text, res, why, _ in rows:
                    shown = text.replace("`", "'").replace("|", "\\|")
                    fh.write(f"| {res} | `{f}:{n}` | `{shown}` | {why} |\n")
        return 0 if caught == len(tried) else 1
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree])


if __name__ == "__main__":
    sys.exit(main())
