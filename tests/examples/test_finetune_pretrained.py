"""examples/finetune_pretrained.py: stopped after 2 steps and resumed to 4, its ``--check``
then compares all 4 losses and the greedy samples with an uninterrupted one-device run, so it
passes only if the resume is exact and FSDP x TP equals one device. Once on the default
checkpoint (``px.models.save_pretrained``, bytes: needs neither torch nor tokenizers), once on
a GPT-2 saved by transformers with a BPE tokenizer beside it (skipped without them)."""

import pathlib
import runpy
import sys

import pytest

SCRIPT = pathlib.Path(__file__).parents[2] / "examples" / "finetune_pretrained.py"
SMALL = ["--seq-len", "32", "--batch", "8", "--eval-every", "2", "--save-every", "1",
         "--sample-tokens", "6", "--lr", "3e-3"]


def run(monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *SMALL, *map(str, args)])
    return runpy.run_path(str(SCRIPT), run_name="not_main")["main"]()


def hf_checkpoint(folder: pathlib.Path, texts) -> pathlib.Path:
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    import parallax as px

    tok = px.data.train_bpe(texts, vocab_size=300)
    config = transformers.GPT2Config(vocab_size=tok.vocab_size, n_positions=64, n_embd=32,
                                     n_layer=2, n_head=4)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    tok.save(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["default", "transformers-gpt2"])
def test_stop_resume_and_check_against_one_device(checkpoint, tmp_path, monkeypatch, capsys):
    text = tmp_path / "text"
    text.mkdir()
    for i in range(12):
        (text / f"{i}.txt").write_text(f"Document {i}: the quick brown fox jumps over the lazy "
                                       f"dog {i} times, and then it rests. " * 3)
    args = ["--text", text, "--run-dir", tmp_path / "run"]
    if checkpoint == "default":
        args += ["--checkpoint", tmp_path / "ckpt"]
        runpy.run_path(str(SCRIPT), run_name="not_main")["default_checkpoint"](tmp_path / "ckpt")
    else:
        texts = [p.read_text() for p in sorted(text.iterdir())]
        args += ["--checkpoint", hf_checkpoint(tmp_path / "hf", texts)]
    first = run(monkeypatch, *args, "--steps", 4, "--stop-after", 2)
    assert len(first) == 2
    losses = run(monkeypatch, *args, "--steps", 4, "--check")  # SystemExit on a mismatch
    assert len(losses) == 4 and losses[:2] == first
    out = capsys.readouterr().out
    assert "resumed from step 2" in out and "samples equal" in out and "before:" in out
    assert "step 4: held-out loss" in out and "perplexity" in out
