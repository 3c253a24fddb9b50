# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Ported from https://github.com/vllm-project/vllm/blob/37fa82dee586a01d953581f8937c528b94a2816d/tests/entrypoints/openai/chat_completion/test_chat_stop_token_ids_validation.py
# kvprefix: only the model, the server start and model-specific constants changed (tests/vllm_conformance/README.md).

import openai
import pytest
import pytest_asyncio
from support.vllm_remote import RemoteOpenAIServer, get_vocab_size

MODEL_NAME = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(server_registry):
    args = []

    with RemoteOpenAIServer(MODEL_NAME, args, server_registry) as remote_server:
        yield remote_server


@pytest_asyncio.fixture
async def client(server):
    async with server.get_async_client() as async_client:
        yield async_client


@pytest.mark.asyncio
async def test_chat_stop_token_ids_valid(client):
    """Test that valid stop_token_ids are accepted in chat completions."""
    vocab_size = get_vocab_size(MODEL_NAME)
    valid_token_id = vocab_size - 1

    completion = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Testing valid stop token ids"}],
        max_tokens=5,
        extra_body={"stop_token_ids": [valid_token_id]},
    )

    assert completion.choices[0].message.content is not None


@pytest.mark.asyncio
async def test_chat_stop_token_ids_out_of_vocab(client):
    """Test that out-of-vocab stop_token_ids are rejected with a 400."""
    vocab_size = get_vocab_size(MODEL_NAME)
    invalid_token_id = vocab_size + 1

    with pytest.raises(openai.BadRequestError) as excinfo:
        await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Testing stop token ids"}],
            max_tokens=5,
            extra_body={"stop_token_ids": [invalid_token_id]},
        )

    error = excinfo.value
    error_message = str(error)

    assert error.status_code == 400
    assert str(invalid_token_id) in error_message
    assert str(vocab_size) in error_message


@pytest.mark.asyncio
async def test_chat_stop_token_ids_negative(client):
    """Test that negative stop_token_ids are rejected with a 400."""
    with pytest.raises(openai.BadRequestError) as excinfo:
        await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Testing stop token ids"}],
            max_tokens=5,
            extra_body={"stop_token_ids": [-1]},
        )

    assert excinfo.value.status_code == 400
