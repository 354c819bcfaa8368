"""examples/train_moe.py and examples/expert_parallel_hf.py on 2 ranks, started as the README
shows, every loss (or logit) and parameter checked by the example against a dense or
single-process model: the dense example on gloo, the Hugging Face one on gloo (dynamic mode) and
on mpi (static mode), the same code on both. (The dense example's operators and their gradients
run on mpi in tests/backends/test_mpi.py; the mpi launcher runs the Hugging Face example.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_moe.py"


def test_training_matches_the_dense_model() -> None:
    argv = [sys.executable, "-m", "unicoll", "run", "-n", "2", str(EXAMPLE)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "backend gloo: 2 ranks x 2 experts, 30 Adam steps: every loss and every parameter match" in proc.stdout


HF_EXAMPLE = EXAMPLE.parent / "expert_parallel_hf.py"


@pytest.mark.parametrize(("launch", "mode"), [([], []), (["--mpi"], ["--static"])], ids=["gloo", "mpi-static"])
def test_the_hugging_face_example_matches_the_single_process(launch: list[str], mode: list[str]) -> None:
    pytest.importorskip("transformers", minversion="5.0")
    argv = [sys.executable, "-m", "unicoll", "run", *launch, "-n", "2", str(HF_EXAMPLE), "--steps", "3", *mode]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    backend, name = ("mpi", "static") if launch else ("gloo", "dynamic")
    expected = f"backend {backend}: Mixtral, 2 ranks x 2 experts ({name} mode), 3 AdamW steps: every step's logits"
    assert expected in proc.stdout
