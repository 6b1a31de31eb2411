"""`probe` and `health`: what the nodes run, and whether the fleet is fit to serve."""

from __future__ import annotations

from pathlib import Path

import typer

from fleetctl.base.jsonout import print_json
from fleetctl.cli import common
from fleetctl.cli.app import app
from fleetctl.cli.options import (
    AcceptNewOpt,
    InventoryArg,
    JsonOpt,
    KnownHostsOpt,
    ProfilesOpt,
    StateDirOpt,
    no_calibration,
    parallel,
    timeout,
)


@app.command()
def probe(
    inventory: str | None = typer.Argument(
        None, metavar="[INVENTORY]", help="Inventory YAML (not needed with --local)."
    ),
    local: bool = typer.Option(False, "--local", help="Probe this machine instead, without SSH."),
    parallel: int = parallel("probed"),
    accept_new: bool = AcceptNewOpt,
    known_hosts: Path | None = KnownHostsOpt,
    timeout: float = timeout(30.0),
    state_dir: Path | None = StateDirOpt,
    profiles: list[Path] = ProfilesOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Gather each node's GPUs, driver, CUDA, vLLM and OS over SSH into the state folder."""
    import itertools

    from fleetctl.base.errors import UserError
    from fleetctl.base.progress import progress

    if local:
        from fleetctl.fleet.probe import local_facts

        print_json(local_facts().to_json())
        return
    if inventory is None:
        raise UserError("give an inventory, or --local for this machine", None, "see --help")
    from fleetctl.fleet.probe import probe_fleet
    from fleetctl.fleet.ssh import SshOptions

    inv, _ = common.load(inventory, profiles, ssh=True)
    sdir = common.state_dir(inv, state_dir)
    options = SshOptions(known_hosts, accept_new, inv.spec.ssh.connect_timeout_s, timeout)
    done = itertools.count(1)  # nodes finish on the probe's threads: count without a lock
    with progress("probing", len(inv.nodes), enabled=not as_json) as bar:
        facts = probe_fleet(inv, options, parallel, on_done=lambda _: bar.update(next(done)))
    sdir.save_facts(facts)
    failed = [f.error for _, f in sorted(facts.nodes.items()) if f.error is not None]
    if as_json:
        print_json(facts.to_json())
    else:
        from fleetctl.cli.render import facts_table

        console = common.console()
        console.print(facts_table(facts))
        common.unchecked(console, [e.text for e in failed], len(inv.nodes), "probe")
        console.print(f"Saved to {sdir.facts_path}.")
    if failed:
        raise typer.Exit(1)


@app.command()
def health(
    inventory: str = InventoryArg,
    parallel: int = parallel("probed"),
    accept_new: bool = AcceptNewOpt,
    known_hosts: Path | None = KnownHostsOpt,
    timeout: float = timeout(30.0),
    state_dir: Path | None = StateDirOpt,
    profiles: list[Path] = ProfilesOpt,
    as_json: bool = JsonOpt,
    skip_calibration: bool = no_calibration(
        "Do not refresh the calibration from the running servers (by default a 2-second look)."
    ),
) -> None:
    """Check nodes and servers: reachability, version skew in a class, GPUs, ECC, servers."""
    from fleetctl.apply.calibrate import refresh_running
    from fleetctl.fleet import health as h
    from fleetctl.fleet.probe import probe_fleet
    from fleetctl.fleet.ssh import SshOptions
    from fleetctl.fleet.statedir import HealthRecord

    inv, catalog = common.load(inventory, profiles, ssh=True)
    sdir = common.state_dir(inv, state_dir)
    before = sdir.previous_facts()
    options = SshOptions(known_hosts, accept_new, inv.spec.ssh.connect_timeout_s, timeout)
    facts = probe_fleet(inv, options, parallel)
    sdir.save_facts(facts)
    deployments = sdir.load_state().deployments
    skew, equivalent = h.check_skew(inv, facts)
    checks = [
        *h.check_reachability(facts),
        *skew,
        *h.check_changes(before, facts),
        *h.check_gpus(facts, deployments),
        *h.check_servers(deployments),
    ]
    # The router reads node equivalence from here (a non-equivalent node is its own class).
    sdir.save_health(HealthRecord(facts.probed_at, equivalent))
    healthy = all(c.status != "fail" for c in checks)
    # A server that cannot be read is a note in the refresh, not a failed check.
    refreshed = None if skip_calibration else refresh_running(inv, catalog, sdir)
    if as_json:
        print_json(
            {
                "healthy": healthy,
                "checks": [c.to_json() for c in checks],
                "calibration": None if refreshed is None else refreshed.to_json(),
            }
        )
    else:
        from fleetctl.base.text import plural
        from fleetctl.cli.render import health_table

        console = common.console()
        console.print(health_table(checks))
        unreached = sum(1 for f in facts.nodes.values() if not f.reached)
        if unreached:
            console.print(
                f"[red]could not check {unreached} of {plural(len(inv.nodes), 'node')}[/]"
            )
        if refreshed is not None:
            for line in refreshed.lines():
                console.print(line, markup=False, highlight=False, soft_wrap=True)
        console.print("[green]healthy[/]" if healthy else "[red]unhealthy[/]")
    if not healthy:
        raise typer.Exit(1)
