"""JSON from outside is read in memory linear in its size with a small constant, at every
size up to its reader's limit (issue 61): a long string costs about its own bytes again
(the bracket-depth scan of before cost ~120 bytes a character), and a manifest that
cannot be read at all — damaged, or beyond this process's memory — is passed over for the
previous checkpoint like any damaged one. Memory is measured (tracemalloc, RLIMIT_AS in a
subprocess), never time."""

import json
import os
import resource
import subprocess
import sys
import tracemalloc

import pytest
from harness.mpirun import ROOT, job_env
from checkpoint.test_hostile_hdf5 import resign

from hpcpipe.__main__ import main
from hpcpipe.checkpoint import manifest as manifests
from hpcpipe.checkpoint import step_name
from hpcpipe.util.schema import Mismatch, parse_json


def _peak_per_byte(data: bytes) -> float:
    """Bytes tracemalloc saw allocated at the peak of parse_json(data), per input byte."""
    tracemalloc.start()
    try:
        parse_json(data)
        return tracemalloc.get_traced_memory()[1] / len(data)
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("mib", [1, 16, 64])
def test_a_long_string_costs_about_its_own_size(mib):
    data = b'{"__metadata__": {"note": "' + b"x" * (mib * 2**20) + b'"}}'
    assert _peak_per_byte(data) < 2.5  # the text once decoded, the string once parsed


@pytest.mark.parametrize("body", [b"[]", b'{"k": 1}', b"1", b'"ab"', b'"\\\\"'])
def test_many_small_values_cost_what_python_objects_cost(body):
    data = b"[" + b",".join([body] * (2**20 // (len(body) + 1))) + b"]"
    assert _peak_per_byte(data) < 64  # Python's own containers; the scan added 120


def test_depth_is_still_bounded_inside_and_outside_strings():
    deep = b"[" * 65 + b"]" * 65
    with pytest.raises(Mismatch, match="nested more than 64"):
        parse_json(deep)
    assert parse_json(b"[" * 64 + b"]" * 64) is not None
    assert parse_json(b'["' + b"[" * 100_000 + b'"]') == ["[" * 100_000]
    with pytest.raises(Mismatch, match="nested more than 64"):
        parse_json(b'{"a": ' * 5000 + b"1" + b"}" * 5000)


def _capped(args, gigabytes):
    cap = int(gigabytes * 2**30)
    return subprocess.run([sys.executable, "-m", "hpcpipe", *args], cwd=ROOT, env=job_env(),
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS,
                                                                (cap, cap)))


def test_a_legal_20_mib_manifest_is_read_within_a_small_cap(finished):
    """The hostile case: 20 MiB of manifest (the limit is 64) ended in `error:
    MemoryError`; the manifest's free-form "source" holds the bulk here."""
    folder = finished / "checkpoints" / step_name(2)
    resign(folder, lambda m: m.update(source="s" * (20 * 2**20)))
    assert os.path.getsize(folder / manifests.MANIFEST) > 20 * 2**20
    done = _capped(["ckpt", "verify", str(folder)], 1.5)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-2000:]


def test_a_manifest_beyond_memory_falls_back_to_the_previous_checkpoint(
        capsys, finished, stdlib_tokens, monkeypatch):
    from reliability.test_no_hang import _train

    real = manifests.parse_json

    def parse(data):  # this checkpoint's manifest is more than the process can hold
        if b'"step": 2' in data:
            raise MemoryError
        return real(data)

    monkeypatch.setattr(manifests, "parse_json", parse)
    assert main(_train(finished, stdlib_tokens, "train.steps=3") + ["--resume"]) == 0
    out = capsys.readouterr().out
    assert "out of memory reading" in out and "resuming from the previous good checkpoint" \
        in out and step_name(1) in out
    assert json.loads((finished / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3
