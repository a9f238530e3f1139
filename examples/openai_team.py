"""A two-solver + judge team written with the plain ``openai`` client — nothing srpo-specific.

Train it:   srpo train --config configs/openai/team.yaml
Serve it:   srpo serve --model runs/openai-team   (then point this same code at the URL it prints)

srpo calls ``solve(task, base_url)`` once per episode with the episode's own endpoint; the code
below runs unchanged against any OpenAI-compatible server with models named ``solver_1``,
``solver_2`` and ``judge``.  Its prompts are those of srpo's built-in ``parallel_aggregate`` in the
demo, so the two can be compared (configs/studies/gateway_vs_builtin.yaml).
"""

from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI


def ask(client: OpenAI, model: str, content: str) -> str:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}])
    return reply.choices[0].message.content or ""


def solve(task, base_url: str) -> str:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    question = task.question  # srpo's Task; anything with the problem text would do
    # The two solvers answer independently, in parallel ...
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda m: ask(client, m, f"{question} Reply with just the number."),
                                ["solver_1", "solver_2"]))
    # ... and the judge reads both: srpo records one transition whose active set is the two
    # answers (K = 2), then the judge's own (K = 1).
    listing = "\n".join(f"({i}) {a}" for i, a in enumerate(answers, 1))
    return ask(client, "judge", f"Problem: {question}\n\nAnswers proposed by other solvers:\n{listing}\n\n"
                                f"Decide which answer is correct and give it.\nReply with just the number.")
