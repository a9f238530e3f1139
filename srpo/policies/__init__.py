"""Language models behind the roles: loading, layouts, sampling and teacher-forced log-probs."""

from srpo.policies.models import DEFAULT_MODEL, ModelLoadError, load_model, registered_names

__all__ = ["DEFAULT_MODEL", "ModelLoadError", "load_model", "registered_names"]

from srpo.policies.layouts import (  # noqa: E402
    LAYOUTS,
    GenerationRequest,
    LoraSettings,
    PolicySet,
    build_policies,
)
from srpo.policies.sampling import Sample, SamplingParams  # noqa: E402

__all__ += ["LAYOUTS", "GenerationRequest", "LoraSettings", "PolicySet", "Sample", "SamplingParams", "build_policies"]
