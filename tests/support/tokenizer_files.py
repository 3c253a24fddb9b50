"""A tokenizer directory for template tests: the tiny test model's tokenizer files, with a chat template of the
test's own."""

import json
import shutil
from pathlib import Path


def tokenizer_dir(tmp_path: Path, tiny_llama_path: str, chat_template: str | None = None) -> dict:
    """Copies the tokenizer files into ``tmp_path`` (and ``chat_template`` as its chat_template.jinja); returns the
    tokenizer_config, for a test that changes it and writes it back."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_llama_path}/{name}", tmp_path / name)
    if chat_template is not None:
        (tmp_path / "chat_template.jinja").write_text(chat_template)
    return json.loads((tmp_path / "tokenizer_config.json").read_text())
