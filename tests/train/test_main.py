"""``python -m swa_bench.train`` on hostile input. Every refusal is one line on stderr, exit 2, no
traceback, nothing trained, and every file already there (in the output folder or outside it)
byte-for-byte as it was. The refusals run in this process (``tests.invoke.trainer``, the same
``main``); a few, and what needs a fresh interpreter (the address-space limit a step is sized
against, signals, a real run), run as a user would: a subprocess under a time and memory limit."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from swa_bench.model.model import build_model
from swa_bench.model.weights import load_weights
from swa_bench.train.loop import EVAL_SEED, TrainConfig, held_out_loss, held_out_windows
from tests import invoke

ROOT = Path(__file__).resolve().parents[2]
PROG = "python -m swa_bench.train: "
TINY = ["--steps", "2", "--batch", "1", "--seq-len", "64", "--length-warmup", "none",
        "--eval-prompts", "1", "--device", "cpu"]
MEMORY_LIMIT = 4 << 30  # address space; torch's import maps under 1 GiB
LONG = "a" * 300


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def trainer(cwd: Path, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m swa_bench.train`` with the tiny settings, in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "swa_bench.train", *TINY, *argv], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=_limit_memory)


def snapshot(folder: Path) -> dict[str, object]:
    """Every entry under ``folder``: a file's bytes, a link's target, a folder's presence."""
    out: dict[str, object] = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        out[key] = (("link", os.readlink(path)) if path.is_symlink() else
                    ("dir",) if path.is_dir() else path.read_bytes())
    return out


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A working folder with a user's files: checkpoints and cards, a victim outside ``tr``,
    and the links an attacker with write access to ``tr`` would plant."""
    tr = tmp_path / "tr"
    (tr / "dir").mkdir(parents=True)
    (tr / "dir2.md").mkdir()
    (tmp_path / "victim").write_bytes(b"not yours\n")
    (tr / "mine.safetensors").write_bytes(b"the user's checkpoint")
    (tr / "mine.md").write_text("# the user's card\n")
    (tr / "cardonly.md").write_text("# a card with no checkpoint\n")
    (tr / "link.safetensors").symlink_to(tmp_path / "victim")
    (tr / "new.md").symlink_to("../victim")
    (tr / "same.safetensors").write_bytes(b"a checkpoint")
    (tr / "same.md").symlink_to("same.safetensors")
    return tmp_path


def refusal(argv: list[str], message: str):
    return pytest.param(argv, message, id=" ".join(a[:24] for a in argv))


BAD_ARGUMENTS = [
    refusal(["--steps", "0"], "--steps: 0 must lie in [1, 10000000]"),
    refusal(["--steps", "100000000000000000000"], "--steps: 100000000000000000000 must lie"),
    refusal(["--steps", "1e20"], "argument --steps: invalid int value: '1e20'"),
    refusal(["--steps", "many"], "argument --steps: invalid int value"),
    refusal(["--batch", "-2"], "--batch: -2 must be at least 1"),
    refusal(["--batch", "1e9"], "argument --batch: invalid int value: '1e9'"),
    refusal(["--batch", "1000000000"], "--batch 1000000000 x --seq-len 64: a training step "
                                       "needs"),
    refusal(["--seq-len", "8"], "--seq-len: 8 must lie in [64, 320]"),
    refusal(["--seq-len", "100000"], "--seq-len: 100000 must lie in [64, 320]"),
    refusal(["--max-facts", "0"], "--max-facts: 0 must lie in [1, 32]"),
    refusal(["--max-facts", "33"], "--max-facts: 33 must lie in [1, 32]"),
    refusal(["--lr", "nan"], "--lr: nan must be finite and above 0"),
    refusal(["--lr", "inf"], "--lr: inf must be finite and above 0"),
    refusal(["--lr", "-1"], "--lr: -1.0 must be finite and above 0"),
    refusal(["--lr", "0"], "--lr: 0.0 must be finite and above 0"),
    refusal(["--seed", "1e20"], "argument --seed: invalid int value: '1e20'"),
    refusal(["--seed", "100000000000000000000"], "--seed: 100000000000000000000 must lie in "
                                                 "[0, 18446688733643]"),
    refusal(["--seed", "-1"], "--seed: -1 must lie in [0,"),
    refusal(["--device", "quantum"], "--device: 'quantum' is not a torch device"),
    refusal(["--device", "cpu:1"], "--device: 'cpu:1': the CPU is cpu or cpu:0"),
    refusal(["--device", "meta"], "--device: 'meta': no meta device is present here"),
    refusal(["--eval-prompts", "0"], "--eval-prompts: 0 must lie in [1, 10000]"),
    refusal(["--eval-prompts", "1000000000"], "--eval-prompts: 1000000000 must lie in"),
    refusal(["--length-warmup", "64-100"], "is not LENGTH:STEPS"),
    refusal(["--seq-len", "256", "--length-warmup", "128:10,64:10"], "lengths rising"),
    refusal(["--seq-len", "256", "--length-warmup", "64:0"], "steps >= 1"),
    refusal(["--seq-len", "256", "--steps", "100", "--length-warmup", "64:100"],
            "--length-warmup: its 100 steps leave none of 100"),
    refusal(["--no-such-option"], "unrecognized arguments: --no-such-option"),
]
if not torch.cuda.is_available():
    BAD_ARGUMENTS.append(refusal(["--device", "cuda"], "--device: 'cuda': no cuda device is "
                                                       "present here"))

BAD_OUTPUTS = [
    refusal(["--out", "tr/mine.safetensors"], "--out: tr/mine.safetensors exists; --overwrite "
                                              "replaces it"),
    refusal(["--out", "tr/cardonly.safetensors"], "--out: tr/cardonly.md exists"),
    refusal(["--out", "tr/model.md"], "--out: tr/model.md ends in .md, the card's suffix"),
    refusal(["--out", "tr/model.MD"], "ends in .md"),
    refusal(["--out", "tr/dir"], "--out: tr/dir is a folder"),
    refusal(["--out", "tr/"], "--out: tr is a folder"),
    refusal(["--out", ""], "is a folder"),
    refusal(["--out", "tr/dir2.safetensors", "--overwrite"], "--out: tr/dir2.md is a folder"),
    refusal(["--out", "tr/link.safetensors", "--overwrite"], "is a symlink to"),
    refusal(["--out", "tr/new.safetensors", "--overwrite"], "tr/new.md is a symlink to"),
    refusal(["--out", "tr/same.safetensors", "--overwrite"], "is the checkpoint itself"),
    refusal(["--out", "tr/mine.safetensors/x.safetensors"], "tr/mine.safetensors is not a "
                                                            "folder"),
    refusal(["--out", "/proc/swa-bench-test/x.safetensors"], "cannot write there"),
    refusal(["--out", f"tr/{LONG}.safetensors"], "a name longer than the 255 bytes"),
    refusal(["--out", f"tr/{LONG}/x.safetensors"], "a name longer than the 255 bytes"),
]


# Through the real interpreter: an argparse error, an --out refusal, and the step that fits the
# machine but not the subprocess's 4 GiB address space (the limit is what counts).
IN_A_SUBPROCESS = [
    refusal(["--steps", "many"], "argument --steps: invalid int value"),
    refusal(["--out", "tr/link.safetensors", "--overwrite"], "is a symlink to"),
    refusal(["--batch", "64", "--seq-len", "320"], "--batch 64 x --seq-len 320: a training "
                                                   "step needs 14."),
]


def assert_refused(run, message: str) -> None:
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr + run.stdout
    assert run.stdout == ""  # refused before the first step
    assert run.stderr.count("\n") == 1 and run.stderr.startswith(PROG), run.stderr
    assert message in run.stderr, run.stderr


@pytest.mark.parametrize(("argv", "message"), BAD_ARGUMENTS + BAD_OUTPUTS)
def test_a_refusal_is_one_line_exit_2_and_touches_nothing(argv, message, folder):
    before = snapshot(folder)
    if "--out" not in argv:
        argv = [*argv, "--out", "tr/fresh.safetensors"]
    assert_refused(invoke.trainer(folder, *TINY, *argv), message)
    assert snapshot(folder) == before


@pytest.mark.parametrize(("argv", "message"), IN_A_SUBPROCESS)
def test_a_refusal_through_the_real_interpreter(argv, message, folder):
    before = snapshot(folder)
    if "--out" not in argv:
        argv = [*argv, "--out", "tr/fresh.safetensors"]
    assert_refused(trainer(folder, *argv), message)
    assert snapshot(folder) == before


def test_a_run_writes_checkpoint_and_card_apart_and_overwrite_replaces_both(tmp_path):
    out = tmp_path / "runs" / "tiny.safetensors"  # its folder is created, after training
    first = trainer(tmp_path, "--out", "runs/tiny.safetensors", "--seed", "0")
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[-1].startswith("wrote runs/tiny.safetensors (")
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny.md", "tiny.safetensors"]
    card = out.with_suffix(".md").read_text()
    assert card.startswith("# tiny: a small trained") and "--seed 0 --steps 2" in card
    with safe_open(str(out), framework="pt") as f:  # a checkpoint, not a card over it
        assert '"seed": 0' in f.metadata()["train_config"]
        figures = json.loads(f.metadata()["figures"])
        assert f.get_slice("layers.0.attn.wkv.weight").get_dtype() == "BF16"
    # the figures are the stored weights': measured again from the file, to the bit
    model, _ = build_model(TrainConfig().args)
    load_weights(model, out)
    g = torch.Generator().manual_seed(EVAL_SEED)
    assert held_out_loss(model, held_out_windows(1, 64, g)) == figures["held_out_loss"]
    old = out.read_bytes()

    refused = invoke.trainer(tmp_path, *TINY, "--out", "runs/tiny.safetensors", "--seed", "1")
    assert refused.returncode == 2 and "exists; --overwrite replaces it" in refused.stderr
    assert out.read_bytes() == old

    second = trainer(tmp_path, "--out", "runs/tiny.safetensors", "--seed", "1", "--overwrite")
    assert second.returncode == 0, second.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny.md", "tiny.safetensors"]
    assert "--seed 1 --steps 2" in out.with_suffix(".md").read_text()
    with safe_open(str(out), framework="pt") as f:
        assert '"seed": 1' in f.metadata()["train_config"]
    assert out.read_bytes() != old


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_a_run_stopped_mid_training_leaves_the_old_files_and_no_temp_file(sig, folder):
    before = snapshot(folder)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "swa_bench.train", *TINY, "--steps", "100000",
                             "--out", "tr/mine.safetensors", "--overwrite"], cwd=folder, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_limit_memory)
    try:
        assert proc.stdout.readline().startswith("step     0"), proc.stderr.read()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and err == f"{PROG}interrupted; nothing written\n"
    assert snapshot(folder) == before
