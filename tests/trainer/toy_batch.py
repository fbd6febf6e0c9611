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
