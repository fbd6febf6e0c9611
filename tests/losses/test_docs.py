"""docs/losses.md's example runs as written."""

import re
from pathlib import Path

from fnrl.losses import LOSS_TERMS

DOC = Path(__file__).resolve().parents[2] / "docs" / "losses.md"


def test_losses_doc_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks, "docs/losses.md has no python example"
    try:
        for block in blocks:
            exec(compile(block, str(DOC), "exec"), {"__name__": "docs_losses"})
    finally:
        LOSS_TERMS.pop("positive_nll", None)  # leave the registry as other tests expect
