"""The data kinds' pipelines against their peers, one invocation, ratios of the same run.

- **images**: ``--images`` PNG files (sklearn's digits drawn at 64x64 RGB) decoded, resized to 32x32 and
  normalised, batches of 64, ``--workers`` workers each, every pipeline built once and timed over whole epochs (best
  of 3: the steady state of training, pool start-up excluded):
  ``spark_hvd threads`` / ``processes``: ``BatchReader`` over the same images in Parquet (a binary column, row
  groups of 1 MiB) with ``ImageDecoder`` as ``transformation_fn`` on its thread pool / its worker processes
  (``reader_pool_type``); ``torch DataLoader``: a ``Dataset`` over the image files (the same Pillow decode per file:
  torchvision is not installed here) with ``num_workers`` persistent worker processes and torch's default
  collation; ``in-memory loop``: ``decode_images`` over the bytes already in memory, 64 at a time, on one thread.
  Also the CPU time of this process per epoch (threads pipeline and loop: the work each does, which a loaded
  machine slows alike; the process pipelines' work is in other processes).
- **text**: ``--sentences`` strings (Python's standard-library docstrings, offline) tokenised by a BPE tokenizer
  trained on them in seconds (``tokenizers``), padded per batch of 64, whole epochs (best of 3). Every pipeline
  makes the same call on the same strings in the same process, so the same tokenizer settings (its own thread
  pool over all cores unless ``TOKENIZERS_PARALLELISM`` says otherwise; reported):
  ``tok.encode_batch(list_of_64_str)`` and the same padding loop. ``spark_hvd shuffled``: one ``BatchReader``
  over a string column in Parquet (shuffled, as training reads), tokenising in ``collate_fn`` (which runs on the
  reader's read-ahead thread); ``in-memory, the reader's batches``: the same strings in the same batches as the
  reader yields them in that epoch (listed before the timing), on the caller's thread; ``spark_hvd file order``:
  the reader with ``shuffle=False``; ``in-memory, file order``: the strings of a Python list, 64 at a time in
  their order (the tokenizer costs 5-16% more CPU on shuffled batches than on neighbouring sentences,
  benchmarks/RESULTS.md, so shuffled is compared with shuffled and file order with file order; the third ratio,
  shuffled against file order, includes shuffling's cost). Also the CPU time per epoch of this process, all its
  threads (the tokenizer's too).
- **peak RSS**: one rank (a fresh process) reads an epoch of ``--rss-mib`` MiB of incompressible 64 KiB binary
  rows with a memory budget of a quarter of that (shuffle buffer + read-ahead + prefetch sized to it by the
  reader's documented memory formula); reported: its peak RSS above the RSS it had after its imports, against
  the budget.

Timing: the pipelines of a part run in turns (one epoch of each per round, 3 rounds), best wall time and best CPU
time of each kept, so that a load that drifts weighs on all alike.

Run:  .venv/bin/python benchmarks/data_kinds.py [--images 2000] [--workers 2] [--sentences 20000] [--rss-mib 512]
Results go to stdout (a table) and, with ``--json``, to a file. The machine's load matters: report it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spark_hvd.data.decode import ImageDecoder, decode_images  # noqa: E402
from spark_hvd.data.reader import BatchReader  # noqa: E402

BATCH = 64


def make_images(directory: str, count: int, side: int = 64, fmt: str = "png") -> list[str]:
    """``count`` image files of digits at ``side`` x ``side`` RGB (tinted so that the 3 channels differ; JPEG with
    a little noise, so that it does not compress to almost nothing)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(0)
    paths = []
    os.makedirs(directory, exist_ok=True)
    for n in range(count):
        image = digits.images[n % len(digits.images)] * (255 / 16)
        rgb = np.stack([image, image[::-1], image.T], axis=-1).astype(np.uint8)
        img = Image.fromarray(rgb, mode="RGB").resize((side, side), Image.BILINEAR)
        path = os.path.join(directory, f"{n:05d}.{fmt}")
        if fmt == "jpeg":
            noisy = np.asarray(img, dtype=np.int16) + rng.integers(-12, 13, (side, side, 3), dtype=np.int16)
            Image.fromarray(noisy.clip(0, 255).astype(np.uint8), mode="RGB").save(path, quality=90)
        else:
            img.save(path)
        paths.append(path)
    return paths


class FileImages:
    """torch Dataset over image files, decoding each as ``ImageDecoder`` does."""

    def __init__(self, paths: list[str], size: tuple[int, int]) -> None:
        self.paths, self.size = paths, size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        import torch

        with open(self.paths[i], "rb") as f:
            blob = f.read()
        return torch.from_numpy(decode_images([blob], self.size, "RGB", [0.5] * 3, [0.5] * 3)[0]), i


def bench_images(work: str, count: int, workers: int, side: int = 32) -> dict:
    import torch

    # small: 64x64 PNGs to 32x32 (the sizes of the first runs); larger: JPEGs of 8/7 the side (256 -> 224)
    size = (side, side)
    paths = (make_images(os.path.join(work, "png"), count) if side <= 32 else
             make_images(os.path.join(work, "jpeg"), count, side * 8 // 7, "jpeg"))
    blobs = [open(p, "rb").read() for p in paths]
    pq.write_table(pa.table({"id": np.arange(count), "content": pa.array(blobs, pa.binary())}),
                   os.path.join(work, "images.parquet"), row_group_size=max(1, (1 << 20) // max(map(len, blobs))))
    decoder = ImageDecoder("content", size=size, mean=[0.5] * 3, std=[0.5] * 3)
    readers = {pool: BatchReader(os.path.join(work, "images.parquet"), batch_size=BATCH, shuffle=True,
                                 transformation_fn=decoder, read_ahead_pieces=workers, pool_type=pool)
               for pool in ("thread", "process")}
    epochs = {pool: iter(range(1 << 30)) for pool in readers}

    def ours(pool: str) -> int:
        return sum(len(b["content"]) for b in readers[pool].epoch(next(epochs[pool])))

    dl = torch.utils.data.DataLoader(FileImages(paths, size), batch_size=BATCH, shuffle=True, num_workers=workers,
                                     persistent_workers=workers > 0)

    def loader() -> int:
        return sum(len(x) for x, _ in dl)

    def memory() -> int:
        n = 0
        for start in range(0, count, BATCH):
            n += len(decode_images(blobs[start:start + BATCH], size, "RGB", [0.5] * 3, [0.5] * 3))
        return n

    try:
        wall, cpu = interleaved({"spark_hvd threads": lambda: ours("thread"),
                                 "spark_hvd processes": lambda: ours("process"),
                                 "torch DataLoader": loader, "in-memory loop": memory}, count)
    finally:
        readers["process"].close()
    rates = {name: count / t for name, t in wall.items()}
    # CPU time of this process (all its threads) per epoch: the work each does, which a loaded machine slows alike
    # (the process pipelines' work is in other processes)
    cpu = {k: cpu[k] for k in ("spark_hvd threads", "in-memory loop")}
    return rates, {"cpu ms per epoch": {k: round(v * 1000, 1) for k, v in cpu.items()},
                   "in-memory / threads (1.0: no overhead)": cpu["in-memory loop"] / cpu["spark_hvd threads"]}


def interleaved(fns: dict, count: int, repeats: int = 3) -> tuple[dict, dict]:
    """Best wall time and best CPU time of this process per call of each function, taken in turns (one call of
    each per round, ``repeats`` rounds), so that a load that drifts during the run weighs on every pipeline alike
    (before: all runs of one pipeline, then all of the next)."""
    wall = dict.fromkeys(fns, float("inf"))
    cpu = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            got = fn()
            wall[name] = min(wall[name], time.perf_counter() - t0)
            cpu[name] = min(cpu[name], time.process_time() - c0)
            assert got >= count, (name, got, count)
    return wall, cpu


def corpus(count: int) -> list[str]:
    """Docstrings of the standard library, split into sentences (offline, real English). Only the standard
    library's own modules, in name order (before: every module on ``sys.path``, which imported the scripts of
    ``benchmarks/`` and of the working directory, so the corpus changed with where it ran)."""
    texts: list[str] = []
    seen: set[str] = set()
    for name in sorted(sys.stdlib_module_names):
        if len(texts) >= count or name.startswith("_") or name in ("antigravity", "this", "idlelib", "tkinter",
                                                                    "turtle", "turtledemo"):
            continue
        try:
            with warnings.catch_warnings():  # deprecated modules say so on import
                warnings.simplefilter("ignore")
                module = __import__(name)
        except BaseException:  # noqa: BLE001 - anything importable will do
            continue
        objects = [module, *vars(module).values()]
        objects += [m for o in objects[1:] if isinstance(o, type) for m in vars(o).values()]  # and their methods
        for obj in objects:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and doc not in seen:  # each docstring once (str's, int's... recur everywhere)
                seen.add(doc)
                texts += [s.strip() for s in doc.split(". ") if len(s.strip()) > 20]
    while len(texts) < count:
        texts += texts
    return texts[:count]


def bench_text(work: str, count: int) -> tuple[dict, dict]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    sentences = corpus(count)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(sentences, trainers.BpeTrainer(vocab_size=4000, special_tokens=["[PAD]", "[UNK]"]))
    pq.write_table(pa.table({"text": sentences}), os.path.join(work, "text.parquet"), row_group_size=4096)

    def pad(encodings) -> np.ndarray:
        ids = [e.ids for e in encodings]
        out = np.zeros((len(ids), max(map(len, ids))), np.int64)
        for i, row in enumerate(ids):
            out[i, :len(row)] = row
        return out

    def collate(batch: dict) -> dict:
        return {"ids": pad(tok.encode_batch(list(batch["text"])))}

    path = os.path.join(work, "text.parquet")
    shuffled = BatchReader(path, batch_size=BATCH, shuffle=True, collate_fn=collate)
    ordered = BatchReader(path, batch_size=BATCH, shuffle=False, collate_fn=collate)
    # the strings of the very batches the shuffled reader yields in each epoch (same seed, same epochs), listed
    # before the timing: the in-memory peer tokenises the same strings in the same batches
    rounds = 3
    same = {e: [list(b["text"]) for b in BatchReader(path, batch_size=BATCH, shuffle=True, prefetch=0).epoch(e)]
            for e in range(rounds)}
    epochs = {name: iter(range(rounds)) for name in ("shuffled", "ordered", "same")}

    def ours(reader: BatchReader, name: str) -> int:
        return sum(len(b["ids"]) for b in reader.epoch(next(epochs[name])))

    def memory() -> int:
        return sum(len(pad(tok.encode_batch(sentences[s:s + BATCH]))) for s in range(0, count, BATCH))

    def memory_same() -> int:
        return sum(len(pad(tok.encode_batch(texts))) for texts in same[next(epochs["same"])])

    batches = -(-count // BATCH)
    fns = (("spark_hvd shuffled", lambda: ours(shuffled, "shuffled")), ("in-memory, the reader's batches", memory_same),
           ("spark_hvd file order", lambda: ours(ordered, "ordered")), ("in-memory, file order", memory))
    wall, cpu = interleaved(dict(fns), count, rounds)
    rates = {name: batches / t for name, t in wall.items()}
    cpu = {name: round(t * 1000, 1) for name, t in cpu.items()}
    return rates, {"cpu ms per epoch (all threads)": cpu}


_RSS_CHILD = r"""
import os, resource, sys, json
sys.path.insert(0, {root!r})
from spark_hvd.data.reader import BatchReader
import numpy as np, pyarrow
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) * 1024
base = rss()
reader = BatchReader({path!r}, batch_size={batch}, shuffle=True, shuffle_buffer_rows={buffer_rows},
                     read_ahead_pieces={ahead}, prefetch={prefetch})
peak, rows = 0, 0
for batch in reader.epoch(0):
    rows += len(batch["blob"])
    peak = max(peak, rss())
print(json.dumps({{"base": base, "peak": peak, "rows": rows}}))
"""


def bench_rss(work: str, mib: int) -> dict:
    row = 64 << 10
    rows = (mib << 20) // row
    path = os.path.join(work, "rss.parquet")
    rng = np.random.default_rng(0)
    with pq.ParquetWriter(path, pa.schema([("id", pa.int64()), ("blob", pa.binary())]), compression="none") as w:
        for start in range(0, rows, 16):  # row groups of 1 MiB, as prepare_data writes binary columns
            n = min(16, rows - start)
            w.write_table(pa.table({"id": np.arange(start, start + n),
                                    "blob": pa.array([rng.bytes(row) for _ in range(n)], pa.binary())}))
    budget = (mib << 20) // 4
    # the reader's memory, as its docstring gives it: up to 2 x shuffle_buffer_rows rows held by the shuffle (rows
    # of row groups still partly in the buffer; compacted beyond that), read_ahead_pieces row groups being decoded,
    # prefetch batches queued. Sized here: a quarter of the budget for the buffer (twice held: a half), a quarter
    # for the queued batches, 4 row groups of 1 MiB read ahead.
    batch = 32
    buffer_rows = (budget // 4) // row
    ahead = 4
    prefetch = max(1, (budget // 4) // (batch * row))
    code = _RSS_CHILD.format(root=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path=path,
                             batch=batch, buffer_rows=buffer_rows, ahead=ahead, prefetch=prefetch)
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                     .stdout.strip().splitlines()[-1])
    grown = out["peak"] - out["base"]
    return {"dataset MiB": mib, "budget MiB": budget >> 20, "peak RSS above start MiB": round(grown / 2**20, 1),
            "ratio to budget": round(grown / budget, 2), "rows read": out["rows"],
            "settings": {"shuffle_buffer_rows": buffer_rows, "read_ahead_pieces": ahead,
                         "prefetch": prefetch, "batch_size": batch}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=32,
                        help="output side: 32 (64x64 PNGs, the default) or larger (JPEGs of 8/7 the side)")
    parser.add_argument("--sentences", type=int, default=20000)
    parser.add_argument("--rss-mib", type=int, default=512)
    parser.add_argument("--only", choices=["images", "text", "rss"], help="run one part only")
    parser.add_argument("--json")
    args = parser.parse_args()
    results = {"load": os.getloadavg(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="bench-data-") as work:
        if args.only in (None, "images"):
            images, results["images CPU"] = bench_images(work, args.images, args.workers,
                                                             args.image_size)
            results["images/s"] = images
            results["images ratios"] = {
                f"{ours} vs {peer}": images[ours] / images[peer]
                for ours in ("spark_hvd threads", "spark_hvd processes")
                for peer in ("torch DataLoader", "in-memory loop")}
        if args.only in (None, "text"):
            text, results["text CPU"] = bench_text(work, args.sentences)
            results["text batches/s"] = text
            results["tokenizer threads"] = {v: os.environ.get(v, "unset") for v in ("TOKENIZERS_PARALLELISM",
                                                                                    "RAYON_NUM_THREADS")}
            results["text ratios"] = {
                "shuffled vs in-memory, the same batches": text["spark_hvd shuffled"]
                / text["in-memory, the reader's batches"],
                "file order vs in-memory, file order": text["spark_hvd file order"] / text["in-memory, file order"],
                "shuffled vs in-memory, file order (shuffling's cost included)": text["spark_hvd shuffled"]
                / text["in-memory, file order"],
            }
        if args.only in (None, "rss"):
            results["rss"] = bench_rss(work, args.rss_mib)
    results["load after"] = os.getloadavg()
    print(json.dumps(results, indent=2, default=float))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=float)


if __name__ == "__main__":
    main()
