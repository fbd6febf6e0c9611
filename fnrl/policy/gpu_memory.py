"""Who owns one GPU's memory when the trainer and vLLM servers share the card: a pure plan.

    split = plan_gpu_split(card_bytes=80 * GIB, trainer=TrainerNeed(peak_bytes=...,
                           resident_bytes=...), servers=(ServerNeed(name="rollout0",
                           weights_bytes=..., kv_bytes=...),), synchronous=True)
    print(split.table())
    split.trainer_env()            # XLA_PYTHON_CLIENT_MEM_FRACTION, ..._PREALLOCATE
    split.server_args("rollout0")  # --gpu-memory-utilization u [--enable-sleep-mode]

The two engines' knobs, as their documentation states them (neither checked on a GPU with
both processes here; see docs/gpu.md):
  JAX (jaxlib >= 0.4.1): `XLA_PYTHON_CLIENT_MEM_FRACTION=f` preallocates f x the card's
      TOTAL memory at the first operation (default 0.75; with neither variable set, newer
      jaxlibs may grow past it). The process's CUDA context is outside that pool.
      `XLA_CLIENT_MEM_FRACTION` is the newer spelling; setting both is reported to fail
      in the CUDA plugin (which then falls back to the CPU), so the plan sets the old
      name (which jaxlib 0.11.2, the lent GPU image's, reads) and unsets the new one.
      `XLA_PYTHON_CLIENT_ALLOCATOR=platform` is the only allocator that gives memory
      back to the device when a buffer dies: what time-sharing needs.
  vLLM (the V1 engine's GPU worker, 0.10 to 0.2x): `gpu_memory_utilization` u is a
      fraction of the card's TOTAL memory for this one instance. At start the worker
      refuses unless the device's free memory, after what other processes already hold,
      is at least u x total. Its KV cache is `--kv-cache-memory-bytes` when given (fnrl
      gives it unless `rollout.kv_memory_fraction` is set), else u x total less the
      instance's weights, profiled activations and non-torch memory. So u must cover the
      instance's weights, KV and workspace, and the fractions of every process on the
      card, plus their CUDA contexts, must stay under 1.
  vLLM sleep (`--enable-sleep-mode`, `POST /sleep?level=1`, `POST /wake_up`): level 1
      moves the weights to CPU memory and drops the KV cache; the server keeps its
      context and a little more on the device.

Side by side: each server gets u = its need / the card (rounded up), the trainer what is
left (rounded down), refused unless that holds its step's peak. Time-shared (servers
asleep while the trainer steps, as verl does when colocated): the trainer's step peak
beside sleeping servers, and the servers awake beside what the trainer keeps between
steps (its parameters and optimizer moments, with the platform allocator); only a
synchronous schedule (η = 0: no generation while a step runs) can do it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

GIB = 2**30
CUDA_CONTEXT_BYTES = 2**30
"""Device memory of one process's CUDA context with cuBLAS/cuDNN handles and their
workspaces, outside any fraction: 0.5-1 GiB on an H100 with CUDA 12/13 (lazy module
loading gives the low end); the plan takes the high end for every process on the card.
An estimate from the vendors' figures, not measured here."""
SERVER_WORKSPACE_BYTES = 2**30
"""A vLLM server's device memory beyond weights and KV, inside its utilization: the
profiled forward pass at max_num_batched_tokens (activations, the sampler's logits) and
torch's allocator slack (servers run with --enforce-eager: no CUDA graphs). An estimate."""
SERVER_ASLEEP_BYTES = 2**29
"""What a server at sleep level 1 still holds on the device besides its context (buffers
allocated outside the sleep allocator's pool). An estimate."""
CARD_SPARE_FRACTION = 0.03
"""Of the card left to no one: what nvidia-smi's memory.total holds that a process cannot
allocate, fragmentation, and the error of the estimates above."""
FRACTION_STEP = 1000
"""Fractions are rounded to 1/1000 of the card (80 MiB of an 80 GB card): servers' up,
the trainer's down."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerNeed:
    """One trainer process's device memory: its step's peak, and what stays between steps
    (parameters, optimizer moments, a KL reference)."""

    peak_bytes: int
    resident_bytes: int

    def __post_init__(self):
        if not 0 <= self.resident_bytes <= self.peak_bytes:
            raise ValueError(f"TrainerNeed: resident_bytes={self.resident_bytes} must be in "
                             f"[0, peak_bytes={self.peak_bytes}]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerNeed:
    """One vLLM server on the card, by its role name ("rollout0", "eval"): its weights and
    the KV it must hold (max_num_seqs sequences at the model's length). `fraction` > 0: a
    utilization the run's config fixed (rollout.kv_memory_fraction), taken as it is."""

    name: str
    weights_bytes: int
    kv_bytes: int
    fraction: float = 0.0

    @property
    def need_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + SERVER_WORKSPACE_BYTES


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuSplit:
    """The card's split: the trainer's memory fraction (each trainer process's, a warm
    standby included), each server's gpu_memory_utilization, and whether the servers
    sleep while the trainer steps. `figures`: (what, bytes) lines for the table."""

    card_bytes: int
    trainer_fraction: float
    server_fractions: Mapping[str, float]
    fixed: frozenset[str]
    """Servers whose utilization the config fixed: their command line already has it."""
    sleep: bool
    figures: tuple[tuple[str, int], ...]

    def trainer_env(self) -> dict[str, str | None]:
        """The trainer process's environment changes (None: unset the variable)."""
        env: dict[str, str | None] = {
            "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{self.trainer_fraction:.3f}",
            "XLA_CLIENT_MEM_FRACTION": None}
        if self.sleep:   # grow on demand and give a step's buffers back when they die
            env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false",
                       XLA_PYTHON_CLIENT_ALLOCATOR="platform")
        else:            # its whole share at start: nothing left for others to take
            env.update(XLA_PYTHON_CLIENT_PREALLOCATE="true")
        return env

    def server_args(self, name: str) -> tuple[str, ...]:
        """vLLM flags for server `name` (a role name); () for a server not on the card."""
        if name not in self.server_fractions:
            return ()
        args = () if name in self.fixed else (
            "--gpu-memory-utilization", f"{self.server_fractions[name]:.3f}")
        return args + (("--enable-sleep-mode",) if self.sleep else ())

    def table(self) -> str:
        mode = ("time-shared: the servers sleep while the trainer steps" if self.sleep
                else "side by side")
        lines = [f"one GPU of {self.card_bytes / GIB:.2f} GiB, {mode}",
                 f"  trainer  XLA_PYTHON_CLIENT_MEM_FRACTION={self.trainer_fraction:.3f} "
                 f"({self.trainer_fraction * self.card_bytes / GIB:.2f} GiB)"]
        lines += [f"  {name:<8} gpu_memory_utilization={f:.3f} "
                  f"({f * self.card_bytes / GIB:.2f} GiB)"
                  for name, f in self.server_fractions.items()]
        lines += [f"    {what}: {b / GIB:.2f} GiB" for what, b in self.figures]
        return "\n".join(lines)


def plan_gpu_split(*, card_bytes: int, trainer: TrainerNeed, servers: Sequence[ServerNeed],
                   synchronous: bool, sleep: bool | None = None,
                   trainers: int = 1) -> GpuSplit:
    """The split of one card of `card_bytes` between `trainers` trainer processes and
    `servers`. `sleep`: None plans side by side when that fits, else time-shared when
    `synchronous`; True only time-shared; False only side by side. Raises ValueError
    naming every figure when no allowed split fits, or when time-sharing is asked of a
    schedule that overlaps generation with training."""
    if card_bytes <= 0 or trainers < 1 or not servers:
        raise ValueError(f"plan_gpu_split: card_bytes={card_bytes}, trainers={trainers}, "
                         f"{len(servers)} servers: need a card, a trainer and a server")
    shares = {s.name: s.fraction or _up(s.need_bytes / card_bytes) for s in servers}
    contexts = (trainers + len(servers)) * CUDA_CONTEXT_BYTES
    usable = card_bytes * (1 - CARD_SPARE_FRACTION) - contexts
    serving = sum(shares.values()) * card_bytes
    beside = (usable - serving) / trainers             # each trainer's room, servers awake
    asleep = (usable - len(servers) * SERVER_ASLEEP_BYTES) / trainers   # servers asleep
    awake_with_resident = usable - serving - trainers * trainer.resident_bytes
    figures = [(f"CUDA contexts ({trainers + len(servers)} processes)", contexts),
               (f"spare ({CARD_SPARE_FRACTION:.0%} of the card)",
                round(card_bytes * CARD_SPARE_FRACTION))]
    for s in servers:
        if s.fraction:
            figures.append((f"{s.name}: fraction fixed by rollout.kv_memory_fraction",
                            round(s.fraction * card_bytes)))
        else:
            figures += [(f"{s.name}: weights", s.weights_bytes), (f"{s.name}: KV", s.kv_bytes),
                        (f"{s.name}: workspace", SERVER_WORKSPACE_BYTES)]
    figures += [("trainer: step peak", trainer.peak_bytes),
                ("trainer: kept between steps", trainer.resident_bytes)]
    # Fits are judged on the rounded fractions: what JAX will really be given.
    side_fraction, asleep_fraction = _down(beside / card_bytes), _down(asleep / card_bytes)
    side_fits = side_fraction * card_bytes >= trainer.peak_bytes
    share_fits = asleep_fraction * card_bytes >= trainer.peak_bytes and awake_with_resident >= 0
    if side_fits and sleep is not True:
        return GpuSplit(card_bytes=card_bytes, trainer_fraction=side_fraction,
                        server_fractions=shares, fixed=_fixed(servers), sleep=False,
                        figures=tuple(figures))
    if share_fits and sleep is not False and synchronous:
        return GpuSplit(card_bytes=card_bytes, trainer_fraction=asleep_fraction,
                        server_fractions=shares, fixed=_fixed(servers), sleep=True,
                        figures=tuple(figures))
    raise ValueError(_refusal(card_bytes, figures, beside=beside, asleep=asleep,
                              awake_with_resident=awake_with_resident, peak=trainer.peak_bytes,
                              side_fits=side_fits, share_fits=share_fits, sleep=sleep,
                              synchronous=synchronous))


def _up(fraction: float) -> float:
    # The 1e-9 keeps a float's last bit (0.907 * 1000 = 906.9999...) from a whole step.
    return math.ceil(fraction * FRACTION_STEP - 1e-9) / FRACTION_STEP


def _down(fraction: float) -> float:
    return math.floor(fraction * FRACTION_STEP + 1e-9) / FRACTION_STEP


def _fixed(servers: Sequence[ServerNeed]) -> frozenset[str]:
    return frozenset(s.name for s in servers if s.fraction)


def _refusal(card_bytes, figures, *, beside, asleep, awake_with_resident, peak, side_fits,
             share_fits, sleep, synchronous) -> str:
    each = "; ".join(f"{what} {b / GIB:.2f}" for what, b in figures)
    rooms = (f"side by side the trainer gets {max(beside, 0) / GIB:.2f} GiB for a step peak "
             f"of {peak / GIB:.2f} GiB; with the servers asleep it gets "
             f"{max(asleep, 0) / GIB:.2f} GiB, and the servers awake beside what it keeps "
             f"leave {awake_with_resident / GIB:.2f} GiB")
    overlap = ("the servers can sleep only while no generation runs: a synchronous schedule "
               "(--preset sync, η = 0); this one overlaps generation with training")
    if sleep is True and not synchronous:
        what = f"rollout.gpu_sleep=True, but {overlap}"
    elif sleep is True:
        what = "rollout.gpu_sleep=True, but it does not fit time-shared" + (
            " (it fits side by side: leave --rollout.gpu-sleep unset)" if side_fits else "")
    elif share_fits:   # side by side did not fit, and time-sharing was ruled out
        what = ("it fits only with the servers asleep while the trainer steps, but "
                + (overlap if not synchronous else "rollout.gpu_sleep=False"))
    else:
        what = "it fits neither side by side nor time-shared"
    return (f"the trainer and the servers do not fit one GPU of {card_bytes / GIB:.2f} GiB: "
            f"{what}; {rooms}. Figures (GiB): {each}. To fit: --preset sync with "
            "--rollout.gpu-sleep unset (when it fits time-shared), --trainer.remat full, "
            "--trainer.logprob-chunk (e.g. 1024), --trainer.micro-batches, "
            "--trainer.compute-dtype bfloat16, --rollout.max-num-seqs, --model.max-seq-len, "
            "--rollout.serve-dtype bfloat16, fewer servers, --eval.server rollout, or a second GPU.")
