# DeepSpeed Batch Lab. `make lab` runs the lab; `make test` passes the tests. Both set up first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Reinstall when the dependency list changes.
STAMP  := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)
LAB_PORT ?= 8888

# Bad input is refused when make reads this file, before any prerequisite (install, ops, lint) runs, for a goal
# named on the command line: `$(call matches,VALUE,extended regex)` is "yes" when the whole value matches.
goal = $(filter $(1),$(MAKECMDGOALS))
matches = $(shell printf '%s\n' '$(1)' | grep -Exq '$(2)' && echo yes)
ifneq ($(call goal,lab),)
ifneq ($(call matches,$(LAB_PORT),[1-9][0-9]*),yes)
$(error LAB_PORT=$(LAB_PORT): must be a TCP port, 1 to 65535)
endif
ifneq ($(shell test '$(LAB_PORT)' -le 65535 && echo yes),yes)
$(error LAB_PORT=$(LAB_PORT): must be a TCP port, 1 to 65535)
endif
endif

# NGC and cloud deep-learning images ship their own CUDA torch: the venv keeps it (labkit/runtime/node_venv.py:
# --system-site-packages, or a .pth to the node's own venv when PYTHON is itself a venv), and only the other
# tested versions in constraints.txt apply. Elsewhere torch comes from PyPI at the tested version.
SYSTEM_TORCH := $(shell $(PYTHON) -c "import torch" 2>/dev/null && echo yes)
# Which extras: all by default; a GPU node running the notebooks needs only `notebooks` (a kernel and nbval).
EXTRAS ?= lab,test,hf,monitor
# Offline (an air-gapped node): WHEELHOUSE=dir made by `make wheelhouse`; pip then never reaches an index.
WHEELHOUSE ?=
PIP_FROM := $(if $(WHEELHOUSE),--no-index --find-links $(abspath $(WHEELHOUSE)),)

.PHONY: install ops lab test test-fast lint bench docs clean gpu-check gpu-reference wheelhouse wheelhouse-proof

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) labkit/runtime/node_venv.py $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(if $(WHEELHOUSE),,$(BIN)/python -m pip install -q --upgrade pip)
	$(if $(SYSTEM_TORCH),grep -v '^torch==' constraints.txt,cat constraints.txt) > $(VENV)/constraints.txt
	$(BIN)/python -m pip install -q $(PIP_FROM) -c $(VENV)/constraints.txt -e '.$(if $(EXTRAS),[$(EXTRAS)])'
	rm -f $(VENV)/.installed-*
	touch $@

# Every wheel the lab needs on an air-gapped node, into $(WHEELHOUSE_DIR) (labkit/runtime/wheelhouse.py): labkit,
# DeepSpeed built from its sdist, every dependency for WHEEL_PYTHON on manylinux x86-64, torch left to the node
# (WITH_TORCH=1 carries it), and what the node has left out (NODE_PACKAGES=its `pip list --format=freeze`).
# E.g. make wheelhouse WHEEL_PYTHON=3.12 EXTRAS=notebooks NODE_PACKAGES=node-freeze.txt
WHEELHOUSE_DIR ?= $(or $(WHEELHOUSE),wheelhouse)
WHEEL_PYTHON ?= $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# Before `install`, and before the module deletes the old wheels (it checks them again, with labkit's Python range).
ifneq ($(call goal,wheelhouse),)
ifneq ($(call matches,$(WHEEL_PYTHON),[0-9]\.[0-9][0-9]?),yes)
$(error WHEEL_PYTHON=$(WHEEL_PYTHON): must be the node's CPython as major.minor, e.g. 3.12)
endif
# NODE_PACKAGES_UNWRITTEN: wheelhouse-proof's sub-make in a dry run (make -n), whose file the lines before it write.
ifeq ($(NODE_PACKAGES_UNWRITTEN),)
ifneq ($(NODE_PACKAGES),)
ifneq ($(shell test -f '$(NODE_PACKAGES)' && test -r '$(NODE_PACKAGES)' && echo yes),yes)
$(error NODE_PACKAGES=$(NODE_PACKAGES): no such readable file (the node's `pip list --format=freeze`, or names one a line))
endif
endif
endif
endif
wheelhouse: install
	$(BIN)/python -m labkit.runtime.wheelhouse --out $(WHEELHOUSE_DIR) --python $(WHEEL_PYTHON) --extras '$(EXTRAS)' \
		$(if $(NODE_PACKAGES),--node-packages $(NODE_PACKAGES)) $(if $(WITH_TORCH),--with-torch)

# CI's proof of the offline install: a "node" venv holding torch only, a wheelhouse for it, a fresh venv made from
# the node's Python installed with --no-index, and one 2-rank run in it.
PROOF := $(CURDIR)/build/wheelhouse-proof
wheelhouse-proof: install
	rm -rf $(PROOF) && mkdir -p $(PROOF)
	$(PYTHON) -m venv $(PROOF)/node
	$(PROOF)/node/bin/python -m pip install -q --no-compile -c constraints.txt torch
	$(PROOF)/node/bin/python -m pip list --format=freeze > $(PROOF)/node-freeze.txt
	$(MAKE) --no-print-directory wheelhouse WHEELHOUSE=$(PROOF)/wheelhouse EXTRAS= NODE_PACKAGES=$(PROOF)/node-freeze.txt \
		$(if $(findstring n,$(firstword -$(MAKEFLAGS))),NODE_PACKAGES_UNWRITTEN=1)
	$(MAKE) --no-print-directory install VENV=$(PROOF)/venv PYTHON=$(PROOF)/node/bin/python \
		WHEELHOUSE=$(PROOF)/wheelhouse EXTRAS=
	$(PROOF)/venv/bin/python -c "import torch, sys; assert torch.__file__.startswith('$(PROOF)/node'), torch.__file__"
	LABKIT_RUNS_DIR=$(PROOF)/runs TORCH_EXTENSIONS_DIR=$(PROOF)/torch_extensions \
		$(PROOF)/venv/bin/python -m labkit run --example zero3 --world-size 2 \
		--micro-batch 8 --steps 3 --optimizer sgd

# DeepSpeed JIT-compiles its ops on first use (30-90 s each); build them once, up front. On a GPU without an
# nvcc matching torch's CUDA it builds none and says so (runs then use torch_adam); it clears stale build locks.
ops: install
	$(BIN)/python -m labkit.runtime.ops

# JupyterLab on 127.0.0.1 only, token auth on (the URL with the token is printed). The tools run as
# `python -m`: a venv made on top of another (node_venv's .pth) sees them installed there and has no scripts of its own.
lab: ops
	$(BIN)/python -m jupyter lab --ip=127.0.0.1 --port=$(LAB_PORT) --no-browser $(ROOT_FLAG) \
		--ServerApp.root_dir=$(CURDIR)/notebooks

# ruff (lint + import order, notebooks too) and mypy on labkit/: both must be clean.
lint: install
	$(BIN)/python -m ruff check .
	$(BIN)/python -m mypy

# Linters, unit tests, real-run tests, fault suite, browser test, and every notebook through nbval. The op builds
# and the linters run side by side (mypy and the last op build use one core each). pytest runs in TEST_WORKERS
# processes (pytest-xdist; 0: in this one), each file's tests in one of them: a notebook's cells run in order in
# one kernel, and a module's shared runs start once. One worker leaves a 2-core machine's second core idle about a
# third of the time (its runs wait on imports, launches and sleeps); two keep both busy. The 25 slowest tests are
# listed at the end: where the suite's time goes, in every CI log.
TEST_WORKERS ?= 2
ifneq ($(call goal,test),)
ifneq ($(call matches,$(TEST_WORKERS),[0-9]+|auto|logical),yes)
$(error TEST_WORKERS=$(TEST_WORKERS): must be a number of pytest-xdist workers, 0 or more (0: none), auto or logical)
endif
endif
test: install
	$(MAKE) --no-print-directory -j2 ops lint
	LABKIT_PROFILE=ci $(BIN)/python -m pytest -ra --durations=25 -n $(TEST_WORKERS) --dist loadfile \
		tests --nbval-lax notebooks

# The tests that start no process (every one that does is marked slow: tests/conftest.py), 2-4 minutes here.
test-fast: install
	$(BIN)/python -m pytest -ra tests -m "not slow"

bench: ops
	$(BIN)/python benchmarks/run_all.py

# Every notebook executed on the ci profile, as HTML with its outputs, in build/docs/ (git-ignored):
# a worked run to read before starting. The committed notebooks stay without outputs.
DOCS := build/docs
docs: ops
	mkdir -p $(DOCS)
	cd notebooks && for nb in *.ipynb; do \
		LABKIT_PROFILE=ci ../$(BIN)/python -m jupyter nbconvert --to html --execute \
			--ExecutePreprocessor.timeout=900 --output-dir ../$(DOCS) "$$nb" || exit 1; \
	done
	@echo "HTML with outputs in $(DOCS)/"

# With a GPU, run this first: ops, GPU-marked tests, a run per ZeRO stage, offload, an OOM probe (2-rank runs on
# 2+ GPUs); report in gpu-check-report.txt. About 3 minutes on one GPU with a warm op cache.
gpu-check: install
	$(BIN)/python -m labkit.study.gpu_check --report gpu-check-report.txt

# The GPU reference (labkit/study/gpu_reference.py) into data/reference-<gpu>/: STEP=check, notebooks or answer
# (each resumable), or all. JOBS=N: N notebooks at once, sharing the GPUs (their timings then are not one run's).
STEP ?= all
JOBS ?= 1
ifneq ($(call goal,gpu-reference),)
ifneq ($(call matches,$(STEP),check|notebooks|answer|all),yes)
$(error STEP=$(STEP): must be check, notebooks, answer or all)
endif
ifneq ($(call matches,$(JOBS),[1-9][0-9]*),yes)
$(error JOBS=$(JOBS): must be a number of notebooks at once, 1 or more)
endif
endif
gpu-reference: ops
	$(BIN)/python -m labkit.study.gpu_reference $(STEP) --jobs $(JOBS)

clean:
	rm -rf $(VENV) .cache runs wheelhouse build
