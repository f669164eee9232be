"""A checkpoint's HDF5 files edited by someone who knows the format — the manifest's sizes
and digests made to match again, so only the files' contents can tell: a dataset that
lives in another file (an external or soft link, external storage, a virtual dataset),
one that declares more than the file stores, attributes and objects of the wrong kind,
optimizer state of the wrong type or length, a tensor left without optimizer state, HDF5's
own structures broken. Each is one readable error that names the file, never a traceback,
never data read from outside the folder, never Adam's state silently replaced."""

import json
import math
import os
import shutil

import h5py
import numpy as np
import pytest
from harness.hostile import ends_with_one_error, small_config
from mpi4py import MPI

from hpcpipe import checkpoint as ckpt
from hpcpipe.checkpoint import manifest as manifests
from hpcpipe.checkpoint.hdf5 import Reader, sha256
from hpcpipe.train.trainer import train

MODEL, OPTIM = "model-pp000.h5", "optim-r00000.h5"


@pytest.fixture(scope="module")
def original(tmp_path_factory, stdlib_tokens):
    """A small model's checkpoint after one step, with its optimizer state."""
    run = tmp_path_factory.mktemp("hostile") / "run"
    cfg = small_config("train.steps=1", f'data.path="{stdlib_tokens}"')
    train(cfg, str(run), MPI.COMM_SELF, out=lambda *_: None)
    return run / "checkpoints" / ckpt.step_name(1)


@pytest.fixture
def folder(original, tmp_path):
    dst = tmp_path / original.name
    shutil.copytree(original, dst)
    return dst


def resign(folder, edit=None) -> dict:
    """What an editor that knows the format does: the manifest (edited by `edit`) with
    every file's size and SHA-256, and its own digest, made to match again."""
    manifest = json.loads((folder / manifests.MANIFEST).read_text())
    if edit:
        edit(manifest)
    for name, info in manifest["files"].items():
        info.update(size=os.path.getsize(folder / name), sha256=sha256(str(folder / name)))
    manifests.write(str(folder), json.dumps(manifest))
    return manifest


def replace(group, key, make):
    """Dataset `key` of `group` replaced by what `make(group, key, old_data)` puts there."""
    old = group[key][()]
    del group[key]
    make(group, key, old)


def a_segment(f):
    """(kind group, key) of the first optimizer segment of an optimizer file."""
    return f["exp_avg"], min(f["exp_avg"])


def state_of(folder, key: str):
    """Reader.state for the segment `key` ("NAME@START") of the optimizer file."""
    manifest = ckpt.read_manifest(str(folder))
    name = key.split("@")[0]
    piece = next(p for p in manifest["pieces"][name] if p["start"] == int(key.split("@")[1]))
    reader = Reader(str(folder), manifest)
    try:
        return reader.state("exp_avg", name, (piece["start"], piece["stop"]))
    finally:
        reader.close()


def outside_file(tmp_path, data) -> str:
    """An HDF5 file outside the checkpoint holding `data` as dataset "x", and the same
    bytes raw (for external storage)."""
    path = str(tmp_path / "outside.h5")
    with h5py.File(path, "w") as f:
        f["x"] = data
    data.tofile(str(tmp_path / "outside.raw"))
    return path


def _external_link(tmp_path, group, key, old):
    group[key] = h5py.ExternalLink(outside_file(tmp_path, np.zeros_like(old)), "/x")


def _external_storage(tmp_path, group, key, old):
    outside_file(tmp_path, np.zeros_like(old))
    group.create_dataset(key, shape=old.shape, dtype=old.dtype,
                         external=[(str(tmp_path / "outside.raw"), 0, old.nbytes)])
    group[key].attrs["dtype"] = "float32"


def _virtual(tmp_path, group, key, old):
    path = outside_file(tmp_path, np.zeros_like(old))
    layout = h5py.VirtualLayout(shape=old.shape, dtype=old.dtype)
    layout[...] = h5py.VirtualSource(path, "x", shape=old.shape)
    group.create_virtual_dataset(key, layout)


def _soft_link(tmp_path, group, key, old):
    group["elsewhere"] = np.zeros_like(old)
    group[key] = h5py.SoftLink("/elsewhere")


ELSEWHERE = {"external link": (_external_link, "ExternalLink"),
             "external storage": (_external_storage, "keeps its data in other files"),
             "virtual dataset": (_virtual, "keeps its data in other files"),
             "soft link": (_soft_link, "SoftLink")}


@pytest.mark.parametrize("how", list(ELSEWHERE))
def test_weights_kept_elsewhere_are_never_read(capsys, folder, tmp_path, how):
    make, words = ELSEWHERE[how]
    with h5py.File(folder / MODEL, "a") as f:
        replace(f, "wte", lambda g, k, old: make(tmp_path, g, k, old))
    resign(folder)
    assert any(words in p for p in ckpt.verify(str(folder))), how
    line = ends_with_one_error(capsys, ["ckpt", "export", str(folder), "--out",
                                        str(tmp_path / "out.safetensors")])
    assert MODEL in line and words in line
    assert not (tmp_path / "out.safetensors").exists()


def test_optimizer_state_behind_a_link_to_another_file_is_never_read(folder, tmp_path):
    with h5py.File(folder / OPTIM, "a") as f:
        group, key = a_segment(f)
        replace(group, key, lambda g, k, old: _external_link(tmp_path, g, k, old))
    resign(folder)
    assert any("ExternalLink" in p for p in ckpt.verify(str(folder)))
    with pytest.raises(ckpt.CheckpointError, match="ExternalLink"):
        state_of(folder, key)


def test_a_whole_group_linked_from_another_file_is_never_read(folder, tmp_path):
    with h5py.File(folder / OPTIM, "a") as f:
        key = min(f["exp_avg"])
        f.copy("exp_avg", f, "kept")
        del f["exp_avg"]
    shutil.copy(folder / OPTIM, tmp_path / "outside.h5")
    with h5py.File(folder / OPTIM, "a") as f:
        f["exp_avg"] = h5py.ExternalLink(str(tmp_path / "outside.h5"), "/kept")
    resign(folder)
    assert any("exp_avg is an HDF5 ExternalLink" in p for p in ckpt.verify(str(folder)))
    with pytest.raises(ckpt.CheckpointError, match="ExternalLink"):
        state_of(folder, key)


def test_a_dataset_declaring_more_than_the_file_stores_is_refused(folder):
    """Chunks never written read as the fill value: Adam's moments made up, and a declared
    size far beyond the file would be allocated before any check."""
    with h5py.File(folder / OPTIM, "a") as f:
        group, key = a_segment(f)
        replace(group, key, lambda g, k, old: g.create_dataset(
            k, shape=old.shape, dtype=old.dtype, chunks=old.shape, fillvalue=1e30))
    resign(folder)
    assert any("the file stores 0 of them" in p for p in ckpt.verify(str(folder)))
    with pytest.raises(ckpt.CheckpointError, match="declares .* bytes but the file stores 0"):
        state_of(folder, key)


@pytest.mark.parametrize("kind", ["int32", "strings", "short", "2-d"])
def test_optimizer_state_of_another_type_or_length_is_refused(folder, kind):
    make = {"int32": lambda old: np.ones(old.shape, np.int32),
            "strings": lambda old: np.array([b"1.5"] * old.size, dtype=h5py.string_dtype()),
            "short": lambda old: old[:-1],
            "2-d": lambda old: np.stack([old, old])}[kind]
    with h5py.File(folder / OPTIM, "a") as f:
        group, key = a_segment(f)
        replace(group, key, lambda g, k, old: g.create_dataset(k, data=make(old)))
    resign(folder)
    with pytest.raises(ckpt.CheckpointError, match=f"{OPTIM}: exp_avg/{key} is .*floats"):
        state_of(folder, key)


def test_a_tensor_left_without_optimizer_state_is_refused(folder):
    """The others keep theirs: silently starting this one's Adam from zero (with the
    others' step count) is never what a resume should do."""
    resign(folder, lambda m: m["pieces"].__setitem__("wte", []))
    reader = Reader(str(folder), ckpt.read_manifest(str(folder)))
    try:
        with pytest.raises(ckpt.CheckpointError, match="none for wte"):
            reader.state("exp_avg", "wte", (0, 16))
    finally:
        reader.close()


@pytest.mark.parametrize("where", ["dataset dtype", "file"])
def test_an_attribute_of_the_wrong_type_is_one_error(capsys, folder, tmp_path, where):
    with h5py.File(folder / MODEL, "a") as f:
        if where == "file":
            f.attrs["file"] = np.array([1, 2])
        else:
            f["wte"].attrs["dtype"] = np.array([1, 2, 3])
    resign(folder)
    line = ends_with_one_error(capsys, ["ckpt", "export", str(folder), "--out",
                                        str(tmp_path / "out.h5")])
    assert MODEL in line and "not a string" in line


def test_a_group_where_a_tensor_belongs_is_one_error(capsys, folder, tmp_path):
    with h5py.File(folder / MODEL, "a") as f:
        del f["wte"]
        f.create_group("wte")
    resign(folder)
    line = ends_with_one_error(capsys, ["ckpt", "export", str(folder), "--out",
                                        str(tmp_path / "out.h5")])
    assert "wte is an HDF5 Group, not a dataset" in line


def test_info_counts_the_parameters_of_a_huge_declared_shape_exactly(capsys, folder):
    """An edited manifest may declare any shape; the count it prints is still exact (not
    wrapped around 64 bits)."""
    def huge(m):
        m["model"]["vocab_size"] = 2**62
        m["tensors"]["wte"]["shape"][0] = 2**62

    manifest = resign(folder, huge)
    assert ckpt.read_manifest(str(folder))  # consistent in itself
    from hpcpipe.__main__ import main

    assert main(["ckpt", "info", str(folder)]) == 0
    params = sum(math.prod(t["shape"]) for t in manifest["tensors"].values())
    assert f"{params:,} parameters" in capsys.readouterr().out


@pytest.mark.parametrize("signature, words", [(b"HEAP", "bad local heap signature"),
                                               (b"GCOL", "bad global heap collection")])
def test_a_file_whose_hdf5_structures_are_damaged_is_one_error_naming_it(
        capsys, folder, tmp_path, signature, words):
    """HDF5's own structures broken (one signature overwritten), the digests made to match:
    h5py raises RuntimeError or KeyError, or an OSError that names no file; `verify`
    said so, while export and generate (which read the weights alone) ended in a
    traceback or a line without the file's name."""
    data = (folder / MODEL).read_bytes()
    assert data.count(signature) == 1
    (folder / MODEL).write_bytes(data.replace(signature, b"XXXX"))
    resign(folder)
    assert any(words in p for p in ckpt.verify(str(folder)))
    for argv in (["ckpt", "export", str(folder), "--out", str(tmp_path / "out.h5")],
                 ["generate", str(folder), "--tokens", "1", "--prompt", "a"]):
        line = ends_with_one_error(capsys, argv)
        assert f"{folder}: unreadable checkpoint" in line and words in line, line
    assert not (tmp_path / "out.h5").exists()
