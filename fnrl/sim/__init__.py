"""fnrl's simulator: the real coordinator on a virtual cluster of up to thousands of GPUs.

    python -m fnrl.sim --preset fnrl --gpus 1024 --steps 100 --eta 3

What is real and what is simulated. Every decision is the real job's: each cycle calls
`fnrl.policy.schedule.reconcile` and `.decide` on a `ClusterSnapshot` (so StaleFlow's
staleness buffers, routing, lazy sync and migration, Laminar's repack, OrchestrRL's
balancer and the sampler run unchanged, configured by `fnrl.config.presets`), and
the per-step records are `fnrl.control.report.step_record`'s with the loop's own `Book`.
What is simulated is what the decisions act on: rollout engines (continuous batching
over StaleFlow's decode cost model, KV capacity, preemption, prefill; fnrl.sim.engine),
the trainer (FLOPs / (GPUs × peak × MFU)) and weight movement (Laminar's publish stall,
relay chain and PCIe pull, or an NCCL broadcast, or a colocated reshard), with every
parameter in fnrl/sim/costs.toml (fnrl.sim.costs).

Why a plain event heap rather than the real asyncio loop on a virtual-time event loop.
We considered running `fnrl.control.loop.Controller` itself over simulated role handles
on an event loop whose clock jumps to the next timer. That loop moves *tokens*: every
streamed chunk is appended to the partial response pool (a JSON-lines file), every
consumed batch is built into padded arrays by `fnrl.trainer.batching.make_batch`, every
response is decoded and rewarded, and every tick builds its snapshot by walking Python
objects, one per trajectory. The scale target (1,024 GPUs, 100 steps, 2,048 trajectories
a step with 20K-token tails) is about 10^9 generated tokens: writing them alone would
take far longer than the 60 s budget on two cores, and each simulated stream would be
an asyncio task waking per chunk. The simulator therefore moves *counts*: trajectories
are numpy columns, an engine advances between events in closed form (no per-token or
per-step work), and the loop's `act` is mirrored command for command on that
bookkeeping (fnrl.sim.cluster.Simulation.act: Route enqueues, Interrupt and Migrate
settle tokens into segments, Pull stops the engine until the load lands, Consume checks
V_token + η ≥ V_buf on every token). The policy never knows the difference: it sees the
same snapshot columns and issues the same commands. A cycle runs, like the loop's tick,
when something landed (a trajectory finished, a pull, a train step), at most every
`cycle_s` of virtual time (1 s by default; the loop's TICK_S is 0.1 s); `loop_ticks=True`
ticks exactly as the loop does (every wake, and an idle tick after each cycle).

How we know the mirror is faithful: fnrl.sim.handles implements the role-handle
Protocols over the same cost models, on an asyncio loop whose clock jumps to the next
timer, so the real `Controller` runs a small simulated cluster itself. Under `sync`,
`one_step` and `fnrl` (lazy sync, migration, repack, balancing all active) it issues the
same commands at the same virtual times as this heap, cycle by cycle
(tests/sim/test_real_loop.py).
"""
