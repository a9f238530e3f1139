"""A gateway backend with a fixed script, for the API tests (Responses, Messages): no model behind it."""

from srpo.gateway import tools
from srpo.gateway.protocol import Choice


class ToolBackend:
    """Answers with a weather call (after ``preamble``) when tools are offered and not refused,
    else with text; keeps every request it got."""

    roles = ["agent"]

    def __init__(self, preamble: str = ""):
        self.preamble = preamble
        self.requests = []

    async def complete(self, req):
        self.requests.append(req)
        if req.tools and req.tool_choice != "none":
            text, calls = tools.parse_tool_calls(f'{self.preamble}<tool_call>{{"name": "weather", "arguments": '
                                                 f'{{"city": "Paris"}}}}</tool_call>', "hermes")
            return [Choice(text=text, finish_reason="tool_calls", completion_tokens=9, tool_calls=calls)], 5
        return [Choice(text="It is sunny.", finish_reason="stop", completion_tokens=4)], 5
