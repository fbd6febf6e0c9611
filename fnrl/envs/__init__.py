"""Environments for multi-turn rollouts with tools (docs/environments.md).

Pure, loop-free pieces: the interface and registry (base), tool-call parsing
(tool_calls), the calculator, exact token bookkeeping over turns (turns), the episode
driver (episode), the built-in environments (builtin) and an adapter for
gymnasium-style text environments (gym_adapter). Tools that run code execute in
fnrl.sandbox, a roles-level process pool that implements `base.ToolRunner`.

Nothing is imported here: the sandbox's worker processes import `calculator` alone and
must not pay for numpy.
"""
