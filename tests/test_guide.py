"""docs/guide.md's minimal training loop runs as written.

The guide's one ``python`` code block is extracted and executed in this
process (4 forced CPU devices, conftest); the test then checks what the loop
checkpointed and restored from the names the block left behind.
"""

import re
import shutil
from pathlib import Path

import numpy as np

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guide.md"


def guide_code() -> str:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) == 1, f"docs/guide.md should hold one python block, has {len(blocks)}"
    return blocks[0]


def test_guide_loop_checkpoints_and_restores():
    names: dict = {"__name__": "guide"}
    try:
        exec(compile(guide_code(), str(GUIDE), "exec"), names)
    finally:
        if "store_root" in names:
            shutil.rmtree(names["store_root"], ignore_errors=True)
    info, restored = names["info"], names["restored"]
    assert info.step == 3
    assert (info.tier, info.memory_tiers) == ("memory", ["local"])
    assert info.host_state == {"data_position": 3}
    np.testing.assert_array_equal(np.asarray(restored["params"]["w"]),
                                  np.asarray(names["state"]["params"]["w"]))
    assert int(restored["step"]) == 3
    assert names["events"][0]["version"] == 3
    assert names["events"][0]["bytes"] > 0
