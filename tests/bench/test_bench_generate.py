"""bench generate: it samples the tokens it says it timed, and writes what it measured
(the speed itself is measured, never asserted: it is the machine's)."""

import json

from hpcpipe.__main__ import main
from hpcpipe.bench import generate
from hpcpipe.model import GPT, GPTConfig
from hpcpipe.model.sampler import Sampler


class Counting(Sampler):
    def __init__(self, *args):
        super().__init__(*args)
        self.produced = 0

    def tokens(self, ids, count):
        for token in super().tokens(ids, count):
            self.produced += 1
            yield token


def test_every_run_samples_the_tokens_it_times():
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8)
    model = GPT(cfg)
    sampler = Counting(model, model.stage.be, 0.8, 0, 0)
    rates = generate.tokens_per_second(sampler, 20, 3)  # 20 > block_size: the cache restarts
    assert len(rates) == 3 and all(r > 0 for r in rates) and sampler.produced == 60


def test_the_command_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "generate.json"
    assert main(["bench", "generate", "--set", "model.n_layer=1", "--tokens", "5",
                 "--repeats", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| tokens | runs | best tokens/s |" in text and "| 5 | 2 |" in text
    result = json.loads(out.read_text())
    assert result["suite"] == "generate" and result["tokens"] == 5
    assert len(result["runs_tokens_per_s"]) == 2
    assert result["tokens_per_s"] == max(result["runs_tokens_per_s"])
