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
