"""The built-in ``parallel_aggregate`` (two workers, the study recipe's prompts) rewritten as an
``openai``-client program, for ``bench_gateway_team.py``: the same roles and the same prompt texts,
the aggregator reading the workers' extracted answers as the built-in's does — so both sides of
the benchmark sample the same work and what differs is the gateway."""

from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

from srpo.tasks.kinds import task_kind

SYSTEM = "Be brief."


def _answer_of(text: str) -> str:
    """The built-in aggregator's reading of a worker's reply: its answer, else the text, shortened."""
    found = task_kind("math").extract_answer(text)
    text = (text or "").strip()
    return found if found is not None else (text if len(text) <= 200 else text[:200] + " ...")


def solve(task, base_url: str) -> str:
    """The team with a client built for each episode, as most programs are written."""
    return _team(task, OpenAI(base_url=base_url, api_key="unused", max_retries=0))


_CLIENT: OpenAI | None = None


def solve_shared_client(task, base_url: str) -> str:
    """The same team with one client per process, pointed at each episode's URL by
    ``with_options`` (about 50 µs, against about 0.1 ms to build a client where srpo runs programs:
    its SSL context is shared, ``srpo/workflows/ssl_reuse.py``)."""
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    return _team(task, _CLIENT.with_options(base_url=base_url))


def _team(task, client: OpenAI) -> str:
    def ask(model: str, content: str) -> str:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}])
        return reply.choices[0].message.content or ""

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda m: ask(m, f"{task.question} Reply with just the number."),
                                ["worker_1", "worker_2"]))
    lines = [f"Problem: {task.question}", "", "Answers proposed by other solvers:"]
    lines += [f"({i}) {_answer_of(a)}" for i, a in enumerate(answers, 1)]
    lines += ["", "Decide which answer is correct and give it."]
    return ask("aggregator", "\n".join(lines) + "\nReply with just the number.")
