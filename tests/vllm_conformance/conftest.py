"""vLLM's OpenAI-server tests, ported (README.md here): all of them in the slow lane (each needs a server of the
built-in model, tens of seconds to boot on 2 cores)."""

import pytest

HERE = __file__.rsplit("/", 1)[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if str(item.path).startswith(HERE):
            item.add_marker(pytest.mark.slow)


# The sample inputs of vLLM's tests/entrypoints/conftest.py that the ported files use, as there (Apache-2.0,
# https://github.com/vllm-project/vllm/blob/043cd1a182d3f43671d92c7c5b5dc97c4a361a0d/tests/entrypoints/conftest.py;
# sample_choice is named sample_structured_outputs_choices in the newer test files).
@pytest.fixture
def sample_regex():
    return (r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}"
            r"(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)")


@pytest.fixture
def sample_json_schema():
    return {
        "type": "object",
        "properties": {
            "name": {
                "type": "string"
            },
            "age": {
                "type": "integer"
            },
            "skills": {
                "type": "array",
                "items": {
                    "type": "string",
                    "maxLength": 10
                },
                "minItems": 3
            },
            "work_history": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "company": {
                            "type": "string"
                        },
                        "duration": {
                            "type": "number"
                        },
                        "position": {
                            "type": "string"
                        }
                    },
                    "required": ["company", "position"]
                }
            }
        },
        "required": ["name", "age", "skills", "work_history"]
    }


@pytest.fixture
def sample_structured_outputs_choices():
    return [
        "Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript",
        "Ruby", "Swift", "Kotlin"
    ]
