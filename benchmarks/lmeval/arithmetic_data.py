"""The arithmetic tasks' data, read from the JSONL files beside this module (lm-evaluation-harness calls `load` as the
tasks' `custom_dataset`), so that the tasks need no dataset hub and work from any directory."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def load(**_: object) -> datasets.DatasetDict:
    splits = {}
    for split in ("fewshot", "test"):
        with open(HERE / f"arithmetic_{split}.jsonl") as f:
            splits[split] = datasets.Dataset.from_list([json.loads(line) for line in f])
    return datasets.DatasetDict(splits)
