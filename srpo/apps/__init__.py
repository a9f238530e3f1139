"""What users run: the ``srpo`` command line (:mod:`~srpo.apps.cli`) and the commands behind it —
studies, supervised warm starts, the demo, reports.  Nothing below ``srpo.apps`` imports it."""
