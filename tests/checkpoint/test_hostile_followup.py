"""More checkpoints edited or damaged by someone else (the manifest re-signed to match, as
test_hostile_hdf5's `resign` does): a link to nothing inside a checkpoint or its
checkpoints/ folder (`ckpt ls` lists the rest and names it), counters such as adam_step
at 2**63 - 1 or a loss scale of 0 (refused when the manifest is read, before a resume
trains), a recorded config nested too deep for tomllib (read past), and weights or Adam
moments that are NaN, infinite or — for the second moment — negative (refused by export
and resume, naming the file and tensor), special token ids past the vocabulary, a
carried tokenizer.json that is none (refused by export), a step record of text. Each is one readable error or a listing, never a
traceback, and the checkpoint is left as it was."""

import os
import shutil

import h5py
import numpy as np
import pytest
from harness.hostile import ends_with_one_error, small_config, snapshot, train_args
from mpi4py import MPI
from test_hostile_hdf5 import MODEL, OPTIM, resign

from hpcpipe import checkpoint as ckpt
from hpcpipe.__main__ import main
from hpcpipe.checkpoint.hdf5 import Reader, read_dataset, store
from hpcpipe.checkpoint.manifest import MANIFEST, MAX_COUNT
from hpcpipe.train.trainer import train

TENSOR = "h.0.attn.c_attn.weight"


def trained(tmp_path_factory, tokens, *extra, steps=1):
    """A small model's checkpoint after `steps` steps (with `extra` overrides)."""
    run = tmp_path_factory.mktemp("followup") / "run"
    cfg = small_config(f"train.steps={steps}", f'data.path="{tokens}"', *extra)
    train(cfg, str(run), MPI.COMM_SELF, out=lambda *_: None)
    return run / "checkpoints" / ckpt.step_name(steps)


@pytest.fixture(scope="module")
def original(tmp_path_factory, stdlib_tokens):
    return trained(tmp_path_factory, stdlib_tokens)


def copied(checkpoint, tmp_path):
    """A run directory holding a copy of `checkpoint` (its folder: run / CKPT)."""
    shutil.copytree(checkpoint, tmp_path / "run" / "checkpoints" / checkpoint.name)
    return tmp_path / "run"


@pytest.fixture
def run(original, tmp_path):
    return copied(original, tmp_path)


CKPT = os.path.join("checkpoints", ckpt.step_name(1))


def poison(file, key, values, where=slice(0, 3)):
    """Dataset `key` of the HDF5 file with elements `where` of its flat data set to
    `values`, stored as hpcpipe stores it (checksum, attributes kept)."""
    with h5py.File(file, "a") as f:
        old, attrs = read_dataset(f[key], str(file)), dict(f[key].attrs)  # bfloat16 too
        del f[key]
        data = old.reshape(-1).copy()
        data[where] = values
        store(f, key, data.reshape(old.shape), **{k: v for k, v in attrs.items()
                                                   if k != "dtype"})


# -- ckpt ls: a link to nothing ----------------------------------------------------------

def test_ls_lists_a_checkpoint_holding_a_link_to_nothing_and_names_it(capsys, run):
    os.symlink("/nonexistent/model-pp001.h5", run / CKPT / "model-pp001.h5")
    assert main(["ckpt", "ls", str(run)]) == 0
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if "<- latest" in line]
    assert line.split()[0] == ckpt.step_name(1) and "MiB" in line
    assert "model-pp001.h5: a link to '/nonexistent/model-pp001.h5', which leads " \
           "nowhere; not counted" in out


def test_ls_names_a_link_to_nothing_in_the_checkpoints_folder(capsys, run):
    os.symlink("/nonexistent", run / "checkpoints" / ckpt.step_name(7))
    assert main(["ckpt", "ls", str(run)]) == 0
    out = capsys.readouterr().out
    assert "1 checkpoint(s)" in out and "<- latest" in out
    assert f"  {ckpt.step_name(7)}  (a link to '/nonexistent', which leads nowhere; " \
           f"ignored)" in out


def test_ls_of_a_run_whose_checkpoints_folder_is_a_link_to_nothing_is_one_error(
        capsys, tmp_path):
    (tmp_path / "run").mkdir()
    os.symlink(tmp_path / "gone", tmp_path / "run" / "checkpoints")
    line = ends_with_one_error(capsys, ["ckpt", "ls", str(tmp_path / "run")])
    assert "checkpoints: a link to" in line and "which leads nowhere" in line


def test_ls_of_one_checkpoint_says_what_to_give_never_zero_checkpoints(capsys, run):
    # it printed "RUN/checkpoints/step_00000001: 0 checkpoint(s)" and status 0
    line = ends_with_one_error(capsys, ["ckpt", "ls", str(run / CKPT)])
    assert "is one checkpoint" in line and "ckpt info" in line


# -- terminal escapes in a manifest's text -----------------------------------------------

ESCAPES = "\x1b[2J\x1b[31m\r\x07\u202e"  # clear, red, back to column 0, bell, right-to-left


def test_info_shows_a_manifest_s_control_characters_escaped(capsys, run):
    """A manifest re-signed with terminal escapes in its free text (the schedule's name,
    the state's optimizer and an extra state entry, key and value): `ckpt info` prints
    them as visible escapes, never as the bytes that would clear or recolour the
    terminal."""
    def edit(m):
        m["layout"]["schedule"] = "1f1b" + ESCAPES
        m["state"]["optimizer"] = "adamw\x1b[5m"
        m["state"]["note" + ESCAPES] = "x" + ESCAPES
    resign(run / CKPT, edit)
    assert main(["ckpt", "info", str(run)]) == 0
    out = capsys.readouterr().out
    assert not any(ch in out for ch in "\x1b\r\x07\u202e"), repr(out)
    assert "schedule 1f1b\\x1b[2J\\x1b[31m\\r\\x07\\u202e," in out
    assert "optimizer adamw\\x1b[5m" in out and "note\\x1b[2J" in out


def test_ls_shows_control_characters_in_names_escaped(capsys, run):
    """A name in the checkpoints/ folder with escapes (an unfinished save's .tmp, listed
    by `ckpt ls`) is printed escaped."""
    (run / "checkpoints" / ("step_00000002\x1b[2J.tmp")).mkdir()
    assert main(["ckpt", "ls", str(run)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "step_00000002\\x1b[2J.tmp  (incomplete" in out


# -- counters near 2**63 -----------------------------------------------------------------

def _set(field, value):
    def edit(m):
        part, key = (m["state"], field[6:]) if field.startswith("state.") else (m, field)
        part[key] = value
    return edit


COUNTERS = ["step", "adam_step", "state.good_steps", "state.lr_step", "state.data_step"]


def at_step(run, step: int):
    """The checkpoint renamed for `step` (a folder's name must match its manifest's)."""
    folder = run / "checkpoints" / ckpt.step_name(step)
    os.replace(run / CKPT, folder)
    return folder


@pytest.mark.parametrize("field", COUNTERS)
def test_a_counter_past_what_any_run_reaches_is_refused_naming_it(run, field):
    folder = at_step(run, 2**63 - 1) if field == "step" else run / CKPT
    resign(folder, _set(field, 2**63 - 1))
    with pytest.raises(ckpt.CheckpointError, match=rf"{MANIFEST}: {field} = "
                       rf"9223372036854775807: must be an integer from 0 to {MAX_COUNT}"):
        ckpt.read_manifest(str(folder))


@pytest.mark.parametrize("field", COUNTERS)
def test_a_counter_at_the_bound_is_still_accepted(run, field):
    folder = at_step(run, MAX_COUNT) if field == "step" else run / CKPT
    resign(folder, _set(field, MAX_COUNT))
    assert ckpt.read_manifest(str(folder))


def test_a_resume_from_adam_step_2_63_refuses_before_training(capsys, run, tmp_path,
                                                                stdlib_tokens):
    """It used to resume, train, and fail at the end when the next checkpoint's adam_step
    no longer fitted the manifest."""
    resign(run / CKPT, _set("adam_step", 2**63 - 1))
    before = snapshot(run)
    line = ends_with_one_error(capsys, train_args(tmp_path / "next", stdlib_tokens,
                                                  "train.steps=3")
                               + ["--resume", str(run / CKPT)])
    assert "adam_step = 9223372036854775807" in line
    assert snapshot(run) == before
    assert not (tmp_path / "next" / "checkpoints").exists()



def test_a_resume_from_a_loss_scale_of_0_refuses_before_training(capsys, run, tmp_path,
                                                                  stdlib_tokens):
    """No run writes a loss scale of 0 (a fixed one is positive, a dynamic one at least
    1); resumed, it divided the gradients by 0: a ZeroDivisionError's traceback at the
    first step."""
    resign(run / CKPT, _set("state.loss_scale", 0.0))
    before = snapshot(run)
    line = ends_with_one_error(capsys, train_args(tmp_path / "next", stdlib_tokens,
                                                  "train.steps=3")
                               + ["--resume", str(run / CKPT)])
    assert "state.loss_scale = 0.0: must be a finite number, above 0" in line, line
    assert snapshot(run) == before


def test_a_resume_reads_past_a_recorded_config_nested_too_deep(capsys, run, tmp_path,
                                                               stdlib_tokens):
    """The manifest's config text is only read for the note on a changed train.steps; TOML
    nested thousands deep made tomllib's RecursionError a traceback instead of no note."""
    resign(run / CKPT, lambda m: m.__setitem__("config", "a = " + "[" * 5000 + "]" * 5000))
    assert main(train_args(tmp_path / "next", stdlib_tokens, "train.steps=2")
                + ["--resume", str(run / CKPT)]) == 0
    assert "Traceback" not in capsys.readouterr().err

# -- NaN, infinities, negative second moments ---------------------------------------------

@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_export_refuses_weights_that_are_not_finite(capsys, run, tmp_path, value):
    poison(run / CKPT / MODEL, TENSOR, value)
    resign(run / CKPT)
    out = tmp_path / "hf" / "model.safetensors"
    line = ends_with_one_error(capsys, ["ckpt", "export", str(run), "--out", str(out)])
    assert MODEL in line and f"tensor {TENSOR} holds 3 NaN or infinite value(s)" in line
    assert not out.exists() and not (tmp_path / "hf" / "config.json").exists()


def resume(capsys, folder, tmp_path, tokens, *extra) -> str:
    """The error line of a resume from the checkpoint `folder` (which must stay as it was)."""
    before = snapshot(folder)
    line = ends_with_one_error(capsys, train_args(tmp_path / "next", tokens,
                                                  "train.steps=4", *extra)
                               + ["--resume", str(folder)])
    assert snapshot(folder) == before
    return line


def segment(folder, kind="exp_avg_sq") -> str:
    with h5py.File(folder / OPTIM, "r") as f:
        return f"{kind}/{min(f[kind])}"


@pytest.mark.parametrize("kind, value, words", [
    ("exp_avg", np.nan, "3 NaN or infinite"), ("exp_avg_sq", np.inf, "3 NaN or infinite"),
    ("exp_avg_sq", -1.0, "3 negative value(s)")])
def test_a_resume_refuses_adam_moments_that_cannot_be(capsys, run, tmp_path, stdlib_tokens,
                                                      kind, value, words):
    key = segment(run / CKPT, kind)
    poison(run / CKPT / OPTIM, key, value)
    resign(run / CKPT)
    line = resume(capsys, run / CKPT, tmp_path, stdlib_tokens)
    assert OPTIM in line and f"{key} holds {words}" in line


def test_a_negative_zero_second_moment_is_not_negative(run):
    key = segment(run / CKPT)
    poison(run / CKPT / OPTIM, key, -0.0)
    resign(run / CKPT)
    name, start = key.split("/")[1].split("@")
    manifest = ckpt.read_manifest(str(run / CKPT))
    piece = next(p for p in manifest["pieces"][name] if p["start"] == int(start))
    reader = Reader(str(run / CKPT), manifest)
    try:
        assert reader.state("exp_avg_sq", name, (piece["start"], piece["stop"]))[0] == 0
    finally:
        reader.close()


def test_a_resume_refuses_weights_that_are_not_finite(capsys, run, tmp_path, stdlib_tokens):
    poison(run / CKPT / MODEL, TENSOR, np.nan, slice(5, 6))
    resign(run / CKPT)
    line = resume(capsys, run / CKPT, tmp_path, stdlib_tokens)
    assert MODEL in line and f"tensor {TENSOR} holds 1 NaN or infinite value(s)" in line


BF16 = ('train.dtype="bfloat16"',)


@pytest.mark.parametrize("extra, file, key, value, words", [
    (("outer.local_steps=2",), "local-r00000.h5", "exp_avg_sq/0", -2.0, "negative"),
    (("outer.local_steps=2",), "local-r00000.h5", "weights/0", np.nan, "NaN or infinite"),
    (('parallel.schedule="pipedream-2bw"',), "versions-pp000.h5", "previous/0", np.inf,
     "NaN or infinite"),
    (BF16, OPTIM, "master", np.nan, "NaN or infinite"),
    (BF16, MODEL, TENSOR, np.inf, "NaN or infinite")])
def test_other_state_a_resume_reads_is_checked_too(capsys, tmp_path_factory, tmp_path,
                                                  stdlib_tokens, extra, file, key, value,
                                                  words):
    """Local SGD's per-replica weights and moments, the asynchronous pipeline's previous
    weight version, a 16-bit run's bfloat16 weights and float32 master copy."""
    folder = copied(trained(tmp_path_factory, stdlib_tokens, *extra, steps=2), tmp_path) \
        / "checkpoints" / ckpt.step_name(2)
    key = segment(folder, key) if key == "master" else key
    poison(folder / file, key, value)
    resign(folder)
    line = resume(capsys, folder, tmp_path, stdlib_tokens, *extra)
    assert file in line and f"{key} holds 3 {words}" in line


def test_export_refuses_bfloat16_weights_that_are_not_finite(capsys, tmp_path_factory,
                                                             tmp_path, stdlib_tokens):
    folder = copied(trained(tmp_path_factory, stdlib_tokens, *BF16), tmp_path) / CKPT
    poison(folder / MODEL, "wpe", np.nan, slice(0, 2))
    resign(folder)
    line = ends_with_one_error(capsys, ["ckpt", "export", str(folder), "--out",
                                        str(tmp_path / "out.h5")])
    assert MODEL in line and "tensor wpe holds 2 NaN or infinite value(s)" in line
    assert not (tmp_path / "out.h5").exists()


# -- special token ids past the vocabulary -----------------------------------------------

@pytest.mark.parametrize("record, ids", [("source_model", 300), ("source_model", [0, 2**40]),
                                         ("tokenizer", 256)])
def test_a_special_token_id_past_the_vocabulary_is_refused(capsys, run, tmp_path, record,
                                                           ids):
    """A manifest re-signed with eos_token_id 300 for a vocabulary of 256 was read, and an
    export wrote that id into config.json: an id no logit is for, so generate on the
    export never stops. It is refused when the manifest is read, naming it."""
    def edit(m):
        m[record] = {"eos_token_id": ids}
        if record == "tokenizer":  # (its file must be among the manifest's)
            (run / CKPT / "tokenizer.json").write_text("{}")
            m["tokenizer"]["file"] = "tokenizer.json"
            m["files"]["tokenizer.json"] = {}
    resign(run / CKPT, edit)
    before = snapshot(run)
    for argv in (["ckpt", "info", str(run)],
                 ["ckpt", "export", str(run), "--out", str(tmp_path / "hf"), "--format", "hf"]):
        line = ends_with_one_error(capsys, argv)
        assert f"{record}.eos_token_id = {ids}: past the model's vocabulary of 256" in line, \
            line
    assert snapshot(run) == before
    assert not os.path.exists(tmp_path / "hf") or not os.listdir(tmp_path / "hf")


# -- a carried tokenizer.json that is none ------------------------------------------------

@pytest.mark.parametrize("text, words", [
    ("[]", "is not a tokenizer.json the tokenizers package reads"),
    (" " * (65 << 20), "is too large for a tokenizer.json"),
    (None, "1,000 tokens, more than the model's vocabulary of 260")],
    ids=["not a tokenizer", "65 MiB", "another vocabulary"])
def test_export_refuses_a_carried_tokenizer_json_that_is_none(capsys, tmp_path, text, words):
    """An imported Llama's tokenizer.json replaced (and the manifest re-signed) by text no
    tokenizer reads, 65 MiB, or a tokenizer of 1,000 tokens for a vocabulary of 260:
    `generate` refused it, but `ckpt export --format hf` copied it into the folder it
    wrote, whole (read into memory however large), for transformers to fail on."""
    from harness import required
    from harness.tokenfiles import write_tokenizer_json

    from hpcpipe import Llama

    try:
        import tokenizers  # noqa: F401
    except ImportError:
        required.missing("hf", "Hugging Face's tokenizers is not installed")
    cfg = small_config('model.arch="llama"', "model.n_kv_head=1", "model.n_layer=1",
                       "model.vocab_size=260")
    folder = tmp_path / "ckpt"
    ckpt.write_weights(str(folder), ckpt.Origin(cfg.to_toml(), cfg.model, "float32"),
                       {n: np.asarray(v) for n, v in Llama(cfg.model).params.items()},
                       tokenizer=write_tokenizer_json(tmp_path / "t.json", 259).read_bytes())
    if text is None:
        write_tokenizer_json(folder / "tokenizer.json", 1000)
    else:
        (folder / "tokenizer.json").write_text(text)
    resign(folder)
    before = snapshot(folder)
    line = ends_with_one_error(capsys, ["ckpt", "export", str(folder), "--out",
                                        str(tmp_path / "hf"), "--format", "hf"])
    assert str(folder / "tokenizer.json") in line and words in line, line
    assert snapshot(folder) == before
    assert not (tmp_path / "hf").exists()  # the folder it made is gone: a retry finds none


@pytest.mark.parametrize("out", ["new/deeper", "there"])
def test_a_failed_export_leaves_no_folder_it_made(capsys, tmp_path, out):
    """A damaged shard: the export failed, and left the --out folder (and those above it)
    it had made, empty, for a retry to meet. A folder that was there is kept."""
    from hpcpipe import GPT

    cfg = small_config("model.n_layer=1", "model.vocab_size=16")
    folder = tmp_path / "ckpt"
    ckpt.write_weights(str(folder), ckpt.Origin(cfg.to_toml(), cfg.model, "float32"),
                       {n: np.asarray(v) for n, v in GPT(cfg.model).params.items()})
    shard = folder / "model-pp000.h5"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    (tmp_path / "there").mkdir()
    for fmt in ([], ["--format", "hf"]):
        target = tmp_path / out / ("" if fmt else "model.safetensors")
        line = ends_with_one_error(capsys, ["ckpt", "export", str(folder), "--out",
                                            str(target), *fmt])
        assert "model-pp000.h5" in line, line
        assert sorted(os.listdir(tmp_path)) == ["ckpt", "there"]
        assert os.listdir(tmp_path / "there") == []
    assert not os.path.exists(tmp_path / "hf") or not os.listdir(tmp_path / "hf")


def test_a_step_record_of_text_is_named_as_text(capsys, run):
    """A state file whose step record is the text "1" was refused as `attribute step = 1,
    not an integer`: a 1 is what the checkpoint's step is, so the message read as wrong."""
    with h5py.File(run / CKPT / "model-pp000.h5", "a") as f:
        f.attrs["step"] = "1"
    resign(run / CKPT)
    line = ends_with_one_error(capsys, ["ckpt", "export", str(run), "--out",
                                        str(run.parent / "out.h5")])
    assert "model-pp000.h5: attribute step = '1', not an integer" in line, line
