"""The doctor's eviction cause names the disk tier that would keep what was evicted: the smallest size (doubling
from 64 MiB) at which the planner's disk tier below the same pool recovers every evicted hit; a log with a larger
working set gets a larger power of two."""

import json
import re

import support.doctor_logs as logs

from kvprefix.cli import main
from kvprefix.tiers.sizes import parse_size


def eviction_detail(capsys, tmp_path, tokenizer_dir, *extra) -> tuple[str, float]:
    path = logs.write_jsonl(tmp_path / "log.jsonl", logs.evicting(*extra))
    assert main(["doctor", str(path), "--model", str(tokenizer_dir), "--json", "--capacity", "800"]) == 0
    report = json.loads(capsys.readouterr().out)
    (cause,) = [c for c in report["causes"] if c["kind"] == "eviction"]
    return cause["example"]["detail"], cause["hit_rate_after"]


def test_the_eviction_cause_names_the_disk_size_that_keeps_the_blocks(capsys, tmp_path, tokenizer_dir) -> None:
    detail, _ = eviction_detail(capsys, tmp_path, tokenizer_dir)
    match = re.search(r"--kv-disk-size (\S+),", detail)
    assert match and "tokens per replica keeps it" in detail, detail
    assert parse_size(match.group(1)) == 64 * 2**20  # this small log's handbooks fit the first size tried
    bigger, _ = eviction_detail(capsys, tmp_path, tokenizer_dir, 64, 2)  # 64 handbooks: more than 64 MiB of KV
    size = parse_size(re.search(r"--kv-disk-size (\S+),", bigger).group(1))
    assert size > 64 * 2**20 and size & (size - 1) == 0, bigger
