"""One GPU split between the trainer and vLLM servers: figures by hand, the refusals, the
env and flags, and the invariants over random figures. Pure: nothing here ran on a GPU."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fnrl.policy.gpu_memory import (CARD_SPARE_FRACTION, CUDA_CONTEXT_BYTES, GIB,
                                    SERVER_ASLEEP_BYTES, SERVER_WORKSPACE_BYTES, ServerNeed,
                                    TrainerNeed, plan_gpu_split)

CARD = 80 * GIB


def _server(name="rollout0", weights=1, kv=1, fraction=0.0) -> ServerNeed:
    return ServerNeed(name=name, weights_bytes=weights * GIB, kv_bytes=kv * GIB,
                      fraction=fraction)


def test_side_by_side_by_hand():
    split = plan_gpu_split(card_bytes=CARD, trainer=TrainerNeed(peak_bytes=28 * GIB,
                           resident_bytes=6 * GIB), servers=(_server(),), synchronous=False)
    assert not split.sleep
    # The server: 1 + 1 + 1 GiB (workspace) of 80 = 0.0375, rounded up to 0.038.
    assert SERVER_WORKSPACE_BYTES == GIB and CUDA_CONTEXT_BYTES == GIB
    assert split.server_fractions == {"rollout0": 0.038}
    # The trainer: 80 x 0.97 spare - 2 contexts - 0.038 x 80 = 72.56 GiB = 0.907 of it.
    assert CARD_SPARE_FRACTION == 0.03
    assert split.trainer_fraction == 0.907
    assert split.trainer_env() == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.907",
                                   "XLA_CLIENT_MEM_FRACTION": None,
                                   "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}
    assert split.server_args("rollout0") == ("--gpu-memory-utilization", "0.038")
    assert split.server_args("rollout9") == ()
    table = split.table()
    assert "side by side" in table and "rollout0: KV: 1.00 GiB" in table


def test_too_big_is_refused_with_every_figure():
    with pytest.raises(ValueError) as err:
        plan_gpu_split(card_bytes=CARD, trainer=TrainerNeed(peak_bytes=100 * GIB,
                       resident_bytes=90 * GIB), servers=(_server(weights=15, kv=30),),
                       synchronous=True)
    msg = str(err.value)
    assert "one GPU of 80.00 GiB" in msg and "fits neither" in msg
    for figure in ("trainer: step peak 100.00", "trainer: kept between steps 90.00",
                   "rollout0: weights 15.00", "rollout0: KV 30.00",
                   "CUDA contexts (2 processes) 2.00", "spare (3% of the card) 2.40"):
        assert figure in msg
    assert "--trainer.micro-batches" in msg and "a second GPU" in msg


# Beside a 25 GiB server the trainer gets 77.6 - 2 - 25 = 50.6 GiB: not its 60. Asleep,
# the servers leave it 77.6 - 2 - 0.5 = 75.1; awake beside its 10 GiB, 40.6 to spare.
ONLY_ASLEEP = dict(card_bytes=CARD, trainer=TrainerNeed(peak_bytes=60 * GIB,
                   resident_bytes=10 * GIB), servers=(_server(weights=4, kv=20),))


def test_fits_only_asleep_gets_sleep_under_a_synchronous_schedule():
    assert SERVER_ASLEEP_BYTES == GIB // 2
    split = plan_gpu_split(**ONLY_ASLEEP, synchronous=True)
    assert split.sleep
    assert split.trainer_fraction == 0.938   # 75.1 / 80 = 0.93875, rounded down
    assert split.server_fractions == {"rollout0": 0.313}   # 25 / 80 = 0.3125, rounded up
    assert split.trainer_env() == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.938",
                                   "XLA_CLIENT_MEM_FRACTION": None,
                                   "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                                   "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
    assert split.server_args("rollout0") == ("--gpu-memory-utilization", "0.313",
                                             "--enable-sleep-mode")
    assert "time-shared" in split.table()


def test_fits_only_asleep_is_refused_when_generation_overlaps_training():
    with pytest.raises(ValueError, match=r"fits only with the servers asleep.*--preset sync"):
        plan_gpu_split(**ONLY_ASLEEP, synchronous=False)
    with pytest.raises(ValueError, match="rollout.gpu_sleep=False"):
        plan_gpu_split(**ONLY_ASLEEP, synchronous=True, sleep=False)


def test_sleep_asked_for():
    small = dict(card_bytes=CARD, trainer=TrainerNeed(peak_bytes=8 * GIB, resident_bytes=GIB),
                 servers=(_server(),))
    assert plan_gpu_split(**small, synchronous=True, sleep=True).sleep
    with pytest.raises(ValueError, match=r"gpu_sleep=True, but .*η = 0"):
        plan_gpu_split(**small, synchronous=False, sleep=True)
    # Awake servers beside what the trainer keeps do not fit: time-sharing cannot help.
    with pytest.raises(ValueError, match="does not fit time-shared"):
        plan_gpu_split(card_bytes=CARD, trainer=TrainerNeed(peak_bytes=60 * GIB,
                       resident_bytes=55 * GIB), servers=(_server(weights=4, kv=20),),
                       synchronous=True, sleep=True)


def test_a_fraction_the_config_fixed_and_a_standby_trainer():
    split = plan_gpu_split(card_bytes=CARD, trainer=TrainerNeed(peak_bytes=20 * GIB,
                           resident_bytes=GIB), servers=(_server(fraction=0.3),
                           _server(name="eval")), synchronous=False, trainers=2)
    assert split.server_fractions == {"rollout0": 0.3, "eval": 0.038}
    assert split.server_args("rollout0") == ()   # its command line already says 0.3
    # Each of 2 trainers: (77.6 - 4 contexts - 24 - 3.04) / 2 = 23.28 GiB = 0.291 of it.
    assert split.trainer_fraction == 0.291


@settings(max_examples=200, deadline=None)
@given(card=st.integers(8, 200), peak=st.floats(0.1, 150), resident=st.floats(0, 1),
       servers=st.lists(st.tuples(st.floats(0, 40), st.floats(0, 40)), min_size=1,
                        max_size=3),
       trainers=st.integers(1, 2), synchronous=st.booleans(),
       sleep=st.sampled_from([None, True, False]))
def test_a_plan_never_overcommits_the_card(card, peak, resident, servers, trainers,
                                           synchronous, sleep):
    card_bytes = card * GIB
    trainer = TrainerNeed(peak_bytes=int(peak * GIB), resident_bytes=int(resident * peak * GIB))
    needs = tuple(ServerNeed(name=f"rollout{i}", weights_bytes=int(w * GIB),
                             kv_bytes=int(k * GIB)) for i, (w, k) in enumerate(servers))
    try:
        split = plan_gpu_split(card_bytes=card_bytes, trainer=trainer, servers=needs,
                               synchronous=synchronous, sleep=sleep, trainers=trainers)
    except ValueError as err:
        assert f"step peak {trainer.peak_bytes / GIB:.2f}" in str(err)
        return
    assert split.sleep in ((True,) if sleep else (False,) if sleep is False else (True, False))
    assert not split.sleep or synchronous
    reserved = (trainers + len(needs)) * CUDA_CONTEXT_BYTES + CARD_SPARE_FRACTION * card_bytes
    for s in needs:   # every server gets at least its need
        assert split.server_fractions[s.name] * card_bytes >= s.need_bytes
    assert split.trainer_fraction * card_bytes >= trainer.peak_bytes
    serving = sum(split.server_fractions.values()) * card_bytes
    if split.sleep:   # the step beside sleeping servers; awake servers beside what stays
        assert (trainers * split.trainer_fraction * card_bytes
                + len(needs) * SERVER_ASLEEP_BYTES + reserved) <= card_bytes + 1024
        assert trainers * trainer.resident_bytes + serving + reserved <= card_bytes + 1024
    else:
        assert trainers * split.trainer_fraction * card_bytes + serving + reserved \
            <= card_bytes + 1024
