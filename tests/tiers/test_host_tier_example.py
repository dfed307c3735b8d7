"""``examples/host_tier.py`` runs and prints what the README says it prints."""

from __future__ import annotations

import runpy
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "host_tier.py"


def test_the_example_promotes_from_the_host_tier(capsys):
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert "second read: 24 tokens, 24 cached (8 on the device, 16 from the host tier)" in out
    assert "after the update: 24 tokens, 0 cached" in out
    assert "demoted 8, promoted 4, weight epoch 1" in out
    assert "cat picture: 16 tokens, 0 cached" in out
    assert "dog picture: 16 tokens, 8 cached (8 on the device" in out  # the text, not the image
