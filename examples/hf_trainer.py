"""Hugging Face ``transformers.Trainer`` on Spark with spark_hvd, the training script unmodified.

The driver half (``fit_on_spark``) writes the text column of a DataFrame to Parquet and runs this same file as a
script on ``num_proc`` ranks (``spark_hvd.runner.run("hf_trainer.py", args=[...])``). The rank half (``train``)
is an ordinary HF script: ``Trainer`` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` ...)
that spark_hvd sets, and its ``init_process_group`` meets over the job's authenticated store. Nothing is
downloaded: the tokenizer is trained here with ``tokenizers`` on the same text, and the model is a small GPT-2
built from a config and randomly initialised.

    python examples/hf_trainer.py --num-proc 2 --steps 40        # a local[2] session
"""

from __future__ import annotations

import argparse
import json
import os
import sys

TOKEN_LEN = 24


def _tokenizer(texts: list[str]):
    """A word-level tokenizer trained on ``texts`` (the same on every rank: the text is the same)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")


def train(data: str, out: str, steps: int, batch_size: int) -> None:
    """The rank side: a plain transformers.Trainer script (what would run under torchrun)."""
    import pyarrow.parquet as pq
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    texts = pq.read_table(data).column("text").to_pylist()
    tokenizer = _tokenizer(texts)
    enc = tokenizer(texts, truncation=True, max_length=TOKEN_LEN, padding="max_length", return_tensors="pt")

    class TextData(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(texts)

        def __getitem__(self, i: int) -> dict:
            ids, mask = enc["input_ids"][i], enc["attention_mask"][i]
            return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=TOKEN_LEN, n_embd=32, n_layer=2, n_head=2,
                        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=batch_size,
                             learning_rate=3e-3, logging_steps=5, save_strategy="no", report_to=[], use_cpu=True,
                             ddp_backend="gloo", ddp_find_unused_parameters=False,
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=TextData())
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump({"world_size": args.world_size, "losses": losses, "steps": trainer.state.global_step}, f)


def sample_text(n: int) -> list[str]:
    """``n`` sentences of a tiny repetitive grammar: a language model can learn it in a few dozen steps."""
    import random

    rng = random.Random(0)
    subjects, verbs, objects = ["the cat", "a dog", "my friend", "the model"], ["sees", "likes", "eats"], \
        ["the ball", "a fish", "some data", "the moon"]
    return [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} ." for _ in range(n)]


def fit_on_spark(spark, df, out: str, num_proc: int = 2, steps: int = 40, batch_size: int = 8) -> dict:
    """The driver side: the DataFrame's ``text`` column to Parquet, this file run as a script on every rank."""
    from spark_hvd.runner import run

    data = os.path.join(out, "text.parquet")
    df.select("text").toPandas().to_parquet(data)  # small text; a big one would go through the Store
    run(os.path.abspath(__file__), args=["--data", data, "--out", out, "--steps", str(steps),
                                         "--batch-size", str(batch_size)], num_proc=num_proc, spark=spark)
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="(rank side) the Parquet file of the text")
    parser.add_argument("--out", default="hf_trainer_out")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-proc", type=int, default=2)
    args = parser.parse_args(argv)
    if args.data:  # a rank, started by run()
        train(args.data, args.out, args.steps, args.batch_size)
        return
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.master(f"local[{args.num_proc}]").getOrCreate()
    os.makedirs(args.out, exist_ok=True)
    df = spark.createDataFrame([(t,) for t in sample_text(512)], "text string")
    summary = fit_on_spark(spark, df, os.path.abspath(args.out), args.num_proc, args.steps, args.batch_size)
    print(f"world size {summary['world_size']}, loss {summary['losses'][0]:.3f} -> {summary['losses'][-1]:.3f} "
          f"in {summary['steps']} steps")


if __name__ == "__main__":
    main(sys.argv[1:])
