"""`traces list` and `traces get`: the public traces by name, one command from the cache."""

from __future__ import annotations

import textwrap
from pathlib import Path

import typer

from fleetctl.base.jsonout import print_json
from fleetctl.base.public_traces import (
    CACHE_ENV,
    REGISTRY_ENV,
    PublicTrace,
    cache_dir,
    cached_path,
    clean_partials,
    find,
    is_cached,
    registry,
)
from fleetctl.cli.app import traces_app
from fleetctl.cli.options import JsonOpt

WIDTH = 80
_RAW = "https://raw.githubusercontent.com/"
_CACHE_HELP = (
    f"The cache is ${CACHE_ENV}/traces/ (default ~/.cache/fleetctl/traces/, or "
    f"$XDG_CACHE_HOME/fleetctl/traces/). ${REGISTRY_ENV} names a JSON file of entries that "
    "replace or add to the built-in ones (a mirror's URLs, say)."
)


@traces_app.command("list")
def traces_list(as_json: bool = JsonOpt) -> None:
    """List the public traces: source, licence, size, sha256, citation.

    Use a name wherever a trace file goes (simulate --trace, plan --workload-from,
    --what-if, apply --gate) once `fleetctl traces get NAME` has cached it.
    """
    known = registry()
    clean_partials()
    if as_json:
        print_json(
            {
                "cache": str(cache_dir()),
                "traces": [
                    {**t.to_json(), "cached": is_cached(t), "path": str(cached_path(t))}
                    for t in known.values()
                ],
            }
        )
        return
    blocks = ["\n".join(_block(t)) for t in known.values()]
    typer.echo("\n\n".join(blocks))
    typer.echo(f"\ncache: {cache_dir()}")


def _block(t: PublicTrace) -> list[str]:
    """One trace as lines of at most WIDTH columns; the full URL is in --json when it is long."""
    state = "cached" if is_cached(t) else "not cached"
    head = f"{t.name}  {t.size:,} bytes  {t.license or '?'}  {state}"
    lines = [head]
    lines += textwrap.wrap(t.description, WIDTH, initial_indent="  ", subsequent_indent="  ")
    lines.append(f"  from   {_source(t.url)}")
    lines.append(f"  sha256 {t.sha256}")
    if t.citation:
        lines += textwrap.wrap(
            t.citation, WIDTH, initial_indent="  cite   ", subsequent_indent="         "
        )
    return lines


def _source(url: str) -> str:
    """The URL, or for a long GitHub raw one `OWNER/REPO@BRANCH:PATH`, which fits the width."""
    if len(url) <= WIDTH - 9 or not url.startswith(_RAW):
        return url
    owner, repo, branch, path = url[len(_RAW) :].split("/", 3)
    return f"{owner}/{repo}@{branch}:{path}"


@traces_app.command("get", help=f"Download a public trace into the cache. {_CACHE_HELP}")
def traces_get(
    name: str = typer.Argument(..., metavar="NAME", help="A name from `fleetctl traces list`."),
    source: Path | None = typer.Option(
        None,
        "--from",
        metavar="FILE",
        help="Take this copy already on disk instead of downloading (checked the same way).",
    ),
) -> None:
    from fleetctl.cli.trace_fetch import cached_and_valid, copy_from, download

    trace = find(name)
    if cached_and_valid(trace):
        typer.echo(f"{trace.name} is already cached and its sha256 matches", err=True)
    elif source is not None:
        copy_from(trace, source)
        typer.echo(f"{trace.name}: copied from {source}, sha256 ok", err=True)
    else:
        typer.echo(f"{trace.name}: downloading {trace.size:,} bytes from {trace.url}", err=True)
        download(trace)
        typer.echo(f"{trace.name}: sha256 ok", err=True)
    typer.echo(str(cached_path(trace)))  # on stdout alone, for $(fleetctl traces get NAME)
