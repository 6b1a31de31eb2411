"""`examples`, `profiles` and `version`: what ships with fleetctl, and copies to edit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from fleetctl.base.jsonout import print_json
from fleetctl.cli import common
from fleetctl.cli.app import app, examples_app, profiles_app
from fleetctl.cli.options import EXAMPLE_PREFIX, JsonOpt, ProfilesOpt


@examples_app.callback()
def examples(ctx: typer.Context, as_json: bool = JsonOpt) -> None:
    """List the bundled example inventories (use them as example:NAME, or copy one to edit)."""
    if ctx.invoked_subcommand is not None:
        return
    from fleetctl.base.resources import examples as bundled_examples

    found = bundled_examples()
    if as_json:
        print_json({name: str(path) for name, path in found.items()})
        return
    from fleetctl.base.resources import example_description
    from fleetctl.cli.render import examples_table

    texts = {name: example_description(path) for name, path in found.items()}
    common.console().print(examples_table(texts), highlight=False)


@examples_app.command("copy")
def examples_copy(
    name: str = typer.Argument(..., metavar="NAME", help="The example, with or without example:."),
    dest: Path | None = typer.Argument(
        None, metavar="[DEST]", help="File or folder to write (default: ./NAME.yaml)."
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
) -> None:
    """Write an editable copy of a bundled example inventory."""
    from fleetctl.base.errors import Location, UserError
    from fleetctl.fleet.statedir import write_atomic

    source = common.example_path(EXAMPLE_PREFIX + name.removeprefix(EXAMPLE_PREFIX))
    target = dest or Path(source.name)
    if target.is_dir():
        target = target / source.name
    if target.exists() and not force:
        raise UserError("file exists", Location(str(target)), "pass --force to overwrite it")
    write_atomic(target, source.read_text(encoding="utf-8"))
    typer.echo(f"wrote {target}; plan it with `fleetctl plan {target}`")


@profiles_app.command("list")
def profiles_list(profiles: list[Path] = ProfilesOpt, as_json: bool = JsonOpt) -> None:
    """List the GPU, model and format profiles."""
    from fleetctl.model.catalog import load_catalog

    cat = load_catalog(profiles)
    if as_json:
        print_json(
            {
                "gpus": {k: v.model_dump() for k, v in cat.gpus.items()},
                "models": {k: v.model_dump() for k, v in cat.models.items()},
                "formats": {k: v.model_dump() for k, v in cat.formats.items()},
            }
        )
        return
    from fleetctl.cli.render import profiles_table

    common.console().print(profiles_table(cat))


@profiles_app.command("show")
def profiles_show(
    name: str = typer.Argument(..., metavar="NAME", help="A GPU, model or format, or an alias."),
    profiles: list[Path] = ProfilesOpt,
    as_json: bool = typer.Option(
        False, "--json", help="Print JSON (the default: a profile is shown as its JSON)."
    ),
) -> None:
    """Show one profile (GPU, model or format) by name or alias, as JSON."""
    from fleetctl.base.errors import UserError, suggestion
    from fleetctl.model.catalog import load_catalog

    cat = load_catalog(profiles)
    found: Any = cat.find_gpu(name)
    if found is None:
        for table in (cat.models, cat.formats):
            found = next((v for k, v in table.items() if k.lower() == name.lower()), None)
            if found:
                break
    if found is None:
        hint = suggestion(name, [*cat.gpus, *cat.models, *cat.formats])
        raise UserError(f"no profile named '{name}'", None, hint or "see `fleetctl profiles list`")
    print_json(found.model_dump())


@profiles_app.command("import-hf-config")
def profiles_import(
    config: Path = typer.Argument(..., metavar="CONFIG.json", help="A Hugging Face config.json."),
    name: str = typer.Option(..., "--name", metavar="NAME", help="Profile name to create."),
    hf_id: str | None = typer.Option(
        None, "--hf-id", metavar="ORG/NAME", help="The model's Hugging Face id."
    ),
    out: Path = typer.Option(
        Path("profiles"),
        "--out",
        metavar="DIR",
        help="Profiles folder to write into (models/NAME.yaml).",
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing profile file."),
) -> None:
    """Add a model profile from a Hugging Face config.json (parameter counts computed)."""
    import yaml

    from fleetctl.base.errors import Location, UserError
    from fleetctl.fleet.statedir import write_atomic
    from fleetctl.model.catalog import ModelProfile
    from fleetctl.model.hfconfig import profile_from_config, read_config

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


@app.command()
def version() -> None:
    """Print fleetctl's version (also: fleetctl --version)."""
    from fleetctl import __version__

    typer.echo(f"fleetctl {__version__}")
