"""Flags shared by the end-to-end runs: a smaller model than the default (64 wide),
4 groups a step and 16 held-out problems, so a step takes about a second on a CPU."""

SMALL = ["--warm-start.steps", "20", "--model.hidden-size", "64", "--model.intermediate-size",
         "128", "--model.num-hidden-layers", "2", "--model.num-attention-heads", "2",
         "--model.num-key-value-heads", "1", "--task.num-eval", "16",
         "--algo.groups-per-step", "4", "--rollout.groups-per-batch", "4"]
