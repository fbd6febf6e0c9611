"""Sandboxed tool execution off the event loop: `pool.SandboxPool` runs each tool call in
a fresh bubblewrap sandbox (`kernel`, with the `seccomp` filter), or, only where that
cannot run and the run allows it, in audit-hooked workers (`hook`). `worker` is the code
that runs a call in either. Nothing is imported here, so a sandbox starts with the
standard library only (docs/environments.md)."""
