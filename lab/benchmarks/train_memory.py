"""The memory column of lab/benchmarks/train_step.py: peak trainer memory per configuration.

Each configuration (plain, chunked log-probs, chunked log-probs + remat) is measured
by `python -m fnrl.trainer.peak` in a fresh process (its peak VmHWM over one step)
and estimated by the trainer's memory plan (`fnrl.trainer.memory.trainer_memory`),
which decides whether the full shape is safe to run on a shared machine.

The chunk keeps its positions per row at every row count, so a smaller shape of the
same model (fewer layers or rows) is chunked the same way.
"""

from __future__ import annotations

import json
import subprocess
import sys

CHUNK_POSITIONS = 128   # positions per row per chunk: 8 rows × 128 = 1,024 tokens a chunk
MEMORY_CONFIGS = {
    "plain": {"chunked": False, "remat": False},
    "chunked log-probs": {"chunked": True, "remat": False},
    "chunked log-probs + remat": {"chunked": True, "remat": True},
}


def _trainer(options: dict, rows: int, dtype: str):
    from fnrl.config import TrainerConfig
    return TrainerConfig(logprob_chunk=rows * CHUNK_POSITIONS if options["chunked"] else 0,
                         remat=options["remat"], compute_dtype=dtype, param_dtype="float32")


def planned_peak_gb(model_kw: dict, options: dict, *, rows: int, length: int, dtype: str) -> float:
    """The trainer memory plan's peak for this configuration, in GB."""
    from fnrl.config import AlgoConfig
    from fnrl.models.decoder import DecoderConfig
    from fnrl.trainer.memory import trainer_memory
    plan = trainer_memory(DecoderConfig(**model_kw), _trainer(options, rows, dtype), AlgoConfig(),
                          rows=rows, length=length)
    return plan.peak_bytes / 1e9


def measure(options: dict, *, layers: int, rows: int, length: int, dtype: str,
            timeout_s: float = 900) -> dict:
    """One train step in a fresh `fnrl.trainer.peak` process: its JSON line."""
    trainer = _trainer(options, rows, dtype)
    cmd = [sys.executable, "-m", "fnrl.trainer.peak", "--rows", str(rows), "--length",
           str(length), "--layers", str(layers), "--logprob-chunk", str(trainer.logprob_chunk),
           "--compute-dtype", dtype, "--steps", "1", "--remat",
           "full" if options["remat"] else "none"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd[1:])} exited with {out.returncode}: "
                           f"{out.stderr[-1500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
