"""Flags shared by the end-to-end runs: a smaller model than the default (64 wide, a
128-token context, responses cut at 96 tokens), 4 groups a step and 16 held-out
problems, so a step takes about a second on a CPU. Held-out evaluation runs on rollout 0
(pulling the newest version first), not on a server of its own: that server's start
(two processes importing vLLM, about 20 CPU-seconds) was a fifth of a short run's CPU.
The dedicated lane is proven by test_eval_lane_e2e.py, and the default job's process
lifetimes with it by tests/backends/test_cluster_lifetime.py; a run that wants another
lane gives --eval.server after SMALL."""

SMALL = ["--warm-start.steps", "20", "--model.hidden-size", "64", "--model.intermediate-size",
         "128", "--model.num-hidden-layers", "2", "--model.num-attention-heads", "2",
         "--model.num-key-value-heads", "1", "--model.max-position-embeddings", "128",
         "--algo.max-new-tokens", "96", "--task.num-eval", "16",
         "--algo.groups-per-step", "4", "--rollout.queued-groups", "4",
         "--eval.server", "rollout"]
