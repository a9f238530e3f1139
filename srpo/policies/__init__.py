"""Language models behind the roles: loading, layouts, sampling and teacher-forced log-probs."""

from srpo.policies.models import DEFAULT_MODEL, ModelLoadError, load_model, registered_names

__all__ = ["DEFAULT_MODEL", "ModelLoadError", "load_model", "registered_names"]

from srpo.policies.layouts import LAYOUTS, LoraSettings, PolicySet, build_policies  # noqa: E402

__all__ += ["LAYOUTS", "LoraSettings", "PolicySet", "build_policies"]
# The messages to and from a sampler (SamplingParams, GenerationRequest, Sample) live in srpo.types.
