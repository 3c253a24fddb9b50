"""--html writes the report as a page; a real headless browser lays it out and its own script finds every chart bar
drawn (``data-rendered="ok"`` on <body>)."""

import json
import shutil
import subprocess

import pytest
import support.doctor_logs as logs

from kvprefix.cli import main

BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


def test_html_report_has_the_causes_the_charts_and_the_marked_spans(capsys, tmp_path, tokenizer_dir):
    log = logs.write_jsonl(tmp_path / "log.jsonl", logs.volatile())
    page = tmp_path / "report.html"
    assert main(["doctor", str(log), "--model", str(tokenizer_dir), "--json", "--html", str(page)]) == 0
    report = json.loads(capsys.readouterr().out)
    html = page.read_text()
    for cause in report["causes"]:
        assert f"id='{cause['kind']}'" in html
    assert "aria-label='hit rate per fix'" in html and "aria-label='divergence positions'" in html
    assert "<mark>2026-12-01T12:00:01Z. </mark>" in html


@pytest.mark.slow
@pytest.mark.skipif(BROWSER is None, reason="no headless Chromium on this machine (.ci/run installs it)")
def test_html_report_renders_in_a_headless_browser(capsys, tmp_path, tokenizer_dir):
    rows = logs.volatile()
    for row, shuffled in zip(rows, logs.shuffled_tools(), strict=True):
        row["tools"] = shuffled["tools"]
    log = logs.write_jsonl(tmp_path / "log.jsonl", rows)
    page = tmp_path / "report.html"
    assert main(["doctor", str(log), "--model", str(tokenizer_dir), "--html", str(page)]) == 0
    capsys.readouterr()
    dom = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    assert 'data-rendered="ok"' in dom
    assert "volatile-prefix" in dom and "reordered" in dom
    shot = tmp_path / "report.png"
    subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1200,1600", page.as_uri()], capture_output=True, timeout=120)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
