"""A run on disk and around it: the run folder (:mod:`srpo.runs.run_dir`), atomic checkpoints
(:mod:`srpo.runs.checkpoint`), the metrics and samples logs, trackers (:mod:`srpo.runs.trackers`),
what a run folder may be trusted with (:mod:`srpo.runs.trust`), signals and preemption, and serving
a trained team (:mod:`srpo.runs.serving`)."""
