# etweedie — two commands do all set-up on a fresh machine:
#   make demo    create .venv, install torch + etweedie (with its compiled extension), run the demo
#   make test    same set-up, then the test suite
# TORCH_SPEC picks the torch to install when the venv has none (an installed torch is kept).

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

PY    := $(VENV)/bin/python
PIP   := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.etweedie-installed
SOURCES := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*/*.h csrc/*/*.cpp csrc/*/*.cu)

.PHONY: all demo test install bench clean

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)

# Rebuilt whenever a kernel source, setup.py or pyproject.toml changes.
$(STAMP): $(PY) $(SOURCES)
	$(PIP) install -q --upgrade pip setuptools wheel ninja
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	else \
		echo "installing $(TORCH_SPEC)"; $(PIP) install -q "$(TORCH_SPEC)"; \
	fi
	$(PIP) install -q --no-build-isolation -e ".[test]"
	$(PY) -c "import etweedie, json; print('etweedie backends:', json.dumps(etweedie.backends.available()))"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m etweedie demo

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.table

clean:
	rm -rf build *.egg-info etweedie/_C*.so $(STAMP)
