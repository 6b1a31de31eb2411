#!/usr/bin/env python3
"""Mutation testing of fleetctl's pure core (issue 15), by module, in bounded time.

Not part of CI and not a dev dependency: the tool (mutmut 2.5.1) lives in its own cached venv,
~/.cache/fleetctl/mutation-venv, made on first use with pip. Each module is mutated in a
throwaway copy of the working tree under /tmp (mutmut 2 edits the file in place and keeps its
.mutmut-cache in the current directory), so the checkout is never touched. Each module's
mutants run against only its fast tests (TESTS below), with the dev venv's Python.

    python scripts/mutation.py                       # every module in TESTS, 600 s each
    python scripts/mutation.py --budget 300 fleetctl/routing/scheduler.py
    python scripts/mutation.py --jobs 2              # modules in parallel (mutmut 2 is serial)

A module whose budget runs out is stopped; its untested mutants are reported as such and the
score counts only the tested ones. The report goes to benchmarks/out/mutation-<date>.md
(git-ignored): killed / survived / timeout / score per module and each survivor's diff.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOOL = "mutmut==2.5.1"
VENV = Path.home() / ".cache" / "fleetctl" / "mutation-venv"

# module -> the fast tests that exercise it (each file runs in a few seconds).
TESTS: dict[str, list[str]] = {
    "fleetctl/routing/scheduler.py": ["tests/test_scheduler.py"],
    "fleetctl/routing/policy.py": ["tests/test_policy.py", "tests/test_scheduler.py"],
    "fleetctl/routing/request.py": ["tests/test_routing_parse.py"],
    "fleetctl/planner/optimize.py": ["tests/test_planner.py"],
    "fleetctl/planner/expand.py": ["tests/test_planner.py"],
    "fleetctl/perf.py": ["tests/test_perf.py"],
    "fleetctl/sim/engine.py": ["tests/test_sim.py"],
    "fleetctl/apply/steps.py": ["tests/test_apply_steps.py"],
}


def ensure_venv() -> Path:
    mutmut = VENV / "bin" / "mutmut"
    if mutmut.exists():
        return mutmut
    VENV.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", TOOL], check=True)
    return mutmut


def copy_tree(dest: Path) -> None:
    """The working tree's tracked and untracked-but-not-ignored files, as they are now."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in files:
        if not raw:
            continue
        rel = raw.decode()
        src = REPO / rel
        if not src.is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)


def statuses(work: Path) -> list[tuple[int, int, str]]:
    """(mutant id, line number, status) for every mutant mutmut knows of."""
    db = sqlite3.connect(work / ".mutmut-cache")
    try:
        return db.execute(
            "SELECT m.id, l.line_number, m.status FROM Mutant m JOIN Line l ON m.line = l.id"
            " ORDER BY m.id"
        ).fetchall()
    finally:
        db.close()


def run_module(module: str, budget: float, python: str, mutmut: Path, keep: bool) -> dict:
    work = Path(tempfile.mkdtemp(prefix="fleetctl-mutation-", dir="/tmp"))
    try:
        copy_tree(work)
        tests = " ".join(TESTS.get(module, []))
        # mutmut 2 splits the runner on spaces (no shell): PYTHONPATH travels in env below.
        runner = f"{python} -m pytest -x -q -p no:cacheprovider {tests}"
        env = dict(os.environ, PYTHONPATH=str(work), PYTHONDONTWRITEBYTECODE="1")
        cmd = [
            str(mutmut),
            "run",
            "--paths-to-mutate",
            module,
            "--tests-dir",
            "tests",
            "--runner",
            runner,
            "--no-progress",
            "--simple-output",
        ]
        t0 = time.monotonic()
        log = (work / "mutmut.log").open("w")
        proc = subprocess.Popen(
            cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        stopped = False
        try:
            proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            stopped = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        elapsed = time.monotonic() - t0
        rows = statuses(work) if (work / ".mutmut-cache").exists() else []
        survivors = []
        for mid, line, status in rows:
            if status != "bad_survived":
                continue
            diff = subprocess.run(
                [str(mutmut), "show", str(mid)], cwd=work, env=env, capture_output=True, text=True
            ).stdout.strip()
            survivors.append((mid, line, diff))
        counts: dict[str, int] = {}
        for _, _, status in rows:
            counts[status] = counts.get(status, 0) + 1
        return {
            "module": module,
            "tests": tests,
            "elapsed": elapsed,
            "stopped": stopped,
            "rc": proc.returncode,
            "counts": counts,
            "survivors": survivors,
            "log_tail": (work / "mutmut.log").read_text(errors="replace")[-2000:],
        }
    finally:
        if keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def score(counts: dict[str, int]) -> tuple[int, int, int, int, int, str]:
    killed = counts.get("ok_killed", 0) + counts.get("ok_suspicious", 0)
    survived = counts.get("bad_survived", 0)
    timeout = counts.get("bad_timeout", 0)
    untested = counts.get("untested", 0)
    skipped = counts.get("skipped", 0)
    tested = killed + survived + timeout
    # A timed-out mutant is one the tests stopped (an infinite loop): counted as killed.
    pct = f"{100 * (killed + timeout) / tested:.1f}%" if tested else "n/a"
    return killed, survived, timeout, untested, skipped, pct


def report(results: list[dict], budget: float, argv: list[str]) -> str:
    out = [
        f"# Mutation testing, {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
        "",
        f"Command: `python scripts/mutation.py {' '.join(argv)}`  ",
        f"Tool: {TOOL}; budget {budget:.0f} s per module; git "
        + subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
        "",
        "Score = (killed + timeout) / tested; untested = not reached within the budget.",
        "",
        "| module | tests | killed | survived | timeout | untested | score | time |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        k, s, t, u, _, pct = score(r["counts"])
        stop = " (budget)" if r["stopped"] else ""
        out.append(
            f"| {r['module']} | {r['tests']} | {k} | {s} | {t} | {u} | {pct}"
            f" | {r['elapsed']:.0f} s{stop} |"
        )
    for r in results:
        out += ["", f"## {r['module']}: surviving mutants ({len(r['survivors'])})", ""]
        if not r["counts"]:
            out += ["mutmut produced no results; its log ends:", "", "```", r["log_tail"], "```"]
        for mid, line, diff in r["survivors"]:
            out += [f"### mutant {mid}, line {line}", "", "```diff", diff, "```", ""]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("modules", nargs="*", help="modules to mutate (default: all in TESTS)")
    ap.add_argument("--budget", type=float, default=600, help="seconds per module (600)")
    ap.add_argument("--jobs", type=int, default=1, help="modules run in parallel (1)")
    ap.add_argument(
        "--python",
        default=str(REPO / ".venv" / "bin" / "python"),
        help="the Python that runs the tests (the dev venv's)",
    )
    ap.add_argument("--out", type=Path, help="report path (benchmarks/out/mutation-<date>.md)")
    ap.add_argument("--keep", action="store_true", help="keep the /tmp work copies")
    args = ap.parse_args()
    modules = args.modules or list(TESTS)
    for m in modules:
        if m not in TESTS:
            ap.error(f"{m}: no tests mapped (add it to TESTS in {Path(__file__).name})")
    mutmut = ensure_venv()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(
            pool.map(lambda m: run_module(m, args.budget, args.python, mutmut, args.keep), modules)
        )
    text = report(results, args.budget, sys.argv[1:])
    out = args.out or REPO / "benchmarks" / "out" / f"mutation-{dt.date.today():%Y-%m-%d}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text.split("\n## ")[0])
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
