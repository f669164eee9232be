"""Config loading: defaults, overrides, and one test per kind of bad input, each checking
that the message names the file, the key, the value and what is allowed."""

import textwrap
import tomllib

import numpy as np
import pytest

from hpcpipe import config
from hpcpipe.config import Config, ConfigError


def write(tmp_path, text, name="run.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def error_of(tmp_path, text, overrides=()):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        config.load(path, overrides)
    return path, str(info.value)


def test_shipped_configs_load():
    tiny = config.load("inputs/tiny.toml")
    assert tiny.model.n_layer == 4 and tiny.data.corpus == "stdlib"
    gpt2 = config.load("inputs/gpt2-124m.toml")
    assert (gpt2.model.n_layer, gpt2.model.n_embd, gpt2.model.block_size) == (12, 768, 1024)


def test_gpt2_small_is_gpt2_small_on_any_launch():
    from hpcpipe.model import param_layout
    from hpcpipe.schedules import check, generate

    gpt2 = config.load("inputs/gpt2-124m.toml")
    model = gpt2.model
    assert (model.vocab_size, model.padded_vocab) == (50257, 50304)
    params = sum(int(np.prod(shape)) for _, shape in param_layout(model))
    assert params == 124_439_808 + 47 * 768  # GPT-2 small's, plus the masked padding rows
    for world in (1, 2, 4, 8):  # the README's sbatch line on a node of any of these
        resolved = config.for_world(gpt2, world)
        assert resolved.parallel.dp == world and resolved.tokens_per_step == 64 * 1024
    zb = config.load("inputs/gpt2-124m-zb-8gpu.toml")
    node = config.for_world(zb, 8)
    p, m = node.parallel.pp, node.parallel.microbatches
    assert (node.parallel.dp, p, node.parallel.schedule, m) == (2, 4, "zb-v", 8) and m >= 2 * p
    assert node.checkpoint.every > 0 and node.checkpoint.every_minutes > 0
    check(generate("zb-v", p, m))


def test_defaults_fill_missing_keys(tmp_path):
    cfg = config.load(write(tmp_path, "[model]\nn_layer = 2\n"))
    assert cfg.model.n_layer == 2 and cfg.model.n_embd == Config().model.n_embd
    assert cfg.train == Config().train


def test_integers_are_accepted_where_numbers_go(tmp_path):
    cfg = config.load(write(tmp_path, "[train]\nlr = 1\nmin_lr = 0\n"))
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)


def test_overrides(tmp_path):
    path = write(tmp_path, "[train]\nsteps = 10\n")
    cfg = config.load(path, ["train.steps=3", "optim.lr=1e-4", "optim.min_lr=0",
                             'data.corpus="notes.txt"',
                             "train.dtype=float64"])
    assert cfg.train.steps == 3 and cfg.optim.lr == 1e-4
    assert cfg.data.corpus == "notes.txt" and cfg.train.dtype == "float64"


def test_resolved_toml_round_trips(tmp_path):
    cfg = config.load("inputs/tiny.toml", ["optim.lr=0.1", "optim.min_lr=0.01"])
    again = config.load(write(tmp_path, cfg.to_toml()))
    assert (again.model, again.train, again.data, again.parallel) == \
        (cfg.model, cfg.train, cfg.data, cfg.parallel)


def test_unknown_key(tmp_path):
    path, msg = error_of(tmp_path, "[train]\nstep = 10\n")
    assert path in msg and "train.step" in msg and "unknown key" in msg and "steps" in msg


def test_unknown_section(tmp_path):
    path, msg = error_of(tmp_path, "[optimizer]\nlr = 1\n")
    assert path in msg and "optimizer" in msg and "(did you mean optim?)" in msg
    assert "known sections: model, train, optim, outer, pipedream, data, parallel" in msg


def test_wrong_type(tmp_path):
    path, msg = error_of(tmp_path, '[model]\nn_layer = "four"\n')
    assert path in msg and "model.n_layer = 'four'" in msg and "must be an integer" in msg


def test_bool_is_not_an_integer(tmp_path):
    _, msg = error_of(tmp_path, "[train]\nsteps = true\n")
    assert "train.steps = True" in msg and "must be an integer" in msg


def test_float_where_integer_goes(tmp_path):
    _, msg = error_of(tmp_path, "[train]\nmicro_batch_size = 2.5\n")
    assert "train.micro_batch_size = 2.5" in msg and "integer" in msg


def test_heads_must_divide_channels(tmp_path):
    path, msg = error_of(tmp_path, "[model]\nn_embd = 130\nn_head = 4\n")
    assert path in msg and "model.n_embd = 130" in msg and "divisible by model.n_head = 4" in msg


@pytest.mark.parametrize("text, words", [
    ('arch = "bert"', ["model.arch = 'bert'", "allowed: gpt2, llama"]),
    ("n_kv_head = 2", ["model.n_kv_head = 2", 'belongs to model.arch = "llama"']),
    ("tie_word_embeddings = false", ["model.tie_word_embeddings = False", "GPT-2 takes true"]),
    ('arch = "llama"\nn_kv_head = 3', ["model.n_kv_head = 3", "must divide model.n_head = 4"]),
    ('arch = "llama"\nn_head = 8\nn_embd = 24', ["model.n_head = 8", "heads of 3 channels"]),
    ('arch = "llama"\nrope_theta = 0', ["model.rope_theta = 0", "positive number"]),
])
def test_the_family_keys_are_checked_naming_the_key(tmp_path, text, words):
    path, msg = error_of(tmp_path, f"[model]\n{text}\n")
    assert path in msg and all(w in msg for w in words), msg


def test_a_llama_config_loads_and_writes_back(tmp_path):
    cfg = config.from_dict({"model": {"arch": "llama", "n_kv_head": 2, "rope_theta": 100000,
                                      "intermediate_size": 320,
                                      "tie_word_embeddings": False}})
    assert cfg.model.kv_heads == 2 and cfg.model.rope_theta == 100000.0
    path = tmp_path / "again.toml"
    path.write_text(cfg.to_toml())
    assert config.load(str(path)).model == cfg.model


def test_non_positive_value(tmp_path):
    _, msg = error_of(tmp_path, "[train]\nsteps = 0\n")
    assert "train.steps = 0" in msg and "at least 1" in msg


def test_value_not_in_allowed_set(tmp_path):
    _, msg = error_of(tmp_path, '[train]\ndtype = "half"\n')
    assert "train.dtype = 'half'" in msg and "allowed: float32, float64, bfloat16, float16" in msg
    _, msg = error_of(tmp_path, '[parallel]\nschedule = "zb-h3"\n')
    assert "parallel.schedule = 'zb-h3'" in msg and "zb-h1" in msg and "auto" in msg


def test_min_lr_above_lr(tmp_path):
    _, msg = error_of(tmp_path, "[train]\nlr = 1e-3\nmin_lr = 1e-2\n")
    assert "optim.min_lr = 0.01" in msg and "between 0 and optim.lr" in msg


def test_data_parallel_settings(tmp_path):
    _, msg = error_of(tmp_path, "[parallel]\ndp = -1\n")
    assert "parallel.dp = -1" in msg and '0 or "auto"' in msg
    _, msg = error_of(tmp_path, '[parallel]\ndp = "four"\n')
    assert "parallel.dp = 'four'" in msg
    _, msg = error_of(tmp_path, "[parallel]\nzero = 4\n")
    assert "parallel.zero = 4" in msg and "allowed: 0 (off), 1" in msg
    assert "or 3 (and the weights between steps)" in msg
    assert config.from_dict({"parallel": {"dp": 2, "zero": 3}}).parallel.zero == 3
    _, msg = error_of(tmp_path, '[parallel]\ngrad_comm_dtype = "float16"\n')
    assert "allowed: auto, float32, bfloat16" in msg


def test_dp_auto_takes_the_world_and_keeps_the_global_batch(tmp_path):
    # dp = "auto" (or 0) is world ÷ (pp × tp); global_batch_size fixes the step's batch
    # whatever dp comes out, as Megatron's --global-batch-size does.
    text = ('[model]\nn_layer = 4\n[train]\nmicro_batch_size = 2\nglobal_batch_size = 16\n'
            '[parallel]\ndp = "auto"\npp = 2\ntp = 2\n')
    cfg = config.load(write(tmp_path, text))
    assert cfg.parallel.dp == 0 and config.load(write(tmp_path, cfg.to_toml())) == cfg
    for world, dp, microbatches in ((4, 1, 8), (8, 2, 4), (16, 4, 2)):
        resolved = config.for_world(cfg, world)
        assert (resolved.parallel.dp, resolved.parallel.microbatches) == (dp, microbatches)
        assert resolved.tokens_per_step == 16 * cfg.model.block_size
    fixed = config.for_world(config.load(write(tmp_path, "[parallel]\ndp = 2\n")), 5)
    assert fixed.parallel.dp == 2  # a count the world lacks is the grid's to refuse
    with pytest.raises(ConfigError) as info:
        config.for_world(cfg, 6)
    assert "6 ranks" in str(info.value) and "2 × 2 = 4" in str(info.value)
    with pytest.raises(ConfigError) as info:
        config.for_world(cfg, 12)  # dp 3: 16 sequences do not split into 3 × 2
    assert "train.global_batch_size = 16" in str(info.value) and "3 × 2 = 6" in str(info.value)


def test_a_layout_is_read_checked_and_written_back_in_its_printed_form(tmp_path):
    # "auto" is "" (the blocks placed by cost); a given layout comes back spelt out, so the
    # resolved config.toml reads as the plan prints it.
    text = '[model]\nn_layer = 6\n[parallel]\npp = 2\nlayout = "auto"\n'
    cfg = config.load(write(tmp_path, text))
    assert cfg.parallel.layout == "" and cfg.notes == ()
    assert config.load(write(tmp_path, cfg.to_toml())) == cfg
    cfg = config.from_dict({"parallel": {"layout": "Ett t.attn|.mlp t*3L", "pp": 2},
                            "model": {"n_layer": 6}})
    assert cfg.parallel.layout == "E t t t.attn | .mlp t t t L"
    assert config.load(write(tmp_path, cfg.to_toml())).parallel.layout == cfg.parallel.layout
    _, msg = error_of(tmp_path, '[parallel]\nlayout = "E t | x L"\n')
    assert "parallel.layout = 'E t | x L'" in msg and "'x' is no item of a layout" in msg


def test_the_old_counts_still_load_as_a_layout_and_retired_keys_say_what_replaced_them(
        tmp_path):
    """parallel.layers_per_stage (whole blocks, as old configs and the config.toml of old
    runs give it) maps to parallel.layout with one line saying so; fractional counts (a
    seam was 0.5, later sixths and widths) and parallel.split_widths are refused, each
    with one message naming what replaced them."""
    cfg = config.load(write(tmp_path, "[model]\nn_layer = 4\n[parallel]\npp = 2\n"
                                      "layers_per_stage = [1, 3]\n"))
    assert cfg.parallel.layout == "E t | t t t L"
    assert cfg.notes == ('parallel.layers_per_stage = [1, 3] is now parallel.layout = '
                         '"E t | t t t L"',)
    assert config.load(write(tmp_path, "[parallel]\nlayers_per_stage = []\n")).notes[0] \
        .startswith("parallel.layers_per_stage is now parallel.layout")
    _, msg = error_of(tmp_path, "[model]\nn_layer = 4\n[parallel]\npp = 2\n"
                                "layers_per_stage = [1.5, 2.5]\n")
    assert "fractional counts are retired" in msg \
        and 'parallel.layout = "E t t.attn | .mlp t t L"' in msg
    _, msg = error_of(tmp_path, "[parallel]\npp = 2\nlayers_per_stage = [1.1667, 2.8333]\n")
    assert "parallel.layers_per_stage" in msg and "fractional counts are retired" in msg
    for count in ("inf", "nan"):  # TOML's: refused by name, not a bare OverflowError
        _, msg = error_of(tmp_path, f"[parallel]\npp = 2\nlayers_per_stage = [{count}, 2]\n")
        assert "parallel.layers_per_stage" in msg and "parallel.layout" in msg
    _, msg = error_of(tmp_path, "[parallel]\nsplit_widths = true\n")
    assert "parallel.split_widths = True: is retired" in msg and "t.attn | .mlp" in msg
    # false, its default, is in every run's config.toml of the time: read, with a note
    cfg = config.load(write(tmp_path, "[parallel]\nsplit_widths = false\n"
                                      "layers_per_stage = []\n"))
    assert cfg.notes[0].startswith("parallel.split_widths is retired") and len(cfg.notes) == 2
    _, msg = error_of(tmp_path, '[parallel]\nlayers_per_stage = [2, 2]\nlayout = ""\n')
    assert "give only parallel.layout" in msg


def test_more_stages_than_layers(tmp_path):
    # Four model stages on three blocks: halves (a stage edge at a block's seam) fit them.
    text = "[model]\nn_layer = 3\n[parallel]\npp = 2\nschedule = \"zb-v\"\n"
    assert config.load(write(tmp_path, text)).parallel.pp == 2
    _, msg = error_of(tmp_path, "[model]\nn_layer = 1\n[parallel]\npp = 2\nschedule = \"zb-v\"\n")
    assert "parallel.pp = 2" in msg and "4 model stages" in msg and "n_layer = 1" in msg
    assert "half a transformer block" in msg


def test_a_layout_must_fit(tmp_path):
    _, msg = error_of(tmp_path, '[model]\nn_layer = 4\n[parallel]\npp = 2\n'
                                'layout = "E t | t t L"\n')
    assert "parallel.layout = 'E t | t t L'" in msg and "model.n_layer = 4" in msg
    _, msg = error_of(tmp_path, '[parallel]\npp = 2\nlayout = "E t t t t L"\n')
    assert "has 1 stages, and the schedule runs 2 model stages" in msg
    _, msg = error_of(tmp_path, "[parallel]\nlayout = 3\n")
    assert "must be a string" in msg


def test_chunks_must_suit_the_schedule(tmp_path):
    _, msg = error_of(tmp_path, "[parallel]\nschedule = \"1f1b\"\nchunks = 2\n")
    assert "parallel.chunks = 2" in msg and "interleaved-1f1b" in msg
    _, msg = error_of(tmp_path, "[parallel]\nschedule = \"auto\"\nchunks = 3\n")
    assert "parallel.chunks = 3" in msg and "allowed: 0, 1 or 2" in msg


def test_gpu_aware_setting(tmp_path):
    assert config.load(write(tmp_path, "[parallel]\ngpu_aware_mpi = false\n")) \
        .parallel.gpu_aware_mpi is False
    _, msg = error_of(tmp_path, "[parallel]\ngpu_aware_mpi = \"yes\"\n")
    assert "parallel.gpu_aware_mpi = 'yes'" in msg and '"auto", true, false' in msg


def test_invalid_toml(tmp_path):
    path, msg = error_of(tmp_path, "[model\nn_layer = 2\n")
    assert path in msg and "not valid TOML" in msg


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        config.load(str(tmp_path / "nope.toml"))


def test_bad_override_syntax(tmp_path):
    _, msg = error_of(tmp_path, "", overrides=["steps=3"])
    assert "--set" in msg and "section.key=value" in msg


def test_override_of_unknown_key(tmp_path):
    path, msg = error_of(tmp_path, "", overrides=["train.stpes=3"])
    assert "train.stpes" in msg and "unknown key" in msg and "(with --set)" in msg


def test_local_sgd_keys_and_the_layouts_it_refuses(tmp_path):
    """outer.local_steps is off by default; its keys are checked, and each combination it
    cannot run with is refused with one message naming the key to change."""
    assert Config().outer.local_steps == 0
    cfg = config.from_dict({"outer": {"local_steps": 16, "outer_optimizer": "nesterov",
                                      "outer_lr": 0.7, "outer_comm_dtype": "bfloat16",
                                      "outer_moments": "average"},
                            "parallel": {"dp": 2, "pp": 2, "tp": 2}})
    assert cfg.outer.local_steps == 16
    for text, words in [
            ("[train]\nlocal_steps = -1\n", "must be 0 or more"),
            ('[train]\nlocal_steps = 4\nouter_optimizer = "adam"\n', "allowed: average, nesterov"),
            ("[train]\nlocal_steps = 4\nouter_lr = 0\n", "must be in (0, 2]"),
            ("[train]\nlocal_steps = 4\nouter_momentum = 1\n", "must be in [0, 1)"),
            ('[train]\nouter_comm_dtype = "float16"\n', "allowed: auto, float32, bfloat16"),
            ('[train]\nouter_moments = "sum"\n', "allowed: local, average"),
            ("[train]\nlocal_steps = 4\n[parallel]\nzero = 1\n", "set parallel.zero = 0"),
            ("[train]\nlocal_steps = 4\npost_validation = true\n",
             "set train.post_validation = false"),
            ('[train]\nlocal_steps = 4\ndtype = "float16"\n', "a fixed train.loss_scale")]:
        _, msg = error_of(tmp_path, text)
        assert words in msg, (text, msg)
    config.from_dict({"train": {"dtype": "float16", "loss_scale": 1024.0},
                      "outer": {"local_steps": 4}})


def test_powersgd_keys_and_what_it_refuses(tmp_path):
    """parallel.grad_compression is off by default; PowerSGD's keys are checked, it runs
    with ZeRO-1/2, tp, post-validation and bfloat16, and what it cannot run with (local SGD,
    float16's dynamic loss scale) is refused with one message naming the key to change."""
    assert Config().parallel.grad_compression == "none"
    cfg = config.from_dict({"train": {"dtype": "bfloat16", "post_validation": True},
                            "parallel": {"dp": 2, "pp": 2, "tp": 2, "zero": 2,
                                         "grad_compression": "powersgd", "powersgd_rank": 2,
                                         "grad_comm_dtype": "bfloat16"}})
    assert (cfg.parallel.powersgd_rank, cfg.parallel.powersgd_min_gain) == (2, 2.0)
    for text, words in [
            ('[parallel]\ngrad_compression = "1bit"\n', "allowed: none, powersgd"),
            ("[parallel]\npowersgd_rank = -1\n", "must be 0 or more"),
            ("[parallel]\npowersgd_warmup = -1\n", "must be 0 or more"),
            ('[parallel]\npowersgd_dtype = "float16"\n', "allowed: auto, float32, bfloat16"),
            ('[train]\nlocal_steps = 4\n[parallel]\ngrad_compression = "powersgd"\n',
             'set parallel.grad_compression = "none"'),
            ('[train]\ndtype = "float16"\n[parallel]\ngrad_compression = "powersgd"\n',
             "a fixed train.loss_scale")]:
        _, msg = error_of(tmp_path, text)
        assert words in msg, (text, msg)
    config.from_dict({"train": {"dtype": "float16", "loss_scale": 1024.0},
                      "parallel": {"grad_compression": "powersgd"}})


def test_gpt2s_vocabulary_is_padded_unless_the_config_says(tmp_path):
    """GPT-2's 50257 tokens pad to 50304 rows (a multiple of 128: the head's GEMMs aligned)
    unless model.vocab_multiple is given; other vocabularies stay as they are; the
    resolved config (a run's config.toml) says which, so a resume keeps it."""
    path = tmp_path / "c.toml"
    path.write_text("[model]\nvocab_size = 50257\n")
    cfg = config.load(str(path))
    assert cfg.model.vocab_multiple == 128 and cfg.model.padded_vocab == 50304
    assert config.load(str(path), ["model.vocab_multiple=1"]).model.padded_vocab == 50257
    path.write_text("[model]\nvocab_size = 50258\n")
    assert config.load(str(path)).model.vocab_multiple == 1
    path.write_text(cfg.to_toml())
    assert config.load(str(path)).model.vocab_multiple == 128


def test_asynchronous_data_parallel_keys_and_what_they_refuse(tmp_path):
    """parallel.async_dp is off by default; its keys are checked, it runs with pp, tp, 16-bit
    compute, Muon and any synchronous schedule, and what needs the replicas in step (ZeRO,
    post-validation, PowerSGD, local SGD, the asynchronous pipeline, float16's dynamic loss
    scale) is refused with one message naming the key to change; a replay needs a mode
    that can differ from run to run; SSP's delay compensation needs AdamW."""
    assert Config().parallel.async_dp == "none"
    for mode, sync in (("ssp", False), ("easgd", False), ("easgd", True)):
        cfg = config.from_dict({"train": {"dtype": "bfloat16"}, "optim": {"optimizer": "muon"},
                                "parallel": {"dp": 2, "pp": 2, "async_dp": mode,
                                             "easgd_sync": sync, "schedule": "zb-v"}})
        assert cfg.parallel.async_dp == mode
    config.from_dict({"parallel": {"dp": 2, "tp": 2, "async_dp": "ssp", "staleness": 0,
                                   "async_replay": "runs/recorded"}})
    refused = '[parallel]\nasync_dp = "ssp"\n'
    for text, words in [
            ('[parallel]\nasync_dp = "hogwild"\n', "allowed: none, ssp, easgd"),
            ("[parallel]\nstaleness = -1\n", "must be 0 (synchronous)"),
            ("[parallel]\neasgd_tau = 0\n", "must be at least 1"),
            ("[parallel]\ndp = 4\neasgd_alpha = 0.3\n", "dp × α ≤ 1"),
            ("[parallel]\nasync_timeout = 0\n", "must be positive seconds"),
            ('[parallel]\nasync_replay = "runs/x"\n', 'needs parallel.async_dp = "ssp"'),
            ('[parallel]\nasync_dp = "easgd"\neasgd_sync = true\nasync_replay = "runs/x"\n',
             'needs parallel.async_dp = "ssp"'),
            (refused + "zero = 1\n", "set parallel.zero = 0"),
            (refused + "[train]\npost_validation = true\n", "set train.post_validation = false"),
            (refused + 'grad_compression = "powersgd"\n',
             'set parallel.grad_compression = "none"'),
            (refused + "[train]\nlocal_steps = 4\n", "set outer.local_steps = 0"),
            (refused + 'schedule = "pipedream-2bw"\n', "choose a synchronous schedule"),
            (refused + '[train]\ndtype = "float16"\n', "a fixed train.loss_scale"),
            (refused + 'ssp_correction = "momentum"\n', "allowed: none, lr, dc"),
            (refused + "ssp_dc_lambda = -1.0\n", "a finite λ ≥ 0"),
            (refused + "ssp_patience = -0.5\n", "a finite number ≥ 0 of the replica's"),
            ('[parallel]\nasync_dp = "easgd"\neasgd_lr_scale = -1.0\n',
             "must be 0 (the default: (dp + 1) / dp)"),
            (refused + 'ssp_correction = "dc"\n[train]\noptimizer = "muon"\n',
             "AdamW's second moment")]:
        _, msg = error_of(tmp_path, text)
        assert words in msg, (text, msg)


def test_train_keys_of_old_load_where_they_live_now(tmp_path):
    """[train]'s optimizer, local-SGD and delay-correction keys moved to [optim], [outer]
    and [pipedream] (issue 58): an old config, an old `--set` and an old run's config.toml
    (every key in [train]) still load, with one line for them all; a key given both ways
    is refused, naming both. (The lines marked keep their old names through the codemod.)"""
    keep = "train.min_lr=0.001"  # codemod: keep
    cfg = config.load(write(tmp_path, "[train]\nsteps = 7\nlr = 0.01\nlocal_steps = 2\n"
                                      "[parallel]\ndp = 2\n"), [keep])
    assert (cfg.train.steps, cfg.optim.lr, cfg.optim.min_lr, cfg.outer.local_steps) == \
        (7, 0.01, 0.001, 2)
    assert cfg.notes == ("[train] keys moved: train.lr, train.min_lr are now [optim]'s; "  # codemod: keep
                         "train.local_steps is now outer.local_steps",)  # codemod: keep
    old = {name: dict(table) for name, table in tomllib.loads(Config().to_toml()).items()}
    for section in ("optim", "outer", "pipedream"):
        old["train"].update(old.pop(section))
    resumed = config.from_dict(old, "runs/old/config.toml")
    assert resumed.to_toml().split("\n", 1)[1] == Config().to_toml().split("\n", 1)[1]
    assert len(resumed.notes) == 1 and "delay_correction_decay" in resumed.notes[0]
    assert config.load(write(tmp_path, "[optim]\nlr = 0.01\n")).notes == ()
    # a --set wins over the file, whichever name either uses
    old_set = "train.lr=0.001"  # codemod: keep
    assert config.load("inputs/tiny.toml", [old_set]).optim.lr == 0.001
    assert config.load(write(tmp_path, "[train]\nlr = 0.01\n"), ["optim.lr=0.02"]).optim.lr \
        == 0.02
    _, msg = error_of(tmp_path, "[train]\nlr = 0.01\n[optim]\nlr = 0.02\n")
    assert "train.lr = 0.01: is optim.lr now, which the config also sets (0.02)" in msg  # codemod: keep


def test_the_set_up_timeout_is_seconds_with_a_default_for_old_configs(tmp_path):
    """parallel.setup_timeout (rank 0's reads in the set-up: docs/guides/hangs.md): a
    config without it, as every config before it, gets two hours; it is checked as
    parallel.timeout is."""
    assert config.from_dict({"parallel": {"timeout": 60}}).parallel.setup_timeout == 7200
    for value in ("-1", "1e9"):
        _, msg = error_of(tmp_path, f"[parallel]\nsetup_timeout = {value}\n")
        assert "parallel.setup_timeout" in msg and "from 0 (off)" in msg, msg
