"""A fixed 8-row train batch for the tiny model (unpacked layout), shared by tests that
run the trainer role."""

import numpy as np

from fnrl.trainer.step import pack_sequences, scatter_response


def toy_batch(seq_len: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    prompts = [tuple(rng.integers(3, 20, 5)) for _ in range(8)]
    responses = [tuple(rng.integers(3, 20, 4)) for _ in range(8)]
    out = pack_sequences(prompts, responses, seq_len, pad_id=0)
    out["behaviour_logp_BxT"] = scatter_response([(-3.0,) * 4] * 8, [5] * 8, seq_len)
    out["adv_B"] = rng.standard_normal(8).astype(np.float32)
    return out


def on_policy_batch(graphdef, params, *, rows: int, vocab: int, seed: int,
                    seq_len: int = 16) -> dict[str, np.ndarray]:
    """`rows` random 5-token prompts with 6-token responses whose behaviour log-probs
    are the model's own (version 0: the ratio is 1), and random advantages."""
    from fnrl.trainer.step import token_logprobs

    rng = np.random.default_rng(seed)
    prompts = [tuple(rng.integers(3, vocab, 5)) for _ in range(rows)]
    responses = [tuple(rng.integers(3, vocab, 6)) for _ in range(rows)]
    batch = pack_sequences(prompts, responses, seq_len=seq_len, pad_id=0)
    logp = token_logprobs(graphdef, params, batch["input_BxT"], batch["target_BxT"])
    batch["behaviour_logp_BxT"] = np.asarray(logp) * batch["mask_BxT"]
    batch["adv_B"] = rng.standard_normal(rows).astype(np.float32)
    return batch
