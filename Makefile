# fp8dp: `make demo` sets everything up and trains the demo; `make test` sets everything up and tests.
PY        := .venv/bin/python
BUILD     ?= build/dev
JOBS      ?= $(shell nproc)
CMAKE_ARGS ?=
export PYTHONPATH := $(CURDIR)/python$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: setup build test test-cpp test-python bench format install clean

setup:
	bash scripts/setup_env.sh

# In-place build: the extension is copied into python/fp8dp, so PYTHONPATH=python imports it.
build: setup
	cmake -S . -B $(BUILD) -G Ninja -DPython3_EXECUTABLE=$(CURDIR)/$(PY) -DFP8DP_INPLACE=ON $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS)

test-cpp: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)

# Only the test folders that exist (tests/distributed arrives with the DDP work).
PYTEST_DIRS := $(wildcard tests/python tests/distributed)

test-python: build
	$(PY) -m pytest -q $(PYTEST_DIRS)

test: test-cpp test-python

bench: build
	$(PY) bench/quantize_cpu.py

# A regular (non-editable) install into .venv, built against the torch already there.
install: setup
	$(PY) -m pip install --no-build-isolation .

format:
	clang-format -i $$(git ls-files 'src/*.h' 'src/*.cpp' 'src/*.cu' 'tests/cpp/*.cpp')
	$(PY) -m black -q python tests bench
	$(PY) -m ruff check --fix -q python tests bench

clean:
	rm -rf build python/fp8dp/_C*.so
