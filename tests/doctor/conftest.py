import pytest
from support.doctor_logs import write_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """A small tokenizer whose chat template renders tools (tests never depend on the default model)."""
    return write_tokenizer(tmp_path_factory.mktemp("doctor-tokenizer"))
