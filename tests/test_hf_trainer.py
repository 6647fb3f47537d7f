"""examples/hf_trainer.py: Hugging Face ``transformers.Trainer``, unmodified, on two ranks under ``run()``: a small
randomly initialised GPT-2 on text from a DataFrame; the Trainer sees a world of 2 and the loss falls."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytestmark = pytest.mark.spark

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_transformers_trainer_on_two_ranks(spark, tmp_path):
    spec = importlib.util.spec_from_file_location("hf_trainer", EXAMPLES / "hf_trainer.py")
    hf_trainer = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = hf_trainer
    spec.loader.exec_module(hf_trainer)  # it runs itself (its file) on the ranks
    df = spark.createDataFrame([(t,) for t in hf_trainer.sample_text(512)], "text string")
    summary = hf_trainer.fit_on_spark(spark, df, str(tmp_path), num_proc=2, steps=30)
    assert summary["world_size"] == 2 and summary["steps"] == 30
    losses = summary["losses"]
    assert len(losses) == 6 and losses[-1] < 0.8 * losses[0], losses
