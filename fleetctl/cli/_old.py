"""The command line: thin typer commands, one error boundary; heavy imports wait for the command."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from fleetctl.catalog import Catalog
    from fleetctl.inventory import Inventory

app = typer.Typer(
    name="fleetctl",
    help="Plan, apply, route and simulate vLLM serving on heterogeneous GPU fleets.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
profiles_app = typer.Typer(
    help="List, show and import hardware and model profiles.", no_args_is_help=True
)
app.add_typer(profiles_app, name="profiles")

EXAMPLE_PREFIX = "example:"

InventoryArg = typer.Argument(
    ...,
    help="Inventory YAML, or example:NAME for a bundled example (see `fleetctl examples`).",
    show_default=False,
)
ProfilesOpt = typer.Option(
    None,
    "--profiles",
    help="Folder of extra profiles (gpus/, models/, formats/); overrides bundled ones by name. "
    "Repeatable; FLEETCTL_PROFILES works too.",
)
JsonOpt = typer.Option(False, "--json", help="Print JSON instead of tables.")


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
) -> None:
    """fleetctl: run a mixed GPU fleet serving open-weight LLMs with vLLM."""
    if debug:
        _debug_logging()


class _Stderr:
    """A logging stream that is whatever sys.stderr is at the time (tests swap it)."""

    def write(self, text: str) -> None:
        sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _debug_logging() -> None:
    """--debug: paramiko's own log and each SSH failure's traceback go to stderr.

    Without it they stay quiet (fleetctl.ssh silences paramiko): one line per node is enough.
    """
    import logging

    for name in ("paramiko", "fleetctl.ssh"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        if not any(getattr(h, "fleetctl_debug", False) for h in logger.handlers):
            handler = logging.StreamHandler(_Stderr())
            handler.setFormatter(logging.Formatter("debug: %(name)s: %(message)s"))
            handler.fleetctl_debug = True  # type: ignore[attr-defined]
            logger.addHandler(handler)


def _unchecked(console: Any, lines: list[str], total: int, verb: str = "check") -> None:
    """One line per node that could not be reached, then how many: unwrapped, no markup."""
    for line in lines:
        console.print(line, style="red", markup=False, highlight=False, soft_wrap=True)
    if lines:
        console.print(
            f"could not {verb} {len(lines)} of {total} nodes", style="red", highlight=False
        )


def _console() -> Any:
    from rich.console import Console

    # Piped output gets a wide page rather than rich's 80 columns, so tables stay on one line.
    wide = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160
    return Console(width=wide)


def _resolve_inventory_path(arg: str) -> Path:
    from fleetctl.errors import UserError
    from fleetctl.resources import examples

    if arg.startswith(EXAMPLE_PREFIX):
        name = arg[len(EXAMPLE_PREFIX) :]
        found = examples()
        if name not in found:
            raise UserError(
                f"no bundled example '{name}'",
                None,
                f"choose one of: {', '.join(found)}",
            )
        return found[name]
    return Path(arg)


def _load(
    inventory: str, profiles: list[Path] | None, ssh: bool = False
) -> tuple[Inventory, Catalog]:
    """Load the inventory; `ssh`: this command connects, so its key files must exist."""
    from fleetctl.catalog import load_catalog
    from fleetctl.inventory import load_inventory

    catalog = load_catalog(profiles)
    inv = load_inventory(_resolve_inventory_path(inventory), catalog)
    if ssh:
        inv.check_ssh_files()
    return inv, catalog


def dump_json(data: Any) -> str:
    """Indented JSON, except that list items print one per line: as readable for small
    documents and ~10x faster for plans with thousands of deployments (indent=N makes the
    json module fall back to pure Python)."""
    if not isinstance(data, dict):
        return json.dumps(data, indent=2)
    lines = ["{"]
    for i, (key, value) in enumerate(data.items()):
        comma = "," if i < len(data) - 1 else ""
        if isinstance(value, list) and value:
            items = ",\n    ".join(json.dumps(v, separators=(", ", ": ")) for v in value)
            lines.append(f"  {json.dumps(key)}: [\n    {items}\n  ]{comma}")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}{comma}")
    lines.append("}")
    return "\n".join(lines)


def _print_json(data: Any) -> None:
    sys.stdout.write(dump_json(data) + "\n")


@app.command()
def validate(
    inventory: str = InventoryArg,
    profiles: list[Path] = ProfilesOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Check an inventory and its profiles; print what it declares."""
    inv, _ = _load(inventory, profiles)
    gpus = sum(n.gpu_count for n in inv.nodes)
    if as_json:
        _print_json(
            {
                "inventory": str(inv.path),
                "nodes": len(inv.nodes),
                "gpus": gpus,
                "models": [m.name for m in inv.models],
            }
        )
        return
    _console().print(
        f"[green]ok[/green] {inv.path}: {len(inv.nodes)} nodes, {gpus} GPUs, "
        f"{len(inv.models)} models"
    )


@app.command()
def plan(
    inventory: str = InventoryArg,
    facts: Path | None = typer.Option(
        None, "--facts", help="Probed facts JSON (default: .fleetctl/facts.json when present)."
    ),
    state_dir: Path | None = typer.Option(
        None, "--state-dir", help="State folder (default: .fleetctl beside the inventory)."
    ),
    profiles: list[Path] = ProfilesOpt,
    as_json: bool = JsonOpt,
    out: Path | None = typer.Option(
        None, "-o", "--out", help="Write the plan as JSON to this file."
    ),
    explain: bool = typer.Option(False, "--explain", help="Show why each deployment is placed so."),
) -> None:
    """Compute which model, format and TP size runs on which GPUs, and the diff to what runs."""
    import dataclasses

    from fleetctl.facts import apply_facts, load_facts
    from fleetctl.planner import plan_fleet
    from fleetctl.state import load_state, write_atomic

    inv, catalog = _load(inventory, profiles)
    sdir = state_dir or inv.state_dir
    facts_path = facts or (sdir / "facts.json")
    notes: list[str] = []
    if facts is not None or facts_path.is_file():
        inv, notes = apply_facts(inv, load_facts(facts_path), catalog)
    result = plan_fleet(inv, load_state(sdir))
    if notes:
        result = dataclasses.replace(result, warnings=(*notes, *result.warnings))
    if out is not None:
        # `apply plan.json` may run from another folder: name the inventory absolutely.
        saved = dataclasses.replace(result, inventory=str(Path(result.inventory).resolve()))
        write_atomic(out, dump_json(saved.to_json()) + "\n")
    if as_json:
        _print_json(result.to_json())
        _incomplete(result)
        return
    from fleetctl.render import render_plan

    console = _console()
    console.print(render_plan(result, explain))
    if out is not None:
        console.print(f"Saved the plan to {out}; apply exactly it with `fleetctl apply {out}`.")
    _incomplete(result)


def _incomplete(result: Any) -> None:
    """Exit 3 when a model could not be placed: the plan is valid, but not all of it."""
    if not result.unplaced:
        return
    names = ", ".join(u.model for u in result.unplaced)
    sys.stderr.write(
        f"plan incomplete: {len(result.unplaced)} model(s) could not be placed ({names}); "
        "the rest of the plan is valid (exit code 3)\n"
    )
    raise typer.Exit(3)


@app.command()
def simulate(
    inventory: str = InventoryArg,
    workload: str | None = typer.Option(
        None,
        "--workload",
        help="Synthetic workload, key=value,... (rate, duration, prompt, output, long_share, "
        "long_prompt, max_context, lengths, arrivals, burst, sessions, turns, priorities, "
        "precision); or a YAML file of the same keys.",
    ),
    trace: Path | None = typer.Option(
        None, "--trace", help="Request trace CSV: TIMESTAMP,ContextTokens,GeneratedTokens."
    ),
    policies: str = typer.Option(
        "round-robin,least-outstanding,power-of-two,kv-aware,hardware-aware",
        "--policies",
        help="Comma-separated routing policies to compare.",
    ),
    load: float | None = typer.Option(
        None, "--load", help="Scale arrivals to this share of the fleet's capacity (e.g. 0.8)."
    ),
    model: str | None = typer.Option(None, "--model", help="Which model the workload targets."),
    limit: int | None = typer.Option(None, "--limit", help="Use only the first N trace requests."),
    seed: int = typer.Option(0, "--seed", help="Random seed (workload and policies)."),
    no_aging: bool = typer.Option(False, "--no-aging", help="Turn priority aging off."),
    profiles: list[Path] = ProfilesOpt,
    as_json: bool = JsonOpt,
    plot: Path | None = typer.Option(None, "--plot", help="Write a TTFT CDF per policy (PNG)."),
) -> None:
    """Replay a workload over the planned fleet with each policy; compare TTFT and more."""
    from fleetctl.sim.command import run_simulate

    inv, _ = _load(inventory, profiles)
    data, renderable = run_simulate(
        inv, workload, trace, policies, load, model, limit, seed, no_aging, plot, not as_json
    )
    if as_json:
        _print_json(data)
    else:
        _console().print(renderable)


@app.command("route-serve")
def route_serve(
    inventory: str = InventoryArg,
    listen: str | None = typer.Option(
        None, "--listen", help="HOST:PORT to bind (default: the inventory's router.listen)."
    ),
    backends: Path | None = typer.Option(
        None, "--backends", help="YAML list of servers fleetctl did not launch (default: state)."
    ),
    policy: str = typer.Option("hardware-aware", "--policy", help="Routing policy."),
    api_key_file: Path | None = typer.Option(
        None, "--api-key-file", help="File (mode 0600) with the key clients must send."
    ),
    backend_api_key_file: Path | None = typer.Option(
        None, "--backend-api-key-file", help="File (mode 0600) with the key to send to backends."
    ),
    max_body_mb: float = typer.Option(32.0, "--max-body-mb", help="Largest request body."),
    upstream_timeout: float = typer.Option(
        600.0, "--upstream-timeout", help="Seconds to wait for a backend's next byte."
    ),
    scrape_interval: float = typer.Option(
        0.25, "--scrape-interval", help="Seconds between /metrics scrapes of each backend."
    ),
    session_store: str | None = typer.Option(
        None,
        "--session-store",
        help="redis://HOST:PORT/DB: share session affinity and the aging window across replicas.",
    ),
    state_dir: Path | None = typer.Option(None, "--state-dir", help="State folder."),
    profiles: list[Path] = ProfilesOpt,
) -> None:
    """Run the OpenAI-compatible routing daemon in front of the fleet (SIGHUP reloads)."""
    from fleetctl.router.daemon import DaemonConfig
    from fleetctl.router.serve import build_router, read_secret, serve

    inv, catalog = _load(inventory, profiles)
    sdir = state_dir or inv.state_dir
    key = (
        read_secret(api_key_file, "API key file")
        if api_key_file
        else os.environ.get("FLEETCTL_API_KEY")
    )
    backend_key = (
        read_secret(backend_api_key_file, "backend API key file") if backend_api_key_file else None
    )
    config = DaemonConfig(
        max_body_bytes=int(max_body_mb * 2**20),
        upstream_timeout_s=upstream_timeout,
        api_key=key or None,
        backend_api_key=backend_key,
        priority_classes=inv.spec.router.priority_classes,
    )

    def make():  # type: ignore[no-untyped-def]
        return build_router(
            inv,
            catalog,
            backends_file=backends,
            state_dir=sdir,
            policy=policy,
            config=config,
            scrape_interval=scrape_interval,
            session_store=session_store,
        )

    router = make()

    def reload():  # type: ignore[no-untyped-def]
        from fleetctl.router.backends import load_backends

        fresh_inv, fresh_catalog = _load(inventory, profiles)
        return load_backends(fresh_inv, fresh_catalog, backends, sdir)

    serve(router, listen or inv.spec.router.listen, reload, None if backends else sdir)


@app.command()
def probe(
    inventory: str | None = typer.Argument(None, help="Inventory YAML (not needed with --local)."),
    local: bool = typer.Option(False, "--local", help="Probe this machine instead, without SSH."),
    parallel: int = typer.Option(32, "--parallel", min=1, help="Nodes probed at once."),
    accept_new: bool = typer.Option(
        False,
        "--accept-new-host-keys",
        help="Trust and record unknown host keys (OpenSSH's accept-new); changed keys are refused.",
    ),
    known_hosts: Path | None = typer.Option(
        None, "--known-hosts", help="known_hosts file (default ~/.ssh/known_hosts)."
    ),
    timeout: float = typer.Option(30.0, "--timeout", help="Seconds per command on a node."),
    state_dir: Path | None = typer.Option(None, "--state-dir", help="State folder."),
    profiles: list[Path] = ProfilesOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Gather each node's GPUs, driver, CUDA, vLLM and OS over SSH into .fleetctl/facts.json."""
    from fleetctl.errors import UserError

    if local:
        from fleetctl.probe import local_facts

        _print_json(local_facts())
        return
    if inventory is None:
        raise UserError("give an inventory, or --local for this machine", None, "see --help")
    from fleetctl.probe import probe_fleet
    from fleetctl.ssh import SshOptions
    from fleetctl.state import write_atomic

    inv, _ = _load(inventory, profiles, ssh=True)
    options = SshOptions(known_hosts, accept_new, inv.spec.ssh.connect_timeout_s, timeout)
    if as_json or not sys.stderr.isatty():
        facts = probe_fleet(inv, options, parallel)
    else:
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            task = bar.add_task("probing", total=len(inv.nodes))
            facts = probe_fleet(inv, options, parallel, on_done=lambda _: bar.advance(task))
    path = (state_dir or inv.state_dir) / "facts.json"
    write_atomic(path, json.dumps(facts, indent=2) + "\n")
    failed = [f["error"] for _, f in sorted(facts["nodes"].items()) if "error" in f]
    if as_json:
        _print_json(facts)
    else:
        from fleetctl.render import facts_table

        console = _console()
        console.print(facts_table(facts))
        _unchecked(console, [e.get("line") or e["detail"] for e in failed], len(inv.nodes), "probe")
        console.print(f"Saved to {path}.")
    if failed:
        raise typer.Exit(1)


@app.command()
def health(
    inventory: str = InventoryArg,
    parallel: int = typer.Option(32, "--parallel", min=1, help="Nodes probed at once."),
    accept_new: bool = typer.Option(
        False, "--accept-new-host-keys", help="Trust and record unknown host keys."
    ),
    known_hosts: Path | None = typer.Option(None, "--known-hosts", help="known_hosts file."),
    timeout: float = typer.Option(30.0, "--timeout", help="Seconds per command on a node."),
    state_dir: Path | None = typer.Option(None, "--state-dir", help="State folder."),
    profiles: list[Path] = ProfilesOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Check nodes and servers: reachability, version skew in a class, GPUs, ECC, servers."""
    from fleetctl import health as h
    from fleetctl.probe import probe_fleet
    from fleetctl.ssh import SshOptions
    from fleetctl.state import load_state, write_atomic

    inv, _ = _load(inventory, profiles, ssh=True)
    sdir = state_dir or inv.state_dir
    facts_path = sdir / "facts.json"
    try:
        before = json.loads(facts_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        before = None
    options = SshOptions(known_hosts, accept_new, inv.spec.ssh.connect_timeout_s, timeout)
    facts = probe_fleet(inv, options, parallel)
    write_atomic(facts_path, json.dumps(facts, indent=2) + "\n")
    deployments = load_state(sdir).deployments
    skew, equivalent = h.check_skew(inv, facts)
    checks = [
        *h.check_reachability(facts),
        *skew,
        *h.check_changes(before, facts),
        *h.check_gpus(facts, deployments),
        *h.check_servers(deployments),
    ]
    # The router reads node equivalence from here (a non-equivalent node is its own class).
    write_atomic(
        sdir / "health.json",
        json.dumps({"checked_at": facts["probed_at"], "equivalent": equivalent}, indent=2) + "\n",
    )
    healthy = all(c.status != "fail" for c in checks)
    if as_json:
        _print_json({"healthy": healthy, "checks": [c.to_json() for c in checks]})
    else:
        from rich.table import Table

        t = Table(title="Health", title_justify="left", header_style="bold", pad_edge=False)
        for col in ("check", "node", "status", "detail"):
            t.add_column(col)
        style = {"ok": "green", "warn": "yellow", "fail": "red"}
        for c in checks:
            t.add_row(c.check, c.node, f"[{style[c.status]}]{c.status}[/]", c.detail)
        console = _console()
        console.print(t)
        unreached = sum(1 for f in facts["nodes"].values() if "error" in f)
        if unreached:
            console.print(f"[red]could not check {unreached} of {len(inv.nodes)} nodes[/]")
        console.print("[green]healthy[/]" if healthy else "[red]unhealthy[/]")
    if not healthy:
        raise typer.Exit(1)


KnownHostsOpt = typer.Option(
    None, "--known-hosts", help="known_hosts file (default ~/.ssh/known_hosts)."
)
AcceptNewOpt = typer.Option(
    False,
    "--accept-new-host-keys",
    help="Trust and record unknown host keys (OpenSSH's accept-new); changed keys are refused.",
)
YesOpt = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation.")


@app.command()
def apply(
    target: str = typer.Argument(
        ...,
        help="Inventory YAML (plans now), example:NAME, or a plan saved with `plan -o FILE.json` "
        "(applied exactly, if the state has not changed since).",
        show_default=False,
    ),
    yes: bool = YesOpt,
    parallel: int = typer.Option(32, "--parallel", min=1, help="Nodes worked on at once."),
    secrets_file: Path | None = typer.Option(
        None, "--secrets-file", help="0600 file of KEY=VALUE secrets named in apply.secrets."
    ),
    facts: Path | None = typer.Option(None, "--facts", help="Probed facts JSON."),
    accept_new: bool = AcceptNewOpt,
    known_hosts: Path | None = KnownHostsOpt,
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds per command on a node."),
    state_dir: Path | None = typer.Option(None, "--state-dir", help="State folder."),
    profiles: list[Path] = ProfilesOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Start, replace and stop vLLM servers over SSH until the nodes run the plan."""
    from fleetctl.apply.commands import (
        Common,
        check_saved_plan,
        is_plan_file,
        read_plan_file,
        run_apply,
    )

    plan_file = None
    if is_plan_file(target):
        inv_path, serial, deployments = read_plan_file(Path(target))
        inv, catalog = _load(inv_path, profiles, ssh=True)
        check_saved_plan(Path(target), deployments, inv)
        plan_file = (Path(target), serial, deployments)
    else:
        inv, catalog = _load(target, profiles, ssh=True)
    c = Common(known_hosts, accept_new, timeout, parallel, state_dir, as_json, yes)

    planned: list[Any] = []

    def make_plan(state):  # type: ignore[no-untyped-def]
        import dataclasses

        from fleetctl.facts import apply_facts, load_facts
        from fleetctl.planner import plan_fleet

        facts_path = facts or ((state_dir or inv.state_dir) / "facts.json")
        planned_inv, notes = inv, list[str]()
        if facts is not None or facts_path.is_file():
            planned_inv, notes = apply_facts(inv, load_facts(facts_path), catalog)
        result = plan_fleet(planned_inv, state)
        planned.append(result)
        return dataclasses.replace(result, warnings=(*notes, *result.warnings))

    code = run_apply(inv, c, make_plan, plan_file, secrets_file, _console())
    if code:
        raise typer.Exit(code)
    if planned:  # applied as planned, but a model is missing from the plan: say so, exit 3
        _incomplete(planned[0])


@app.command()
def status(
    inventory: str = InventoryArg,
    parallel: int = typer.Option(32, "--parallel", min=1, help="Nodes asked at once."),
    accept_new: bool = AcceptNewOpt,
    known_hosts: Path | None = KnownHostsOpt,
    timeout: float = typer.Option(30.0, "--timeout", help="Seconds per command on a node."),
    state_dir: Path | None = typer.Option(None, "--state-dir", help="State folder."),
    profiles: list[Path] = ProfilesOpt,
    as_json: bool = JsonOpt,
) -> None:
    """What state.json records, checked live on the nodes: running, dead, drifted, ports."""
    from fleetctl.apply.commands import Common, options
    from fleetctl.apply.status import status_fleet
    from fleetctl.state import load_state

    inv, _ = _load(inventory, profiles, ssh=True)
    c = Common(known_hosts, accept_new, timeout, parallel, state_dir, as_json, True)
    state = load_state(state_dir or inv.state_dir)
    rows, summary = status_fleet(inv, state, options(inv, c))
    unreachable = summary["unreachable"]
    # Every server running, and every node asked: nothing unchecked passes for fine.
    good = all(r.condition == "running" for r in rows) and not unreachable
    if as_json:
        _print_json({"ok": good, **summary, "servers": [r.to_json() for r in rows]})
    else:
        from rich.table import Table

        t = Table(title="Servers", title_justify="left", header_style="bold", pad_edge=False)
        for col in ("node", "model", "GPUs", "port", "condition", "detail"):
            t.add_column(col)
        for r in rows:
            style = "green" if r.condition == "running" else "red"
            gpus = ",".join(map(str, r.gpus))
            # An unreachable node's one line follows the table, once per node, not per server.
            detail = "node not checked: see below" if r.condition == "unreachable" else r.detail
            t.add_row(r.node, r.model, gpus, str(r.port), f"[{style}]{r.condition}[/]", detail)
        console = _console()
        if rows:
            console.print(t)
        _unchecked(console, [u["line"] for u in unreachable], summary["nodes"])
        console.print(f"{len(rows)} servers, state serial {summary['serial']}.")
    if not good:
        raise typer.Exit(1)


@app.command()
def destroy(
    inventory: str = InventoryArg,
    yes: bool = YesOpt,
    parallel: int = typer.Option(32, "--parallel", min=1, help="Nodes worked on at once."),
    accept_new: bool = AcceptNewOpt,
    known_hosts: Path | None = KnownHostsOpt,
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds per command on a node."),
    state_dir: Path | None = typer.Option(None, "--state-dir", help="State folder."),
    profiles: list[Path] = ProfilesOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Stop every server fleetctl started on the nodes and empty the state."""
    from fleetctl.apply.commands import Common, run_destroy

    inv, _ = _load(inventory, profiles, ssh=True)
    c = Common(known_hosts, accept_new, timeout, parallel, state_dir, as_json, yes)
    code = run_destroy(inv, c, _console())
    if code:
        raise typer.Exit(code)


@app.command()
def examples(as_json: bool = JsonOpt) -> None:
    """List the bundled example inventories (use them as example:NAME)."""
    from fleetctl.resources import examples as bundled_examples

    found = bundled_examples()
    if as_json:
        _print_json({name: str(path) for name, path in found.items()})
        return
    for name, path in found.items():
        first = path.read_text(encoding="utf-8").splitlines()[0].lstrip("# ")
        typer.echo(f"example:{name:<22} {first}")


@profiles_app.command("list")
def profiles_list(profiles: list[Path] = ProfilesOpt, as_json: bool = JsonOpt) -> None:
    """List the GPU, model and format profiles."""
    from fleetctl.catalog import load_catalog

    cat = load_catalog(profiles)
    if as_json:
        _print_json(
            {
                "gpus": {k: v.model_dump() for k, v in cat.gpus.items()},
                "models": {k: v.model_dump() for k, v in cat.models.items()},
                "formats": {k: v.model_dump() for k, v in cat.formats.items()},
            }
        )
        return
    from fleetctl.render import profiles_table

    _console().print(profiles_table(cat))


@profiles_app.command("show")
def profiles_show(name: str, profiles: list[Path] = ProfilesOpt) -> None:
    """Show one profile (GPU, model or format) by name or alias."""
    from fleetctl.catalog import load_catalog
    from fleetctl.errors import UserError

    cat = load_catalog(profiles)
    found: Any = cat.find_gpu(name)
    if found is None:
        for table in (cat.models, cat.formats):
            found = next((v for k, v in table.items() if k.lower() == name.lower()), None)
            if found:
                break
    if found is None:
        from fleetctl.errors import did_you_mean

        hint = did_you_mean(name, [*cat.gpus, *cat.models, *cat.formats])
        raise UserError(
            f"no profile named '{name}'",
            None,
            f"did you mean '{hint}'?" if hint else "see `fleetctl profiles list`",
        )
    _print_json(found.model_dump())


@profiles_app.command("import-hf-config")
def profiles_import(
    config: Path = typer.Argument(..., help="A Hugging Face config.json."),
    name: str = typer.Option(..., "--name", help="Profile name to create."),
    hf_id: str | None = typer.Option(None, "--hf-id", help="The model's Hugging Face id."),
    out: Path = typer.Option(
        Path("profiles"), "--out", help="Profiles folder to write into (models/NAME.yaml)."
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing profile file."),
) -> None:
    """Add a model profile from a Hugging Face config.json (parameter counts computed)."""
    import yaml

    from fleetctl.catalog import ModelProfile
    from fleetctl.errors import Location, UserError
    from fleetctl.hfconfig import profile_from_config, read_config
    from fleetctl.state import write_atomic

    data = profile_from_config(read_config(config), name, config, hf_id)
    try:
        ModelProfile.model_validate(data)
    except ValueError as e:
        raise UserError(
            f"the config gives an invalid profile: {e}", Location(str(config))
        ) from None
    target = out / "models" / f"{name}.yaml"
    if target.exists() and not force:
        raise UserError("profile file exists", Location(str(target)), "pass --force to overwrite")
    header = f"# {name}: imported from {config.name} by `fleetctl profiles import-hf-config`.\n"
    write_atomic(target, header + yaml.safe_dump(data, sort_keys=False))
    typer.echo(
        f"wrote {target} ({data['params_total'] / 1e9:.2f}B parameters); "
        f"use it with --profiles {out} or FLEETCTL_PROFILES={out}"
    )


@app.command(
    # `vllm serve`'s flags are forwarded as they are (a `vllm` shim on test hosts calls this),
    # so argparse parses them; typer would reject the hundreds it does not declare.
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def emulate(ctx: typer.Context) -> None:
    """Serve one emulated vLLM OpenAI-compatible server on a modelled GPU (see emulate --help)."""
    from fleetctl.emulator.args import parse_args
    from fleetctl.emulator.config import resolve

    args, ignored = parse_args(list(ctx.args))
    for flag in ignored:
        sys.stderr.write(f"warning: emulate ignores the vllm serve flag {flag}\n")
    config = resolve(args)
    from fleetctl.emulator.server import serve

    serve(config)


@app.command()
def version() -> None:
    """Print fleetctl's version."""
    from fleetctl import __version__

    typer.echo(f"fleetctl {__version__}")


def main() -> None:
    """Entry point: run the app inside the one error boundary."""
    debug = "--debug" in sys.argv[1:] or os.environ.get("FLEETCTL_DEBUG") == "1"
    try:
        app()
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    except Exception as e:
        from fleetctl.errors import FleetError

        if debug:
            raise
        if isinstance(e, FleetError):
            sys.stderr.write(f"error: {e}\n")
            sys.exit(e.exit_code)
        sys.stderr.write(
            f"internal error: {type(e).__name__}: {e} (run with --debug for the traceback)\n"
        )
        sys.exit(1)
