"""From GRPO groups to the arrays of one train step: pure functions, host-side numpy.

    arrays, info = build_batch([g.trajectories for g in groups], algo=cfg.algo,
                               trainer=cfg.trainer, seq_len=seq_len, pad_id=pad_id)

A sample is anything with `prompt_ids`, `response_ids`, `logprobs` (μ, one per
response token), `versions` and `reward`: `fnrl.types.Trajectory`. A sample whose
reward is None or non-finite, or whose log-probs are not all finite, is invalid: it
keeps its place but has mask 0, advantage 0 and no say in its group's baseline.

Shapes are static per length bucket, so the jitted step compiles at most once per
bucket. Two layouts:
  one sequence per row (pack_rows = 0): rows = number of sequences, T = the smallest
      bucket that holds the longest sequence; `adv_B` per row.
  packed (pack_rows = R): sequences first-fit-decreasing into R rows of T tokens, with
      `segment_ids_BxT` / `positions_BxT` so attention stays inside each sequence;
      `adv_BxT` per token.
With micro-batches, row r belongs to micro-batch r % M (as `split_micro_batches`
splits), and every GRPO group is placed inside a single micro-batch.

Rollout routing replay (a mixture of experts): when every sample carries the engine's
routes (`routes`, fnrl.types.Routes: per position of prompt + response, per layer its
experts), the batch has `routes_BxTxLxK`, laid out like `input_BxT`: position j holds
the routes of the token that is the input there. A batch where only some samples carry
routes is refused.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from fnrl.config import AlgoConfig, TrainerConfig
from fnrl.losses.advantages import compute_advantages, overlong_penalty
from fnrl.policy.filtering import informative

Sample = Any  # prompt_ids, response_ids, logprobs, versions, reward (routes)


def is_valid(s: Sample) -> bool:
    """Whether a sample may train: a finite reward and finite behaviour log-probs."""
    return (s.reward is not None and bool(np.isfinite(s.reward))
            and bool(np.isfinite(np.asarray(s.logprobs, np.float64)).all()))


def group_advantages(groups: Sequence[Sequence[Sample]], algo: AlgoConfig
                     ) -> tuple[list[np.ndarray], list[np.ndarray], dict[str, float]]:
    """Per-sequence advantages and shaped rewards by group (after DAPO overlong shaping;
    NaN for an invalid sample), and facts about the rewards."""
    width = max(len(g) for g in groups)
    rewards = np.full((len(groups), width), np.nan, np.float64)  # ragged groups: NaN pad
    lengths = np.zeros_like(rewards)
    for gi, group in enumerate(groups):
        for si, s in enumerate(group):
            rewards[gi, si] = s.reward if is_valid(s) else np.nan
            lengths[gi, si] = len(s.response_ids)
    raw = rewards.copy()
    if algo.overlong_buffer > 0:
        rewards = rewards + overlong_penalty(lengths, max_len=algo.max_new_tokens,
                                             buffer=algo.overlong_buffer,
                                             factor=algo.overlong_penalty)
    adv = compute_advantages(rewards, algo, lengths_GxN=lengths)
    any_valid = bool(np.isfinite(raw).any())
    info = {"reward_mean": float(np.nanmean(raw)) if any_valid else float("nan"),
            "invalid_samples": int(sum(not is_valid(s) for g in groups for s in g)),
            "zero_variance_groups": sum(not informative(g) for g in raw.tolist()),
            "overlong_penalty_mean": float(np.nanmean(rewards - raw))
            if any_valid else 0.0}
    return ([adv[gi, :len(g)] for gi, g in enumerate(groups)],
            [rewards[gi, :len(g)] for gi, g in enumerate(groups)], info)


def default_buckets(seq_len: int) -> tuple[int, ...]:
    """Powers of two from 16 up to seq_len, then seq_len: at most log2 compilations."""
    out, b = [], 16
    while b < seq_len:
        out.append(b)
        b *= 2
    return (*out, seq_len)


def choose_length(longest: int, buckets: Sequence[int], seq_len: int) -> int:
    """The smallest bucket ≥ `longest` next-token positions (no buckets: powers of two)."""
    buckets = tuple(buckets) or default_buckets(seq_len)
    for bucket in buckets:
        if bucket >= longest:
            return bucket
    raise ValueError(f"a sequence needs {longest} positions; the largest length bucket is "
                     f"{buckets[-1]}")


def assign_micro_batches(group_sizes: Sequence[int], micro_batches: int) -> list[int]:
    """Micro-batch of each group: largest first onto the least-loaded micro-batch."""
    load = [0] * micro_batches
    out = [0] * len(group_sizes)
    for gi in sorted(range(len(group_sizes)), key=lambda g: -group_sizes[g]):
        m = min(range(micro_batches), key=lambda k: load[k])
        out[gi] = m
        load[m] += group_sizes[gi]
    return out


def first_fit_decreasing(sizes: Sequence[int], num_bins: int, capacity: int,
                         max_items: int = 0) -> list[int] | None:
    """Bin of each item, or None if they do not fit into num_bins of `capacity` holding
    at most `max_items` items each (0: any number)."""
    free = [capacity] * num_bins
    count = [0] * num_bins
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        b = next((b for b in range(num_bins) if free[b] >= sizes[i]
                  and (not max_items or count[b] < max_items)), None)
        if b is None:
            return None
        out[i] = b
        free[b] -= sizes[i]
        count[b] += 1
    return out


def _plan_unpacked(group_of: list[int], micro_of_group: list[int], micro_batches: int
                   ) -> tuple[list[tuple[int, int]], int]:
    """(row, start=0) of each sequence, one per row; rows r ≡ micro-batch (mod M)."""
    per_micro = [0] * micro_batches
    place = []
    for g in group_of:
        m = micro_of_group[g]
        place.append((per_micro[m] * micro_batches + m, 0))
        per_micro[m] += 1
    return place, max(per_micro) * micro_batches


def _plan_packed(slots: list[int], group_of: list[int], micro_of_group: list[int],
                 rows: int, micro_batches: int, length: int, max_segments: int
                 ) -> list[tuple[int, int]] | None:
    """(row, start) of each sequence packed into `rows` rows of `length`, or None. A row
    holds at most max_segments - 1 sequences: its padding tail is a run of its own for
    the attention kernels (fnrl.models.attention)."""
    rows_per_micro = rows // micro_batches
    place: list[tuple[int, int] | None] = [None] * len(slots)
    for m in range(micro_batches):
        members = [i for i, g in enumerate(group_of) if micro_of_group[g] == m]
        bins = first_fit_decreasing([slots[i] for i in members], rows_per_micro, length,
                                    max_items=max_segments - 1)
        if bins is None:
            return None
        fill = [0] * rows_per_micro
        for i, b in zip(members, bins):
            place[i] = (b * micro_batches + m, fill[b])
            fill[b] += slots[i]
    return place


def build_batch(groups: Sequence[Sequence[Sample]], *, algo: AlgoConfig, trainer: TrainerConfig,
                seq_len: int, pad_id: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Arrays for one train step from whole groups, plus host-side facts about them.

    seq_len is the longest next-token length the model takes (used when there are no
    length buckets). Invalid samples (`is_valid`) stay in the batch with mask 0.
    """
    adv_by_group, rewards_by_group, info = group_advantages(groups, algo)
    samples = [s for g in groups for s in g]
    group_of = [gi for gi, g in enumerate(groups) for _ in g]
    adv = np.concatenate(adv_by_group).astype(np.float32)
    # GAE takes each sequence's reward at its last response token (fnrl.losses.value).
    rewards = np.concatenate(rewards_by_group) if algo.uses_critic else None
    slots = [len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples]
    M = trainer.micro_batches
    micro_of_group = assign_micro_batches([sum(slots[i] for i, g in enumerate(group_of) if g == gi)
                                           for gi in range(len(groups))], M)
    longest = max(slots)
    if trainer.pack_rows == 0:
        length = choose_length(longest, trainer.length_buckets, seq_len)
        place, rows = _plan_unpacked(group_of, micro_of_group, M)
    else:
        rows = trainer.pack_rows
        for length in [b for b in (trainer.length_buckets or default_buckets(seq_len))
                       if b >= longest]:
            place = _plan_packed(slots, group_of, micro_of_group, rows, M, length,
                                 trainer.pack_max_segments)
            if place is not None:
                break
        else:
            raise ValueError(f"{len(samples)} sequences ({sum(slots)} positions) do not fit "
                             f"{rows} rows of the length buckets "
                             f"{trainer.length_buckets or default_buckets(seq_len)} at most "
                             f"{trainer.pack_max_segments - 1} a row "
                             f"(trainer.pack_max_segments={trainer.pack_max_segments})")

    arrays = _fill(samples, place, adv, rows, length, pad_id, packed=trainer.pack_rows > 0,
                   rewards=rewards)
    routes = sample_routes(samples)
    if routes is not None:
        arrays["routes_BxTxLxK"] = _fill_routes(routes, place, rows, length)
    info.update(tokens=int(arrays["mask_BxT"].sum()), length=length, rows=rows,
                fill=float(sum(slots) / (rows * length)))
    return arrays, info


def _fill(samples, place, adv, rows, length, pad_id, *, packed: bool,
          rewards: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Writes each sequence's next-token arrays at its (row, start); with `rewards`, also
    `reward_BxT`: each valid sequence's reward at its last response token."""
    input_ = np.full((rows, length), pad_id, np.int32)
    target = np.full((rows, length), pad_id, np.int32)
    mask = np.zeros((rows, length), np.float32)
    behaviour = np.zeros((rows, length), np.float32)
    adv_BxT = np.zeros((rows, length), np.float32)
    adv_B = np.zeros((rows,), np.float32)
    segment = np.zeros((rows, length), np.int32)
    positions = np.zeros((rows, length), np.int32)
    next_segment = np.ones((rows,), np.int32)
    reward_BxT = np.zeros((rows, length), np.float32)
    for i, (s, (row, start), a) in enumerate(zip(samples, place, adv)):
        tokens = np.asarray(tuple(s.prompt_ids) + tuple(s.response_ids), np.int32)
        n, plen = len(tokens) - 1, len(s.prompt_ids)
        span = slice(start, start + n)
        input_[row, span], target[row, span] = tokens[:-1], tokens[1:]
        response = slice(start + plen - 1, start + n)
        # An invalid sample keeps its place (shapes stay static) but trains nothing; its
        # log-probs are left at 0, since a NaN times mask 0 is still NaN in the loss.
        if is_valid(s):
            # Multi-turn: fed ids (tool results) are context, never trained on.
            loss_mask = getattr(s, "loss_mask", None)
            mask[row, response] = 1.0 if loss_mask is None else np.asarray(loss_mask, np.float32)
            behaviour[row, response] = np.asarray(s.logprobs, np.float32)
            trained = np.flatnonzero(mask[row, response])
            if rewards is not None and trained.size:   # at the last trained token
                reward_BxT[row, response.start + trained[-1]] = rewards[i]
        adv_BxT[row, response], adv_B[row] = a, a
        segment[row, span] = next_segment[row]
        positions[row, span] = np.arange(n)
        next_segment[row] += 1
    out = {"input_BxT": input_, "target_BxT": target, "mask_BxT": mask,
           "behaviour_logp_BxT": behaviour}
    if packed:
        out.update(adv_BxT=adv_BxT, segment_ids_BxT=segment, positions_BxT=positions)
    else:
        out["adv_B"] = adv_B
    if rewards is not None:
        out["reward_BxT"] = reward_BxT
    return out


def sample_routes(samples: Sequence[Sample]) -> list[np.ndarray] | None:
    """Each sample's routes over prompt + response, [tokens, layers, top_k] int32; None
    when no sample carries any. Raises ValueError, naming the sample, when only some do,
    or when they differ in layers x top_k or in length from the sample's tokens: a batch
    half replayed would train half its tokens through another routing."""
    found = [getattr(s, "routes", None) for s in samples]
    if all(r is None for r in found):
        return None
    out, shape = [], None
    for i, (s, routes) in enumerate(zip(samples, found)):
        name = f"sample {i} (uid {getattr(s, 'uid', '?')!r})"
        if routes is None:
            raise ValueError(f"routing replay: {name} has no routes (none recorded, or a "
                             "position's were never reported), while other samples of the "
                             "batch carry routes")
        r = routes.array().astype(np.int32)
        tokens = len(s.prompt_ids) + len(s.response_ids)
        if len(r) != tokens or (shape is not None and r.shape[1:] != shape):
            raise ValueError(f"routing replay: {name} has routes of shape {r.shape} for "
                             f"{tokens} tokens, expected ({tokens}, "
                             f"{', '.join(map(str, shape)) if shape else 'L, K'})")
        shape = r.shape[1:]
        out.append(r)
    return out


def _fill_routes(routes: Sequence[np.ndarray], place, rows: int, length: int) -> np.ndarray:
    """`routes_BxTxLxK` laid out as `_fill` lays out `input_BxT`. Padding holds expert 0:
    any valid id does, its positions are masked and their outputs never read."""
    _, L, K = routes[0].shape
    out = np.zeros((rows, length, L, K), np.int32)
    for r, (row, start) in zip(routes, place):
        # Inputs are tokens[:-1]: the last token is only a target, never routed.
        out[row, start:start + len(r) - 1] = r[:-1]
    return out


def make_batch(groups, trainer_version: int, *, algo, trainer, seq_len: int, pad_id: int,
               episodes: bool = False):
    """Arrays for one train step (length buckets, packing and micro-batches per the
    trainer config; advantages per the algorithm), plus host-side statistics
    (`episodes`: a multi-turn environment's run, whose statistics include
    `episode_stats` even for a batch without tool calls)."""
    trajs = [t for g in groups for t in g.trajectories]
    arrays, info = build_batch([g.trajectories for g in groups], algo=algo, trainer=trainer,
                               seq_len=seq_len, pad_id=pad_id)
    # Staleness of sampled tokens: a fed token (tool result) has no policy version.
    versions = np.concatenate([np.asarray(t.versions, np.int64)[np.asarray(
        getattr(t, "loss_mask", None) or [1] * len(t.versions), bool)] for t in trajs])
    staleness = trainer_version - versions
    stats = {
        "reward_mean": info["reward_mean"],
        "invalid_samples": info["invalid_samples"],
        "tokens": info["tokens"],
        "zero_variance_groups": info["zero_variance_groups"],
        "batch_length": info["length"],
        "batch_fill": info["fill"],
        "staleness_mean": float(staleness.mean()),
        "staleness_max": int(staleness.max()),
        "staleness_hist": np.bincount(staleness, minlength=1).tolist(),
        "response_len_mean": float(np.mean([len(t.response_ids) for t in trajs])),
    }
    if episodes or any(getattr(t, "tool_calls", 0) or len(getattr(t, "turn_starts", ())) > 1
                       for t in trajs):   # multi-turn episodes
        stats.update(episode_stats(trajs))
    return arrays, stats


def episode_stats(trajs) -> dict[str, float]:
    """Multi-turn facts of a batch: sampled turns per trajectory, tool calls per
    trajectory, and the fraction of tool calls that ended "ok" (NaN with no calls)."""
    calls = sum(t.tool_calls for t in trajs)
    return {"turns_mean": float(np.mean([t.num_sampled_turns for t in trajs])),
            "tool_calls_mean": float(np.mean([t.tool_calls for t in trajs])),
            "tool_success_rate": sum(t.tool_ok for t in trajs) / calls if calls else float("nan"),
            "fed_tokens": int(sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajs))}
