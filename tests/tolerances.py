"""Platform-aware tolerances for tests that compare two numerical paths (the GPU lane).

    from tests.tolerances import assert_close, tol
    assert_close(got, want, "bfloat16")               # relative to each element and the max
    np.testing.assert_allclose(got, want, **tol("float32"))

What differs between two correct paths is rounding, and how much depends on where they
run and in what dtype:
  float32 on CPU       summation order only (XLA's CPU matmuls are exact float32).
  float32 on GPU       at matmul precision "highest" (what fnrl.trainer.platform picks for
                       float32 compute): blocked, reordered reductions, an order more.
                       At "default" JAX uses TF32 on Ampere and later (10-bit mantissa):
                       remat vs plain gradients differed by 1.4e-4 on an H200.
  bfloat16             8-bit mantissa: every activation and cotangent rounds to ~2**-8,
                       and errors add up through layers; any platform.
`tests/` is on sys.path (conftest.py's folder), so any test module imports this one.
"""

from __future__ import annotations

import numpy as np

# (rtol, atol relative to the reference's largest magnitude), by (dtype, platform, precision).
_FLOAT32 = {("cpu", "highest"): (1e-5, 1e-5), ("cpu", "default"): (1e-5, 1e-5),
            ("gpu", "highest"): (5e-5, 5e-5), ("gpu", "default"): (5e-3, 5e-3)}
_BFLOAT16 = (3e-2, 2e-2)


def platform() -> str:
    """The platform JAX computes on here ("cpu", "gpu", "tpu")."""
    import jax
    return jax.default_backend()


def tol(dtype: str = "float32", *, precision: str = "highest",
        on: str | None = None) -> dict[str, float]:
    """rtol and atol (absolute for values of order 1: `assert_close` scales it by the
    reference's largest magnitude) of a comparison in `dtype`
    ("float32", "bfloat16") with float32 matmuls at `precision` ("highest", "default")
    on platform `on` (default: this one). TPU counts as GPU (reordered, blocked)."""
    name = np.dtype(dtype).name if dtype != "bfloat16" else "bfloat16"
    if name == "bfloat16":
        rtol, atol = _BFLOAT16
    elif name == "float32":
        where = on or platform()
        key = ("cpu" if where == "cpu" else "gpu", "default" if precision != "highest"
               else "highest")
        rtol, atol = _FLOAT32[key]
    else:
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    return {"rtol": rtol, "atol": atol}


def assert_close(got, want, dtype: str = "float32", *, precision: str = "highest",
                 err_msg: str = "") -> None:
    """`got` within `tol(dtype, precision=...)` of `want`, atol scaled by want's largest
    magnitude (so a gradient of order 1e-3 is not compared at an absolute 1e-2)."""
    t = tol(dtype, precision=precision)
    want = np.asarray(want, np.float32)
    scale = float(np.abs(want).max()) if want.size else 1.0
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=t["rtol"],
                               atol=t["atol"] * max(scale, 1e-30), err_msg=err_msg)
