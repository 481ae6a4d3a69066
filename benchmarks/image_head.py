"""Image classifiers trained on a base model's layer, measured on real labelled photos that ship in a package:
GCompris' categorization photos (Debian's gcompris-qt-data: fishes, monuments, renewable energy, tools; Wikimedia
Commons photos, public domain or CC0), on the demo's EfficientNet-Lite0.

    .venv/bin/python benchmarks/image_head.py [--folds 5] [--per-class N] [--json PATH]

1. ImageNet's own labels: the demo model's top-1 for every photo, counted right when it is one of the ImageNet classes
   listed for the photo's class below (where they map: ImageNet has no wind turbine, multimeter or pliers).
2. Stratified k-fold: for each fold, a job trains a head on the other folds' photos over HTTP (`POST
   /v2/models/M/train`, a zip of one folder per class, default params), and its version classifies the fold's photos
   (`/classify`). The baseline: logistic regression (scikit-learn) on the same base layer's features of the same
   training photos (no augmentation), scored on the same held-out photos.
3. The first fold's job again: its features come from the feature store (computed 0), and the job's time drops by
   what computing them took.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import time
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from corpora import PHOTO_CLASSES, gcompris_photos
from demo_server import demo_server
from results import arguments, table, write_result
from soak_server import free_port

BASE = "efficientnet_lite0"
LAYER = "avg_pool"
# ImageNet classes that count as each class's right answer, where ImageNet has them.
IMAGENET_CLASSES = {
    "fishes": {"tench", "goldfish", "great white shark", "tiger shark", "hammerhead", "electric ray", "stingray",
               "barracouta", "eel", "coho", "rock beauty", "anemone fish", "sturgeon", "gar", "lionfish", "puffer"},
    "monuments": {"palace", "triumphal arch", "dome", "mosque", "obelisk", "castle", "church", "stupa", "monastery",
                  "bell cote", "water tower", "pedestal", "megalith", "cliff dwelling", "steel arch bridge",
                  "suspension bridge", "planetarium", "library", "beacon", "boathouse"},
    "renewable": {"dam", "solar dish", "pinwheel"},
    "tools": {"hammer", "screwdriver", "power drill", "chain saw", "rule", "slide rule", "can opener",
              "letter opener", "corkscrew", "screw", "nail", "hatchet", "cleaver", "spatula", "carpenter's kit",
              "hair spray", "scale"},
}  # fmt: skip


def post(url: str, body: bytes, content_type: str, timeout_s: float = 120) -> Any:
    """POST and the JSON answer."""
    request = urllib.request.Request(url, body, {"Content-Type": content_type}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return json.loads(answer.read())


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return json.loads(answer.read())


def multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes, str]]) -> tuple[bytes, str]:
    """A multipart/form-data body and its content type."""
    boundary = f"layerserve{random.getrandbits(64):x}"
    parts = []
    for name, value in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
    for name, (filename, data, media_type) in files.items():
        head = (f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                f"Content-Type: {media_type}\r\n\r\n")  # fmt: skip
        parts.append(head.encode() + data + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def top1(url: str, model: str, images: list[bytes]) -> list[str]:
    """Each image's top-1 label from `model`."""
    labels = []
    for image in images:
        answer = post(f"{url}/v2/models/{model}/classify?top_k=1", image, "image/webp")
        labels.append(answer["predictions"][0][0]["label"])
    return labels


def features(url: str, images: list[bytes]) -> np.ndarray:
    """The base layer's features of each image."""
    rows = [post(f"{url}/v2/models/{BASE}/features?layer={LAYER}", image, "image/webp")["features"][0]
            for image in images]  # fmt: skip
    return np.array(rows, np.float32)


def folds(labels: list[str], count: int, seed: int) -> list[list[int]]:
    """Stratified folds: each class's photos shuffled and dealt round the folds."""
    dealt: list[list[int]] = [[] for _ in range(count)]
    rng = random.Random(seed)
    for label in sorted(set(labels)):
        indexes = [i for i, found in enumerate(labels) if found == label]
        rng.shuffle(indexes)
        for position, index in enumerate(indexes):
            dealt[position % count].append(index)
    return [sorted(fold) for fold in dealt]


def train(url: str, model: str, photos: list[tuple[str, str, bytes]], params: dict[str, Any]) -> dict[str, Any]:
    """A job on (label, name, bytes) photos, waited for: the job's record, with its wall time."""
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as zipped:
        for label, name, data in photos:
            zipped.writestr(f"{label}/{name}", data)
    body, content_type = multipart(
        {"params": json.dumps(params), "apply": "true"}, {"file": ("photos.zip", archive.getvalue(), "application/zip")}
    )
    started = time.perf_counter()
    job = post(f"{url}/v2/models/{model}/train", body, content_type)
    while job["state"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.5)
        job = get(f"{url}/v2/jobs/{job['id']}")
    if job["state"] != "succeeded":
        raise RuntimeError(f"the job on {model} {job['state']}: {job['error']}")
    return {**job, "wall_s": time.perf_counter() - started}


def logistic_baseline(x: np.ndarray, y: list[str], training: list[int], held: list[int]) -> float:
    """Logistic regression on the training photos' features, its accuracy on the held-out ones."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(x[training])
    model = LogisticRegression(max_iter=5000).fit(scaler.transform(x[training]), [y[i] for i in training])
    found = model.predict(scaler.transform(x[held]))
    return float(np.mean([f == y[i] for f, i in zip(found, held, strict=True)]))


def run(fold_count: int, per_class: int | None, seed: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every measurement above, on one demo server."""
    by_class = gcompris_photos()
    photos = [(label, name, data) for label in PHOTO_CLASSES for name, data in by_class[label][:per_class]]
    labels = [label for label, _, _ in photos]
    images = [data for _, _, data in photos]
    params = {"base": BASE, "seed": seed, **(extra or {})}
    with demo_server(free_port()) as (url, _):
        imagenet = top1(url, BASE, images)
        x = features(url, images)
        dealt = folds(labels, fold_count, seed)
        runs = []
        for number, held in enumerate(dealt):
            training = [i for i in range(len(photos)) if i not in set(held)]
            job = train(url, f"photos_fold{number}", [photos[i] for i in training], params)
            found = top1(url, f"photos_fold{number}", [images[i] for i in held])
            runs.append({
                "fold": number, "training_photos": len(training), "held_out": len(held),
                "head_accuracy": float(np.mean([f == labels[i] for f, i in zip(found, held, strict=True)])),
                "baseline_accuracy": logistic_baseline(x, labels, training, held),
                "job_s": job["wall_s"], "features_s": job["progress"]["features"]["seconds"],
                "features_computed": job["progress"]["features"]["computed"],
                "features_reused": job["progress"]["features"]["reused"],
                "epochs_run": job["progress"]["epochs_run"], "best_epoch": job["progress"]["best_epoch"],
            })  # fmt: skip
        training = [i for i in range(len(photos)) if i not in set(dealt[0])]
        warm = train(url, "photos_fold0", [photos[i] for i in training], params)
    right = {label: [imagenet[i] in IMAGENET_CLASSES[label] for i in range(len(photos)) if labels[i] == label]
             for label in PHOTO_CLASSES}  # fmt: skip
    predicted: dict[str, dict[str, int]] = {}
    for label, name in zip(labels, imagenet, strict=True):
        predicted.setdefault(label, {})[name] = predicted.setdefault(label, {}).get(name, 0) + 1
    return {
        "base": BASE,
        "layer": LAYER,
        "photos": {label: labels.count(label) for label in PHOTO_CLASSES},
        "folds": runs,
        "imagenet": {label: float(np.mean(hits)) for label, hits in right.items()},
        "imagenet_all": float(np.mean([hit for hits in right.values() for hit in hits])),
        "imagenet_top_labels": {
            label: sorted(names.items(), key=lambda item: -item[1])[:4] for label, names in predicted.items()
        },
        "warm": {
            "job_s": warm["wall_s"],
            "features_s": warm["progress"]["features"]["seconds"],
            "features_computed": warm["progress"]["features"]["computed"],
            "features_reused": warm["progress"]["features"]["reused"],
        },
    }


def render(result: dict[str, Any]) -> str:
    """The tables the docs include."""
    runs = result["folds"]
    photos = ", ".join(f"{label} {count}" for label, count in result["photos"].items())
    head = [r["head_accuracy"] for r in runs]
    base = [r["baseline_accuracy"] for r in runs]
    lines = [
        f"{sum(result['photos'].values())} photos ({photos}), GCompris' categorization set; base "
        f"{result['base']}, layer {result['layer']}; {len(runs)}-fold, stratified.",
        "",
        table(
            ["classifier", "accuracy (mean over folds)", "min", "max"],
            [
                ["head trained by layerserve (default params)", np.mean(head), min(head), max(head)],
                ["logistic regression on the same features", np.mean(base), min(base), max(base)],
                ["the ImageNet model's own top-1, where it maps", result["imagenet_all"], None, None],
            ],
        ),
        "",
        table(
            [
                "fold",
                "training photos",
                "held out",
                "head",
                "baseline",
                "job s",
                "of it features s",
                "epochs run",
                "best epoch",
            ],
            [
                [
                    r["fold"],
                    r["training_photos"],
                    r["held_out"],
                    r["head_accuracy"],
                    r["baseline_accuracy"],
                    r["job_s"],
                    r["features_s"],
                    r["epochs_run"],
                    r["best_epoch"],
                ]
                for r in runs
            ],
        ),
        "",
        "ImageNet's own top-1 per class: "
        + "; ".join(
            f"{label} {share:.2f} (most often: {', '.join(n for n, _ in result['imagenet_top_labels'][label])})"
            for label, share in result["imagenet"].items()
        )
        + ".",
        "",
        f"Fold 0 again, its features all from the feature store ({result['warm']['features_reused']} reused, "
        f"{result['warm']['features_computed']} computed): the job took {result['warm']['job_s']:.1f} s against "
        f"{runs[0]['job_s']:.1f} s, its features {result['warm']['features_s']:.2f} s against "
        f"{runs[0]['features_s']:.2f} s.",
    ]
    return "\n".join(lines)


def main() -> None:
    """Run it, print the tables, write JSON with `--json`."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--per-class", type=int, help="photos of each class (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--params", type=json.loads, default={}, help="more training params, as JSON")
    parser.add_argument("--quick", action="store_true", help="2 folds of 8 photos a class")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.folds, args.per_class = 2, 8
    result = {"parameters": arguments(args), **run(args.folds, args.per_class, args.seed, args.params)}
    print(render(result))
    if args.json:
        write_result(args.json, result)


if __name__ == "__main__":
    main()
