#!/usr/bin/env python3
"""Build input-grounded prompts (edit or summarise a given text) from WikiText-2's test split.

Prompt lookup's home ground is a task whose answer repeats its input: proofreading, rewriting,
summarising a passage given in full. This takes the first paragraphs of 60-140 words from
data/wikitext-2-raw/wiki.test.raw (CC BY-SA 3.0), undoes WikiText's tokenisation spaces
(" @-@ ", " , ", " 's"), and asks for one of three edits of each in turn. The output is
deterministic: rerunning it rewrites data/prompts/grounded_edits.jsonl byte for byte.

    python3 scripts/make_grounded_prompts.py [--count 64]
"""
import argparse
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
TASKS = [
    "Proofread the following paragraph and return it in full, with any mistakes fixed:\n\n{}",
    "Rewrite the following paragraph in the present tense, keeping everything else as it is:\n\n{}",
    "Summarise the following paragraph in two sentences, reusing its own words:\n\n{}",
]


def detokenize(line: str) -> str:
    text = line.strip()
    for pattern, replacement in [(r" @(.)@ ", r"\1"), (r" ([,.;:!?)'])", r"\1"),
                                 (r"\( ", "("), (r" n't", "n't"), (r'" (.*?) "', r'"\1"')]:
        text = re.sub(pattern, replacement, text)
    return text


def paragraphs(path: pathlib.Path, min_words: int, max_words: int):
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("="):
            continue
        words = len(stripped.split())
        if min_words <= words <= max_words and "<unk>" not in stripped:
            yield detokenize(stripped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "data/prompts/grounded_edits.jsonl"))
    args = parser.parse_args()
    source = ROOT / "data/wikitext-2-raw/wiki.test.raw"
    with open(args.out, "w", encoding="utf-8") as out:
        for i, text in enumerate(paragraphs(source, 60, 140)):
            if i == args.count:
                break
            task = TASKS[i % len(TASKS)].format(text)
            out.write(json.dumps({"id": i, "task": i % len(TASKS), "prompt": task}) + "\n")


if __name__ == "__main__":
    main()
