"""A huge count_tokens body, as the API node's counting child renders it (`PromptRenderer.for_bulk`), side by
side: the text cut into pieces encoded on every core (`models.prompt.cut_points`, the default) against one
call over the whole text (the baseline: what the child did before). Seconds, peak memory and the ratio;
the ids are checked equal.

Owns: building the request (one user message of `--mib` MiB of English text), timing each way in a fresh
process (peak RSS is per process). Must not: start a server; the whole path is tests/e2e/test_abuse.py.

    python bench/bulk_tokenize.py              # 30 MiB, the default model's tokenizer
    python bench/bulk_tokenize.py --mib 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def one(way: str, mib: int) -> dict[str, Any]:
    """In a child process: render the request one way; its seconds, token count, a digest and peak RSS."""
    import hashlib

    from models import prompt
    from models.files import local_folder
    from shared.ir import Message, Protocol, Request, Role, TextPart
    from shared.settings import Settings

    settings = Settings.from_env(os.environ)
    name, folder = local_folder(settings.model, settings.model_cache)
    renderer = prompt.PromptRenderer.load(folder, name=name, max_model_len=8192)
    if way == "whole":
        prompt.CUT_EVERY = 1 << 60  # never cut: one encode of the whole text
    text = "hello world, this is some text. " * (mib * 2**20 // 32)
    request = Request(id="r", protocol=Protocol.ANTHROPIC_MESSAGES, model="m", messages=(Message(role=Role.USER, content=(TextPart(text=text),)),))
    started = time.perf_counter()
    ids = renderer.for_bulk().render(request)
    seconds = time.perf_counter() - started
    digest = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]
    return {"seconds": seconds, "tokens": len(ids), "digest": digest, "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=30)
    parser.add_argument("--way", choices=["whole", "cut"], help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    if args.way:
        print(json.dumps(one(args.way, args.mib)))
        return
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    found = {}
    for way in ("whole", "cut"):
        done = subprocess.run([sys.executable, __file__, "--mib", str(args.mib), "--way", way], capture_output=True, text=True, env=env, check=True)
        found[way] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{way:>5}: {found[way]['tokens']:,} tokens in {found[way]['seconds']:.1f} s, peak RSS {found[way]['peak_gib']:.2f} GiB")
    assert found["whole"]["digest"] == found["cut"]["digest"], "the ids differ"
    print(f"same ids; cut / whole: {found['whole']['seconds'] / found['cut']['seconds']:.2f}x faster, "
          f"{found['whole']['peak_gib'] / found['cut']['peak_gib']:.2f}x less memory at peak ({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
