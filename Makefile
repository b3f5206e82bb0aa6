# acco_ds: `make demo` runs a 2-rank ACCO training on CPU, `make test` runs the tests.
# Both create .venv and install what they need on first use (torch CPU build first,
# so that no other package can pull a CUDA build of torch).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
STEPS  ?= 60
WORKERS ?= 2
# JIT-built ops (DeepSpeed's shared-memory op, its fused Adam) live beside the venv that built them: a shared
# ~/.cache/torch_extensions would be rebuilt (a minute or more) whenever another checkout's venv ran last.
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions
# ...built by the venv's ninja, as the tests build them (tests/conftest.py puts the venv's bin first on PATH): a
# system ninja of another version keeps another .ninja_log format, and each switch rebuilds the op from scratch.
NINJA_PATH := PATH="$(abspath $(BIN)):$$PATH"

.PHONY: install demo test test-fast docs bench-kernels bench-cluster clean

install: $(STAMP)

# The native ops are built ahead of time (second pip install, ACCO_BUILD_OPS=1; the CUDA op too when
# torch has CUDA and nvcc is found, ACCO_BUILD_CUDA=1/0 forces/skips it), so demo and test never
# JIT-compile. Editing csrc/ re-runs this recipe: the built module must match the sources.
OPS_SOURCES := $(wildcard csrc/*.h csrc/*/*.h csrc/*/*.cpp csrc/*/*.cu)

$(STAMP): setup.py requirements-dev.txt constraints.txt $(OPS_SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip "setuptools>=70.1"
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e . -r requirements-dev.txt
	ACCO_BUILD_OPS=1 $(BIN)/python -m pip install -q -c constraints.txt --no-build-isolation --no-deps -e .
	$(BIN)/python -c "import acco_ds.ops.acco_cpu_ops_op"
	# DeepSpeed's CPU backend JIT-builds its own shared-memory op at the first init_distributed, and its fused
	# Adam for an "AdamW" without torch_adam: build both now, so that demo and test compile nothing.
	DS_ACCELERATOR=cpu $(NINJA_PATH) $(BIN)/python -c "from deepspeed.accelerator import get_accelerator as a; \
		[a().create_op_builder(n).load() for n in ('ShareMemCommBuilder', 'FusedAdamBuilder')]"
	touch $@

demo: $(STAMP)
	DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 $(NINJA_PATH) $(BIN)/deepspeed --num_gpus 2 examples/train_gpt.py \
		--deepspeed_config configs/acco_cpu.json --steps $(STEPS)

# pytest-xdist workers (WORKERS, default 2: one per core); tests marked `alone` hold the machine to themselves
# (tests/conftest.py).
test: $(STAMP)
	DS_ACCELERATOR=cpu $(BIN)/python -m pytest -q -p no:cacheprovider --timeout 900 -n $(WORKERS) --dist loadgroup --no-loadscope-reorder tests

# The fast subset (no multi-process training): under 3 minutes on 2 cores.
test-fast: $(STAMP)
	DS_ACCELERATOR=cpu $(BIN)/python -m pytest -q -p no:cacheprovider --timeout 300 -n $(WORKERS) --dist loadgroup --no-loadscope-reorder -m "not slow" tests

# The documentation site into site/: the config reference regenerated from the pydantic models first.
docs: $(STAMP)
	$(BIN)/python -m acco_ds.config.reference
	$(BIN)/mkdocs build --strict

bench-kernels: $(STAMP)
	$(BIN)/python benchmarks/kernels.py

bench-cluster: $(STAMP)
	$(BIN)/python benchmarks/cluster.py all --repeats 3

clean:
	rm -rf $(VENV) build *.egg-info site
