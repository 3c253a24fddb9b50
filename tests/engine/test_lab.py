"""`kvprefix lab` runs end to end (on the tests' small random model) with small settings."""

import pytest

from kvprefix.cli import main


@pytest.mark.slow
def test_lab_command(default_model_dir, capsys):
    assert main(["lab", "--model", default_model_dir, "--system-tokens", "64", "--num-requests", "3",
                 "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    rows = [row for row in map(str.split, out.splitlines()) if len(row) == 8 and row[2] == "|"]
    cached_on = {row[0]: int(row[3]) for row in rows}
    assert cached_on["1"] == 0 and cached_on["2"] == 64 and cached_on["3"] == 64 and cached_on["changed"] == 0
    assert "outputs with caching on and off: identical" in out
