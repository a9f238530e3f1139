"""Tools through the gateway: prompts for every model, calls parsed per family, tool_choice and
response_format read into a grammar or refused (srpo.gateway.tools, srpo.gateway.formats)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")

from srpo.gateway import tools  # noqa: E402
from srpo.gateway.backends import render  # noqa: E402
from srpo.gateway.protocol import ProtocolError, parse_request  # noqa: E402
from srpo.policies.tiny import byte_tokenizer  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}


def _args(call):
    return json.loads(call["function"]["arguments"])


# -- the fixture suite: what models write, what the program must get ------------------------------
HERMES_CASES = [
    # (reply, expected content, expected [(name, arguments)])
    ('<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>', "", [("weather", {"city": "Paris"})]),
    # parallel calls, text before them
    ('Let me check.\n<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>\n'
     '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>', "Let me check.",
     [("weather", {"city": "Paris"}), ("search", {"q": "x"})]),
    # SmolLM2's own training format: a list inside one block
    ('<tool_call>[{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "search", "arguments": {}}]</tool_call>',
     "", [("weather", {"city": "Oslo"}), ("search", {})]),
    # a literal </tool_call> inside an argument does not cut the call
    ('<tool_call>{"name": "search", "arguments": {"q": "what does </tool_call> mean"}}</tool_call>', "",
     [("search", {"q": "what does </tool_call> mean"})]),
    # the closing tag cut off by the token budget at the very end: still a call
    ('<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}', "", [("weather", {"city": "Rome"})]),
    ('<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}\n</to', "", [("weather", {"city": "Rome"})]),
    # "parameters" instead of "arguments"
    ('<tool_call>{"name": "weather", "parameters": {"city": "Lima"}}</tool_call>', "", [("weather", {"city": "Lima"})]),
]
MALFORMED = [
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>[{"name": "weather", "arguments": {"city": "Paris"}</tool_call>',  # a broken list of calls
    '<tool_call>{"name": "weather"} and then more words',  # unclosed with text after it
    "The weather is fine.",  # no call at all
]


@pytest.mark.parametrize("reply, content, expected", HERMES_CASES)
def test_hermes_calls_are_parsed(reply, content, expected):
    text, calls = tools.parse_tool_calls(reply, "hermes")
    assert text == content
    assert [(c["function"]["name"], _args(c)) for c in calls] == expected
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)


@pytest.mark.parametrize("reply", MALFORMED)
def test_text_that_does_not_parse_is_returned_as_content(reply):
    assert tools.parse_tool_calls(reply, "hermes") == (reply, [])


def test_a_call_whose_header_is_written_is_a_call_with_its_arguments_as_written():
    """Once ``{"name": ..., "arguments": `` is written the block is a call (its arguments stream
    from there), as OpenAI returns calls: arguments are what the model wrote, which a client
    validates — cut off by ``</tool_call>`` or by the token budget, they are cut off."""
    text, calls = tools.parse_tool_calls('<tool_call>{"name": "weather", "arguments": {"city": "Paris"</tool_call>',
                                         "hermes")
    assert text == "" and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
           [("weather", '{"city": "Paris"')]
    text, calls = tools.parse_tool_calls('Sure.\n<tool_call>{"name": "weather", "arguments":{"city" :"Ro', "hermes")
    assert text == "Sure." and calls[0]["function"]["arguments"] == '{"city" :"Ro'  # written, not re-serialised


REPLIES = [case[0] for case in HERMES_CASES] + MALFORMED + [
    ' Sure, let me look.\n\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "search", "arguments": {"q": "a \\"quoted\\" } brace"}}\n</tool_call>\nDone.',
    '<tool_call>{"name": "weather", "arguments": {"city": "Paris"</tool_call>',
    'Text with a < sign and <tool_c but no call',
]


@pytest.mark.parametrize("reply", REPLIES)
def test_reading_a_reply_as_it_is_generated_only_ever_adds_and_ends_where_parsing_does(reply):
    """What a stream sends is what :func:`read_hermes` finds certain at each character: it must
    only grow (content and each call's arguments extended, calls appended, names fixed) and end at
    the unstreamed reading — so streamed deltas add up to the unstreamed reply."""
    from srpo.gateway.parsers import read_hermes

    sent_content, sent_calls = "", []
    for cut in range(len(reply) + 1):
        content, calls = read_hermes(reply[:cut], done=False)
        assert content.startswith(sent_content) and len(calls) >= len(sent_calls), (cut, content, calls)
        for (name, args), (old_name, old_args) in zip(calls, sent_calls):
            assert name == old_name and args.startswith(old_args), (cut, calls, sent_calls)
        sent_content, sent_calls = content, calls
    final = read_hermes(reply, done=True)
    assert final[0].startswith(sent_content) and len(final[1]) >= len(sent_calls)
    assert all(a.startswith(old) for (_, a), (_, old) in zip(final[1], sent_calls))
    content, parsed = tools.parse_tool_calls(reply, "hermes")
    assert (content, [(c["function"]["name"], c["function"]["arguments"]) for c in parsed]) == final


def test_a_good_call_before_a_malformed_one_is_kept_and_the_rest_stays_text():
    reply = '<tool_call>{"name": "search", "arguments": {}}</tool_call> <tool_call>{"name": oops}</tool_call>'
    text, calls = tools.parse_tool_calls(reply, "hermes")
    assert [c["function"]["name"] for c in calls] == ["search"] and text == '<tool_call>{"name": oops}</tool_call>'


@pytest.mark.parametrize("reply, expected", [
    ('{"name": "weather", "parameters": {"city": "Paris"}}', [("weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "search", "parameters": {"q": "a"}}; {"name": "weather", "parameters": {}}',
     [("search", {"q": "a"}), ("weather", {})]),
    ('The answer is {"name": "x"}', None),  # JSON inside prose is not a call
])
def test_llama3_calls_are_parsed(reply, expected):
    text, calls = tools.parse_tool_calls(reply, "llama3")
    if expected is None:
        assert (text, calls) == (reply, [])
    else:
        assert text == "" and [(c["function"]["name"], _args(c)) for c in calls] == expected


@pytest.mark.parametrize("reply, content, expected", [
    ('[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Paris"}}]', "", [("weather", {"city": "Paris"})]),
    ('Sure. [TOOL_CALLS]weather[ARGS]{"city": "Bonn"}[TOOL_CALLS]search[ARGS]{"q": "b"}', "Sure.",
     [("weather", {"city": "Bonn"}), ("search", {"q": "b"})]),
    ('[TOOL_CALLS] [{"name": "weather", "arguments": {"city": ', None, None),
])
def test_mistral_calls_are_parsed(reply, content, expected):
    text, calls = tools.parse_tool_calls(reply, "mistral")
    if expected is None:
        assert (text, calls) == (reply, [])
    else:
        assert text == content and [(c["function"]["name"], _args(c)) for c in calls] == expected


@pytest.mark.parametrize("template, fmt", [
    (None, "generic"), ("{{ messages }}", "generic"), ("{% if tools %}<tool_call>{% endif %}", "hermes"),
    ("{% if tools %}[TOOL_CALLS]{% endif %}", "mistral"), ("{% if tools %}<|python_tag|>{% endif %}", "llama3"),
    (tools.CHATML_TOOLS, "hermes"),
])
def test_the_format_follows_the_template(template, fmt):
    assert tools.tool_format(template) == fmt


# -- into the prompt ------------------------------------------------------------------------------
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "snow"},
]


def _request(**extra):
    return parse_request({"model": "solver", "messages": CONVERSATION, "tools": [WEATHER, SEARCH], **extra}, chat=True)


def test_a_model_whose_template_renders_no_tools_gets_the_generic_format():
    tok = byte_tokenizer()  # ChatML without tools, like SmolLM2's
    rendered = render(tok, _request())
    text = tok.decode(rendered.ids)
    assert rendered.tool_format == "generic" and rendered.forced == ""
    assert "<tools>" in text and '"name": "weather"' in text and "Be brief." in text
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    # both tool results, in one user turn, in order
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nsnow\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_the_shipped_chatml_tools_template_renders_the_same_conversation():
    tok = byte_tokenizer()
    tok.chat_template = tools.resolve_chat_template("chatml_tools")
    rendered = render(tok, _request())
    text = tok.decode(rendered.ids)
    assert rendered.tool_format == "hermes"
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call these tools")
    assert '{"name": "weather", "arguments": {"city": "Oslo"}}' in text
    assert text.count("<tool_response>") == 2 and text.endswith("<|im_start|>assistant\n")


def test_tool_choice_none_renders_no_tools_and_required_or_named_force_a_call():
    tok = byte_tokenizer()
    assert "<tools>" not in tok.decode(render(tok, _request(tool_choice="none")).ids)
    required = render(tok, _request(tool_choice="required"))
    assert required.forced == '<tool_call>\n{"name": "' and tok.decode(required.ids).endswith(required.forced)
    named = render(tok, _request(tool_choice={"type": "function", "function": {"name": "search"}}))
    assert named.forced == '<tool_call>\n{"name": "search", "arguments": '
    # the forced start plus what the model wrote is one call
    text, calls = tools.parse_tool_calls(named.forced + '{"q": "x"}}\n</tool_call>', named.tool_format)
    assert [(c["function"]["name"], _args(c)) for c in calls] == [("search", {"q": "x"})]


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/gone"}}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
])
def test_what_cannot_be_honoured_is_refused_naming_the_field(body, param):
    full = {"model": "solver", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], **body}
    with pytest.raises(ProtocolError) as err:
        parse_request(full, chat=True)
    assert err.value.param == param and err.value.status == 400


def test_response_formats_become_the_grammar_the_sampler_enforces():
    """text asks for nothing; json_object for any object; json_schema for its schema (kept whether
    ``strict`` or not); a schema the grammar library cannot compile is a 400 saying why."""
    def grammar(fmt):
        return parse_request({"model": "s", "messages": [{"role": "user", "content": "hi"}],
                              "response_format": fmt}, chat=True).grammar

    assert grammar({"type": "text"}) is None
    assert json.loads(grammar({"type": "json_object"}).schema) == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    g = grammar({"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    assert json.loads(g.schema) == schema and g.name == "answer"
    with pytest.raises(ProtocolError, match="Invalid type: objekt"):
        grammar({"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}})


def test_the_shipped_template_and_the_generic_format_give_the_same_prompt():
    """Two routes to the same text: a model trained through one is prompted the same way by the other."""
    generic, shipped = byte_tokenizer(), byte_tokenizer()
    shipped.chat_template = tools.resolve_chat_template("chatml_tools")
    assert generic.decode(render(generic, _request()).ids) == shipped.decode(render(shipped, _request()).ids)


# -- the Responses API, through the openai client's own parsing -----------------------------------
@pytest.fixture(scope="module")
def responses_url():
    from srpo.gateway.server import Gateway

    from helpers.tool_backend import ToolBackend

    gw = Gateway()
    backend = ToolBackend()
    yield gw.url(gw.open(backend)), backend
    gw.stop()


FLAT_WEATHER = {"type": "function", "name": "weather", "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": False}


def test_the_responses_api_answers_text_and_tool_calls(responses_url):
    openai = pytest.importorskip("openai")
    url, backend = responses_url
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    reply = client.responses.create(model="agent", instructions="Be brief.", input="Weather?", max_output_tokens=20)
    assert reply.output_text == "It is sunny." and reply.status == "completed" and reply.usage.output_tokens == 4
    req = backend.requests[-1]
    assert req.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    assert req.max_tokens == 20
    call = client.responses.create(model="agent", input="Weather in Paris?", tools=[FLAT_WEATHER])
    [item] = call.output
    assert item.type == "function_call" and item.name == "weather" and json.loads(item.arguments) == {"city": "Paris"}
    assert backend.requests[-1].tools[0]["function"]["name"] == "weather"
    # The tool's result fed back: function_call and function_call_output items become chat messages.
    final = client.responses.create(model="agent", input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": item.call_id, "name": "weather", "arguments": item.arguments},
        {"type": "function_call_output", "call_id": item.call_id, "output": "sunny, 21 C"}],
        tools=[FLAT_WEATHER], tool_choice="none")
    assert final.output_text == "It is sunny."
    msgs = backend.requests[-1].messages
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[1]["tool_calls"][0]["id"] == item.call_id and msgs[2] == {
        "role": "tool", "tool_call_id": item.call_id, "content": "sunny, 21 C"}


def test_the_responses_api_streams_its_event_sequence(responses_url):
    openai = pytest.importorskip("openai")
    url, _ = responses_url
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    events = list(client.responses.create(model="agent", input="Weather?", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "It is sunny."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == "It is sunny."
    # the SDK's own stream helper accumulates the same response
    with client.responses.stream(model="agent", input="Weather in Paris?", tools=[FLAT_WEATHER]) as stream:
        done = stream.get_final_response()
    assert done.output[0].type == "function_call" and done.output[0].name == "weather"


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}}, "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [FLAT_WEATHER]}, "tool_choice"),
])
def test_the_responses_api_refuses_what_it_cannot_serve(responses_url, extra, param):
    import httpx

    url, _ = responses_url
    raw = httpx.post(f"{url}/responses", json={"model": "agent", "input": "hi", **extra})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == param, raw.text


def test_a_model_that_ships_a_response_parser_is_parsed_by_it():
    """transformers' tokenizer.parse_response (the model's response_template) comes first."""

    class Tokenizer:
        response_template = {"version": 1}

        def parse_response(self, text, prefix=None):
            assert text == "<call>f(1)</call>"
            return {"role": "assistant", "content": "",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}

    text, calls = tools.parse_tool_calls("<call>f(1)</call>", "hermes", Tokenizer())
    assert text == "" and [(c["function"]["name"], _args(c)) for c in calls] == [("f", {"a": 1})]

    class Broken(Tokenizer):
        def parse_response(self, text, prefix=None):
            raise ValueError("the template does not match")

    reply = '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert tools.parse_tool_calls(reply, "hermes", Broken())[1][0]["function"]["name"] == "g"  # ours, then


@pytest.mark.parametrize("reply, reasoning, content", [
    ("<think>\n2 + 3 is 5.\n</think>\n\nThe answer is 5.", "2 + 3 is 5.", "The answer is 5."),
    ("2 + 3 is 5.</think>The answer is 5.", "2 + 3 is 5.", "The answer is 5."),  # <think> was in the prompt
    ("<think>still thinking when the budget ran out", "still thinking when the budget ran out", ""),
    ("No thinking at all.", "", "No thinking at all."),
])
def test_the_think_parser_splits_thinking_from_the_answer(reply, reasoning, content):
    from srpo.gateway.backends import choice
    from srpo.gateway.parsers import REASONING_PARSERS
    from srpo.types import Sample, SamplingParams

    assert REASONING_PARSERS["think"].split(reply) == (reasoning, content)
    plain = parse_request({"model": "solver", "messages": CONVERSATION}, chat=True)
    c = choice(Sample([1], reply, [0.0], "eos"), SamplingParams(), plain, None, reasoning_parser="think")
    assert (c.reasoning or "", c.text) == (reasoning, content)


@pytest.mark.parametrize("tool_calls, field", [
    ("call it", "messages[1].tool_calls"), (3, "messages[1].tool_calls"), ([1], "messages[1].tool_calls[0]"),
    ([{"type": "function", "function": {"name": "get_weather"}}], "messages[1].tool_calls[0].function.arguments"),
    ([{"type": "function", "function": {"arguments": "{}"}}], "messages[1].tool_calls[0].function.name"),
    ([{"type": "function", "function": "get_weather"}], "messages[1].tool_calls[0].function"),
    ([{"type": "code", "function": {"name": "f", "arguments": "{}"}}], "messages[1].tool_calls[0].type"),
    ([{"id": 7, "type": "function", "function": {"name": "f", "arguments": "{}"}}], "messages[1].tool_calls[0].id"),
    ([{"type": "function", "function": {"name": "f", "arguments": "[" * 20_000 + "]" * 20_000}}],
     "messages[1].tool_calls[0].function.arguments"),
])
def test_malformed_tool_calls_in_an_assistant_turn_are_a_400_naming_the_field(tool_calls, field):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": tool_calls},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    with pytest.raises(ProtocolError) as err:
        parse_request({"model": "s", "messages": messages}, chat=True)
    assert err.value.status == 400 and err.value.param == field


def test_requests_that_would_cost_are_refused_before_the_work():
    """Counts and schema sizes are checked before any per-item work or grammar compilation, each
    refusal a 400 naming its limit (the three shapes a hostile client sends)."""
    from srpo.gateway import formats, protocol

    user = {"role": "user", "content": "hi"}
    big_schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200} for i in range(2000)}}
    deep: dict = {"type": "object"}
    node = deep
    for _ in range(40):
        node["properties"] = {"a": {"type": "object"}}
        node = node["properties"]["a"]
    shapes = {
        "messages": {"model": "s", "messages": [user] * 250_000},
        "tools": {"model": "s", "messages": [user], "tools": [{"type": "function", "function": {"name": f"t{i}"}}
                                                               for i in range(38_000)]},
        "response_format.json_schema.schema": {"model": "s", "messages": [user], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": big_schema}}},
    }
    for param, body in shapes.items():
        with pytest.raises(ProtocolError) as err:
            parse_request(body, chat=True)
        assert err.value.status == 400 and err.value.param == param and "at most" in err.value.message
    with pytest.raises(ProtocolError, match=f"deeper than {formats.MAX_SCHEMA_DEPTH}"):
        parse_request({"model": "s", "messages": [user], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": deep}}}, chat=True)
    assert protocol.MAX_MESSAGES >= 1024 and protocol.MAX_TOOLS >= 128  # room for real agents


def test_without_the_grammar_library_structured_requests_are_a_501_naming_the_install(monkeypatch, caplog):
    import builtins

    from srpo.gateway import server

    real_import = builtins.__import__

    def no_llguidance(name, *args, **kwargs):
        if name.startswith("llguidance"):
            raise ImportError("No module named 'llguidance'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    with pytest.raises(ProtocolError) as err:
        parse_request({"model": "s", "messages": [{"role": "user", "content": "hi"}],
                       "response_format": {"type": "json_object"}}, chat=True)
    assert err.value.status == 501 and "pip install llguidance" in err.value.message
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    assert server.warn_without_grammar_library("srpo serve") is False
    assert "needs llguidance" in caplog.text and "pip install llguidance" in caplog.text


@pytest.mark.parametrize("item, field", [
    ({"type": "function_call", "name": "f", "arguments": "[" * 20_000 + "]" * 20_000, "call_id": "c"},
     "input[1].arguments"),
    ({"type": "function_call", "name": "f", "arguments": "{}", "call_id": 5}, "input[1].call_id"),
    ({"type": "function_call", "name": 3, "arguments": "{}"}, "input[1]"),
    ({"type": "function_call_output", "call_id": ["c"], "output": "x"}, "input[1].call_id"),
])
def test_malformed_function_calls_in_a_responses_request_are_a_400_naming_the_field(item, field):
    from srpo.gateway.responses import parse_responses_request

    with pytest.raises(ProtocolError) as err:
        parse_responses_request({"model": "s", "input": [{"role": "user", "content": "hi"}, item]})
    assert err.value.status == 400 and err.value.param == field


@pytest.mark.parametrize("turn, field", [
    ({"role": "assistant", "content": [{"type": "tool_use", "id": 7, "name": "f", "input": {}}]}, "messages[1].content[0].id"),
    ({"role": "assistant", "content": [{"type": "tool_use", "name": "", "input": {}}]}, "messages[1].content[0]"),
    ({"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": "x"}]}, "messages[1].content[0]"),
    ({"role": "user", "content": [{"type": "tool_result", "tool_use_id": 3, "content": "x"}]},
     "messages[1].content[0].tool_use_id"),
])
def test_malformed_tool_blocks_in_an_anthropic_request_are_a_400_naming_the_field(turn, field):
    from srpo.gateway.anthropic import parse_messages_request

    with pytest.raises(ProtocolError) as err:
        parse_messages_request({"model": "s", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}, turn]})
    assert err.value.status == 400 and err.value.param == field


def test_a_call_to_a_tool_that_was_not_offered_never_reaches_the_client():
    """A reply that calls `sum` when only `weather` and `search` were offered: the call is not passed
    on (and finish_reason is not tool_calls); the offered call beside it is."""
    from srpo.gateway.backends import choice
    from srpo.types import Sample, SamplingParams

    tok = byte_tokenizer()
    req = _request()
    rendered = render(tok, req)
    reply = ('<tool_call>\n{"name": "sum", "arguments": {"a": 1}}\n</tool_call>\n'
             '<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    c = choice(Sample([1], reply, [0.0], "eos"), SamplingParams(), req, rendered, tok)
    assert [t["function"]["name"] for t in c.tool_calls] == ["weather"] and c.finish_reason == "tool_calls"
    only_unknown = '<tool_call>\n{"name": "sum", "arguments": {"a": 1}}\n</tool_call>'
    c = choice(Sample([1], only_unknown, [0.0], "eos"), SamplingParams(), req, rendered, tok)
    assert c.tool_calls == [] and c.finish_reason != "tool_calls"
