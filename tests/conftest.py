"""Test-wide set-up: 8 fake CPU devices before JAX is imported, so sharding is tested
without accelerators.

The GPU lane (`FNRL_GPU_LANE=1 pytest -m gpu`, scripts/gpu_check.sh) leaves JAX to find
the machine's own devices: a GPU where there is one, else the one real CPU device. Its
tests compare at `tolerances.tol`'s platform-aware tolerances."""

import os

if os.environ.get("FNRL_GPU_LANE") != "1":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Most of the suite's time is XLA compiling tiny programs that then run in
    # milliseconds, and much of a CPU compile is LLVM optimising the emitted kernels.
    # Backend level 0 skips that (the HLO passes, fusion and buffer assignment are
    # unchanged, and so is every value a test compares). The fast lane, cold cache, quiet
    # 2-core machine: 455 s (793 s of CPU) at the default level, 346 s (573 s) at 0.
    # (XLA:CPU's older fusion emitters compile some programs faster, but some they emit
    # run slower: the same lane took 405 s with them.) The jobs the e2e tests start
    # inherit it. XLA_FLAGS that already choose a level keep theirs.
    if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# XLA executables persist across the tests' processes (the xdist workers, every trainer a
# run starts) in the trainer's own cache (fnrl.trainer.role.enable_compilation_cache):
# many tests compile the same step of the same tiny model under new jit wrappers, and a
# hit loads it instead (tests/trainer/test_role.py with test_fit.py, one process, beside
# another job on this 2-core machine: 265 s with only the trainers' compiles cached,
# 173 s with every compile going through a cold cache). JAX reads these from the
# environment.
from fnrl.trainer.xla_flags import compilation_cache_dir  # noqa: E402  (imports no JAX)

os.environ["JAX_COMPILATION_CACHE_DIR"] = compilation_cache_dir()
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# Each xdist worker may run an end-to-end job (a trainer, one to three vLLM servers and
# relays: about 6 GiB at peak on CPU, 4 of it the servers'), so memory bounds the workers
# as well as cores do. 6 GiB is the embedded job's plan (fnrl.backends.memory prints it).
WORKER_GIB = 6


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the default addopts): one worker per core, as many as memory holds.
    PYTEST_XDIST_AUTO_NUM_WORKERS overrides it; `-n 0` runs in one process (pdb)."""
    if (pinned := os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")):
        return int(pinned)
    cores = len(os.sched_getaffinity(0))
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    return max(1, min(cores, int(available // WORKER_GIB)))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """One warm-started model cache for every end-to-end run of the test session, shared
    by its xdist workers (their base temp dirs sit in one directory of the session's):
    the first run to need a model builds it under the cache's lock, the others load it."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "model_cache"
    shared.mkdir(exist_ok=True)
    return str(shared)


@pytest.fixture(scope="session")
def char_tokenizer_dir(tmp_path_factory) -> Path:
    """fnrl's embedded character-level tokenizer (fnrl.data.arith): <bos>/<eos>/<pad>, no
    chat template."""
    from fnrl.data.arith import build_tokenizer, save_tokenizer

    out = tmp_path_factory.mktemp("char-tokenizer")
    save_tokenizer(build_tokenizer(), out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, char_tokenizer_dir) -> Path:
    """A random tiny Qwen2 with fnrl's arithmetic tokenizer, as an HF directory: the
    embedded model's layout (vocab padded to 16, DecoderConfig's rope_theta), 32 positions."""
    from fnrl.models.synthetic import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("models") / "tiny", "qwen2", seed=0,
                            tokenizer_dir=char_tokenizer_dir, vocab_multiple=16,
                            rope_theta=10000.0, max_position_embeddings=32)


@pytest.fixture(scope="session")
def peaked_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with its weights scaled up: peaked next-token distributions, so a
    kernel difference or a wrong context shows in the log-probs (near-uniform ones hide
    it)."""
    import jax

    from fnrl.models.hf_io import load_pretrained, save_pretrained

    cfg, _, params = load_pretrained(tiny_model_dir)
    params = jax.tree.map(lambda p: p * 4.0 if p.ndim >= 2 else p, params)
    return save_pretrained(tmp_path_factory.mktemp("peaked") / "model", cfg, params,
                           tokenizer_dir=tiny_model_dir)


@pytest.fixture(scope="session")
def bpe_tokenizer_dir(tmp_path_factory) -> Path:
    """A Qwen-style byte-level BPE tokenizer with a ChatML chat template (no hub)."""
    from fnrl.models.synthetic import build_bpe_tokenizer

    return build_bpe_tokenizer(tmp_path_factory.mktemp("bpe-tokenizer"))


@pytest.fixture(scope="session")
def synthetic_model_dir(tmp_path_factory, bpe_tokenizer_dir):
    """Factory `make(family="qwen2", **write_checkpoint_kwargs) -> Path`: a small random
    checkpoint of a family ("qwen2", "qwen3", "llama") with the BPE tokenizer and a
    generation_config.json; one per distinct call per session."""
    from fnrl.models.synthetic import write_checkpoint

    made: dict[str, Path] = {}

    def make(family: str = "qwen2", **kwargs) -> Path:
        key = json.dumps([family, kwargs], sort_keys=True, default=str)
        if key not in made:
            out = tmp_path_factory.mktemp(f"synthetic-{family}") / "model"
            made[key] = write_checkpoint(out, family, **{"seed": 0, **kwargs},
                                         tokenizer_dir=bpe_tokenizer_dir)
        return made[key]

    return make


@pytest.fixture
def write_run_config():
    """Writes a RunConfig (defaults plus overrides) as DIR/config.json; returns the path."""
    from fnrl.config import RunConfig, from_dict, save_json

    def write(directory: Path, **overrides) -> Path:
        cfg = from_dict(RunConfig, overrides)
        directory.mkdir(parents=True, exist_ok=True)
        save_json(cfg, directory / "config.json")
        return directory / "config.json"

    return write


def pytest_collection_modifyitems(config, items):
    """Files with slow tests first. Under `--dist loadfile --no-loadscope-reorder` the
    workers take whole files in collection order (xdist's own reorder puts the files with
    the most tests first, and so the one- and two-test end-to-end files, the longest,
    last: seen running alone at the end); started first, the quick files fill the gaps
    instead. A stable sort: the order within a file, and of the fast files, stays."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
