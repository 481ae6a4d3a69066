"""Poisoned batches: concurrent V2 requests to the demo token classifier, some with token ids past its vocabulary
(or negative); how many good requests fail, and what the bad ones get.

    .venv/bin/python benchmarks/poisoned_batch.py [--rounds 5] [--requests 250] [--bad-every 25] [--port 8790]
                                                  [--json PATH]

Each round sends `--requests` requests at once (one connection pool); every `--bad-every`-th has an id of 5000,
1073 or -1 at position 5. Before batch isolation, the bad ones failed whole batches of good ones.
"""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from demo_server import demo_server
from results import arguments, by_status, table, write_result

BAD_IDS = (5000, 1073, -1)


async def run(url: str, rounds: int, requests: int, bad_every: int) -> tuple[Counter[str], Counter[str], str]:
    """(the good requests' answers by status, the bad ones', one bad answer's body)."""
    rng = np.random.default_rng(0)
    good: Counter[str] = Counter()
    bad: Counter[str] = Counter()
    example = ""
    limits = httpx.Limits(max_connections=requests)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        for _ in range(rounds):
            bodies = []
            for index in range(requests):
                tokens = rng.integers(1, 1000, 64).tolist()
                if index % bad_every == 0:
                    tokens[5] = BAD_IDS[index // bad_every % len(BAD_IDS)]
                inputs = [{"name": "tokens", "shape": [1, 64], "datatype": "INT32", "data": tokens}]
                bodies.append((index % bad_every == 0, {"inputs": inputs, "parameters": {"cache": False}}))
            answers = await asyncio.gather(
                *(client.post(f"{url}/v2/models/token_classifier/infer", json=body) for _, body in bodies),
                return_exceptions=True,
            )
            for (is_bad, _), answer in zip(bodies, answers, strict=True):
                status = type(answer).__name__ if isinstance(answer, BaseException) else str(answer.status_code)
                if is_bad:
                    bad[status] += 1
                    if not example and isinstance(answer, httpx.Response):
                        example = answer.text
                else:
                    good[status] += 1
    return good, bad, example


def render(result: dict[str, Any]) -> str:
    """The good and the bad requests: how many, how many failed, their answers by status; one bad answer."""

    def row(kind: str) -> list[Any]:
        answers = result[kind]
        total = sum(answers.values())
        failed = total - answers.get("200", 0)
        return [kind, total, failed, failed / total if total else 0.0, by_status(answers)]

    text = table(["requests", "sent", "not 200", "share not 200", "answers by status"], [row("good"), row("bad")])
    return f"{text}\n\nA bad request's answer:\n\n```\n{result['bad_answer'][:300]}\n```"


def main() -> None:
    """Serve the demo, send the rounds, print the figures (and write them as JSON with `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=250)
    parser.add_argument("--bad-every", type=int, default=25)
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    with demo_server(args.port) as (url, _):
        good, bad, example = asyncio.run(run(url, args.rounds, args.requests, args.bad_every))
    print(f"good requests: {sum(good.values())}, failed: {sum(good.values()) - good['200']}, answers: {dict(good)}")
    print(f"bad requests: {sum(bad.values())}, answers: {dict(bad)}")
    print(f"a bad request's answer: {example[:300]}")
    if args.json:
        write_result(
            args.json, {"parameters": arguments(args), "good": dict(good), "bad": dict(bad), "bad_answer": example}
        )


if __name__ == "__main__":
    main()
