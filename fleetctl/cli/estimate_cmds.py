"""`estimate`: will a model fit on a GPU group, and how fast, without an inventory."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from fleetctl.base.jsonout import print_json
from fleetctl.cli import common
from fleetctl.cli.app import app
from fleetctl.cli.options import JsonOpt, NoCalibrationOpt, ProfilesOpt

VERSION = re.compile(r"\d{1,4}\.\d{1,4}(\.\d{1,4})?([.+-]?[A-Za-z0-9]{1,16}){0,3}")


@app.command()
def estimate(
    gpu: str = typer.Option(..., "--gpu", metavar="GPU", help="GPU profile name or alias."),
    model: str = typer.Option(..., "--model", metavar="PROFILE", help="Model profile name."),
    fmt: str = typer.Option(
        ..., "--format", metavar="FORMAT", help="Weight format: bf16, fp16, fp8, awq-int4, ..."
    ),
    tp: int = typer.Option(1, "--tp", min=1, max=64, metavar="N", help="Tensor-parallel size."),
    utilization: float | None = typer.Option(
        None,
        "--gpu-memory-utilization",
        min=0.05,
        max=1.0,
        metavar="U",
        help="Share of each GPU's memory vLLM may use (default: the release's, 0.9 or 0.92).",
    ),
    max_model_len: int | None = typer.Option(
        None, "--max-model-len", min=1, metavar="L", help="Default: the model's context."
    ),
    batched_tokens: int | None = typer.Option(
        None,
        "--max-num-batched-tokens",
        min=1,
        metavar="B",
        help="Default: vLLM's for this GPU.",
    ),
    seqs: int | None = typer.Option(
        None, "--max-num-seqs", min=1, metavar="S", help="Default: vLLM's for this GPU."
    ),
    kv_cache_dtype: str = typer.Option(
        "auto", "--kv-cache-dtype", metavar="auto|fp8", help="KV cache element type."
    ),
    enforce_eager: bool = typer.Option(
        False, "--enforce-eager", help="No CUDA graphs (less memory reserved, slower steps)."
    ),
    vllm_version: str | None = typer.Option(
        None, "--vllm-version", metavar="X.Y.Z", help="The vLLM release to estimate for."
    ),
    batch: int = typer.Option(1, "--batch", min=1, metavar="N", help="Sequences decoding at once."),
    context: int = typer.Option(
        1024, "--context", min=1, metavar="T", help="Tokens of context each decoding sequence has."
    ),
    prompt: int = typer.Option(
        1024, "--prompt", min=1, metavar="P", help="Prompt tokens, prefilled alone."
    ),
    profiles: list[Path] = ProfilesOpt,
    no_calibration: bool = NoCalibrationOpt,
    state_dir: Path | None = typer.Option(
        None,
        "--state-dir",
        metavar="DIR",
        help="State folder whose calibration.json to use (default: .fleetctl in the current "
        "folder).",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """How much KV cache a model gets on a GPU group, and its decode and prefill speeds.

    Exit code 3 when the model does not fit (vLLM would not start: its KV cache would not
    hold one sequence of max_model_len), as `plan` exits 3 for a model it cannot place; the
    answer then says which --tp, or which --format, fits instead."""
    from fleetctl.base.errors import UserError, shown, suggestion
    from fleetctl.model.catalog import load_catalog
    from fleetctl.model.estimate import Settings, Workload, fits_instead
    from fleetctl.model.estimate import estimate as run

    cat = load_catalog(profiles)
    found = cat.find_gpu(gpu)
    if found is None:
        hint = suggestion(gpu, list(cat.gpus))
        raise UserError(
            f"no GPU profile named '{gpu}'",
            None,
            (f"{hint} " if hint else "")
            + "add one under gpus/ in a --profiles folder (see `fleetctl profiles list`)",
        )
    if model not in cat.models and not any(k.lower() == model.lower() for k in cat.models):
        hint = suggestion(model, list(cat.models))
        raise UserError(
            f"no model profile named '{model}'",
            None,
            (f"{hint} " if hint else "")
            + "make one with `fleetctl profiles import-hf-config config.json --name NAME`, "
            "then pass --profiles",
        )
    if vllm_version is not None and not VERSION.fullmatch(vllm_version):
        raise UserError(
            f"--vllm-version {shown(vllm_version)} is not a release number", None, "e.g. 0.6.3"
        )
    if vllm_version is not None:
        from fleetctl.vllm.release import NEWEST_READ, OLDEST_MODELLED, unmodelled

        why = unmodelled(vllm_version)
        if why is not None:
            span = (
                f"{'.'.join(map(str, OLDEST_MODELLED))} to {'.'.join(map(str, NEWEST_READ[:2]))}.x"
            )
            raise UserError(why, None, f"give a release from {span}")
    if kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
        raise UserError(f"unknown --kv-cache-dtype '{kv_cache_dtype}'", None, "use auto or fp8")
    settings = Settings(
        tp,
        utilization,
        max_model_len,
        batched_tokens,
        seqs,
        kv_cache_dtype,
        enforce_eager,
        vllm_version or cat.target_vllm_version,
    )
    calibration = None
    if not no_calibration:
        from fleetctl.fleet.statedir import STATE_DIR_NAME, StateDir

        calibration = StateDir(state_dir or Path.cwd() / STATE_DIR_NAME).load_calibration()
    result = run(
        found,
        cat.model(model),
        cat.format(fmt),
        settings,
        Workload(batch, context, prompt),
        calibration,
    )
    instead = [] if result.fits else fits_instead(result, list(cat.formats.values()), calibration)
    if as_json:
        doc = result.to_json()
        print_json(doc if result.fits else {**doc, "fits_with": [f.to_json() for f in instead]})
    else:
        from fleetctl.cli.render import estimate_table

        common.console().print(estimate_table(result, instead))
    if not result.fits:
        raise typer.Exit(3)
