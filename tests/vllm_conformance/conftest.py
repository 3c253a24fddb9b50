"""vLLM's OpenAI-server tests, ported (README.md here): all of them in the slow lane (each needs a server of the
built-in model, tens of seconds to boot on 2 cores)."""

import pytest

HERE = __file__.rsplit("/", 1)[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if str(item.path).startswith(HERE):
            item.add_marker(pytest.mark.slow)
