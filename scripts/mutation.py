#!/usr/bin/env python3
"""Mutation testing of fleetctl's pure core, by module, in bounded time.

Not part of CI and not a dev dependency: the tool (mutmut 2.5.1) lives in its own cached venv,
~/.cache/fleetctl/mutation-venv, made on first use with pip. Each module is mutated in a
throwaway copy of the working tree under /tmp (mutmut 2 edits the file in place and keeps its
.mutmut-cache in the current directory), so the checkout is never touched. Each module's
mutants run against only its fast tests (TESTS below), with the dev venv's Python.

    python scripts/mutation.py                       # every module in TESTS, 600 s each
    python scripts/mutation.py --budget 300 fleetctl/routing/scheduler.py
    python scripts/mutation.py --jobs 2              # modules in parallel (mutmut 2 is serial)
    python scripts/mutation.py --tests "tests/test_a.py tests/test_b.py" fleetctl/model/perf.py

Incremental by default: each module's .mutmut-cache is kept in benchmarks/out/mutation-cache/
(git-ignored) and copied into the next run's work copy. mutmut 2 then keeps killed mutants
killed and retests only survivors (and mutants of changed lines) when a test file changed, so
a run after a new test takes seconds, not minutes. --fresh ignores the cache: use it for a
number recorded in benchmarks/results/mutation.md.

A surviving mutant that cannot change behaviour is listed, with the reason, in
scripts/mutation_equivalents/<module>.toml (e.g. routing.scheduler.toml), matched by the
stripped original and mutated source lines, so the entry survives line-number shifts:

    [[equivalent]]
    line = "if now - t < self.window:"
    mutant = "if now - t <= self.window:"
    why = "float timestamps: the two differ only at equal times"

Score = (killed + timeout) / (tested - equivalent). A module whose budget runs out is stopped;
its untested mutants are reported as such and the score counts only the tested ones. The
report goes to benchmarks/out/mutation-<date>.md (git-ignored): killed / survived / timeout /
equivalent / score per module, each unexplained survivor's diff, and equivalence entries that
no longer match any survivor (stale: delete them).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOOL = "mutmut==2.5.1"
VENV = Path.home() / ".cache" / "fleetctl" / "mutation-venv"
CACHE = REPO / "benchmarks" / "out" / "mutation-cache"
EQUIVALENTS = REPO / "scripts" / "mutation_equivalents"

# routing/policies/'s modules by their tests: the baselines' as policy.py's (the same two
# simulations left out), the peers' by their rules, without the simulated workload.
BASELINES = ("round_robin", "least_outstanding", "power_of_two", "kv_aware")
BASELINE_TESTS = [
    "tests/routing/test_policy_units.py",
    "tests/routing/test_policy.py",
    "--deselect tests/routing/test_policy.py::test_session_affinity_holds_for_every_later_turn",
    "--deselect tests/routing/test_policy.py::test_strict_hints_in_simulation",
]
PEERS = ("cache_aware", "prefix_kv", "kv_router")
PEER_TESTS = [
    "tests/routing/test_peer_policies.py",
    "--deselect tests/routing/test_peer_policies.py::"
    "test_peer_policies_complete_a_simulated_workload",
]

# module -> the fast tests that exercise it (each file runs in a few seconds).
TESTS: dict[str, list[str]] = {
    # The two starvation tests simulate minutes of traffic; test_properties.py holds the same
    # property, so they are left out of the per-mutant run (this can only lower the score).
    "fleetctl/routing/scheduler.py": [
        "tests/routing/test_scheduler.py",
        "tests/routing/test_routing_warmup.py",
        "--deselect tests/routing/test_scheduler.py::"
        "test_low_priority_requests_do_not_starve_with_aging",
        "--deselect tests/routing/test_scheduler.py::"
        "test_low_priority_requests_starve_without_aging",
    ],
    "fleetctl/routing/policy.py": [
        "tests/routing/test_policy_units.py",
        "tests/routing/test_routing_warmup.py",
        "tests/routing/test_policy.py",
        "tests/routing/test_scheduler.py",
        "--deselect tests/routing/test_policy.py::test_session_affinity_holds_for_every_later_turn",
        "--deselect tests/routing/test_policy.py::test_strict_hints_in_simulation",
    ],
    "fleetctl/routing/request.py": ["tests/routing/test_routing_parse.py"],
    # The units file first: it kills most mutants within its ~2 s.
    "fleetctl/planner/optimize.py": [
        "tests/planner/test_planner_units.py",
        "tests/planner/test_planner.py",
        "tests/planner/test_cost.py",
    ],
    "fleetctl/planner/expand.py": [
        "tests/planner/test_planner_units.py",
        "tests/planner/test_planner.py",
    ],
    "fleetctl/model/perf.py": ["tests/model/test_perf.py"],
    # tests/sim/test_sim.py takes 14-35 s: too slow per mutant; these three take ~2.5 s together.
    "fleetctl/sim/engine.py": [
        "tests/sim/test_sim_engine.py",
        "tests/sim/test_sim_vllm_rules.py",
        "tests/sim/test_lora_engine.py",
    ],
    "fleetctl/apply/steps.py": ["tests/apply/test_apply_steps.py"],
    **{f"fleetctl/routing/policies/{m}.py": BASELINE_TESTS for m in BASELINES},
    **{f"fleetctl/routing/policies/{m}.py": PEER_TESTS for m in PEERS},
    "fleetctl/daemon/relay.py": ["tests/daemon/test_relay.py"],
    "fleetctl/vllm/metrics.py": ["tests/vllm/test_vllm_metrics.py"],
}


def module_key(module: str) -> str:
    """fleetctl/routing/scheduler.py -> routing.scheduler (cache and equivalents file names)."""
    return module.removeprefix("fleetctl/").removesuffix(".py").replace("/", ".")


def load_equivalents(module: str) -> list[dict[str, str]]:
    path = EQUIVALENTS / f"{module_key(module)}.toml"
    if not path.exists():
        return []
    entries = tomllib.loads(path.read_text()).get("equivalent", [])
    for e in entries:
        missing = {"line", "mutant", "why"} - set(e)
        if missing:
            raise SystemExit(f"{path}: an [[equivalent]] entry lacks {sorted(missing)}")
    return entries


def changed_lines(diff: str) -> tuple[str, str]:
    """The (original, mutated) source line of a one-line mutant's diff, stripped; blank lines
    dropped (a removed decorator's diff also takes the blank line above it)."""

    def side(mark: str, header: str) -> str:
        lines = (
            ln[1:].strip()
            for ln in diff.splitlines()
            if ln[:1] == mark and not ln.startswith(header)
        )
        return " ".join(ln for ln in lines if ln)

    return side("-", "---"), side("+", "+++")


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


def hash_of_tests(tests: Path) -> str:
    """mutmut 2's hash of the test files (mutmut/cache.py hash_of_tests, for one folder): a
    mutant tested against another hash was not tried with the tests as they are now."""
    h = hashlib.sha256()
    for root, _dirs, files in os.walk(tests):
        for name in files:
            if name.endswith(".py") and (
                name.startswith("test") or name.endswith("_tests.py") or "test" in root
            ):
                h.update((Path(root) / name).read_bytes())
    return h.hexdigest()


def not_tried(work: Path, tests_hash: str) -> list[int]:
    """Mutants neither killed nor tried against the current tests."""
    db = sqlite3.connect(work / ".mutmut-cache")
    try:
        rows = db.execute(
            "SELECT id FROM Mutant WHERE status = 'untested'"
            " OR (status != 'ok_killed' AND tested_against_hash != ?) ORDER BY id",
            (tests_hash,),
        ).fetchall()
    finally:
        db.close()
    return [r[0] for r in rows]


def cache_of(work: Path) -> bool:
    return (work / ".mutmut-cache").exists()


def save_cache(src: Path, dest: Path) -> None:
    """Copy mutmut's SQLite cache through SQLite itself: a run stopped by the budget may leave a
    hot journal beside it, which a plain file copy would lose (mutmut then finds the copy "out
    of date" and clears it)."""
    tmp = dest.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    with sqlite3.connect(src) as a, sqlite3.connect(tmp) as b:
        a.backup(b)
    a.close()
    b.close()
    tmp.replace(dest)


def restore_module(work: Path, module: str) -> None:
    """A run stopped mid-mutant leaves the mutant in place and the original in MODULE.bak."""
    bak = work / (module + ".bak")
    if bak.exists():
        bak.replace(work / module)


def run_module(
    module: str,
    budget: float,
    python: str,
    mutmut: Path,
    keep: bool,
    tests: str,
    fresh: bool,
) -> dict:
    work = Path(tempfile.mkdtemp(prefix="fleetctl-mutation-", dir="/tmp"))
    cached = CACHE / f"{module_key(module)}.sqlite"
    try:
        copy_tree(work)
        if cached.exists() and not fresh:
            shutil.copy2(cached, work / ".mutmut-cache")
        # mutmut 2 splits the runner on spaces (no shell), so PYTHONPATH travels in env. The
        # tests run through run_tests(): mutmut 2 counts only pytest's exit 1 as a kill, so a
        # mutant that breaks an import (exit 2 or 4) would count as a survivor. The hypothesis
        # and anyio plugins cost more than the core tests; @given tests run without them.
        runner = (
            f"{python} {work / 'scripts' / 'mutation.py'} --run-tests -x -q -p no:cacheprovider"
            f" -p no:hypothesispytest -p no:anyio {tests}"
        )
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
        alone = 0

        def run(argv: list[str]) -> bool:
            """Run mutmut within what is left of the budget; False once the budget is out."""
            proc = subprocess.Popen(
                argv,
                cwd=work,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=max(1.0, budget - (time.monotonic() - t0)))
                return True
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                restore_module(work, module)
                return False

        stopped = not run(cmd)
        # mutmut 2's whole-module run can end with mutants it never tried: its queue skips
        # some cached rows (duplicate source lines, boxed/mutmut#280) and its worker sometimes
        # ends without a word. `mutmut run ID` tries one mutant, so each left is run alone.
        tests_hash = hash_of_tests(work / "tests")
        for mid in [] if stopped else not_tried(work, tests_hash):
            alone += 1
            log.write(f"\n[mutation.py] mutant {mid} was not tried: running it alone\n")
            log.flush()
            if not run([*cmd[:2], str(mid), *cmd[2:]]):
                stopped = True
                break
        log.close()
        elapsed = time.monotonic() - t0
        rows = statuses(work) if cache_of(work) else []
        if rows:
            CACHE.mkdir(parents=True, exist_ok=True)
            save_cache(work / ".mutmut-cache", cached)
        known = load_equivalents(module)
        used: set[int] = set()
        survivors, equivalent = [], []
        for mid, line, status in rows:
            if status != "bad_survived":
                continue
            diff = subprocess.run(
                [str(mutmut), "show", str(mid)], cwd=work, env=env, capture_output=True, text=True
            ).stdout.strip()
            old, new = changed_lines(diff)
            match = next(
                (
                    i
                    for i, e in enumerate(known)
                    if e["line"].strip() == old and e["mutant"].strip() == new
                ),
                None,
            )
            if match is None:
                survivors.append((mid, line, diff))
            else:
                used.add(match)
                equivalent.append((mid, line, known[match]["why"]))
        counts: dict[str, int] = {}
        for _, _, status in rows:
            counts[status] = counts.get(status, 0) + 1
        counts["equivalent"] = len(equivalent)
        return {
            "equivalent": equivalent,
            "stale": [e for i, e in enumerate(known) if i not in used],
            "module": module,
            "tests": tests,
            "elapsed": elapsed,
            "stopped": stopped,
            "alone": alone,
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
    """(killed, unexplained survivors, timeout, untested, equivalent, score)."""
    killed = counts.get("ok_killed", 0) + counts.get("ok_suspicious", 0)
    equivalent = counts.get("equivalent", 0)
    survived = counts.get("bad_survived", 0) - equivalent
    timeout = counts.get("bad_timeout", 0)
    untested = counts.get("untested", 0)
    tested = killed + survived + timeout
    # A timed-out mutant is one the tests stopped (an infinite loop): counted as killed.
    pct = f"{100 * (killed + timeout) / tested:.1f}%" if tested else "n/a"
    return killed, survived, timeout, untested, equivalent, pct


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
        "Score = (killed + timeout) / (tested - equivalent); untested = not reached within the"
        " budget; equivalent = survivors listed in scripts/mutation_equivalents/ with a reason.",
        "",
        "| module | tests | killed | survived | timeout | equivalent | untested | score | time |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        k, s, t, u, e, pct = score(r["counts"])
        stop = " (budget)" if r["stopped"] else ""
        if r["alone"]:
            stop += f" ({r['alone']} run alone)"
        out.append(
            f"| {r['module']} | {r['tests']} | {k} | {s} | {t} | {e} | {u} | {pct}"
            f" | {r['elapsed']:.0f} s{stop} |"
        )
    for r in results:
        out += ["", f"## {r['module']}: surviving mutants ({len(r['survivors'])})", ""]
        if not r["counts"]:
            out += ["mutmut produced no results; its log ends:", "", "```", r["log_tail"], "```"]
        for mid, line, diff in r["survivors"]:
            out += [f"### mutant {mid}, line {line}", "", "```diff", diff, "```", ""]
        if r["stale"]:
            out += [
                f"Stale entries in scripts/mutation_equivalents/{module_key(r['module'])}.toml"
                " (no survivor matches them; delete them):",
                "",
            ]
            out += [f"- `{e['line']}` -> `{e['mutant']}`" for e in r["stale"]]
    return "\n".join(out) + "\n"


def run_tests(args: list[str]) -> int:
    """The runner mutmut calls per mutant: pytest, with every failure (a test, a collection or
    an import error) as exit 1, the only code mutmut takes for a killed mutant."""
    import pytest

    return 0 if pytest.main(args) == 0 else 1


def main() -> int:
    if sys.argv[1:2] == ["--run-tests"]:
        return run_tests(sys.argv[2:])
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
    ap.add_argument("--tests", help="test files for the one module given, instead of TESTS's")
    ap.add_argument(
        "--fresh", action="store_true", help="ignore the kept cache: test every mutant again"
    )
    args = ap.parse_args()
    modules = args.modules or list(TESTS)
    if args.tests and len(modules) != 1:
        ap.error("--tests needs exactly one module")
    for m in modules:
        if m not in TESTS and not args.tests:
            ap.error(f"{m}: no tests mapped (add it to TESTS in {Path(__file__).name})")
    mutmut = ensure_venv()

    def one(m: str) -> dict:
        tests = args.tests or " ".join(TESTS[m])
        return run_module(m, args.budget, args.python, mutmut, args.keep, tests, args.fresh)

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(one, modules))
    text = report(results, args.budget, sys.argv[1:])
    out = args.out or REPO / "benchmarks" / "out" / f"mutation-{dt.date.today():%Y-%m-%d}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text.split("\n## ")[0])
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
