"""Sandboxed tool execution off the event loop: `pool.SandboxPool` runs tools in
worker processes (`worker`) under limits. Nothing is imported here, so a worker starts
with the standard library only (docs/environments.md)."""
