"""``srpo study``: methods × workflows × tasks × seeds, each cell a training run plus evaluation.

A study file names a base training config, the axes of the grid (each a list of labelled
override sets), the seeds, and the evaluation.  Every cell trains in its own run folder,
evaluates, and writes ``cell.json``; a finished cell is never re-run and an interrupted one
resumes from its last checkpoint, so the whole study is resumable by running it again.

    output_dir: runs/study-methods-math
    base: ../math/parallel_aggregate/base.yaml     # relative to this file
    overrides: {run.steps: 12, train.group_size: 4}
    axes:
      method:
        - {label: srpo, set: {method.name: srpo}}
        - {label: grpo, set: {method.name: grpo}}
    seeds: [0, 1]
    eval:
      k: 2
      datasets:
        - {source: synthetic_arithmetic, level: 0, n: 50, seed: 999, name: arith}
    eval_untrained: true      # also evaluate each workflow's starting point (default false)
    references:               # other untrained starting points, evaluated once (e.g. before a warm start)
      - {label: base model, set: {model.init_from: ""}}
    keep_checkpoints: false   # delete a cell's checkpoints once it is evaluated (default true)

A full-model checkpoint of the 135M default is ~1.6 GB, so a grid of 20 cells keeps ~32 GB unless
``keep_checkpoints: false``; ``cell.json``, ``metrics.jsonl`` and ``samples.jsonl`` stay either way.

The results table (``results.md``/``results.json``) reports avg@k and pass@k per dataset and their
macro-averages as mean ± standard error over seeds, and per cell the diagnostics of training:
set-ratio statistics and clip fraction by set size, gradient norm (range and coefficient of
variation), mean active-set size (first and last steps), the router's set size, invalid events,
and correct answers per million team tokens.
"""
