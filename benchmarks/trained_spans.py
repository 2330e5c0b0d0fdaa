"""Chat-template mode's tokenize-and-label step, the two ways it can run: from the tokenizer's
character offsets, or from the ids alone with each token's byte length (``dataset.token_bytes``).

On the rendered samples of ``pipeline.conversations`` (the chat template of ``pipeline.tokenizer_dir``'s
tokenizer: SmolLM2's ChatML when installed), in one process pinned to one core, CPU seconds (the
tokenizer's threads included) of, alternating, each ``--repeats`` times (medians):

- **offsets**: ``encode_batch`` with offsets, then ``span_samples`` (the path for other tokenizers);
- **ids**: ``tokens.trained_spans`` (``encode_batch_fast``, then ``byte_span_samples``);
- **encode only**: ``encode_batch_fast`` of the same texts, what the tokenizer alone costs.

Both paths' labels are checked equal.

    python benchmarks/trained_spans.py --rows 2000 --repeats 7
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from pipeline import conversations, tokenizer_dir  # noqa: E402  (the same generated rows and tokenizer)
from report import write_report  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=HERE / "results" / "trained_spans.json")
    args = p.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

    import numpy as np
    from transformers import AutoTokenizer

    from sfttool.dataset.chat_targets import chat_template_samples
    from sfttool.dataset.encode_columns import span_samples
    from sfttool.dataset.token_bytes import byte_lengths
    from sfttool.dataset.tokens import batch_token_ids, special_token_texts, trained_spans

    folder, name = tokenizer_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    specials = special_token_texts(tokenizer)
    samples = [s for row in conversations(args.rows) for s in chat_template_samples(row["conversation"], tokenizer,
                                                                                     specials)]
    texts, spans = [t for t, _ in samples], [s for _, s in samples]
    if byte_lengths(tokenizer) is None:
        raise SystemExit(f"{name}: not a byte-level BPE tokenizer; only the offsets path applies")

    def offsets():
        return span_samples(batch_token_ids(tokenizer, texts, with_offsets=True), texts, spans)

    def ids():
        return trained_spans(tokenizer, texts, spans)

    def encode_only():
        return batch_token_ids(tokenizer, texts)

    seconds: dict[str, list[float]] = {"offsets": [], "ids": [], "encode_only": []}
    results = {}
    for _ in range(args.repeats):
        for label, step in (("offsets", offsets), ("ids", ids), ("encode_only", encode_only)):
            start = time.process_time()
            results[label] = step()
            seconds[label].append(time.process_time() - start)
    if not np.array_equal(results["offsets"].labels, results["ids"].labels):
        raise SystemExit("the two paths' labels differ")
    median = {label: statistics.median(values) for label, values in seconds.items()}
    tokens = len(results["ids"].ids)
    print(f"{name}: {len(texts)} samples, {tokens} tokens, 1 core, medians of {args.repeats}")
    print(f"{'path':12} {'CPU s':>7} {'vs encode only':>15}")
    for label in seconds:
        print(f"{label:12} {median[label]:7.3f} {median[label] / median['encode_only']:14.2f}x")
    write_report(args.out, "trained_spans", tokenizer=name, rows=args.rows, samples=len(texts), tokens=tokens,
                 repeats=args.repeats, cpu_seconds=median, cpu_seconds_each=seconds,
                 saved_fraction=round(1 - median["ids"] / median["offsets"], 3))


if __name__ == "__main__":
    main()
