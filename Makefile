# etweedie — two commands do all set-up on a fresh machine:
#   make demo    create .venv, install torch + etweedie (with its compiled extension), sample MNIST digits
#                with the shipped posterior (python -m experiments.mnist.demo; grid and mnist-eval row in runs/demo)
#   make demo-8g the eight-Gaussians demo (python -m experiments.eight_gaussians.demo)
#   make test    same set-up, then the CUDA compile check (when nvcc is on PATH), then the test suite
#   make check-cuda   compile every csrc/cuda/*.cu with plain nvcc (sm_80, sm_90); ptxas report
#   make check-triton compile the Triton kernels for sm_80 with Triton's compiler (no GPU needed)
#   make gpu-check    on a machine with a GPU and a CUDA torch: build, tests on CUDA, benchmarks
# TORCH_SPEC picks the torch to install when the venv has none (an installed torch is kept).

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

PY    := $(VENV)/bin/python
PIP   := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.etweedie-installed
SOURCES := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*/*.h csrc/*/*.cpp csrc/*/*.cu csrc/*/*.cuh)
NVCC    ?= nvcc

.PHONY: all demo demo-8g test install bench clean check-cuda check-cuda-if-available check-triton gpu-check

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)

# Rebuilt whenever a kernel source, setup.py or pyproject.toml changes.
$(STAMP): $(PY) $(SOURCES)
	@$(PY) -c "import setuptools" 2>/dev/null && $(PY) -m ninja --version >/dev/null 2>&1 || $(PIP) install -q --upgrade pip setuptools wheel ninja || $(PY) -c "import setuptools"
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	else \
		echo "installing $(TORCH_SPEC)"; $(PIP) install -q "$(TORCH_SPEC)"; \
	fi
	$(PIP) install -q --no-build-isolation -e ".[test]"
	@# k-diffusion's declared dependencies pull torchvision and another torch: its samplers need only
	@# torchsde/torchdiffeq/trampoline (in the test extra), so install the package itself without them.
	$(PIP) install -q --no-deps "k-diffusion==0.1.1.post1"
	$(PY) -c "import etweedie, json; print('etweedie backends:', json.dumps(etweedie.backends.available()))"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m experiments.mnist.demo

demo-8g: $(STAMP)
	$(PY) -m experiments.eight_gaussians.demo

test: $(STAMP) check-cuda-if-available
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Plain-nvcc compile of the CUDA kernels (no GPU, no CUDA torch needed); writes
# benchmarks/ptxas_report.txt (registers/spills per kernel).
check-cuda:
	NVCC=$(NVCC) bash scripts/check_cuda.sh

check-cuda-if-available:
	@if command -v $(NVCC) >/dev/null 2>&1; then \
		$(MAKE) --no-print-directory check-cuda; \
	else \
		echo "notice: $(NVCC) not found on PATH; skipping the CUDA compile check (make check-cuda)"; \
	fi

# Lower every Triton kernel variant to a cubin for sm_80 with Triton's own compiler (no GPU needed;
# about a minute for float32, TRITON_CHECK_ARGS="--dtypes fp32,fp64" adds several minutes).
TRITON_CHECK_ARGS ?=
check-triton: $(STAMP)
	env -u TRITON_INTERPRET $(PY) scripts/check_triton.py $(TRITON_CHECK_ARGS)

# Needs an NVIDIA GPU and a CUDA build of torch; stops with the reason before building otherwise.
# Where python3 already is a virtual environment holding a CUDA torch (an offline GPU box):
#   make gpu-check VENV=$$(python3 -c 'import sys; print(sys.prefix)')
# (benchmarks/RESULTS.md has the exact command of the recorded H200 run).
# Log and JSON results in gpu_check/ (GPU_CHECK_ARGS=--quick for smaller benchmark shapes).
GPU_CHECK_ARGS ?=
# A machine whose python3 already holds a CUDA torch gets a venv that sees it (no download).
gpu-check:
	@if [ ! -x $(PY) ]; then \
		if $(PYTHON) -c "import torch, sys; sys.exit(torch.version.cuda is None)" 2>/dev/null; then \
			$(PYTHON) -m venv --system-site-packages $(VENV); else $(PYTHON) -m venv $(VENV); fi; fi
	@$(PY) scripts/gpu_check.py --preflight
	$(MAKE) --no-print-directory install
	$(PY) scripts/gpu_check.py --skip-build $(GPU_CHECK_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.table

clean:
	rm -rf build *.egg-info etweedie/_C*.so $(STAMP)
