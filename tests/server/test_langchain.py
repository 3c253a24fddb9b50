"""LangChain (langchain-openai, a client nobody here wrote) and openai's .parse() against a real server of the
built-in default model, SmolLM2-135M-Instruct: bind_tools gets a tool call back, with_structured_output a valid
object by each of LangChain's methods, .parse() a valid object and a strict tool's parsed arguments."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field
from support.servers import Server

M = "default-model-v1"


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(description="The city, e.g. Paris", max_length=40)


class Capital(BaseModel):
    """A country and its capital city."""

    country: str = Field(max_length=40)
    capital: str = Field(max_length=40)
    continent: Literal["Africa", "America", "Asia", "Europe", "Oceania"]


def _chat(server: Server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=M, base_url=server.url + "/v1", api_key="none", temperature=0, max_tokens=80,
                      max_retries=0, timeout=600)


@pytest.mark.slow
def test_langchain_bind_tools_returns_a_tool_call(builtin_model_server: Server) -> None:
    # The 135M model seldom calls a tool of its own accord (tool_choice "auto"): "any" is OpenAI's "required".
    llm = _chat(builtin_model_server).bind_tools([GetWeather], tool_choice="any")
    reply = llm.invoke("What is the weather like in Paris today?")
    (call,) = reply.tool_calls
    assert call["name"] == "GetWeather" and call["id"].startswith("call_")
    GetWeather.model_validate(call["args"])
    assert "paris" in call["args"]["city"].lower(), call


@pytest.mark.slow
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_returns_a_valid_object(builtin_model_server: Server, method: str) -> None:
    # json_schema: response_format (LangChain's default); function_calling: a named tool_choice.
    llm = _chat(builtin_model_server).with_structured_output(Capital, method=method)
    answer = llm.invoke("What is the capital of France?")
    assert isinstance(answer, Capital), answer


@pytest.mark.slow
def test_openai_parse_with_the_default_model(builtin_model_server: Server) -> None:
    import openai

    client = openai.OpenAI(base_url=builtin_model_server.url + "/v1", api_key="none", max_retries=0, timeout=600)
    r = client.chat.completions.parse(
        model=M, messages=[{"role": "user", "content": "What is the capital of France?"}], response_format=Capital,
        temperature=0, max_tokens=80)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Capital) and r.choices[0].finish_reason == "stop"
    assert "paris" in parsed.capital.lower(), parsed
    # A strict pydantic tool: .parse() validates the call's arguments into the model.
    r = client.chat.completions.parse(
        model=M, messages=[{"role": "user", "content": "What is the weather like in Paris today?"}],
        tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required", temperature=0, max_tokens=80)
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather) and r.choices[0].finish_reason == "tool_calls"
