"""srpo: Setwise Relative Policy Optimization for multi-agent LLM workflows.

Sub-packages, in the direction data flows (see docs/architecture in README):
``tasks`` → ``workflows`` → ``events`` → ``objective`` → ``trainer``; ``policies`` stand behind
the roles.  ``srpo.objective`` is pure tensor math and can be used alone.
"""

__version__ = "0.1.0"
