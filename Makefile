# acco_ds: `make demo` runs a 2-rank ACCO training on CPU, `make test` runs the tests.
# Both create .venv and install what they need on first use (torch CPU build first,
# so that no other package can pull a CUDA build of torch).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
STEPS  ?= 60

.PHONY: install demo test bench-kernels bench-cluster clean

install: $(STAMP)

$(STAMP): setup.py requirements-dev.txt constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e . -r requirements-dev.txt
	touch $@

demo: $(STAMP)
	DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 $(BIN)/deepspeed --num_gpus 2 examples/train_gpt.py \
		--deepspeed_config configs/acco_cpu.json --steps $(STEPS)

test: $(STAMP)
	DS_ACCELERATOR=cpu $(BIN)/python -m pytest -q -p no:cacheprovider --timeout 900 tests

bench-kernels: $(STAMP)
	$(BIN)/python benchmarks/kernels.py

bench-cluster: $(STAMP)
	$(BIN)/python benchmarks/cluster.py all --repeats 3

clean:
	rm -rf $(VENV) build *.egg-info
