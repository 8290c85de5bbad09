"""Converting the default model's GGUF once says what it does, and shows no progress bar or warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.model


def test_the_first_conversion_prints_one_message_and_no_bars_or_warnings(tmp_path: Path) -> None:
    script = "from models.files import local_folder; local_folder('smollm2', sys.argv[1])"
    convert = [sys.executable, "-c", f"import sys; {script}", str(tmp_path / "models")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    first = subprocess.run(convert, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=True)
    lines = first.stderr.splitlines()
    assert lines[0].startswith("Converting the model SmolLM2-135M-Instruct once"), first.stderr
    assert lines[1:] == ["Model converted."], first.stderr
    again = subprocess.run(convert, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=True)
    assert again.stderr == ""  # converted once: later starts say nothing
