"""srpo: Setwise Relative Policy Optimization for multi-agent LLM workflows.

The packages form layers, each importing only those below it (docs/architecture.md draws them;
a test checks the code against it): ``objective`` (pure tensor math, usable alone) → ``events`` →
``tasks``/``policies``/``methods`` → ``types`` → ``rollout``/``parallel`` → ``gateway`` →
``workflows`` → ``build`` → ``train`` → ``apps``; ``runs`` (a run's folder, checkpoints, logs)
and ``config`` (the schema) lie beneath them all.
"""

__version__ = "0.1.0"
