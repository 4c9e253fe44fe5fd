# DeepSpeed Batch Lab. `make lab` runs the lab; `make test` passes the tests. Both set up first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Reinstall when the dependency list changes.
STAMP  := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)
LAB_PORT ?= 8888

# NGC and cloud deep-learning images ship their own CUDA torch: the venv sees it and keeps it, and only the
# other tested versions in constraints.txt apply. Elsewhere torch comes from PyPI at the tested version.
SYSTEM_TORCH := $(shell $(PYTHON) -c "import torch" 2>/dev/null && echo yes)
VENV_FLAGS   := $(if $(SYSTEM_TORCH),--system-site-packages,)

.PHONY: install ops lab test test-fast lint bench docs clean gpu-check

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(if $(SYSTEM_TORCH),grep -v '^torch==' constraints.txt,cat constraints.txt) > $(VENV)/constraints.txt
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt -e '.[lab,test,hf,monitor]'
	rm -f $(VENV)/.installed-*
	touch $@

# DeepSpeed JIT-compiles its ops on first use (30-90 s each); build them once, up front. On a GPU without an
# nvcc matching torch's CUDA it builds none and says so (runs then use torch_adam); it clears stale build locks.
ops: install
	$(BIN)/python -m labkit.runtime.ops

# JupyterLab on 127.0.0.1 only, token auth on (the URL with the token is printed).
lab: ops
	$(BIN)/jupyter lab --ip=127.0.0.1 --port=$(LAB_PORT) --no-browser $(ROOT_FLAG) \
		--ServerApp.root_dir=$(CURDIR)/notebooks

# ruff (lint + import order, notebooks too) and mypy on labkit/: both must be clean.
lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

# Linters, unit tests, real-run tests, fault suite, browser test, and every notebook through nbval.
test: ops lint
	LABKIT_PROFILE=ci $(BIN)/python -m pytest -ra tests --nbval-lax notebooks

test-fast: install
	$(BIN)/python -m pytest -ra tests -m "not slow and not browser and not faults and not multinode and not slurm and not mpi"

bench: ops
	$(BIN)/python benchmarks/run_all.py

# Every notebook executed on the ci profile, as HTML with its outputs, in build/docs/ (git-ignored):
# a worked run to read before starting. The committed notebooks stay without outputs.
DOCS := build/docs
docs: ops
	mkdir -p $(DOCS)
	cd notebooks && for nb in *.ipynb; do \
		LABKIT_PROFILE=ci ../$(BIN)/jupyter nbconvert --to html --execute \
			--ExecutePreprocessor.timeout=900 --output-dir ../$(DOCS) "$$nb" || exit 1; \
	done
	@echo "HTML with outputs in $(DOCS)/"

# With a GPU, run this first: ops, GPU-marked tests, one 2-rank run per ZeRO stage; report in gpu-check-report.txt.
gpu-check: install
	$(BIN)/python -m labkit.runtime.gpu_check --report gpu-check-report.txt

clean:
	rm -rf $(VENV) .cache runs
