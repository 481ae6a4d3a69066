"""The restricted reader of legacy PyTorch checkpoints: real weights in, every other global refused."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from layerserve.demo.efficientnet_lite0 import checkpoint_path
from layerserve.demo.torch_checkpoint import CheckpointError, load_state_dict


def test_reads_the_packaged_efficientnet_checkpoint() -> None:
    state = load_state_dict(checkpoint_path())
    weights = {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}
    assert sum(v.size for v in weights.values()) == 4_694_024
    assert state["_conv_stem.weight"].shape == (32, 3, 3, 3)
    assert state["_fc.weight"].dtype == np.float32 and np.isfinite(state["_fc.weight"]).all()


class Exploit:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("owned",))


def test_refuses_any_other_global(tmp_path: Path) -> None:
    path = tmp_path / "evil.pth"
    with path.open("wb") as file:
        for header in (0x1950A86A20F9469CFC6C, 1001, {}):
            pickle.dump(header, file, protocol=2)
        pickle.dump(Exploit(), file, protocol=2)
    with pytest.raises(CheckpointError, match=r"\.print, which this reader does not accept"):
        load_state_dict(path)
