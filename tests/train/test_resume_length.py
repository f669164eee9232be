"""A resume that changes train.steps says so: the learning rate's decay is laid out over
train.steps, so the run from there is another run's (hpcpipe/train/resume.py)."""

from dataclasses import replace

from hpcpipe import config
from hpcpipe.train.resume import changed_length, resume_notes


def manifest_of(steps: int) -> dict:
    cfg = config.Config()
    return {"config": replace(cfg, train=replace(cfg.train, steps=steps)).to_toml()}


def test_a_resume_to_another_length_says_what_changes():
    line = changed_length(manifest_of(300), 500, "runs/x/checkpoints/step_00000300")
    assert line == ("runs/x/checkpoints/step_00000300: train.steps = 500, where the run that "
                    "wrote it had 300: the learning rate now decays to step 500, so the steps "
                    "from here differ from that run's")


def test_a_resume_to_the_same_length_says_nothing():
    assert changed_length(manifest_of(300), 300, "ckpt") is None
    assert changed_length({"config": "not = [toml"}, 300, "ckpt") is None


def test_the_notes_of_a_resume_say_the_length_and_whether_anything_is_left():
    assert resume_notes(manifest_of(300), 120, 300, "ckpt") == []
    longer = resume_notes(manifest_of(300), 300, 500, "ckpt")
    assert len(longer) == 1 and "train.steps = 500" in longer[0]
    assert resume_notes(manifest_of(300), 300, 300, "ckpt") == [
        "the checkpoint is at step 300, train.steps = 300: nothing to do"]


def test_imported_weights_were_no_run_so_a_resume_from_them_says_nothing_of_one(tmp_path):
    """`ckpt import-hf` / `import-gguf` write the defaults' train.steps (300) and no data:
    fine-tuning from them (docs/guides/llama.md) said 'the run that wrote it had 300' and
    'written before hpcpipe did' — of a checkpoint no run wrote, by an hpcpipe that did."""
    from hpcpipe.train.resume import check_same_data

    imported = {**manifest_of(300), "source": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert resume_notes(imported, 0, 40, "ckpt") == []
    said = []
    check_same_data(imported, {"name": "notes"}, False, False, "ckpt", said.append)
    assert said == []
    check_same_data(manifest_of(300), {"name": "notes"}, False, False, "ckpt", said.append)
    assert "does not record its training data" in said[0]  # a run's, from before it did


def test_a_resume_onto_another_seed_or_global_batch_says_its_windows_differ(tmp_path):
    """Resuming with another train.seed (or another dp × microbatches × micro_batch_size)
    drew other windows than the run that wrote the checkpoint, without a word: the run
    then read as one run, its val loss compared across other windows."""
    from mpi4py import MPI

    from hpcpipe.train.trainer import train

    corpus = tmp_path / "notes.txt"
    corpus.write_text("a user's own notes, some words to learn from\n" * 300)
    base = ["model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=16",
            "train.micro_batch_size=2", "train.eval_batches=1", "train.eval_every=0",
            "train.steps=2", "checkpoint.every=1", "parallel.microbatches=2",
            f'data.corpus="{corpus}"', f'data.path="{tmp_path / "t.h5"}"']
    run_dir, quiet = str(tmp_path / "run"), lambda *_: None
    train(config.load("inputs/tiny.toml", base), run_dir, MPI.COMM_SELF, out=quiet)
    same, other = [], []
    train(config.load("inputs/tiny.toml", base + ["train.steps=3"]), run_dir,
          MPI.COMM_SELF, out=same.append, resume="")
    assert not any("windows" in line for line in same)
    train(config.load("inputs/tiny.toml", base + ["train.steps=4", "train.seed=7",
                                                  "train.micro_batch_size=1"]),
          run_dir, MPI.COMM_SELF, out=other.append, resume="")
    said = [line for line in other if "windows from here" in line]
    assert len(said) == 2, other
    assert "train.seed = 7, where the run that wrote it had 0" in said[0]
    assert "2 sequences a step" in said[1] and "had 4" in said[1]
