"""A two-solver + judge team written with the plain ``openai`` client — nothing srpo-specific.

Train it:   srpo train --config configs/openai_team.yaml
Serve it:   srpo serve --model runs/openai-team      (then point the same code at http://127.0.0.1:8000/v1)

srpo calls ``solve(task, base_url)`` once per episode with the episode's own endpoint; the code
below would run unchanged against any OpenAI-compatible server that has models named
``solver_1``, ``solver_2`` and ``judge``.
"""

from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI


def ask(client: OpenAI, model: str, content: str) -> str:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}])
    return reply.choices[0].message.content or ""


def solve(task, base_url: str) -> str:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    question = f"{task.question} Reply with just the number."
    # The two solvers answer independently and in parallel ...
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda m: ask(client, m, question), ["solver_1", "solver_2"]))
    # ... and the judge reads both: srpo sees one transition with an active set of K = 2.
    listing = "\n".join(f"Answer {i + 1}: {a}" for i, a in enumerate(answers))
    return ask(client, "judge", f"{task.question}\n{listing}\nReply with just the correct number.")
