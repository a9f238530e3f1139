"""A search workflow that calls its retriever in every episode, whatever the model writes (the
tiny model rarely writes a search): for runs that must have a retrieval call in flight."""

from dataclasses import dataclass

from srpo.workflows.builtins import Search


@dataclass
class AlwaysSearch(Search):
    name = "always_search"

    async def run(self, ctx, task):
        text = (await ctx.ask("searcher", task.question, event_type="search", turn=0)).text
        await ctx.call_tool("retriever", self.retriever.search, task.question, self.top_k)
        return text
