"""Tasks: datasets (loaders with row validation), answer extraction and grading, retrieval,
synthetic generators, and evaluation metrics.  Tasks never import the trainer."""

from srpo.tasks.base import DatasetError, Task, load_jsonl_rows
from srpo.tasks.metrics import avg_at_k, macro_average, pass_at_k

__all__ = ["DatasetError", "Task", "avg_at_k", "load_jsonl_rows", "macro_average", "pass_at_k"]
