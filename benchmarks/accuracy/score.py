"""How far fleetctl's performance model is from public vLLM measurements, row by row.

Runs `fleetctl estimate`'s code path (fleetctl.model.estimate, the same as the command) on every row
of kv_points.yaml and speed_points.yaml, and prints each row's signed error (model / measured
- 1) and the median and p90 of |error| by figure, GPU, format and vLLM version range.

    python benchmarks/accuracy/score.py [--rows] [--json OUT.json] [--exclude-doubtful]

Rows whose GPU, model or format has no profile are listed as skipped, never guessed. Decode rows
at a batch above 1 are closed-loop serving runs (`vllm bench serve --max-concurrency B`; a row
may say `closed_loop: false` for an offline batch): their TPOT is scored as the step that also
prefills the requests that replace finished ones (`closed_loop`), the rest through `estimate`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fleetctl.model.catalog import Catalog, ModelProfile, load_catalog
from fleetctl.model.estimate import Settings, Workload, estimate
from fleetctl.model.hfconfig import profile_from_config
from fleetctl.model.perf import EnginePerf
from fleetctl.vllm.release import unmodelled

HERE = Path(__file__).resolve().parent

# What the sources call a GPU -> its fleetctl profile. The A100's form factor is rarely stated:
# SXM4 is the common one in the clouds the sources ran on. Unmapped names are skipped.
GPU_NAMES = {
    "nvidia a100 80gb": "A100-SXM4-80GB",
    "nvidia a100": "A100-SXM4-80GB",
    "nvidia h100": "H100-SXM-80GB",
    "nvidia a10g": "A10G",
    "nvidia a10": "A10G",
    "h100-80gb": "H100-SXM-80GB",
    "a6000": "RTX-A6000",
    "nvidia a100 40gb": "A100-SXM4-40GB",
}
# Format names in the datasets -> fleetctl format profiles; gptq-int8 (weight-only W8A16) has
# no profile yet (fleetctl's int8 is W8A8).
FORMATS = {"bf16": "bf16", "fp16": "fp16", "awq-int4": "awq-int4", "gptq-int4": "gptq-int4"}
FORMATS["fp8"] = "fp8"


@dataclass(frozen=True)
class Scored:
    row: dict[str, Any]
    figure: str  # kv_tokens, decode_16bit, decode_int4, prefill, e2e_16bit, e2e_int4
    measured: float
    model: float

    @property
    def error(self) -> float:
        return self.model / self.measured - 1.0


def _version(row: dict[str, Any]) -> str | None:
    """The row's vLLM release as the model reads it; None (fleetctl's target) when unknown."""
    text = str(row.get("vllm_version") or "")
    return text if text[:1].isdigit() else None


def version_range(v: str | None) -> str:
    """V0 before chunked prefill by default (<0.6), V0 0.6-0.7, V1 (>=0.8)."""
    try:
        major, minor = (int(x) for x in str(v).split(".")[:2])
    except ValueError:
        return "unknown"
    if (major, minor) < (0, 6):
        return "<0.6 (V0)"
    if (major, minor) < (0, 8):
        return "0.6-0.7 (V0)"
    return ">=0.8 (V1)"


def load_models(cat: Catalog) -> dict[str, ModelProfile]:
    """Bundled profiles by name and by HF id, plus the datasets' own config.json entries."""
    out: dict[str, ModelProfile] = {}
    for name, m in cat.models.items():
        out[name] = m
        if m.hf_id:
            out[m.hf_id.lower()] = m
    for file in ("models.yaml", "speed_models.yaml"):
        path = HERE / file
        if not path.is_file():
            continue
        for name, cfg in (yaml.safe_load(path.read_text()) or {}).items():
            if name in out or not isinstance(cfg, dict):
                continue
            config = {**cfg, "architectures": [cfg.get("architecture", "unknown")]}
            moe = cfg.get("moe") or {}
            config.update({k: v for k, v in moe.items()} if isinstance(moe, dict) else {})
            try:
                data = profile_from_config(config, name, path, cfg.get("hf_id"))
                out[name] = ModelProfile.model_validate(data)
            except (KeyError, ValueError) as e:
                print(f"skip model {name}: {e}", file=sys.stderr)
                continue
            if cfg.get("hf_id"):
                out[str(cfg["hf_id"]).lower()] = out[name]
    return out


def resolve(row: dict[str, Any], cat: Catalog, models: dict[str, ModelProfile]) -> Any:
    """(gpu, model, format) profiles for a row, or the reason it is skipped."""
    if (row.get("pipeline_parallel_size") or 1) > 1:
        return "pipeline parallelism (fleetctl plans tensor parallelism only)"
    version = _version(row)
    why = unmodelled(version) if version is not None else None
    if why is not None:
        return why.split(":")[0]  # estimate refuses it: "vLLM 0.2.3 is not modelled"
    # The name as the source wrote it, then without a parenthesised remark ("(8x, AWS ...)").
    said = str(row["gpu"])
    bare = said.split("(")[0].strip()
    gpu = (
        cat.find_gpu(said)
        or cat.find_gpu(bare)
        or cat.gpus.get(GPU_NAMES.get(said.lower(), ""))
        or cat.gpus.get(GPU_NAMES.get(bare.lower(), ""))
    )
    if gpu is None:
        return f"no GPU profile for {row['gpu']!r}"
    model = models.get(str(row.get("arch") or "")) or models.get(str(row["model"]).lower())
    if model is None:
        base = str(row["model"]).lower()
        for suffix in ("-awq", "-gptq-int4", "-gptq-int8", "-fp8", "-instruct"):
            base = base.removesuffix(suffix)
        model = models.get(base) or models.get(base + "-instruct")
    if model is None:
        return f"no model profile for {row['model']!r}"
    fmt = FORMATS.get(str(row["format"]))
    if fmt is None:
        return f"no format profile for {row['format']!r}"
    return gpu, model, cat.format(fmt)


def score_kv(rows: Iterable[dict[str, Any]], cat: Catalog, models: dict) -> Iterable[Any]:
    for row in rows:
        found = resolve(row, cat, models)
        if isinstance(found, str):
            yield row, found
            continue
        gpu, model, fmt = found
        m = row.get("measured") or {}
        measured = m.get("kv_cache_tokens") or (
            m.get("gpu_blocks") and m["gpu_blocks"] * (m.get("block_size") or 16)
        )
        if not measured:
            yield row, "no measured KV figure"
            continue
        s = Settings(
            tensor_parallel_size=row.get("tensor_parallel_size") or 1,
            gpu_memory_utilization=row.get("gpu_memory_utilization") or 0.9,
            max_model_len=row.get("max_model_len"),
            max_num_batched_tokens=row.get("max_num_batched_tokens"),
            max_num_seqs=row.get("max_num_seqs"),
            kv_cache_dtype=row.get("kv_cache_dtype") or "auto",
            enforce_eager=bool(row.get("enforce_eager")),
            vllm_version=_version(row),
        )
        e = estimate(gpu, model, fmt, s)
        yield Scored(row, "kv_tokens", float(measured), float(e.budget.kv_tokens))


def score_speed(rows: Iterable[dict[str, Any]], cat: Catalog, models: dict) -> Iterable[Any]:
    for row in rows:
        found = resolve(row, cat, models)
        if isinstance(found, str):
            yield row, found
            continue
        gpu, model, fmt = found
        tp = row.get("tensor_parallel_size") or 1
        version = _version(row)
        eager = bool(row.get("enforce_eager"))
        perf = EnginePerf(gpu, model, fmt, tp, "auto", version, eager)
        m = row.get("measured") or {}
        bits = (
            "int4" if "int4" in fmt.name else "16bit" if fmt.name in ("bf16", "fp16") else fmt.name
        )
        n_in, n_out, batch = (
            row.get("input_tokens") or 1,
            row.get("output_tokens"),
            row.get("batch") or 1,
        )
        kind = row.get("kind")
        if kind == "decode":
            got = m.get("decode_tok_s_per_seq") or (m.get("tpot_ms") and 1000 / m["tpot_ms"])
            if not got:
                yield row, "no decode figure"
                continue
            context = n_in + (n_out or 0) // 2
            if batch > 1 and n_out and row.get("closed_loop", True):
                yield Scored(
                    row, f"decode_{bits}", float(got), closed_loop(perf, batch, n_in, n_out)
                )
                continue
            w = Workload(batch=batch, context=context)
            settings = Settings(tensor_parallel_size=tp, enforce_eager=eager, vllm_version=version)
            e = estimate(gpu, model, fmt, settings, w)
            yield Scored(row, f"decode_{bits}", float(got), e.decode_tok_s_per_seq)
        elif kind == "prefill":
            got = m.get("prefill_tok_s") or (m.get("ttft_ms") and n_in / (m["ttft_ms"] / 1e3))
            if not got:
                yield row, "no prefill figure"
                continue
            yield Scored(row, "prefill", float(got), n_in / perf.prefill_time(n_in))
        elif kind == "e2e":
            got = m.get("total_output_tok_s")
            if not got or not n_out:
                yield row, "no end-to-end figure"
                continue
            seconds = perf.prefill_time(n_in) + perf.decode_span(1, n_in, n_out)
            yield Scored(row, f"e2e_{bits}", float(got), n_out / seconds)
        else:
            yield row, f"unknown kind {kind!r}"


def closed_loop(perf: EnginePerf, batch: int, n_in: int, n_out: int) -> float:
    """Per-sequence decode tokens/s in a closed-loop serving run at concurrency `batch`.

    As each request ends another starts, and its prompt is prefilled in the steps the others
    decode in (V1's chunked prefill; V0's separate prefill steps stall them as long): the steps
    a request decodes in carry (B - 1) x input / output prompt tokens on average besides the B
    decodes. Its TPOT is that mixed step, not a pure decode step."""
    chunk = (batch - 1) * n_in / n_out
    context = n_in + n_out / 2
    kv = batch * context
    pairs = kv + chunk * n_in / 2
    step = perf.step_time(round(batch + chunk), kv, pairs, seqs=batch)
    return 1.0 / step


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def summary(scored: list[Scored], key: str) -> dict[str, dict[str, float]]:
    groups: dict[str, list[float]] = defaultdict(list)
    for s in scored:
        if key == "figure":
            group = s.figure
        elif key == "gpu":
            group = f"{s.figure} | {s.row['gpu']}"
        elif key == "format":
            group = f"{s.figure} | {s.row['format']}"
        else:
            group = f"{s.figure} | {version_range(s.row.get('vllm_version'))}"
        groups[group].append(s.error)
    return {
        g: {
            "n": len(errs),
            "median_abs": statistics.median(abs(e) for e in errs),
            "p90_abs": p90([abs(e) for e in errs]),
            "median_signed": statistics.median(errs),
        }
        for g, errs in sorted(groups.items())
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", action="store_true", help="Print every row's error.")
    ap.add_argument("--json", type=Path, help="Write rows and summaries as JSON here.")
    ap.add_argument("--exclude-doubtful", action="store_true", help="Drop rows marked doubt.")
    args = ap.parse_args()
    cat = load_catalog()
    models = load_models(cat)

    def rows(name: str) -> list[dict[str, Any]]:
        path = HERE / name
        if not path.is_file():
            return []
        found = yaml.safe_load(path.read_text()) or []
        return [r for r in found if not (args.exclude_doubtful and r.get("doubt"))]

    results = [*score_kv(rows("kv_points.yaml"), cat, models)]
    results += score_speed(rows("speed_points.yaml"), cat, models)
    scored = [r for r in results if isinstance(r, Scored)]
    skipped = [r for r in results if not isinstance(r, Scored)]
    if args.rows:
        for s in scored:
            print(
                f"{s.row['id']:<44} {s.figure:<12} {s.measured:>12,.1f} {s.model:>12,.1f} "
                f"{s.error:+7.1%}"
            )
    print(f"\n{len(scored)} rows scored, {len(skipped)} skipped")
    reasons: dict[str, int] = defaultdict(int)
    for _, why in skipped:
        reasons[why] += 1
    for why, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        print(f"  skipped {n:>3}: {why}")
    tables = {k: summary(scored, k) for k in ("figure", "gpu", "format", "version")}
    for key, table in tables.items():
        print(f"\nby {key}:  n  median|err|  p90|err|  median err")
        for group, st in table.items():
            print(
                f"  {group:<40} {st['n']:>3}  {st['median_abs']:>9.1%}  {st['p90_abs']:>8.1%}"
                f"  {st['median_signed']:>+9.1%}"
            )
    if args.json:
        doc = {
            "rows": [
                {
                    "id": s.row["id"],
                    "figure": s.figure,
                    "measured": s.measured,
                    "model": s.model,
                    "error": s.error,
                    "source": s.row["source"],
                }
                for s in scored
            ],
            "skipped": [{"id": r.get("id"), "why": why} for r, why in skipped],
            "summary": tables,
        }
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
